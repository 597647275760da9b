// The benchmark suites `cxlkv bench NAME [--json]` runs. Each returns a report in the shape of
// report.h: {"suite", "machine", "repetitions", "results": [figure...]}.
#ifndef CXLKV_BENCH_SUITES_H_
#define CXLKV_BENCH_SUITES_H_

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cxlkv/status.h"
#include "report.h"

namespace cxlkv::bench {

struct Suite {
  const char* name;
  const char* description;
  Result<nlohmann::json> (*run)(const BenchOptions& options);
};

const std::vector<Suite>& Suites();

// Runs the suite called `name`; kNotFound (listing the known names) when there is none.
Result<nlohmann::json> RunSuite(const std::string& name, const BenchOptions& options);

// Suites, one per layer (bench/<layer>_bench.cc).
Result<nlohmann::json> RunRegionBench(const BenchOptions& options);
Result<nlohmann::json> RunLockBench(const BenchOptions& options);
Result<nlohmann::json> RunAllocBench(const BenchOptions& options);
Result<nlohmann::json> RunCacheBench(const BenchOptions& options);
Result<nlohmann::json> RunTransferBench(const BenchOptions& options);
Result<nlohmann::json> RunE2eBench(const BenchOptions& options);
Result<nlohmann::json> RunRpcBench(const BenchOptions& options);
Result<nlohmann::json> RunTierBench(const BenchOptions& options);
Result<nlohmann::json> RunPnmBench(const BenchOptions& options);
// The near-memory service's figures of the pnm suite: a step through cxlkvd's engines vs
// in-process, link bytes, opening with stored digests (pnm_remote_bench.cc).
Result<std::vector<nlohmann::json>> PnmRemoteFigures(const BenchOptions& options, int reps);
Result<nlohmann::json> RunLongContextBench(const BenchOptions& options);  // longctx_bench.cc
Result<nlohmann::json> RunCapacityBench(const BenchOptions& options);     // capacity_bench.cc
Result<nlohmann::json> RunTraceBench(const BenchOptions& options);        // trace_bench.cc
Result<nlohmann::json> RunRacksBench(const BenchOptions& options);        // racks_bench.cc

// The reference every cross-process protocol chases: two processes bounce a counter through two
// cache lines, each publishing with store + clflush and observing with invalidate + load.
// Returns ns per round trip (pool_bench.cc). With max_seconds > 0 it stops after about that long
// even if fewer rounds were done (a loaded machine: one round can take a scheduler time slice).
double LinePingPongNs(int rounds, double max_seconds = 0);

// MachineJson() plus "line_pingpong_ns" (median of 3 LinePingPongNs runs of 20000 rounds, 5000 with --quick, each
// cut off after 0.5 s) and "nt_copy_gbps" (one thread's non-temporal copy of 64 MiB, 16 MiB with
// --quick), measured now: the machine block of the lock, rpc, transfer and cache suites
// (machine_limits.cc).
nlohmann::json MachineJsonWithLimits(const BenchOptions& options);

// The prefix index's lookup, reserve+commit and 4-writer put in both metadata modes, as figures
// of the rpc suite (meta_bench.cc).
Result<std::vector<nlohmann::json>> MetadataModeFigures(const BenchOptions& options);

}  // namespace cxlkv::bench

#endif  // CXLKV_BENCH_SUITES_H_
