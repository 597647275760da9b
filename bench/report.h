// The uniform shape of every `cxlkv bench NAME` report (docs/benchmarks.md).
//
// Every figure is reported next to the limit it chases, measured in the same run on the same
// machine, with the ratio: {"name", "unit", "median", "samples", "reference", "reference_median",
// "ratio"}, and, where it has a goal, the goal and whether this run met it. Medians over
// repetitions, because these machines are small and noisy.
#ifndef CXLKV_BENCH_REPORT_H_
#define CXLKV_BENCH_REPORT_H_

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cxlkv/status.h"

namespace cxlkv::bench {

struct BenchOptions {
  bool quick = false;     // smaller sizes, fewer repetitions: a smoke run (tests use it)
  int repetitions = 5;    // samples per figure; the median is reported
  std::string workdir = "/dev/shm";  // where benches that need a region or a file put it
  // tier: a block device or NVMe generic device (/dev/ngXnY: passthrough) whose first 256 MiB
  // the SSD rows overwrite, instead of a file in workdir ("" = a file).
  std::string device;
  // trace: the JSON-lines trace to replay (requests with "hash_ids").
  std::string trace;
};

// What a figure is held to: a bound on its ratio to the reference, or on its median where the
// goal is stated in the figure's own unit (e.g. >= 4 Mops). For a time figure (lower is better)
// a ratio goal is an upper bound; for a throughput figure, a lower bound.
struct Goal {
  enum class On { kRatio, kMedian };
  On on = On::kRatio;
  bool at_most = true;  // true: the value must be <= bound; false: >= bound
  double bound = 0;

  static Goal RatioAtMost(double bound) { return {On::kRatio, true, bound}; }
  static Goal RatioAtLeast(double bound) { return {On::kRatio, false, bound}; }
  static Goal MedianAtLeast(double bound) { return {On::kMedian, false, bound}; }

  // The JSON key of the bound: "ratio_max", "ratio_min", "median_max" or "median_min".
  const char* Key() const;
  // Whether `value` (the ratio or the median) meets the goal; a value <= 0 (nothing measured,
  // or a reference of 0) never does.
  bool Met(double value) const;
};

// A figure, its samples, and the reference it is compared with.
struct Figure {
  std::string name;
  std::string unit;                 // "ns/line", "GB/s", ...
  bool higher_is_better = false;
  std::vector<double> samples;
  std::string reference;            // name of the reference figure ("" when it is one)
  std::vector<double> reference_samples;
  std::string note;                 // what the ratio means, in a few words
  std::optional<Goal> goal = std::nullopt;  // none: the figure is reported, not held to a bound
};

double Median(std::vector<double> v);

// {"name", "unit", "higher_is_better", "median", "samples", "reference", "reference_median",
//  "ratio", "note", "goal", "met"}; ratio = median / reference_median; goal = {Goal::Key(): bound}
//  and met = true/false, both null for a figure without a goal.
nlohmann::json FigureJson(const Figure& f);

// CPU model, core count, detected features: where the figures were measured.
// MachineJsonWithLimits (suites.h) adds the two limits measured in the same run.
nlohmann::json MachineJson();

// Prints a report as an aligned table (the non-JSON form of `cxlkv bench`): the machine (and its
// limits where the report has them), then one row per figure with its goal and verdict.
void PrintTable(const nlohmann::json& report, std::FILE* out);

}  // namespace cxlkv::bench

#endif  // CXLKV_BENCH_REPORT_H_
