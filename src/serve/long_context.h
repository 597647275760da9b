// The long-context decode scenario (PNM §3): one sequence of 128K to 1M tokens
// decoded by the reference engine with dense attention, near-memory sparse attention and the
// engine/near-memory hybrid, side by side — decode-step time, bytes that reach the engine per
// step, how much of the dense attention mass the selection kept, and output agreement.
//
// Where the context comes from: a 2-core CPU cannot prefill a million tokens (the attention
// alone is ~10^15 multiply-adds), so the context's KV is synthetic — keys at the model's own
// key norm per layer (measured on a real prefill), a small share of heavy-hitter tokens whose
// keys are several times longer (attention in real models concentrates on few tokens: H2O,
// Quest), values uniform — and the last block is a real prompt prefilled over it. Every decode
// step is the real model: projections, RoPE, attention over the whole context, MLP, logits.
// The sparse and hybrid runs are teacher-forced with the dense run's tokens, so every step is
// compared with dense on the same input.
//
// With `remote_region` set, the same context is also put into a pool there and decoded through
// a near-memory service over it (serve/long_context_remote.h): remote-dense (every page at the
// service), remote-sparse and remote-hybrid, over the pool's RPC as cxlkvd serves engines.
//
// Thread-safety: one call at a time (it uses the process's memory and cores).
#ifndef CXLKV_SRC_SERVE_LONG_CONTEXT_H_
#define CXLKV_SRC_SERVE_LONG_CONTEXT_H_

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cxlkv/status.h"

namespace cxlkv::serve {

struct LongContextOptions {
  nlohmann::json model_config;  // the engine (max_position is raised as needed)
  std::vector<uint64_t> context_tokens = {131072, 1048576};
  std::vector<uint32_t> budget_divisors = {8, 32};  // budget = context / divisor tokens
  uint32_t decode_steps = 8;
  uint32_t near_threads = 1;      // near-memory workers besides the caller
  double heavy_fraction = 0.002;  // share of context tokens with heavy-hitter keys
  double heavy_scale = 10.0;      // their key norm, in units of the model's key norm
  uint64_t seed = 1;
  // Non-empty: also the remote rows, the pool's region created at this path (and its name
  // removed once mapped), of remote_region_bytes (0: sized to the context).
  std::string remote_region;
  uint64_t remote_region_bytes = 0;
  // A remote region that cannot be made (no room for it) skips that context's remote rows with
  // a note instead of failing the run (the demo: its other rows stand on their own).
  bool remote_optional = false;
  std::function<void(const std::string&)> progress;  // one line per phase
};

// One (context, mode, budget) run.
struct LongContextRow {
  uint64_t context_tokens = 0;
  // dense (the engine's attention), dense-nm (the near-memory kernel over every page), sparse,
  // hybrid; remote-dense, remote-sparse, remote-hybrid (the same at a near-memory service).
  std::string mode;
  uint32_t budget_tokens = 0;           // 0 for dense
  double step_ms = 0;                   // median decode step (all layers, the whole model)
  std::vector<double> step_ms_samples;  // every step
  double speedup = 1;                   // dense step_ms / step_ms
  // sparse, hybrid: dense-nm step_ms / step_ms; remote-sparse, remote-hybrid: remote-dense's.
  double speedup_vs_nm_dense = 0;
  double engine_bytes_per_step =
      0;  // bytes that reach the engine per step if the KV lives in the pool
  double kv_read_bytes_per_step = 0;   // KV bytes attention reads per step (wherever it runs)
  double recalled_bytes_per_step = 0;  // hybrid: pages copied into the engine
  double mass_recall_mean = 1, mass_recall_min = 1;  // share of the dense softmax mass attended
  bool mass_measured = true;  // false for the remote rows (the service's selection is not audited)
  double open_ms = 0;         // remote rows: opening the context at the service (its digests)
  uint32_t tokens_agree = 0;                         // steps whose greedy token equals dense's
  uint32_t steps = 0;
  double logits_rel_err_max = 0;  // max over steps of ||logits - dense|| / ||dense||
};

struct LongContextResult {
  std::vector<LongContextRow> rows;
  std::vector<double>
      digest_build_tokens_per_s;  // per context: the bulk digest build after prefill
  std::vector<double> fill_s;     // per context: synthesizing and prefilling
  std::vector<std::string> notes;  // what was skipped, and why
};

// Errors: an invalid model config; kNoSpace naming the bytes when the context's KV cannot be
// allocated; a model the pnm kernels cannot serve (head_dim not a multiple of 16).
Result<LongContextResult> RunLongContextDecode(const LongContextOptions& o);

void PrintLongContext(FILE* out, const LongContextResult& r);
nlohmann::json LongContextJson(const LongContextResult& r);

}  // namespace cxlkv::serve

#endif  // CXLKV_SRC_SERVE_LONG_CONTEXT_H_
