// bench longctx: the long-context decode scenario (serve/long_context.h) as figures — a whole
// decode step of the reference engine with near-memory sparse and hybrid attention next to the
// same step with dense attention (the engine's kernel, and the near-memory kernel over every
// page), measured in the same run on the same synthetic context; the bytes that reach the
// engine per step next to dense's; the attention mass the selection kept next to all of it.
#include <string>

#include "serve/long_context.h"
#include "suites.h"

namespace cxlkv::bench {

Result<nlohmann::json> RunLongContextBench(const BenchOptions& options) {
  serve::LongContextOptions o;
  o.model_config = {{"name", "tiny-llama"}};
  if (options.quick) o.context_tokens = {32768};
  o.decode_steps = options.quick ? 4 : 8;
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
    const std::string name =
        ctx + "/" + row.mode + "/1_" + std::to_string(row.context_tokens / row.budget_tokens);
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
