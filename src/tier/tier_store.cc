// TierStore: opening the devices, adoption and reconcile, the catalogs, the device workers and
// the store's figures (tier_store.h). Spill and promote are in tier_moves.cc.
#include "tier/tier_store.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <set>

#include "pool/pool_internal.h"
#include "pool/status_doc.h"
#include "tier/catalog.h"
#include "tier/dram_device.h"
#include "tier/placement.h"
#include "tier/probe.h"
#include "tier/ssd_device.h"
#include "tier/worker_affinity.h"
#include "util/units.h"

namespace cxlkv::tier {

namespace {

using Block = cache::Index::TierBlock;

Status BadSpec(std::string_view text, const std::string& why) {
  return InvalidArgument("tier '" + std::string(text) + "': " + why +
                         "; expected dram:SIZE[:numa=N] or ssd:PATH:SIZE[:catalog=DIR] (e.g. --tier dram:8G --tier "
                         "ssd:/data/kv.tier:64G)");
}

constexpr std::string_view kCatalogKey = ":catalog=";

}  // namespace

Result<TierSpec> ParseTierSpec(std::string_view text) {
  const size_t colon = text.find(':');
  if (colon == std::string_view::npos) return BadSpec(text, "no kind");
  const std::string_view kind = text.substr(0, colon);
  std::string_view rest = text.substr(colon + 1);
  TierSpec spec;
  if (kind == "dram" || kind == "mem") {
    spec.kind = TierKind::kMem;
    const size_t numa = rest.find(":numa=");
    if (numa != std::string_view::npos) {
      const std::string n(rest.substr(numa + 6));
      if (n.empty() || n.find_first_not_of("0123456789") != std::string::npos) return BadSpec(text, "bad NUMA node");
      spec.numa_node = std::stoi(n);
      rest = rest.substr(0, numa);
    }
    auto bytes = util::ParseByteSize(rest);
    if (!bytes.ok() || *bytes == 0) return BadSpec(text, "bad size '" + std::string(rest) + "'");
    spec.bytes = *bytes;
    return spec;
  }
  if (kind == "ssd") {
    spec.kind = TierKind::kSsd;
    const size_t catalog = rest.rfind(kCatalogKey);
    if (catalog != std::string_view::npos) {
      spec.catalog_dir = std::string(rest.substr(catalog + kCatalogKey.size()));
      if (spec.catalog_dir.empty()) return BadSpec(text, "empty catalog directory");
      rest = rest.substr(0, catalog);
    }
    const size_t last = rest.rfind(':');  // the path may itself hold ':'
    if (last == std::string_view::npos || last == 0) return BadSpec(text, "no path or no size");
    spec.path = std::string(rest.substr(0, last));
    auto bytes = util::ParseByteSize(rest.substr(last + 1));
    if (!bytes.ok()) return BadSpec(text, "bad size '" + std::string(rest.substr(last + 1)) + "'");
    spec.bytes = *bytes;
    return spec;
  }
  return BadSpec(text, "unknown kind '" + std::string(kind) + "'");
}


std::string TierSpec::StateBase() const {
  if (catalog_dir.empty()) return path;
  const size_t slash = path.rfind('/');
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  return catalog_dir + (catalog_dir.back() == '/' ? "" : "/") + name;
}

Result<std::unique_ptr<TierStore>> TierStore::Open(Pool& pool, const TierStoreOptions& options) {
  if (options.tiers.empty()) return InvalidArgument("no capacity tier given: name at least one (--tier)");
  if (options.slot_bytes < 8192 || options.slot_bytes % 4096 != 0) {
    return InvalidArgument("tier slot size " + std::to_string(options.slot_bytes) +
                           " must be a multiple of 4 KiB, at least 8 KiB");
  }
  if (options.spill_target_pct >= options.spill_start_pct || options.spill_start_pct > 100) {
    return InvalidArgument("spill watermarks: want target < start <= 100 (got " + std::to_string(options.spill_target_pct) +
                           " and " + std::to_string(options.spill_start_pct) + ")");
  }
  Pool::Impl& im = pool.impl();
  if (!im.index) return NotFound("this pool has no prefix index: capacity tiers extend it (re-create it with 'cxlkv init')");
  if (im.index->central()) {
    return NotSupported("capacity tiers need a decentralized pool for now (this one's metadata is central): "
                        "re-create it with 'cxlkv init --metadata decentralized'");
  }
  std::unique_ptr<TierStore> store(new TierStore(pool, *im.index, options));
  for (size_t i = 0; i < options.tiers.size(); ++i) {
    const TierSpec& spec = options.tiers[i];
    const std::string what = "tier " + std::to_string(i) + " (" + std::string(TierKindName(spec.kind)) + "): ";
    if (spec.kind == TierKind::kMem) {
      DramOptions o;
      o.index = static_cast<uint32_t>(i);
      o.capacity_bytes = spec.bytes;
      o.slot_bytes = options.slot_bytes;
      o.numa_node = spec.numa_node;
      auto dev = DramDevice::Create(o);
      if (!dev.ok()) return Status(dev.status().code(), what + dev.status().message());
      store->devices_.push_back(std::move(*dev));
    } else {
      // Refused before the device is opened (opening probes it, and may take it exclusively).
      DeviceFileFacts facts;
      if (IoPlatform::Default().Stat(spec.path, &facts) == 0 && (facts.is_block_device || facts.is_char_device) &&
          spec.catalog_dir.empty()) {
        return InvalidArgument(what + spec.path + " is a device: its restart catalog and namespace book need a "
                               "directory on a persistent file system: add catalog=DIR (e.g. --tier ssd:" +
                               spec.path + ":0:catalog=/var/lib/cxlkv)");
      }
      SsdOptions o;
      o.path = spec.path;
      o.index = static_cast<uint32_t>(i);
      o.size_bytes = spec.bytes;
      o.slot_bytes = options.slot_bytes;
      auto dev = SsdDevice::Open(o);
      if (!dev.ok()) return Status(dev.status().code(), what + dev.status().message());
      // The restart record of the SSD's slots, beside its file or in its catalog directory
      // (catalog.h): a slot is named in the index only once the catalog says, durably, what it holds.
      const std::string state = spec.StateBase();
      auto catalog = Catalog::Open(IoPlatform::Default(), state, (*dev)->granule_count());
      if (!catalog.ok()) return Status(catalog.status().code(), what + catalog.status().message());
      if (!(*catalog)->replay_stats().message.empty()) {
        std::fprintf(stderr, "cxlkv: tier: %s: %s\n", spec.path.c_str(), (*catalog)->replay_stats().message.c_str());
      }
      auto book = NamespaceBook::Open(state);
      if (!book.ok()) return Status(book.status().code(), what + book.status().message());
      if (!(*book)->message().empty()) std::fprintf(stderr, "cxlkv: tier: %s\n", (*book)->message().c_str());
      store->catalogs_.resize(i + 1);
      store->catalogs_[i] = std::move(*catalog);
      store->books_.resize(i + 1);
      store->books_[i] = std::move(*book);
      store->devices_.push_back(std::move(*dev));
    }
  }
  store->catalogs_.resize(store->devices_.size());
  store->books_.resize(store->devices_.size());
  store->awaiting_restore_.resize(store->devices_.size());
  // Adopt before the probe: the probe writes to free slots only, and the blocks an earlier
  // cxlkvd left on the SSD are not free.
  store->ReconcileLocked(/*adopt=*/true);
  store->ProbeLocked(/*only_unknown=*/false);
  store->workers_.resize(store->devices_.size());
  if (options.bind_workers) {
    std::vector<WorkerInput> inputs;
    for (size_t i = 0; i < store->devices_.size(); ++i) {
      inputs.push_back({store->devices_[i]->kind(), store->devices_[i]->kind() == TierKind::kSsd
                                                        ? CompletionCpus(options.tiers[i].path)
                                                        : std::vector<int>{}});
    }
    WorkerPlacement placed = PlaceWorkers(inputs, AllowedCpus());
    for (size_t i = 0; i < store->workers_.size(); ++i) store->workers_[i].cpus = placed.cpus[i];
    store->worker_placement_ = placed.summary;
    if (options.log_placement) std::fprintf(stderr, "cxlkv: tier: %s\n", placed.summary.c_str());
  } else {
    store->worker_placement_ = "workers not bound (turned off)";
  }
  for (size_t i = 0; i < store->workers_.size(); ++i) {
    store->workers_[i].thread = std::thread([s = store.get(), i] { s->WorkerLoop(i); });
  }
  store->PublishStatus();
  if (options.background) store->spill_thread_ = std::thread([s = store.get()] { s->SpillLoop(); });
  return store;
}

TierStore::~TierStore() {
  {
    std::lock_guard<std::mutex> g(work_mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  spill_cv_.notify_all();
  if (spill_thread_.joinable()) spill_thread_.join();
  for (Worker& w : workers_) {
    if (w.thread.joinable()) w.thread.join();
  }
}

bool TierStore::Mine(const Block& b) const {
  if (cache::WriterNode(b.writer) != node_) return false;
  const uint32_t dev = cache::LocationDevice(b.location);
  if (dev >= devices_.size() || EntryTierOf(devices_[dev]->kind()) != b.tier) return false;
  if (cache::LocationSlot(b.location) >= devices_[dev]->granule_count()) return false;
  // A node-DRAM block lives in the memory of the process that wrote it: this one, or nobody.
  return b.tier == cache::kTierSsd || b.writer == index_.WriterOfThisProcess();
}

// ---- the restart catalogs ----

Status TierStore::RecordPuts(uint32_t device, std::span<const CatalogEntry> entries) {
  Catalog* catalog = catalogs_[device].get();
  if (catalog == nullptr || entries.empty()) return Status::Ok();
  std::vector<CatalogRecord> records;
  records.reserve(entries.size());
  for (const CatalogEntry& e : entries) records.push_back({CatalogOp::kPut, e});
  return catalog->Append(records);
}

void TierStore::RecordFrees(uint32_t device, std::span<const uint64_t> slots) {
  Catalog* catalog = catalogs_[device].get();
  if (catalog == nullptr || slots.empty()) return;
  std::vector<CatalogRecord> records;
  records.reserve(slots.size());
  for (uint64_t slot : slots) {
    CatalogRecord r;
    r.op = CatalogOp::kFree;
    r.entry.slot = slot;
    records.push_back(r);
  }
  // A free that does not reach the log is harmless: at the next start the index no longer names
  // the slot, so adoption frees it again.
  if (Status s = catalog->Append(records); !s.ok()) {
    std::fprintf(stderr, "cxlkv: tier: recording %zu freed slot(s) of device %u: %s\n", slots.size(), device,
                 s.ToString().c_str());
  }
}

void TierStore::FreeSlots(uint32_t device, std::span<const uint64_t> slots) {
  if (slots.empty()) return;
  RecordFrees(device, slots);  // before the slots can be reused (a reused slot's old record goes first)
  (void)devices_[device]->FreeSlots(slots);
}

// ---- the device workers ----

void TierStore::RunOnDevices(std::vector<std::function<void()>>& jobs) {
  std::unique_lock<std::mutex> g(work_mu_);
  for (size_t i = 0; i < jobs.size() && i < workers_.size(); ++i) {
    if (!jobs[i]) continue;
    workers_[i].job = std::move(jobs[i]);
    ++pending_;
  }
  work_cv_.notify_all();
  done_cv_.wait(g, [&] { return pending_ == 0; });
}

void TierStore::WorkerLoop(size_t device) {
  if (int rc = BindThisThread(workers_[device].cpus); rc < 0) {
    std::fprintf(stderr, "cxlkv: tier: binding device %zu's worker to CPU %s: %s (it runs unbound)\n", device,
                 FormatCpuList(workers_[device].cpus).c_str(), std::strerror(-rc));
  }
  std::unique_lock<std::mutex> g(work_mu_);
  for (;;) {
    work_cv_.wait(g, [&] { return stop_ || workers_[device].job; });
    if (stop_ && !workers_[device].job) return;
    std::function<void()> job = std::move(workers_[device].job);
    workers_[device].job = nullptr;
    g.unlock();
    job();
    g.lock();
    if (--pending_ == 0) done_cv_.notify_all();
  }
}

// ---- adoption and reconciliation ----

uint64_t TierStore::Reconcile() {
  std::lock_guard<std::mutex> g(move_mu_);
  const uint64_t dropped = ReconcileLocked(/*adopt=*/false);
  ProbeLocked(/*only_unknown=*/true);  // a device that was full at open is measured once it has room
  return dropped;
}

void TierStore::ProbeLocked(bool only_unknown) {
  bool changed = false;
  for (auto& dev : devices_) {
    if (only_unknown && dev->bandwidth() > 1) continue;
    if (only_unknown && dev->free_slots() == 0) continue;
    if (auto bw = ProbeBandwidth(*dev); !bw.ok()) {
      // A device full of adopted blocks has no slot to probe with: it is measured later.
      if (!only_unknown) {
        std::fprintf(stderr, "cxlkv: tier: probing %s: %s (placement treats it as the slowest until it is measured)\n",
                     dev->Describe().c_str(), bw.status().ToString().c_str());
      }
    } else {
      changed = true;
    }
    if (dev->bandwidth() == 0) dev->set_bandwidth(1);
  }
  if (changed || placement_ == nullptr) {
    std::vector<uint64_t> bandwidths;
    for (auto& dev : devices_) bandwidths.push_back(dev->bandwidth());
    placement_ = std::make_unique<PlacementCursor>(bandwidths);
  }
}

uint64_t TierStore::ReconcileLocked(bool adopt) {
  std::vector<SlotExtents> named(devices_.size());
  std::vector<Block> lost;
  for (const Block& b : index_.CapacityEntriesOf(node_, /*with_evicting=*/true)) {
    const uint32_t d = cache::LocationDevice(b.location);
    const uint64_t slot = cache::LocationSlot(b.location);
    // Not on a device of this store (another configuration, an earlier process's DRAM), larger
    // than its largest slot, or a slot that overlaps one named already: nobody can serve it.
    if (!Mine(b) || b.bytes > devices_[d]->payload_capacity() ||
        slot + devices_[d]->GranulesFor(b.bytes) > devices_[d]->granule_count()) {
      lost.push_back(b);
      continue;
    }
    // An SSD slot is current only if its catalog says, durably, that it holds this block at
    // this generation (the index may name a slot whose write never reached the drive).
    if (catalogs_[d] != nullptr) {
      CatalogEntry known;
      uint64_t fingerprint = 0;
      if (!catalogs_[d]->Find(slot, &known) || !(known.key == b.key) || known.generation != b.gen ||
          known.bytes != b.bytes || !FingerprintLocked(b.ns, &fingerprint) || known.ns != fingerprint) {
        lost.push_back(b);
        unproven_.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
    }
    if (!AddExtent(named[d], slot, devices_[d]->GranulesFor(b.bytes))) lost.push_back(b);
  }
  const uint64_t dropped = index_.DropCapacity(lost);
  dropped_lost_.fetch_add(dropped, std::memory_order_relaxed);
  for (size_t d = 0; d < devices_.size(); ++d) {
    Device& dev = *devices_[d];
    if (adopt) {
      adopted_.fetch_add(named[d].size(), std::memory_order_relaxed);
      // What the catalog holds and no entry names — every block of a region that was lost or
      // re-created, a spill cut before it published, an entry dropped while no cxlkvd of this
      // node ran — is named again where it can be (tier_restore.cc); the rest is free now (a
      // promote or drop cut before its free was logged left the key elsewhere).
      std::vector<uint64_t> stale;
      if (catalogs_[d] != nullptr) {
        std::vector<CatalogEntry> unnamed;
        for (const CatalogEntry& e : catalogs_[d]->Live()) {
          if (!named[d].contains(e.slot)) unnamed.push_back(e);
        }
        stale = RestoreLocked(static_cast<uint32_t>(d), unnamed, named[d]);
      }
      (void)dev.ResetUsedSlots(named[d]);
      RecordFrees(static_cast<uint32_t>(d), stale);
      if (books_[d] != nullptr) RetainNamespacesLocked(static_cast<uint32_t>(d));
      continue;
    }
    // Blocks a restore could not decide yet (stripe lock not granted): tried again, their slots
    // kept meanwhile.
    if (catalogs_[d] != nullptr && !awaiting_restore_[d].empty()) {
      std::vector<CatalogEntry> unnamed;
      for (uint64_t slot : std::exchange(awaiting_restore_[d], {})) {
        CatalogEntry e;
        if (!named[d].contains(slot) && catalogs_[d]->Find(slot, &e)) unnamed.push_back(e);
      }
      // Their slots are allocated already (kept): the restore checks overlap against what the
      // index names, not against themselves.
      FreeSlots(static_cast<uint32_t>(d), RestoreLocked(static_cast<uint32_t>(d), unnamed, named[d]));
    }
    // Slots whose entry is gone (evicted by another process, or dropped by a full stripe).
    std::vector<uint64_t> orphans;
    for (const auto& [first, length] : dev.AllocatedSlots()) {
      if (!named[d].contains(first)) orphans.push_back(first);
    }
    if (!orphans.empty()) {
      FreeSlots(static_cast<uint32_t>(d), orphans);
      freed_orphans_.fetch_add(orphans.size(), std::memory_order_relaxed);
    }
  }
  return dropped;
}

void TierStore::PublishStatus() {
  nlohmann::json doc = Stats();
  doc["node"] = node_;
  if (Status s = pool::PublishStatus(pool_, "tier-" + std::to_string(node_), doc); !s.ok()) {
    std::fprintf(stderr, "cxlkv: tier: publishing node %u's tier status for 'cxlkv stat': %s\n", node_,
                 s.ToString().c_str());
  }
}

nlohmann::json TierStore::Stats() const {
  nlohmann::json j;
  j["devices"] = nlohmann::json::array();
  for (const auto& d : devices_) {
    const DeviceStats s = d->stats();
    j["devices"].push_back({{"index", d->index()},
                            {"kind", std::string(TierKindName(d->kind()))},
                            {"describe", d->Describe()},
                            {"slot_bytes", d->slot_bytes()},
                            {"slots", d->slot_count()},
                            {"used_slots", d->allocated_slots()},
                            {"capacity_bytes", d->capacity_bytes()},
                            {"used_bytes", d->capacity_bytes() - d->free_bytes()},
                            {"bandwidth_bytes_per_second", d->bandwidth()},
                            {"writes", s.writes},
                            {"reads", s.reads},
                            {"write_errors", s.write_errors},
                            {"read_errors", s.read_errors},
                            {"miss_empty", s.miss_empty},
                            {"miss_corrupt", s.miss_corrupt},
                            {"miss_stale", s.miss_stale}});
  }
  j["spilled"] = spilled_.load();
  j["spill_failed"] = spill_failed_.load();
  j["promoted"] = promoted_.load();
  j["promote_missed"] = promote_missed_.load();
  j["read_out"] = read_out_.load();
  j["read_out_missed"] = read_out_missed_.load();
  j["dropped_full"] = dropped_full_.load();
  j["dropped_lost"] = dropped_lost_.load();
  j["freed_orphan_slots"] = freed_orphans_.load();
  j["adopted"] = adopted_.load();
  j["dropped_unproven"] = unproven_.load();
  j["restored"] = restored_.load();
  j["restore_skipped"] = restore_skipped_.load();
  nlohmann::json catalogs = nlohmann::json::array();
  for (size_t d = 0; d < catalogs_.size(); ++d) {
    if (catalogs_[d] == nullptr) continue;
    const ReplayStats& r = catalogs_[d]->replay_stats();
    catalogs.push_back({{"device", d},
                        {"live", catalogs_[d]->live_count()},
                        {"log_bytes", catalogs_[d]->log_bytes()},
                        {"replayed_checkpoint_entries", r.checkpoint_entries},
                        {"replayed_log_records", r.log_records},
                        {"dropped_records", r.dropped_records},
                        {"replay_seconds", r.replay_seconds},
                        {"replay_message", r.message}});
  }
  j["catalogs"] = catalogs;
  j["worker_placement"] = worker_placement_;
  j["spill_start_pct"] = options_.spill_start_pct;
  j["spill_target_pct"] = options_.spill_target_pct;
  return j;
}

}  // namespace cxlkv::tier
