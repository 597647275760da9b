// bench e2e: the end-to-end comparison (serve/compare.h) as figures: the cxlkv shared pool's
// TTFT and throughput next to each baseline's, measured in the same run on the same machine.
// One repetition is the whole comparison (four configurations of worker processes); --reps
// repeats it and reports medians.
#include <string>

#include "serve/compare.h"
#include "suites.h"

namespace cxlkv::bench {

Result<nlohmann::json> RunE2eBench(const BenchOptions& options) {
  serve::WorkloadOptions w;
  w.kind = serve::WorkloadKind::kDocQa;
  w.documents = options.quick ? 4 : 8;
  w.doc_tokens = options.quick ? 2048 : 6144;
  w.answer_tokens = options.quick ? 32 : 64;
  CXLKV_ASSIGN_OR_RETURN(auto requests, serve::GenerateWorkload(w));
  serve::CompareOptions co;
  co.workdir = options.workdir;
  co.serve.model_config = {{"name", "tiny-llama"}};
  co.serve.concurrency = 2;
  const int reps = options.quick ? 1 : std::min(options.repetitions, 3);
  std::vector<serve::Comparison> runs;
  for (int r = 0; r < reps; ++r) {
    CXLKV_ASSIGN_OR_RETURN(auto c, serve::CompareConfigurations(co, requests));
    runs.push_back(std::move(c));
  }
  nlohmann::json results = nlohmann::json::array();
  const size_t pool = runs[0].summaries.size() - 1;
  for (size_t b = 0; b < pool; ++b) {
    const std::string vs = runs[0].runs[b].mode;
    Figure ttft{"ttft_mean/pool_vs_" + vs, "ms", false, {}, "ttft_mean/" + vs, {},
                "pool TTFT / baseline TTFT: below 1 is the pool's gain"};
    Figure rps{"throughput/pool_vs_" + vs, "req/s", true, {}, "throughput/" + vs, {},
               "pool requests/s over the baseline's"};
    for (const auto& c : runs) {
      ttft.samples.push_back(c.summaries[pool].ttft_mean_ms);
      ttft.reference_samples.push_back(c.summaries[b].ttft_mean_ms);
      rps.samples.push_back(c.summaries[pool].requests_per_s);
      rps.reference_samples.push_back(c.summaries[b].requests_per_s);
    }
    results.push_back(FigureJson(ttft));
    results.push_back(FigureJson(rps));
  }
  return nlohmann::json{{"suite", "e2e"},
                        {"machine", MachineJson()},
                        {"repetitions", reps},
                        {"results", results},
                        {"comparison", serve::ComparisonJson(runs.back())}};
}

}  // namespace cxlkv::bench
