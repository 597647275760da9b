// The router of `cxlkv serve`: starts P prefill and D decode worker processes (each its own
// node on one pool region), feeds them a request set closed- or open-loop, routes each request
// to a prefill worker by policy and to a decode worker by load, and records what happened.
//
//   kLeastLoaded     cache-oblivious: the prefill worker with the fewest requests in flight
//                    (Beluga §6.3)
//   kPrefixAffinity  cache-aware, as Dynamo's and Mooncake's routers: the worker that was sent
//                    the longest prefix of this prompt before, unless it is busier than the
//                    least-loaded one by more than a margin
//
// A worker that dies (kill -9) is noticed by its closed channel: its requests go to another
// worker (a prefill again; a decode again, or a prefill again where its KV went with it), and
// the router — node 0 of the pool, its manager — waits for the pool to recover the dead node
// before it returns.
#ifndef CXLKV_SRC_SERVE_ROUTER_H_
#define CXLKV_SRC_SERVE_ROUTER_H_

#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "serve/kv_connector.h"
#include "serve/workload.h"

namespace cxlkv::serve {

enum class RoutePolicy { kLeastLoaded, kPrefixAffinity };
Result<RoutePolicy> ParseRoutePolicy(std::string_view name);  // "least-loaded" | "prefix-affinity"
std::string_view RoutePolicyName(RoutePolicy p);

struct ServeOptions {
  std::string region;                 // an existing pool with a prefix index (comma-separated paths)
  uint32_t prefill = 2;               // prefill workers. Default 2.
  uint32_t decode = 1;                // decode workers. Default 1.
  KvMode mode = KvMode::kPool;
  RoutePolicy policy = RoutePolicy::kLeastLoaded;
  nlohmann::json model_config;        // engine::ModelConfig as JSON
  std::string weights;                // safetensors; empty: seeded random
  uint32_t engine_blocks = 0;         // per worker; 0: enough for the largest request, twice
  uint64_t private_cache_bytes = 256ull << 20;  // kPrivate / kTcp, per prefill worker
  uint32_t lease_ms = 1000;
  // Capacity tiers that the router's node (node 0) serves, as cxlkvd's --tier specs
  // ("dram:64M", "ssd:PATH:256M"): the region spills to them and hits promote from them.
  // Slots are sized to the model's KV block. Empty: none. Needs decentralized metadata.
  std::vector<std::string> tiers;
  // A prefix hit on a capacity tier: false (default) promotes the blocks into the region (then
  // loads them); true reads them straight into the engine (transfer's capacity source) and
  // leaves them where they are.
  bool stream_capacity = false;
  // Decode workers' attention (engine/sparse_attention.h): "dense" (default), "sparse" (top-K
  // pages next to the memory) or "hybrid"; or "remote" (engine/remote_attention.h: KV mode pool
  // only; the router serves near-memory attention as a cxlkvd would, and decode workers leave
  // the prompt's blocks in the pool for it) or "remote-hybrid" (the same, the decode engine
  // holding half the budget's pages). attention_budget is the sparse budget in tokens.
  std::string attention = "dense";
  uint32_t attention_budget = 2048;
  uint32_t concurrency = 4;           // closed loop: requests in flight. Default 4.
  bool open_loop = false;             // true: requests start at their arrival_s instead
  uint32_t max_per_worker = 2;        // requests queued at one prefill worker at most
  int kill_prefill_after = -1;        // fault injection: SIGKILL prefill worker 0 after N done
  std::string worker_exe;             // runs `serve-worker`; empty: this process's binary (cxlkv)
  std::function<void(size_t done, size_t total)> progress;  // called as requests complete
};

struct RequestRecord {
  uint64_t id = 0;
  std::string group;
  uint32_t prompt_tokens = 0;
  std::vector<int32_t> tokens;        // generated
  int64_t arrival_ns = 0;
  int64_t prefilled_ns = 0;
  int64_t first_ns = 0;               // first token out of the decode worker (KV in place)
  int64_t done_ns = 0;
  int prefill_worker = -1;
  int decode_worker = -1;
  uint32_t retries = 0;
  KvStats prefill;
  KvStats decode;
};

struct ServeRun {
  std::string mode;
  std::string policy;
  uint32_t prefill = 0, decode = 0;
  std::vector<RequestRecord> records;  // in request order
  double wall_s = 0;
  uint32_t workers_killed = 0;
  uint32_t retries = 0;
  nlohmann::json tiers;  // with tiers: the store's statistics at the end (TierStore::Stats)
};

// Errors: kInvalidArgument (zero workers, no requests, a bad option or tier spec, tiers on
// central metadata), kNotFound (the region), a tier device that cannot be used (named),
// and a worker's setup error as it reported it (e.g. kVersionMismatch: the model's KV layout
// is not the one the region holds for it), kIoError (a worker could not be started).
Result<ServeRun> Serve(const ServeOptions& options, const std::vector<Request>& requests);

}  // namespace cxlkv::serve

#endif  // CXLKV_SRC_SERVE_ROUTER_H_
