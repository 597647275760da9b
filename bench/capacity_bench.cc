// `cxlkv bench capacity`: how much KV a pool holds of what it is given. For each block size
// of a real model (and a mix of three models in one pool), one process puts distinct blocks
// until twice the data area has gone in — eviction makes room as a serving pool's
// would — and then counts the blocks still READY. The figure is the KV bytes held; its limit
// is the data area itself (every chunk of the region), read from the same pool. The fill runs
// with both watermarks at 100%, so eviction frees only what each put needs and the figure is
// the allocator's packing; the headroom a default pool's high watermark keeps free is reported
// apart. The same for a node's DRAM and SSD tiers: blocks go through the region and are spilled
// to the tier as they age, past the tier's size, and the figure is the KV bytes the tier holds
// at the end against the tier's size.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cxlkv/cache.h"
#include "cxlkv/pool.h"
#include "pool/pool_internal.h"
#include "suites.h"
#include "tier/tier_store.h"

namespace cxlkv::bench {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kFillTimes = 2;  // bytes put, in data areas: well past capacity, eviction at work

// A namespace of one block size: a model's layout (16-token fp16 blocks) or, where no model
// shape is meant, an unspecified layout and a byte count.
struct BlockShape {
  const char* name;
  uint32_t layers = 0, kv_heads = 0, head_size = 0;
  uint64_t bytes = 0;  // for an unspecified layout
};

KeyNamespace NamespaceFor(const BlockShape& s) {
  KeyNamespace ns;
  ns.model_id = std::string("capacity-") + s.name;
  ns.layout.num_layers = s.layers;
  ns.layout.num_kv_heads = s.kv_heads;
  ns.layout.head_size = s.head_size;
  return ns;
}

uint64_t BlockBytesOf(const BlockShape& s) { return s.layers != 0 ? NamespaceFor(s).layout.BlockBytes() : s.bytes; }

const std::vector<BlockShape>& Shapes() {
  static const std::vector<BlockShape> shapes = {
      {"4KiB", 0, 0, 0, 4 << 10},
      {"20KiB", 0, 0, 0, 20 << 10},                 // a small model's fp8 block, a TP slice
      {"0.48MiB", 0, 0, 0, 503'296},                // 0.48 MiB, line-aligned
      {"qwen2.5-7b_0.875MiB", 28, 4, 128, 0},       // 28 layers, 4 KV heads
      {"llama-3.2-3b_1.75MiB", 28, 8, 128, 0},      // 28 layers, 8 KV heads
      {"llama-3.1-8b_2MiB", 32, 8, 128, 0},
      {"qwen3-8b_2.25MiB", 36, 8, 128, 0},
      {"llama-3.1-70b_5MiB", 80, 8, 128, 0},
      {"9MiB", 0, 0, 0, 9 * kMiB},
  };
  return shapes;
}

struct Fill {
  double held_mib = 0;       // KV bytes READY at the end
  double data_mib = 0;       // the data area
  double watermark_mib = 0;  // the data area up to the high watermark
};

// One fresh pool, filled past capacity with blocks of `shapes` in turn (round robin); counts
// what is READY at the end.
Result<Fill> FillPool(const std::string& path, uint64_t region_bytes, const std::vector<BlockShape>& shapes) {
  PoolCreateOptions co;
  co.size = region_bytes;
  co.max_nodes = 2;
  co.overwrite = true;
  co.high_watermark_pct = 100;
  co.low_watermark_pct = 100;
  // An index with a slot for every block the data area could hold at the smallest size here:
  // the figure is about the allocator, not the index's default of one slot per 16 KiB.
  uint64_t smallest = ~uint64_t{0};
  for (const BlockShape& s : shapes) smallest = std::min(smallest, BlockBytesOf(s));
  co.index_entries = std::max<uint64_t>(1024, region_bytes / smallest * 5 / 4);
  CXLKV_RETURN_IF_ERROR(Pool::Create({path}, co));
  PoolOpenOptions oo;
  oo.node_id = 0;
  CXLKV_ASSIGN_OR_RETURN(auto pool, Pool::Open({path}, oo));
  CXLKV_ASSIGN_OR_RETURN(KvCache * cache, pool->Cache());
  const uint64_t data = pool->impl().allocator->data_bytes();
  std::vector<NamespaceHandle> namespaces;
  std::vector<uint64_t> sizes;
  uint64_t largest = 0;
  for (const BlockShape& s : shapes) {
    CXLKV_ASSIGN_OR_RETURN(auto ns, cache->Namespace(NamespaceFor(s)));
    namespaces.push_back(ns);
    sizes.push_back(BlockBytesOf(s));
    largest = std::max(largest, sizes.back());
  }
  std::vector<uint8_t> payload(largest);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 131);
  std::vector<std::vector<BlockKey>> keys(shapes.size());
  uint64_t put = 0;
  for (uint64_t i = 0; put < kFillTimes * data; ++i) {
    const size_t k = i % shapes.size();
    const BlockKey key{i + 1, 0xca9ac17e00000000ull | k};
    Status s = cache->Put(namespaces[k], key, payload.data(), sizes[k]);
    if (!s.ok() && s.code() != StatusCode::kAlreadyExists) {
      return Status(s.code(), "capacity fill (" + std::string(shapes[k].name) + " block " + std::to_string(i) +
                                  "): " + s.message());
    }
    keys[k].push_back(key);
    put += sizes[k];
  }
  Fill f;
  for (size_t k = 0; k < shapes.size(); ++k) {
    CXLKV_ASSIGN_OR_RETURN(auto peeks, cache->Peek(namespaces[k], keys[k]));
    uint64_t ready = 0;
    for (const KeyPeek& p : peeks) ready += p.state == PeekState::kReady;
    f.held_mib += static_cast<double>(ready * sizes[k]) / kMiB;
  }
  f.data_mib = static_cast<double>(data) / kMiB;
  f.watermark_mib = f.data_mib * PoolCreateOptions{}.high_watermark_pct / 100.0;
  pool.reset();
  ::unlink(path.c_str());
  return f;
}

// A pool whose node 0 has one capacity tier of `kind` and `tier_bytes`; blocks of `shapes` in
// turn are put and each spilled to the tier right away (the spill thread's job, done inline so
// the figure does not depend on its timing), until twice the tier's size has gone in. Counts the
// KV bytes the tier's entries hold at the end.
Result<Fill> FillTier(const std::string& path, tier::TierKind kind, uint64_t tier_bytes,
                      const std::vector<BlockShape>& shapes) {
  uint64_t smallest = ~uint64_t{0}, largest = 0;
  for (const BlockShape& s : shapes) {
    smallest = std::min(smallest, BlockBytesOf(s));
    largest = std::max(largest, BlockBytesOf(s));
  }
  PoolCreateOptions co;
  co.size = std::max<uint64_t>(64 * kMiB, 8 * largest);
  co.max_nodes = 2;
  co.overwrite = true;
  co.index_entries = std::max<uint64_t>(1024, (tier_bytes + co.size) / smallest * 5 / 4);
  CXLKV_RETURN_IF_ERROR(Pool::Create({path}, co));
  PoolOpenOptions oo;
  oo.node_id = 0;
  CXLKV_ASSIGN_OR_RETURN(auto pool, Pool::Open({path}, oo));
  CXLKV_ASSIGN_OR_RETURN(KvCache * cache, pool->Cache());
  tier::TierStoreOptions to;
  const std::string device_file = path + ".tier";
  to.tiers = {tier::TierSpec{kind, kind == tier::TierKind::kSsd ? device_file : "", tier_bytes, -1, ""}};
  to.slot_bytes = (largest + tier::kSlotHeaderBytes + 4095) / 4096 * 4096;  // the largest block's slot
  to.background = false;
  to.log_placement = false;
  to.spill_batch = 1024;  // each spill round scans the index: fewer, larger rounds for small blocks
  auto cleanup = [&] {
    for (const std::string& f : tier::SsdStateFiles(device_file)) ::unlink(f.c_str());
    ::unlink(device_file.c_str());
  };
  auto store = tier::TierStore::Open(*pool, to);
  if (!store.ok()) {
    cleanup();
    return store.status();
  }
  std::vector<NamespaceHandle> namespaces;
  std::vector<uint64_t> sizes;
  for (const BlockShape& s : shapes) {
    CXLKV_ASSIGN_OR_RETURN(auto ns, cache->Namespace(NamespaceFor(s)));
    namespaces.push_back(ns);
    sizes.push_back(BlockBytesOf(s));
  }
  std::vector<uint8_t> payload(largest);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 131);
  Status failed;
  const uint64_t spill_every = std::max<uint64_t>(largest, 8 * kMiB);
  uint64_t put = 0, pending = 0;
  for (uint64_t i = 0; put < kFillTimes * tier_bytes && failed.ok(); ++i) {
    const size_t k = i % shapes.size();
    const BlockKey key{i + 1, 0x71e2c17e00000000ull | k};
    Status s = cache->Put(namespaces[k], key, payload.data(), sizes[k]);
    if (!s.ok() && s.code() != StatusCode::kAlreadyExists) {
      failed = Status(s.code(), "tier capacity fill (" + std::string(shapes[k].name) + " block " + std::to_string(i) +
                                    "): " + s.message());
    }
    put += sizes[k];
    // Spilled in batches, as the spill thread does once the region passes its mark.
    pending += sizes[k];
    while (failed.ok() && pending >= spill_every) {
      auto moved = (*store)->Spill(pending);
      if (!moved.ok()) failed = moved.status();
      if (!moved.ok() || *moved == 0) break;
      pending -= std::min(pending, *moved * smallest);
    }
  }
  Fill f;
  if (failed.ok()) {
    for (const auto& b : pool->impl().index->CapacityEntriesOf(0)) {
      if (b.tier == tier::EntryTierOf(kind)) f.held_mib += static_cast<double>(b.bytes) / kMiB;
    }
    const nlohmann::json st = (*store)->Stats();
    f.data_mib = static_cast<double>(st["devices"][0]["capacity_bytes"].get<uint64_t>()) / kMiB;
  }
  store->reset();
  pool.reset();
  cleanup();
  ::unlink(path.c_str());
  if (!failed.ok()) return failed;
  return f;
}

}  // namespace

Result<nlohmann::json> RunCapacityBench(const BenchOptions& options) {
  const int reps = options.quick ? 1 : std::min(options.repetitions, 2);
  const uint64_t region_bytes = (options.quick ? 64 : 128) * kMiB;
  const std::string path = options.workdir + "/cxlkv-bench-capacity-" + std::to_string(::getpid());
  struct Case {
    std::string name;
    std::vector<BlockShape> shapes;
  };
  std::vector<Case> cases;
  for (const BlockShape& s : Shapes()) {
    // A smoke run (--quick) keeps one size of each kind: a heap slot, chunks, a run of chunks.
    const std::string n = s.name;
    if (!options.quick || n == "20KiB" || n == "qwen2.5-7b_0.875MiB" || n == "qwen3-8b_2.25MiB") {
      cases.push_back({s.name, {s}});
    }
  }
  // Three models' namespaces in one pool, filled together.
  cases.push_back({"mix_qwen2.5-7b+llama-3.2-3b+qwen3-8b", {Shapes()[3], Shapes()[4], Shapes()[6]}});
  nlohmann::json results = nlohmann::json::array();
  for (const Case& c : cases) {
    std::vector<double> held, data, watermark;
    for (int rep = 0; rep < reps; ++rep) {
      CXLKV_ASSIGN_OR_RETURN(Fill f, FillPool(path, region_bytes, c.shapes));
      held.push_back(f.held_mib);
      data.push_back(f.data_mib);
      watermark.push_back(f.watermark_mib);
    }
    results.push_back(FigureJson({"data_area/" + c.name, "MiB", true, data, "", {},
                                  "every chunk of the region: what a pool could hold"}));
    results.push_back(FigureJson({"kv_held/" + c.name, "MiB", true, held, "data_area/" + c.name, data,
                                  "KV bytes READY after a fill of 2x the data area; goal >= 0.95 of the data area"}));
    results.push_back(FigureJson({"high_watermark/" + c.name, "MiB", true, watermark, "", {},
                                  "the data area up to a default pool's high watermark, above which background eviction runs"}));
    results.push_back(FigureJson({"kv_held_of_watermark/" + c.name, "MiB", true, held,
                                  "high_watermark/" + c.name, watermark,
                                  "the same against the data area up to a default pool's high watermark (background "
                                  "eviction's headroom apart)"}));
  }
  // The capacity tiers: a node's DRAM and SSD tier, each filled past its size through the region.
  // A smoke run keeps one size and the mix.
  const uint64_t tier_bytes = (options.quick ? 32 : 256) * kMiB;
  for (tier::TierKind kind : {tier::TierKind::kMem, tier::TierKind::kSsd}) {
    const std::string tier_name(tier::TierKindName(kind));
    for (const Case& c : cases) {
      if (options.quick && c.name != "qwen2.5-7b_0.875MiB" && c.shapes.size() == 1) continue;
      std::vector<double> held, size;
      for (int rep = 0; rep < reps; ++rep) {
        CXLKV_ASSIGN_OR_RETURN(Fill f, FillTier(path, kind, tier_bytes, c.shapes));
        held.push_back(f.held_mib);
        size.push_back(f.data_mib);
      }
      results.push_back(FigureJson({tier_name + "_tier/" + c.name, "MiB", true, size, "", {},
                                    "the " + tier_name + " tier's size"}));
      results.push_back(FigureJson({tier_name + "_kv_held/" + c.name, "MiB", true, held, tier_name + "_tier/" + c.name,
                                    size, "KV bytes on the " + tier_name + " tier after a fill of 2x its size; goal >= "
                                    "0.95 of its size (an SSD slot is whole 4 KiB units, its 64 B header included)"}));
    }
  }
  nlohmann::json report;
  report["suite"] = "capacity";
  report["machine"] = MachineJson();
  report["repetitions"] = reps;
  report["region_bytes"] = region_bytes;
  report["tier_bytes"] = tier_bytes;
  report["results"] = results;
  return report;
}

}  // namespace cxlkv::bench
