// bench longctx: the long-context decode scenario (serve/long_context.h) as figures — a whole
// decode step of the reference engine with near-memory sparse and hybrid attention next to the
// same step with dense attention (the engine's kernel, and the near-memory kernel over every
// page), measured in the same run on the same synthetic context; the bytes that reach the
// engine per step next to dense's; the attention mass the selection kept next to all of it.
// Then the same steps through a near-memory service over a pool holding the context (the
// remote rows), each next to the same attention run in the engine's process.
#include <unistd.h>

#include <string>

#include "serve/long_context.h"
#include "suites.h"

namespace cxlkv::bench {

Result<nlohmann::json> RunLongContextBench(const BenchOptions& options) {
  serve::LongContextOptions o;
  o.model_config = {{"name", "tiny-llama"}};
  if (options.quick) o.context_tokens = {32768};
  o.decode_steps = options.quick ? 4 : 8;
  o.remote_region = "/dev/shm/cxlkv-bench-longctx-" + std::to_string(::getpid());
  o.remote_optional = true;  // no room in /dev/shm for the pool: the in-process figures alone
  CXLKV_ASSIGN_OR_RETURN(serve::LongContextResult r, serve::RunLongContextDecode(o));
  nlohmann::json results = nlohmann::json::array();
  const serve::LongContextRow* dense = nullptr;
  const serve::LongContextRow* nm_dense = nullptr;
  for (const serve::LongContextRow& row : r.rows) {
    const std::string ctx = std::to_string(row.context_tokens / 1024) + "K";
    if (row.mode == "dense") {
      dense = &row;
      continue;
    }
    if (row.mode == "dense-nm") {
      nm_dense = &row;
      results.push_back(FigureJson(
          {"step_ms/" + ctx + "/dense-nm", "ms", false, row.step_ms_samples,
           "step_ms/" + ctx + "/dense", dense->step_ms_samples,
           "decode step, near-memory kernel over every page / engine's dense attention"}));
      continue;
    }
    if (row.mode == "remote-dense") {
      results.push_back(FigureJson({"step_ms/" + ctx + "/remote-dense", "ms", false, row.step_ms_samples,
                                    "step_ms/" + ctx + "/dense-nm", nm_dense->step_ms_samples,
                                    "decode step, every page attended by the near-memory service over "
                                    "the pool / the same kernel in the engine's process"}));
      continue;
    }
    const std::string budget = "1_" + std::to_string(row.context_tokens / row.budget_tokens);
    const std::string name = ctx + "/" + row.mode + "/" + budget;
    if (row.mode.rfind("remote-", 0) == 0) {
      // Next to the same mode and budget in the engine's process (its row came first).
      const std::string local_mode = row.mode.substr(7);
      const serve::LongContextRow* local = nullptr;
      for (const serve::LongContextRow& other : r.rows) {
        if (other.context_tokens == row.context_tokens && other.mode == local_mode &&
            other.budget_tokens == row.budget_tokens) {
          local = &other;
        }
      }
      if (local == nullptr) continue;
      results.push_back(FigureJson({"step_ms/" + name, "ms", false, row.step_ms_samples,
                                    "step_ms/" + ctx + "/" + local_mode + "/" + budget,
                                    local->step_ms_samples,
                                    "decode step through the near-memory service / in-process"}));
      results.push_back(FigureJson({"engine_bytes/" + name,
                                    "B/step",
                                    false,
                                    {row.engine_bytes_per_step},
                                    "engine_bytes/" + ctx + "/dense",
                                    {dense->engine_bytes_per_step},
                                    "bytes crossing to the engine per step (RPC, recalls) / dense's KV"}));
      continue;
    }
    results.push_back(FigureJson({"step_ms/" + name, "ms", false, row.step_ms_samples,
                                  "step_ms/" + ctx + "/dense", dense->step_ms_samples,
                                  "decode step / dense step: below 1 is the speedup's inverse"}));
    results.push_back(
        FigureJson({"step_ms/" + name + "_vs_dense-nm", "ms", false, row.step_ms_samples,
                    "step_ms/" + ctx + "/dense-nm", nm_dense->step_ms_samples,
                    "the same against dense with the near-memory kernel"}));
    results.push_back(
        FigureJson({"engine_bytes/" + name,
                    "B/step",
                    false,
                    {row.engine_bytes_per_step},
                    "engine_bytes/" + ctx + "/dense",
                    {dense->engine_bytes_per_step},
                    "bytes reaching the engine per step (q, out, lse, recalls) / dense's KV"}));
    if (row.mode == "sparse") {
      results.push_back(FigureJson({"mass_kept/" + name,
                                    "share",
                                    true,
                                    {row.mass_recall_mean},
                                    "mass_kept/all",
                                    {1.0},
                                    "dense softmax mass on the selected tokens (goal >= 0.95)"}));
    }
  }
  return nlohmann::json{{"suite", "longctx"},
                        {"machine", MachineJson()},
                        {"repetitions", o.decode_steps},
                        {"results", results},
                        {"scenario", serve::LongContextJson(r)}};
}

}  // namespace cxlkv::bench
