// `cxlkv bench trace --trace FILE`: capacity as hit rate. A public serving trace whose requests
// name their prefix blocks (`hash_ids`, one per 512 tokens: the Mooncake conversation trace) is
// replayed into a pool sized to hold a third of the distinct blocks it names: per request, the
// longest cached prefix is looked up (hit blocks), then the missing blocks are put. The
// reference is an exact-size LRU simulation of the same requests with as many blocks as the
// pool's data area holds at that size, under the same policy (prefix hits refresh, a block
// already present past the prefix is left as it is). Their ratio is what the allocator's
// packing and the eviction policy give away.
//
// Two shapes: blocks the chunk divides (Llama-3.1-8B's 2 MiB) and blocks it does not
// (Qwen2.5-7B's 0.875 MiB, 0.4375 of a chunk). So that a third of a trace's distinct blocks
// fits this machine, chunk and blocks are scaled down together by 32 (64 KiB chunks, 64 KiB and
// 28 KiB blocks): the slab geometry, and so the packing, are the same as at full size.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <list>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cxlkv/cache.h"
#include "cxlkv/pool.h"
#include "pool/pool_internal.h"
#include "suites.h"

namespace cxlkv::bench {
namespace {

constexpr uint64_t kScaledChunk = 64 << 10;  // 2 MiB / 32
constexpr uint64_t kMinTracePoolBytes = 8 << 20;  // a pool's smallest region

using Request = std::vector<uint64_t>;  // the hash ids of its blocks, in prefix order

Result<std::vector<Request>> LoadTrace(const std::string& path, size_t max_requests) {
  if (path.empty()) {
    return InvalidArgument("bench trace needs a trace: pass --trace FILE, a JSON-lines file with a \"hash_ids\" "
                           "array per request (the Mooncake conversation trace is "
                           "FAST25-release/traces/conversation_trace.jsonl of github.com/kvcache-ai/Mooncake)");
  }
  std::ifstream in(path);
  if (!in) return NotFound("cannot open the trace " + path + ": check the path");
  std::vector<Request> out;
  std::string line;
  for (size_t n = 1; out.size() < max_requests && std::getline(in, line); ++n) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("hash_ids") || !j["hash_ids"].is_array()) {
      return InvalidArgument("trace " + path + " line " + std::to_string(n) +
                             ": not a JSON object with a \"hash_ids\" array");
    }
    Request r;
    for (const auto& id : j["hash_ids"]) {
      if (!id.is_number_unsigned()) {
        return InvalidArgument("trace " + path + " line " + std::to_string(n) + ": a hash id is not a non-negative integer");
      }
      r.push_back(id.get<uint64_t>());
    }
    if (!r.empty()) out.push_back(std::move(r));
  }
  if (out.empty()) return InvalidArgument("trace " + path + " has no request with hash ids");
  return out;
}

// The exact-size LRU of `capacity` blocks, under the replay's policy.
double SimulatedHitRate(const std::vector<Request>& trace, uint64_t capacity) {
  std::list<uint64_t> lru;  // front: most recent
  std::unordered_map<uint64_t, std::list<uint64_t>::iterator> where;
  uint64_t hits = 0, blocks = 0;
  for (const Request& r : trace) {
    size_t prefix = 0;
    while (prefix < r.size() && where.count(r[prefix])) ++prefix;
    for (size_t i = 0; i < prefix; ++i) lru.splice(lru.begin(), lru, where[r[i]]);
    for (size_t i = prefix; i < r.size(); ++i) {
      if (where.count(r[i]) || capacity == 0) continue;
      lru.push_front(r[i]);
      where[r[i]] = lru.begin();
      if (lru.size() > capacity) {
        where.erase(lru.back());
        lru.pop_back();
      }
    }
    hits += prefix;
    blocks += r.size();
  }
  return blocks == 0 ? 0 : static_cast<double>(hits) / static_cast<double>(blocks);
}

struct Replay {
  double hit_rate = 0;
  uint64_t capacity_blocks = 0;  // what the data area holds at this size, exactly
};

Result<Replay> ReplayIntoPool(const std::string& path, const std::vector<Request>& trace, uint64_t distinct,
                              uint64_t block_bytes) {
  // A data area of a third of the distinct blocks, plus the tables and index beside it.
  const uint64_t want_data = (distinct + 2) / 3 * block_bytes;
  PoolCreateOptions co;
  co.chunk_bytes = kScaledChunk;
  co.size = (want_data + want_data / 16 + (32 << 20)) / kScaledChunk * kScaledChunk;
  co.max_nodes = 2;
  co.overwrite = true;
  co.index_entries = std::max<uint64_t>(4096, distinct);
  // Eviction frees what each put needs, as the simulated LRU does (no watermark headroom).
  co.high_watermark_pct = 100;
  co.low_watermark_pct = 100;
  PoolOpenOptions oo;
  oo.node_id = 0;
  // The tables beside the data area grow with it: made once, measured, and made again with the
  // data area trimmed to the third (to within a chunk).
  CXLKV_RETURN_IF_ERROR(Pool::Create({path}, co));
  uint64_t data = 0;
  {
    CXLKV_ASSIGN_OR_RETURN(auto probe, Pool::Open({path}, oo));
    data = probe->impl().allocator->data_bytes();
  }
  if (data > want_data + kScaledChunk && co.size - (data - want_data) >= kMinTracePoolBytes) {
    co.size -= (data - want_data) / kScaledChunk * kScaledChunk;
    CXLKV_RETURN_IF_ERROR(Pool::Create({path}, co));
  }
  CXLKV_ASSIGN_OR_RETURN(auto pool, Pool::Open({path}, oo));
  CXLKV_ASSIGN_OR_RETURN(KvCache * cache, pool->Cache());
  KeyNamespace ns_spec;
  ns_spec.model_id = "trace-" + std::to_string(block_bytes);
  CXLKV_ASSIGN_OR_RETURN(auto ns, cache->Namespace(ns_spec));
  std::vector<uint8_t> payload(block_bytes, 0x6b);
  uint64_t hits = 0, blocks = 0;
  std::vector<BlockKey> keys;
  for (const Request& r : trace) {
    keys.clear();
    for (uint64_t id : r) keys.push_back(BlockKey{id + 1, 0x7ace});
    CXLKV_ASSIGN_OR_RETURN(auto hit, cache->Lookup(ns, keys));
    for (size_t i = hit.hit_blocks; i < keys.size(); ++i) {
      Status s = cache->Put(ns, keys[i], payload.data(), block_bytes);
      if (!s.ok() && s.code() != StatusCode::kAlreadyExists) {
        cache->Release(hit.pins);
        return Status(s.code(), "trace replay: put of a " + std::to_string(block_bytes) + "-byte block: " + s.message());
      }
    }
    cache->Release(hit.pins);
    hits += hit.hit_blocks;
    blocks += keys.size();
  }
  Replay out;
  out.hit_rate = static_cast<double>(hits) / static_cast<double>(blocks);
  out.capacity_blocks = pool->impl().allocator->data_bytes() / block_bytes;
  pool.reset();
  ::unlink(path.c_str());
  return out;
}

}  // namespace

Result<nlohmann::json> RunTraceBench(const BenchOptions& options) {
  const size_t requests = options.quick ? 300 : 2000;
  CXLKV_ASSIGN_OR_RETURN(std::vector<Request> trace, LoadTrace(options.trace, requests));
  std::unordered_set<uint64_t> seen;
  for (const Request& r : trace) seen.insert(r.begin(), r.end());
  const uint64_t distinct = seen.size();
  const std::string path = options.workdir + "/cxlkv-bench-trace-" + std::to_string(::getpid());
  struct Shape {
    const char* name;
    uint64_t bytes;
  };
  nlohmann::json results = nlohmann::json::array();
  for (Shape s : {Shape{"llama-3.1-8b_2MiB", kScaledChunk}, Shape{"qwen2.5-7b_0.875MiB", kScaledChunk * 7 / 16}}) {
    // The hit rate is a count, the same in every run: one replay.
    CXLKV_ASSIGN_OR_RETURN(Replay ours, ReplayIntoPool(path, trace, distinct, s.bytes));
    const double simulated = SimulatedHitRate(trace, ours.capacity_blocks);
    const std::string n = s.name;
    results.push_back(FigureJson({"lru_hit_rate/" + n, "fraction", true, {simulated}, "", {},
                                  "exact-size LRU of as many blocks as the data area holds (" +
                                      std::to_string(ours.capacity_blocks) + ")"}));
    results.push_back(FigureJson({"hit_rate/" + n, "fraction", true, {ours.hit_rate}, "lru_hit_rate/" + n, {simulated},
                                  "prefix hit blocks / blocks of the replayed requests; goal >= 0.95 of the LRU's"}));
  }
  nlohmann::json report;
  report["suite"] = "trace";
  report["machine"] = MachineJson();
  report["repetitions"] = 1;
  report["trace"] = options.trace;
  report["requests"] = trace.size();
  report["distinct_blocks"] = distinct;
  report["results"] = results;
  return report;
}

}  // namespace cxlkv::bench
