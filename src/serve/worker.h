// A serving worker process (`cxlkv serve-worker`, started by the router): one node of the pool,
// one reference engine, one KV connector; it takes requests over its channel, one at a time.
//
// Messages (JSON lines). Router → worker:
//   {"type":"prefill","id":N,"attempt":A,"prompt":[..],"decode_port":P}  (decode_port: kTcp only)
//   {"type":"decode","id":N,"attempt":A,"prompt":[..],"first_token":T,"max_new":M}
//   {"type":"exit"}
// Worker → router (every answer to a request echoes its "attempt"):
//   {"type":"ready","port":P}                                 (P: the TCP handoff port, or 0)
//   {"type":"prefilled","id":N,"first_token":T,"stats":{..},"ns":t}
//   {"type":"done","id":N,"tokens":[..],"first_ns":t,"stats":{..},"ns":t}
//   {"type":"error","id":N,"message":"..."}                   (the request failed)
//   {"type":"fatal","message":"..."}                          (the worker cannot serve; it exits)
#ifndef CXLKV_SRC_SERVE_WORKER_H_
#define CXLKV_SRC_SERVE_WORKER_H_

#include <string>

#include <nlohmann/json.hpp>

#include "serve/kv_connector.h"

namespace cxlkv::serve {

// WorkerOptions::attention for decoding with the prompt left in the pool (engine/remote_attention.h),
// attended by the router node's near-memory engines; "remote-hybrid" also holds half the budget's
// pages in the engine (steady selection) and attends those itself.
inline constexpr char kRemoteAttention[] = "remote";
inline constexpr char kRemoteHybridAttention[] = "remote-hybrid";
inline bool IsRemoteAttention(const std::string& a) { return a == kRemoteAttention || a == kRemoteHybridAttention; }

enum class WorkerRole { kPrefill, kDecode };

struct WorkerOptions {
  WorkerRole role = WorkerRole::kPrefill;
  uint32_t index = 0;              // among the workers of its role
  std::string region;              // the pool's region path(s), comma-separated
  uint32_t node_id = 1;
  uint32_t lease_ms = 1000;
  KvMode mode = KvMode::kPool;
  nlohmann::json model_config;     // engine::ModelConfig as JSON
  std::string weights;             // safetensors file; empty: seeded random weights
  uint64_t run_id = 0;
  uint32_t engine_blocks = 512;    // blocks of the engine's paged cache
  uint64_t private_cache_bytes = 256ull << 20;
  bool stream_capacity = false;    // read capacity-tier hits into the engine, not promote them
  std::string attention = "dense"; // decode attention: dense, sparse, hybrid, remote or remote-hybrid
  uint32_t attention_budget = 2048;  // sparse/hybrid/remote: tokens attended per KV head
  int channel_fd = 3;
};

nlohmann::json WorkerOptionsToJson(const WorkerOptions& o);
Result<WorkerOptions> WorkerOptionsFromJson(const nlohmann::json& j);

// Runs until told to exit or the router goes away. Returns the process exit code.
int RunWorker(const WorkerOptions& options);

nlohmann::json KvStatsToJson(const KvStats& s);
KvStats KvStatsFromJson(const nlohmann::json& j);

}  // namespace cxlkv::serve

#endif  // CXLKV_SRC_SERVE_WORKER_H_
