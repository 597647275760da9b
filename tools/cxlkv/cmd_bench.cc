// cxlkv bench NAME [--json] [--quick] [--reps N]: the uniform entry point of every benchmark.
#include <memory>
#include <string>

#include "commands.h"
#include "suites.h"

namespace cxlkv::cli {

void AddBenchCommands(CLI::App& app, CommandResult& result) {
  struct Args {
    std::string name;
    bool json = false;
    bool quick = false;
    int reps = 5;
    std::string workdir = "/dev/shm";
    std::string device;
    std::string trace;
  };
  auto args = std::make_shared<Args>();
  std::string names;
  for (const auto& s : bench::Suites()) names += std::string("\n  ") + s.name + ": " + s.description;
  CLI::App* cmd = app.add_subcommand("bench", "Run a benchmark suite; suites:" + names);
  cmd->add_option("name", args->name, "Suite name")->required();
  cmd->add_flag("--json", args->json, "Print the report as JSON");
  cmd->add_flag("--quick", args->quick, "Small sizes, 2 repetitions: a smoke run");
  cmd->add_option("--reps", args->reps, "Repetitions per figure (the median is reported)")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  cmd->add_option("--workdir", args->workdir, "Where benches that need a region or file put it")
      ->capture_default_str();
  cmd->add_option("--device", args->device,
                  "tier: run the SSD rows on this block device or NVMe generic device (/dev/ngXnY, through "
                  "passthrough) instead of a file; its first 256 MiB are OVERWRITTEN");
  cmd->add_option("--trace", args->trace,
                  "trace: the JSON-lines trace to replay, one request with \"hash_ids\" per line (the Mooncake "
                  "conversation trace)");
  cmd->callback([args, &result] {
    bench::BenchOptions options;
    options.quick = args->quick;
    options.repetitions = args->reps;
    options.workdir = args->workdir;
    options.device = args->device;
    options.trace = args->trace;
    auto report = bench::RunSuite(args->name, options);
    if (!report.ok()) {
      result.status = report.status();
      return;
    }
    if (args->json) {
      std::printf("%s\n", report->dump(2).c_str());
    } else {
      bench::PrintTable(*report, stdout);
    }
  });
}

}  // namespace cxlkv::cli
