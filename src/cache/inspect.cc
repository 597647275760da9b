#include "cache/inspect.h"

#include <algorithm>
#include <cstring>

#include "alloc/chunk_table.h"
#include "cache/index.h"
#include "region/offset.h"
#include "region/region_internal.h"
#include "util/units.h"

namespace cxlkv::cache {
namespace {

// A consistent-enough snapshot of the whole index (one invalidate + read per part).
struct Snapshot {
  IndexLayout layout;
  std::vector<Entry> entries;
  std::vector<std::vector<uint64_t>> pins;  // per node: the key fingerprints it pins
  std::vector<uint64_t> counters;  // node-major: counters[node * kCounterCount + c]
  std::vector<NamespaceSlot> namespaces;
};

template <typename T>
void ReadArray(region::MetaAccess& meta, uint64_t off, std::vector<T>& out, uint64_t count) {
  out.resize(count);
  if (count == 0) return;
  meta.Invalidate(off, count * sizeof(T));
  meta.Read(off, out.data(), count * sizeof(T));
}

Result<Snapshot> Take(Region& first) {
  Snapshot s;
  CXLKV_ASSIGN_OR_RETURN(s.layout, ReadLayout(first));
  auto& meta = first.impl().meta();
  const uint64_t n = s.layout.entries();
  const uint32_t nodes = s.layout.h.max_nodes;
  ReadArray(meta, s.layout.entry(0), s.entries, n);
  s.pins.resize(nodes);
  for (uint32_t node = 0; node < nodes; ++node) {
    ReadPinTable(meta, s.layout, node, /*invalidate=*/true, [&](uint64_t, uint64_t fp) { s.pins[node].push_back(fp); });
  }
  ReadArray(meta, s.layout.ns_slot(0), s.namespaces, kMaxNamespaces);
  s.counters.resize(uint64_t{nodes} * kCounterCount);
  for (uint32_t node = 0; node < nodes; ++node) {
    meta.Invalidate(s.layout.counter(node, kLookups), kCounterRowBytes);
    meta.Read(s.layout.counter(node, kLookups), &s.counters[uint64_t{node} * kCounterCount], kCounterCount * 8);
  }
  return s;
}

bool Live(EntryState s) { return s == kWriting || s == kReady || s == kEvicting; }

double Ratio(uint64_t a, uint64_t b) { return b ? static_cast<double>(a) / static_cast<double>(b) : 0.0; }

}  // namespace

nlohmann::json Stat(Region& first, const std::vector<NodeStatus>& nodes) {
  auto snap = Take(first);
  if (!snap.ok()) return nullptr;
  const Snapshot& s = *snap;
  const uint64_t n = s.layout.entries();
  nlohmann::json j;
  j["entries"] = n;
  j["stripes"] = s.layout.h.stripes;
  j["checksum"] = (s.layout.h.flags & kFlagChecksum) != 0;
  j["capacity_bytes"] = s.layout.h.capacity_bytes;
  j["watermarks_pct"] = {{"high", s.layout.h.high_watermark_pct}, {"low", s.layout.h.low_watermark_pct}};
  uint64_t by_state[5] = {};
  nlohmann::json tiers = nlohmann::json::object();
  std::vector<uint64_t> ready_bytes_by_writer(s.layout.h.max_nodes, 0);
  uint64_t live_bytes = 0;
  for (const Entry& e : s.entries) {
    EntryState st = StateOf(e.state);
    if (st <= kTombstone) ++by_state[st];
    if (!Live(st)) continue;
    if (e.tier == kTierRegion) live_bytes += e.bytes;
    auto& t = tiers[std::to_string(e.tier)];
    if (t.is_null()) t = {{"entries", 0}, {"bytes", 0}};
    t["entries"] = t["entries"].get<uint64_t>() + 1;
    t["bytes"] = t["bytes"].get<uint64_t>() + e.bytes;
    if (st == kReady && WriterNode(e.writer) < ready_bytes_by_writer.size()) {
      ready_bytes_by_writer[WriterNode(e.writer)] += e.bytes;
    }
  }
  j["states"] = nlohmann::json::object();
  for (uint64_t st = kEmpty; st <= kTombstone; ++st) j["states"][StateName(static_cast<EntryState>(st))] = by_state[st];
  j["tiers"] = tiers;
  j["used_bytes"] = live_bytes;  // payload of WRITING, READY and EVICTING entries
  std::vector<uint64_t> total(kCounterCount, 0);
  nlohmann::json per_node = nlohmann::json::object();
  for (uint32_t node = 0; node < s.layout.h.max_nodes; ++node) {
    const uint64_t pins = s.pins[node].size();
    const uint64_t* c = &s.counters[uint64_t{node} * kCounterCount];
    bool any = pins != 0 || ready_bytes_by_writer[node] != 0 ||
               std::any_of(c, c + kCounterCount, [](uint64_t v) { return v != 0; });
    if (!any) continue;
    nlohmann::json row;
    for (uint32_t k = 0; k < kCounterCount; ++k) {
      row[CounterName(static_cast<Counter>(k))] = c[k];
      total[k] += c[k];
    }
    row["pins"] = pins;
    row["ready_bytes_written"] = ready_bytes_by_writer[node];
    static const char* const kStatus[] = {"never", "live", "silent", "left"};
    row["status"] = node < nodes.size() ? kStatus[static_cast<int>(nodes[node])] : "unknown";
    per_node[std::to_string(node)] = row;
  }
  j["per_node"] = per_node;
  nlohmann::json totals;
  for (uint32_t k = 0; k < kCounterCount; ++k) totals[CounterName(static_cast<Counter>(k))] = total[k];
  j["totals"] = totals;
  j["hit_rate"] = {{"blocks", Ratio(total[kHitBlocks], total[kLookupBlocks])},
                   {"lookups_with_a_hit", Ratio(total[kLookups] - std::min(total[kLookups], total[kZeroHitLookups]),
                                                total[kLookups])}};
  j["namespaces"] = nlohmann::json::array();
  for (uint32_t i = 0; i < kMaxNamespaces; ++i) {
    const NamespaceSlot& ns = s.namespaces[i];
    if (ns.state != 2) continue;
    j["namespaces"].push_back({{"id", i},
                               {"model", util::PrintableName(ns.model_id, sizeof ns.model_id)},
                               {"extra", util::PrintableName(ns.extra_key, sizeof ns.extra_key)},
                               {"block_tokens", ns.layout.block_size},
                               {"block_bytes", ns.block_bytes},
                               {"layers", ns.layout.num_layers},
                               {"kv_heads", ns.layout.num_kv_heads},
                               {"head_size", ns.layout.head_size},
                               {"tp", std::to_string(ns.layout.tp_rank) + "/" + std::to_string(ns.layout.tp_size)}});
  }
  return j;
}

void Check(const std::vector<Region*>& regions, const std::vector<NodeStatus>& nodes,
           const std::vector<uint64_t>& root_offsets, std::vector<std::string>& problems) {
  auto snap = Take(*regions[0]);
  if (!snap.ok()) {
    if (snap.status().code() != StatusCode::kNotFound) problems.push_back("prefix index: " + snap.status().ToString());
    return;
  }
  const Snapshot& s = *snap;
  const uint64_t n = s.layout.entries();
  const uint32_t sps = s.layout.h.slots_per_stripe;
  const uint32_t max_nodes = s.layout.h.max_nodes;
  auto node_live = [&](uint32_t node) { return node < nodes.size() && nodes[node] == NodeStatus::kLive; };
  struct Span {
    uint64_t begin, end, slot;
  };
  std::vector<Span> spans;
  for (uint64_t slot = 0; slot < n; ++slot) {
    const Entry& e = s.entries[slot];
    const EntryState st = StateOf(e.state);
    const std::string where = "index slot " + std::to_string(slot) + " (" +
                              (st <= kTombstone ? StateName(st) : "invalid") + "): ";
    if (st > kTombstone) {
      problems.push_back(where + "state word " + std::to_string(e.state) + " is not a state");
      continue;
    }
    if (!Live(st)) continue;
    if (st == kEvicting) problems.push_back(where + "eviction left half done (its evictor died; the next holder of the stripe lock finishes it)");
    if (st == kWriting && !node_live(WriterNode(e.writer))) {
      problems.push_back(where + "written by node " + std::to_string(WriterNode(e.writer)) +
                         ", which is not live, and not reclaimed (recovery runs on a live node)");
    }
    // The entry must be on its key's probe path: its stripe, no EMPTY between home and slot.
    const uint64_t stripe = e.key_lo % s.layout.h.stripes;
    if (slot / sps != stripe) {
      problems.push_back(where + "lies outside its key's stripe " + std::to_string(stripe));
    } else {
      uint64_t i = e.key_hi % sps;
      for (uint32_t k = 0; k < sps && stripe * sps + i != slot; ++k, i = (i + 1) % sps) {
        if (StateOf(s.entries[stripe * sps + i].state) == kEmpty) {
          problems.push_back(where + "is unreachable: an EMPTY slot cuts its probe path");
          break;
        }
      }
    }
    if (e.ns >= kMaxNamespaces || s.namespaces[e.ns].state != 2) {
      problems.push_back(where + "names namespace " + std::to_string(e.ns) + ", which is not registered");
    }
    if (e.tier != kTierRegion) {
      // A capacity entry names a device slot of its owner, which only that node can verify
      // (cxlkvd validates every slot it reads); here: a known tier, a READY state, no pins.
      if (!IsCapacityTier(e.tier)) {
        problems.push_back(where + "names tier " + std::to_string(e.tier) + ", which is not a tier");
      } else if (st == kWriting) {
        problems.push_back(where + "is being written on a capacity tier (only READY blocks move there)");
      }
      if (e.bytes == 0) problems.push_back(where + "a capacity block of 0 bytes");
      continue;
    }
    region::Offset<void> off(e.payload);
    if (e.bytes == 0 || off.region_index() >= regions.size() ||
        off.byte_offset() + e.bytes > regions[off.region_index()]->info().region_size) {
      problems.push_back(where + "payload " + std::to_string(e.payload) + " of " + std::to_string(e.bytes) +
                         " bytes lies outside the pool");
      continue;
    }
    // A dead writer's WRITING payload is freed by the allocator before the entry is reclaimed.
    if (st != kWriting && !alloc::IsAllocated(*regions[off.region_index()], off.byte_offset(), max_nodes)) {
      problems.push_back(where + "payload points at freed space");
    }
    spans.push_back({e.payload, e.payload + e.bytes, slot});
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].begin < spans[i - 1].end) {
      problems.push_back("index slots " + std::to_string(spans[i - 1].slot) + " and " + std::to_string(spans[i].slot) +
                         " have overlapping payloads");
    }
  }
  for (uint64_t root : root_offsets) {
    auto it = std::upper_bound(spans.begin(), spans.end(), root, [](uint64_t v, const Span& sp) { return v < sp.begin; });
    if (it != spans.begin() && root < std::prev(it)->end) {
      problems.push_back("a named root at offset " + std::to_string(root) + " lies inside the payload of index slot " +
                         std::to_string(std::prev(it)->slot));
    }
  }
  std::vector<uint64_t> ready_keys;  // fingerprints of READY entries
  for (const Entry& e : s.entries) {
    if (StateOf(e.state) == kReady) ready_keys.push_back(PinFingerprint(e.key_lo, e.key_hi));
  }
  std::sort(ready_keys.begin(), ready_keys.end());
  for (uint32_t node = 0; node < max_nodes; ++node) {
    const uint64_t pins = s.pins[node].size();
    uint64_t on_unready = 0;
    for (uint64_t fp : s.pins[node]) {
      if (!std::binary_search(ready_keys.begin(), ready_keys.end(), fp)) ++on_unready;
    }
    if (pins && !node_live(node)) {
      problems.push_back("node " + std::to_string(node) + " is not live but holds " + std::to_string(pins) +
                         " pins (recovery drops them once a live node manages the pool)");
    }
    if (on_unready) {
      problems.push_back("node " + std::to_string(node) + " holds " + std::to_string(on_unready) +
                         " pins on keys with no READY entry (a lookup in flight pins its keys before it probes; "
                         "check again)");
    }
  }
}

}  // namespace cxlkv::cache
