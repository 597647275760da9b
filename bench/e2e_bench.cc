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
  const int pool = serve::PoolIndex(runs[0], MetadataMode::kDecentralized);
  const int central = serve::PoolIndex(runs[0], MetadataMode::kCentral);
  if (pool < 0) return Internal("the comparison ran no shared-pool configuration");
  // `pool` next to `ref`, per repetition: mean TTFT, the TTFT of prompts seen before (the
  // papers' cache-hit TTFT), throughput.
  auto compare = [&](int a, int ref, const std::string& label, const std::string& vs, const std::string& what) {
    Figure ttft{"ttft_mean/" + label + "_vs_" + vs, "ms", false, {}, "ttft_mean/" + vs, {},
                what + " TTFT / " + vs + " TTFT: below 1 is the gain"};
    Figure seen{"ttft_seen/" + label + "_vs_" + vs, "ms", false, {}, "ttft_seen/" + vs, {},
                "the same over prompts seen before (cache-hit TTFT)"};
    Figure rps{"throughput/" + label + "_vs_" + vs, "req/s", true, {}, "throughput/" + vs, {},
               what + " requests/s over " + vs + "'s"};
    for (const auto& c : runs) {
      ttft.samples.push_back(c.summaries[a].ttft_mean_ms);
      ttft.reference_samples.push_back(c.summaries[ref].ttft_mean_ms);
      seen.samples.push_back(c.summaries[a].ttft_seen_mean_ms);
      seen.reference_samples.push_back(c.summaries[ref].ttft_seen_mean_ms);
      rps.samples.push_back(c.summaries[a].requests_per_s);
      rps.reference_samples.push_back(c.summaries[ref].requests_per_s);
    }
    results.push_back(FigureJson(ttft));
    results.push_back(FigureJson(seen));
    results.push_back(FigureJson(rps));
  };
  for (size_t b = 0; b < runs[0].summaries.size(); ++b) {
    if (runs[0].modes[b] == serve::KvMode::kPool) continue;
    compare(pool, static_cast<int>(b), "pool", runs[0].runs[b].mode, "pool");
  }
  if (central >= 0) compare(central, pool, "central", "decentralized", "central-metadata pool");
  return nlohmann::json{{"suite", "e2e"},
                        {"machine", MachineJson()},
                        {"repetitions", reps},
                        {"results", results},
                        {"comparison", serve::ComparisonJson(runs.back())}};
}

}  // namespace cxlkv::bench
