// The four configurations of the end-to-end comparison, on one workload, in one run (what
// `cxlkv demo` and `cxlkv bench e2e` show): no KV reuse, a private per-worker DRAM cache, the
// private cache with a TCP handoff, and the cxlkv shared pool. Each gets a fresh pool region
// and fresh worker processes; the generated tokens must be identical, request by request.
#ifndef CXLKV_SRC_SERVE_COMPARE_H_
#define CXLKV_SRC_SERVE_COMPARE_H_

#include <string>
#include <vector>

#include "cxlkv/pool.h"
#include "serve/report.h"
#include "serve/router.h"
#include "serve/workload.h"

namespace cxlkv::serve {

struct CompareOptions {
  ServeOptions serve;                // region, mode and progress are set per configuration
  std::string workdir = "/dev/shm";  // where each configuration's region goes (removed after)
  std::string region_prefix;         // if set: regions at PREFIX-<mode> instead of in workdir
  uint64_t region_bytes = 512ull << 20;
  std::vector<KvMode> modes = {KvMode::kRecompute, KvMode::kPrivate, KvMode::kTcp, KvMode::kPool};
  // The shared-pool configuration runs once per metadata mode listed (docs/metadata.md):
  // decentralized (TraCT) and central (Beluga) by default, in that order.
  std::vector<MetadataMode> pool_metadata = {MetadataMode::kDecentralized, MetadataMode::kCentral};
  // If set: the decentralized pool runs once more with these capacity tiers (ServeOptions::tiers,
  // "(f) cxlkv pool + DRAM/SSD tiers"); an SSD file a run creates is removed after it.
  std::vector<std::string> pool_tiers;
  // Called before each configuration starts, and as its requests complete.
  std::function<void(const std::string& config, size_t done, size_t total)> progress;
};

struct Comparison {
  std::vector<RunSummary> summaries;  // in `modes` order, the pool once per metadata mode
  std::vector<KvMode> modes;          // per summary
  std::vector<MetadataMode> metadata; // per summary (kDecentralized for the baselines)
  std::vector<bool> tiered;           // per summary: ran with CompareOptions::pool_tiers
  std::vector<ServeRun> runs;
  std::vector<double> second_half_hit_rate;  // hit rate of the later half of the requests
  bool tokens_identical = false;
};

// A configuration's display name, e.g. "(d) cxlkv shared pool", "(e) cxlkv pool, central meta".
std::string ConfigName(KvMode mode, MetadataMode metadata = MetadataMode::kDecentralized, bool tiered = false);
// Index in `c` of the shared pool with that metadata mode (and without tiers, or with them);
// -1 when it did not run.
int PoolIndex(const Comparison& c, MetadataMode metadata, bool tiered = false);

// Errors: whatever a run returns, and kInternal when two configurations generated different
// tokens for a request (greedy decoding must not depend on where the KV came from).
Result<Comparison> CompareConfigurations(const CompareOptions& options, const std::vector<Request>& requests);

nlohmann::json ComparisonJson(const Comparison& c);

}  // namespace cxlkv::serve

#endif  // CXLKV_SRC_SERVE_COMPARE_H_
