// What a serving run measured, per configuration: TTFT (mean, P50, P99), TPOT, throughput,
// prefix hit rate and KV bytes moved; as a table, as JSON, and as a TTFT CDF plot (gnuplot).
#ifndef CXLKV_SRC_SERVE_REPORT_H_
#define CXLKV_SRC_SERVE_REPORT_H_

#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "serve/router.h"

namespace cxlkv::serve {

struct RunSummary {
  std::string name;            // the configuration
  size_t requests = 0;
  double ttft_mean_ms = 0, ttft_p50_ms = 0, ttft_p99_ms = 0;
  // Requests whose prompt shares its group with an earlier request ("seen before": the papers'
  // cache-hit TTFT), how many, and their mean TTFT; 0 when none.
  size_t seen_requests = 0;
  double ttft_seen_mean_ms = 0;
  double tpot_mean_ms = 0;     // per output token after the first
  double requests_per_s = 0;
  double tokens_per_s = 0;     // generated tokens
  double hit_rate = 0;         // prefill: reused full blocks / full blocks
  double hit_rate_mem = 0;     // of hit_rate: blocks brought in from node-DRAM tiers
  double hit_rate_ssd = 0;     // of hit_rate: blocks brought in from SSD tiers
  uint32_t computed_tokens = 0;  // prompt tokens run through a prefill (both sides)
  uint64_t bytes_moved = 0;    // KV bytes into and out of engine caches
  double wall_s = 0;
  uint32_t retries = 0;
  uint64_t blocks_not_stored = 0;  // the pool was full of pinned and in-flight blocks (KvStats)
  std::vector<double> ttft_ms;  // per request, for the CDF
};

RunSummary Summarize(const std::string& name, const ServeRun& run);
// Hit rate of the requests of one pass (by index range), e.g. the second pass of a doc-QA set.
double HitRate(const ServeRun& run, size_t first, size_t last);
void PrintTable(std::FILE* out, std::span<const RunSummary> runs);
// Where each configuration's prefix hits came from: the region, node DRAM, SSD.
void PrintTierHits(std::FILE* out, std::span<const RunSummary> runs);
nlohmann::json SummaryJson(const RunSummary& s);
// Writes `png` with one TTFT CDF curve per run (gnuplot's pngcairo or png terminal). Errors:
// kNotFound (no gnuplot: install gnuplot-nox), kIoError.
Status PlotTtftCdf(const std::string& png, std::span<const RunSummary> runs);

}  // namespace cxlkv::serve

#endif  // CXLKV_SRC_SERVE_REPORT_H_
