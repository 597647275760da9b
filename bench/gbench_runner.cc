#include "gbench_runner.h"

#include <mutex>

namespace cxlkv::bench {
namespace {

// Collects iteration runs (not Google Benchmark's own aggregates: we take our own medians).
class Collector : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (run.run_type != Run::RT_Iteration) continue;
      if (run.error_occurred) {
        error = run.run_name.function_name + ": " + run.error_message;
        continue;
      }
      if (run.iterations <= 0) continue;
      seconds[run.run_name.function_name].push_back(run.real_accumulated_time /
                                                    static_cast<double>(run.iterations));
    }
  }
  std::map<std::string, std::vector<double>> seconds;
  std::string error;
};

void InitializeOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    int argc = 1;
    char name[] = "cxlkv-bench";
    char* argv[] = {name, nullptr};
    benchmark::Initialize(&argc, argv);
  });
}

}  // namespace

Result<std::map<std::string, std::vector<double>>> RunCases(const std::vector<GbCase>& cases,
                                                            int repetitions) {
  InitializeOnce();
  benchmark::ClearRegisteredBenchmarks();
  for (const GbCase& c : cases) {
    benchmark::RegisterBenchmark(c.name.c_str(), c.body)
        ->Repetitions(repetitions)
        ->MinTime(c.min_time_s)
        ->UseRealTime();
  }
  Collector collector;
  benchmark::RunSpecifiedBenchmarks(&collector);
  benchmark::ClearRegisteredBenchmarks();
  if (!collector.error.empty()) return Internal("benchmark failed: " + collector.error);
  for (const GbCase& c : cases) {
    if (collector.seconds[c.name].empty()) return Internal("benchmark " + c.name + " produced no runs");
  }
  return std::move(collector.seconds);
}

}  // namespace cxlkv::bench
