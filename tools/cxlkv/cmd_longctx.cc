// cxlkv longctx: the long-context decode scenario (serve/long_context.h) on its own — dense,
// near-memory sparse and hybrid attention side by side at 128K and 1M tokens. The demo runs the
// same scenario after its serving tables.
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "commands.h"
#include "serve/long_context.h"
#include "util/units.h"

namespace cxlkv::cli {

namespace {

struct LongCtxArgs {
  std::string contexts = "128K,1M";
  std::string budgets = "8,32";
  uint32_t steps = 8;
  uint32_t threads = 1;
  double heavy_fraction = serve::LongContextOptions{}.heavy_fraction;
  double heavy_scale = serve::LongContextOptions{}.heavy_scale;
  std::string model_config;
  std::string json_path;
  bool json = false;
  bool remote = false;
  std::string remote_path;  // default /dev/shm/cxlkv-longctx-<pid>
  std::string remote_size;  // default: sized to the context
};

Result<std::vector<uint64_t>> ParseList(const std::string& list, bool sizes, const char* what) {
  std::vector<uint64_t> out;
  for (const std::string& item : SplitPaths(list)) {
    if (sizes) {
      auto v = util::ParseByteSize(item);
      if (!v.ok()) return InvalidArgument(std::string(what) + ": " + v.status().message());
      out.push_back(*v);
    } else {
      char* end = nullptr;
      const unsigned long long v = std::strtoull(item.c_str(), &end, 10);
      if (item.empty() || *end != '\0' || v == 0 || v > 1u << 20) {
        return InvalidArgument(std::string(what) + ": '" + item +
                               "' is not a divisor between 1 and 2^20");
      }
      out.push_back(v);
    }
  }
  if (out.empty()) return InvalidArgument(std::string(what) + " is empty");
  return out;
}

}  // namespace

Result<nlohmann::json> RunLongContextAttention(serve::LongContextOptions o, bool print) {
  if (print) o.progress = [](const std::string& s) { std::fprintf(stderr, "%s\n", s.c_str()); };
  CXLKV_ASSIGN_OR_RETURN(auto r, serve::RunLongContextDecode(o));
  if (print) {
    std::printf(
        "KV of the context: synthetic keys at the model's key norm, %.1f%% heavy hitters at %.0fx; "
        "the "
        "last block a real prefill;\nevery decode step runs the whole model; sparse and hybrid are "
        "teacher-forced with dense's tokens\n\n",
        100 * o.heavy_fraction, o.heavy_scale);
    serve::PrintLongContext(stdout, r);
    if (!o.remote_region.empty()) {
      std::printf("remote-*: the context in a pool, attended by a near-memory service over the pool's RPC "
                  "(queries, outputs and LSEs cross; the engine attends its decoded tokens and merges); "
                  "their 'vs nm' is against remote-dense\n");
      for (const serve::LongContextRow& row : r.rows) {
        if (row.open_ms > 0) {
          std::printf("  %" PRIu64 "K %s: context opened at the service in %.1f ms\n", row.context_tokens / 1024,
                      row.mode.c_str(), row.open_ms);
        }
      }
    }
    for (size_t i = 0; i < r.digest_build_tokens_per_s.size(); ++i) {
      std::printf("digests built after prefill at %.2f M tokens/s (all layers)\n",
                  r.digest_build_tokens_per_s[i] / 1e6);
    }
  }
  return serve::LongContextJson(r);
}

void AddLongContextCommands(CLI::App& app, CommandResult& result) {
  auto a = std::make_shared<LongCtxArgs>();
  CLI::App* cmd = app.add_subcommand("longctx",
                                     "Long-context decode: dense vs near-memory sparse vs hybrid "
                                     "attention (step time, bytes, agreement)");
  cmd->add_option("--contexts", a->contexts,
                  "Context lengths in tokens (K = 1024), comma-separated")
      ->capture_default_str();
  cmd->add_option("--budgets", a->budgets,
                  "Budgets as divisors of the context (8 = 1/8), comma-separated")
      ->capture_default_str();
  cmd->add_option("--steps", a->steps, "Decode steps per configuration")->capture_default_str();
  cmd->add_option("--threads", a->threads, "Near-memory workers besides the caller")
      ->capture_default_str();
  cmd->add_option("--heavy-fraction", a->heavy_fraction,
                  "Share of context keys that are heavy hitters (0: flat attention)")
      ->capture_default_str();
  cmd->add_option("--heavy-scale", a->heavy_scale,
                  "Heavy hitters' key norm, in units of the model's key norm")
      ->capture_default_str();
  cmd->add_option("--model-config", a->model_config,
                  "Engine config JSON (default: the built-in tiny Llama)");
  cmd->add_flag("--remote", a->remote,
                "Also decode through a near-memory service over a pool holding the context "
                "(remote-dense, remote-sparse, remote-hybrid rows)");
  cmd->add_option("--remote-path", a->remote_path,
                  "The remote rows' pool region (created, then removed; default "
                  "/dev/shm/cxlkv-longctx-PID); implies --remote");
  cmd->add_option("--remote-size", a->remote_size,
                  "The remote rows' pool size (default: sized to the context); implies --remote");
  cmd->add_option("--json-out", a->json_path, "Also write the results as JSON to this file");
  cmd->add_flag("--json", a->json, "Print JSON instead of the table");
  cmd->callback([a, &result] {
    result.status = [&]() -> Status {
      CXLKV_ASSIGN_OR_RETURN(auto config, LoadModelConfig(a->model_config));
      CXLKV_ASSIGN_OR_RETURN(auto contexts, ParseList(a->contexts, true, "--contexts"));
      CXLKV_ASSIGN_OR_RETURN(auto divisors, ParseList(a->budgets, false, "--budgets"));
      if (a->steps == 0) return InvalidArgument("--steps must be at least 1");
      std::vector<uint32_t> budgets(divisors.begin(), divisors.end());
      serve::LongContextOptions o;
      o.model_config = config;
      o.context_tokens = contexts;
      o.budget_divisors = budgets;
      o.decode_steps = a->steps;
      o.near_threads = a->threads;
      o.heavy_fraction = a->heavy_fraction;
      o.heavy_scale = a->heavy_scale;
      if (!a->remote_size.empty()) {
        auto bytes = util::ParseByteSize(a->remote_size);
        if (!bytes.ok()) return InvalidArgument("--remote-size: " + bytes.status().message());
        o.remote_region_bytes = *bytes;
      }
      if (a->remote || !a->remote_path.empty() || !a->remote_size.empty()) {
        o.remote_region = a->remote_path.empty()
                              ? "/dev/shm/cxlkv-longctx-" + std::to_string(::getpid())
                              : a->remote_path;
      }
      CXLKV_ASSIGN_OR_RETURN(auto j, RunLongContextAttention(o, !a->json));
      if (a->json) std::printf("%s\n", j.dump(2).c_str());
      if (!a->json_path.empty()) {
        std::ofstream f(a->json_path);
        f << j.dump(2) << "\n";
        if (!f) return IoError("cannot write " + a->json_path);
      }
      return Status::Ok();
    }();
  });
}

}  // namespace cxlkv::cli
