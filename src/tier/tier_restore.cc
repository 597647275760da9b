// TierStore: how a capacity block names its namespace (by fingerprint, the same in every
// region), and the warm restart that uses it — naming again in the index what an SSD holds and
// no entry names, e.g. every block of a shared region that was lost with a host reboot or
// re-created (tier_store.h; docs/tiers.md, "Warm restart into a new region").
#include <cstdio>
#include <set>

#include "tier/tier_store.h"

namespace cxlkv::tier {

bool TierStore::FingerprintLocked(uint32_t ns, uint64_t* fingerprint) {
  if (auto it = fingerprints_.find(ns); it != fingerprints_.end()) {
    *fingerprint = it->second;
    return true;
  }
  // A live namespace slot never changes (P4): read once, remembered for this region.
  auto registered = index_.NamespaceAt(ns);
  if (!registered.ok()) return false;
  *fingerprint = NamespaceFingerprint(registered->seed);
  fingerprints_[ns] = *fingerprint;
  return true;
}

Status TierStore::RecordNamespacesLocked(uint32_t device, std::span<const CatalogEntry> entries) {
  NamespaceBook* book = books_[device].get();
  if (book == nullptr) return Status::Ok();
  std::set<uint64_t> done;
  for (const CatalogEntry& e : entries) {
    if (!done.insert(e.ns).second) continue;
    KeyNamespace known;
    if (book->Find(e.ns, &known)) continue;
    // The spill named this fingerprint from a namespace slot: find that slot's description.
    bool recorded = false;
    for (const auto& [slot, fp] : fingerprints_) {
      if (fp != e.ns) continue;
      auto registered = index_.NamespaceAt(slot);
      if (!registered.ok()) return registered.status();
      CXLKV_RETURN_IF_ERROR(book->Record(fp, registered->desc));
      recorded = true;
      break;
    }
    if (!recorded) return Internal("namespace fingerprint " + std::to_string(e.ns) + " has no namespace slot");
  }
  return Status::Ok();
}

std::vector<uint64_t> TierStore::RestoreLocked(uint32_t device, std::span<const CatalogEntry> unnamed,
                                               SlotExtents& named) {
  std::vector<uint64_t> stale;
  NamespaceBook* book = books_[device].get();
  Device& dev = *devices_[device];
  // Per fingerprint: the namespace slot in this region, registered again from the book's
  // description when the region lacks it (0 ... kMaxNamespaces - 1), or -1 when it cannot be.
  std::map<uint64_t, int64_t> slot_of;
  auto resolve = [&](uint64_t fingerprint) -> int64_t {
    if (auto it = slot_of.find(fingerprint); it != slot_of.end()) return it->second;
    int64_t slot = -1;
    KeyNamespace desc;
    // The description must hash to the fingerprint: a damaged book names no namespace (and
    // registers none).
    if (book != nullptr && book->Find(fingerprint, &desc) &&
        NamespaceFingerprint(cache::Index::SeedFor(desc)) == fingerprint) {
      auto handle = index_.RegisterNamespace(desc);
      if (handle.ok()) {
        slot = handle->id;
        fingerprints_[handle->id] = fingerprint;
      } else {
        std::fprintf(stderr, "cxlkv: tier: %s: cannot register namespace '%s' again: %s (its blocks are freed)\n",
                     dev.Describe().c_str(), desc.model_id.c_str(), handle.status().ToString().c_str());
      }
    }
    slot_of[fingerprint] = slot;
    return slot;
  };
  std::vector<cache::Index::CapacityInsert> inserts;
  std::vector<uint64_t> insert_slot;
  for (const CatalogEntry& e : unnamed) {
    // The slot is held for it while the insert is decided: two records whose slots overlap (a
    // damaged catalog) do not both come back.
    const bool fits = e.tier_kind == static_cast<uint16_t>(TierKind::kSsd) && e.bytes != 0 &&
                      e.bytes <= dev.payload_capacity() && e.slot < dev.granule_count() &&
                      dev.GranulesFor(e.bytes) <= dev.granule_count() - e.slot &&
                      AddExtent(named, e.slot, dev.GranulesFor(e.bytes));
    const int64_t ns = fits ? resolve(e.ns) : -1;
    if (ns < 0) {
      if (fits) named.erase(e.slot);
      stale.push_back(e.slot);
      continue;
    }
    inserts.push_back({static_cast<uint32_t>(ns), e.key, EntryTierOf(dev.kind()),
                       cache::TierLocation(device, e.slot), e.bytes, e.generation});
    insert_slot.push_back(e.slot);
  }
  index_.InsertCapacity(inserts);
  uint64_t restored = 0, kept = 0;
  using Outcome = cache::Index::CapacityInsert::Outcome;
  for (size_t i = 0; i < inserts.size(); ++i) {
    switch (inserts[i].outcome) {
      case Outcome::kInserted:
        ++restored;
        break;
      case Outcome::kTaken:  // the key is cached elsewhere already, or its stripe is full
        named.erase(insert_slot[i]);
        stale.push_back(insert_slot[i]);
        break;
      case Outcome::kLocked:
        // Not decided (the lock was not granted, or this life ended under it): the slot is
        // kept — no spill or probe may write it — and the next Reconcile tries again.
        awaiting_restore_[device].insert(insert_slot[i]);
        ++kept;
        break;
    }
  }
  restored_.fetch_add(restored, std::memory_order_relaxed);
  restore_skipped_.fetch_add(stale.size(), std::memory_order_relaxed);
  if (restored != 0 || !stale.empty() || kept != 0) {
    std::fprintf(stderr, "cxlkv: tier: %s: %llu block(s) no entry named are named again, %zu freed, %llu left for "
                 "another try (stripe lock not held)\n", dev.Describe().c_str(),
                 static_cast<unsigned long long>(restored), stale.size(), static_cast<unsigned long long>(kept));
  }
  return stale;
}

void TierStore::RetainNamespacesLocked(uint32_t device) {
  std::set<uint64_t> in_use;
  for (const CatalogEntry& e : catalogs_[device]->Live()) in_use.insert(e.ns);
  if (Status s = books_[device]->Retain(in_use); !s.ok()) {
    std::fprintf(stderr, "cxlkv: tier: %s: pruning the namespace book: %s\n", devices_[device]->Describe().c_str(),
                 s.ToString().c_str());
  }
}

}  // namespace cxlkv::tier
