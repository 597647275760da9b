// Runs Google Benchmark cases programmatically and hands back every repetition's time, so a
// suite can compute medians and ratios against references measured in the same run.
#ifndef CXLKV_BENCH_GBENCH_RUNNER_H_
#define CXLKV_BENCH_GBENCH_RUNNER_H_

#include <functional>
#include <map>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "cxlkv/status.h"

namespace cxlkv::bench {

struct GbCase {
  std::string name;
  std::function<void(benchmark::State&)> body;
  double min_time_s = 0.05;  // per repetition
};

// Registers `cases`, runs each `repetitions` times and returns name → seconds per iteration
// (wall clock) of every repetition. A case that calls state.SkipWithError fails the whole run
// with that message.
Result<std::map<std::string, std::vector<double>>> RunCases(const std::vector<GbCase>& cases,
                                                            int repetitions);

}  // namespace cxlkv::bench

#endif  // CXLKV_BENCH_GBENCH_RUNNER_H_
