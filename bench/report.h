// The uniform shape of every `cxlkv bench NAME` report (docs/benchmarks.md).
//
// Every figure is reported next to the limit it chases, measured in the same run on the same
// machine, with the ratio: {"name", "unit", "median", "samples", "reference", "reference_median",
// "ratio"}. Medians over repetitions, because these machines are small and noisy.
#ifndef CXLKV_BENCH_REPORT_H_
#define CXLKV_BENCH_REPORT_H_

#include <cstdio>
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

// A figure, its samples, and the reference it is compared with.
struct Figure {
  std::string name;
  std::string unit;                 // "ns/line", "GB/s", ...
  bool higher_is_better = false;
  std::vector<double> samples;
  std::string reference;            // name of the reference figure ("" when it is one)
  std::vector<double> reference_samples;
  std::string note;                 // what the ratio means, in a few words
};

double Median(std::vector<double> v);

// {"name", "unit", "higher_is_better", "median", "samples", "reference", "reference_median",
//  "ratio", "note"}; ratio = median / reference_median.
nlohmann::json FigureJson(const Figure& f);

// CPU model, core count, detected features: where the figures were measured.
nlohmann::json MachineJson();

// Prints a report as an aligned table (the non-JSON form of `cxlkv bench`).
void PrintTable(const nlohmann::json& report, std::FILE* out);

}  // namespace cxlkv::bench

#endif  // CXLKV_BENCH_REPORT_H_
