// cxlkv demo: the main job on the embedded default (regions in /dev/shm). Disaggregated
// prefill/decode serving of a long-document QA workload (documents recur: the first pass
// populates, the second hits) by worker processes running the reference engine, under four
// configurations in one run: no KV reuse, a private per-worker DRAM cache, that cache with a
// TCP handoff, and the cxlkv shared pool. Prints the table, checks that every configuration
// generated the same tokens, and writes the JSON and a TTFT CDF plot. Then the long-context
// scenario: a working set beyond the region, the pool without and with capacity tiers. Last, a
// million-token context decoded with dense, near-memory sparse and hybrid attention, in the
// engine's process and through a near-memory service over a pool.
#include <sys/stat.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "commands.h"
#include "engine/config.h"
#include "serve/compare.h"
#include "util/units.h"

namespace cxlkv::cli {

namespace {

struct DemoArgs {
  std::string workdir = "/dev/shm";
  std::string path;  // older spelling: regions at PATH-<mode>
  std::string size = "512M";
  std::string out;
  uint32_t prefill = 2, decode = 1;
  std::string policy = "least-loaded";
  std::string model_config;
  bool quick = false;
  uint32_t documents = 12;
  double scale = 4;
  // The long-context scenario: a region smaller than the working set, without and with tiers.
  bool long_context = true;
  std::string long_size = "32M";
  std::string tier_dir = ".";  // where the SSD tier's file goes (removed after)
  // The long-context attention scenario: dense vs near-memory sparse vs hybrid decoding.
  bool long_attention = true;
};

// Long documents whose KV outgrows the region: the pool alone loses what LRU evicts before the
// second pass asks again; with capacity tiers the region spills to node DRAM and an SSD file
// (Unified KV pooling) and the second pass promotes its documents back. Prints both runs, where
// each configuration's hits came from, and what the tiers moved.
Result<nlohmann::json> RunLongContext(const DemoArgs& a, const nlohmann::json& config,
                                      const serve::CompareOptions& base) {
  serve::WorkloadOptions w;
  w.kind = serve::WorkloadKind::kDocQa;
  w.vocab_size = config.at("vocab_size").get<uint32_t>();
  w.documents = 8;
  w.doc_tokens = 8192;
  w.scale = a.quick ? 8 : 4;
  w.question_tokens = 256;
  w.answer_tokens = a.quick ? 32 : 64;
  w.passes = 2;
  CXLKV_ASSIGN_OR_RETURN(auto requests, serve::GenerateWorkload(w));
  CXLKV_ASSIGN_OR_RETURN(auto model, engine::ModelConfig::FromJson(config));
  serve::CompareOptions co = base;
  co.modes = {serve::KvMode::kPool};
  co.pool_metadata = {MetadataMode::kDecentralized};
  // One request at a time: this scenario is about capacity, so each document's second request
  // comes after its first one stored the KV, and what the second pass hits depends only on
  // what the region and the tiers kept, not on how requests of a loaded machine interleave.
  co.serve.concurrency = 1;
  CXLKV_ASSIGN_OR_RETURN(co.region_bytes, util::ParseByteSize(a.long_size));
  if (!co.region_prefix.empty()) co.region_prefix += "-long";
  const std::string ssd = a.tier_dir + "/cxlkv-demo-" + std::to_string(::getpid()) + ".tier";
  co.pool_tiers = {"dram:8M", "ssd:" + ssd + ":64M"};
  const uint64_t doc_tokens = static_cast<uint64_t>(w.doc_tokens / w.scale);
  std::printf("\n== long context beyond the region: capacity tiers behind the pool ==\n");
  std::printf("workload long-document QA: %u documents of %" PRIu64 " tokens, 2 passes: KV working set %s in a %s region\n",
              w.documents, doc_tokens, util::FormatBytes(w.documents * doc_tokens * model.KvBytesPerToken()).c_str(),
              util::FormatBytes(co.region_bytes).c_str());
  std::printf("tiers    served by the router's node as its cxlkvd would: node DRAM 8 MiB, SSD file %s 64 MiB\n\n",
              ssd.c_str());
  auto cmp = serve::CompareConfigurations(co, requests);
  if (!cmp.ok()) {
    return Status(cmp.status().code(), "long-context scenario: " + cmp.status().message() +
                                           " (the SSD tier's file goes in --tier-dir; --no-long-context skips it)");
  }
  std::printf("\n");
  serve::PrintTable(stdout, cmp->summaries);
  std::printf("\n");
  serve::PrintTierHits(stdout, cmp->summaries);
  const int plain = serve::PoolIndex(*cmp, MetadataMode::kDecentralized);
  const int tiered = serve::PoolIndex(*cmp, MetadataMode::kDecentralized, /*tiered=*/true);
  if (plain < 0 || tiered < 0) return Internal("long-context scenario: a configuration did not run");
  const nlohmann::json& t = cmp->runs[tiered].tiers;
  std::printf("\ntiers moved: %" PRIu64 " blocks spilled out of the region, %" PRIu64 " promoted back on a hit "
              "(%" PRIu64 " missed)\n", t.value("spilled", uint64_t{0}), t.value("promoted", uint64_t{0}),
              t.value("promote_missed", uint64_t{0}));
  std::printf("second pass hit rate: pool alone %.0f%%, with tiers %.0f%%; TTFT of seen prompts %.1f vs %.1f ms (%.2fx)\n",
              100 * cmp->second_half_hit_rate[plain], 100 * cmp->second_half_hit_rate[tiered],
              cmp->summaries[plain].ttft_seen_mean_ms, cmp->summaries[tiered].ttft_seen_mean_ms,
              cmp->summaries[plain].ttft_seen_mean_ms / cmp->summaries[tiered].ttft_seen_mean_ms);
  std::printf("generated tokens identical with and without tiers, request by request: %s\n",
              cmp->tokens_identical ? "yes" : "NO");
  nlohmann::json j = serve::ComparisonJson(*cmp);
  j["region_bytes"] = co.region_bytes;
  j["kv_working_set_bytes"] = w.documents * doc_tokens * model.KvBytesPerToken();
  j["tiers"] = co.pool_tiers;
  return j;
}

Status RunDemo(const DemoArgs& a) {
  CXLKV_ASSIGN_OR_RETURN(auto config, LoadModelConfig(a.model_config));
  serve::WorkloadOptions w;
  w.kind = serve::WorkloadKind::kDocQa;
  w.vocab_size = config.at("vocab_size").get<uint32_t>();
  w.documents = a.quick ? 6 : a.documents;
  w.doc_tokens = a.quick ? 2048 : 6144;
  w.scale = a.quick ? 8 : a.scale;
  w.question_tokens = 256;
  w.answer_tokens = a.quick ? 32 : 64;
  w.passes = 2;
  CXLKV_ASSIGN_OR_RETURN(auto requests, serve::GenerateWorkload(w));
  serve::CompareOptions co;
  co.workdir = a.workdir;
  co.region_prefix = a.path;
  CXLKV_ASSIGN_OR_RETURN(co.region_bytes, util::ParseByteSize(a.size));
  co.serve.prefill = a.prefill;
  co.serve.decode = a.decode;
  CXLKV_ASSIGN_OR_RETURN(co.serve.policy, serve::ParseRoutePolicy(a.policy));
  co.serve.model_config = config;
  co.serve.concurrency = a.prefill * 2;
  if (a.quick) co.serve.concurrency = a.prefill;
  co.progress = [](const std::string& name, size_t done, size_t total) { ProgressBar(name, done, total); };

  std::printf("== cxlkv demo: disaggregated prefill/decode over a shared KV pool ==\n");
  std::printf("engine   %s: %u layers, hidden %u, %u heads / %u KV heads, vocab %u (CPU, OpenBLAS, fp32)\n",
              config.at("name").get<std::string>().c_str(), config.at("num_layers").get<uint32_t>(),
              config.at("hidden_size").get<uint32_t>(), config.at("num_heads").get<uint32_t>(),
              config.at("num_kv_heads").get<uint32_t>(), w.vocab_size);
  std::printf("workload long-document QA: %u documents of %u tokens + a %u-token question, %u passes (%zu requests),"
              " %u tokens out;\n         lengths are the papers' divided by %g for a 2-core CPU engine\n",
              w.documents, static_cast<uint32_t>(w.doc_tokens / w.scale),
              static_cast<uint32_t>(w.question_tokens / w.scale), w.passes, requests.size(),
              static_cast<uint32_t>(w.answer_tokens / w.scale), w.scale);
  std::printf("serving  %u prefill + %u decode worker processes per configuration, routing %s, %u in flight\n\n",
              a.prefill, a.decode, a.policy.c_str(), co.serve.concurrency);
  CXLKV_ASSIGN_OR_RETURN(auto cmp, serve::CompareConfigurations(co, requests));
  std::printf("\n");
  serve::PrintTable(stdout, cmp.summaries);
  std::printf("\nsecond pass (documents seen before) hit rate:");
  for (size_t i = 0; i < cmp.summaries.size(); ++i) {
    std::printf("  %s%s %.0f%%", cmp.runs[i].mode.c_str(), cmp.metadata[i] == MetadataMode::kCentral ? "/central" : "",
                100 * cmp.second_half_hit_rate[i]);
  }
  std::printf("\ngenerated tokens identical across all %zu configurations, request by request: %s\n",
              cmp.summaries.size(), cmp.tokens_identical ? "yes" : "NO");
  const int d = serve::PoolIndex(cmp, MetadataMode::kDecentralized);
  const int c = serve::PoolIndex(cmp, MetadataMode::kCentral);
  if (d >= 0) {
    const auto& pool = cmp.summaries[d];
    for (size_t i = 0; i < cmp.summaries.size(); ++i) {
      if (cmp.modes[i] == serve::KvMode::kPool) continue;
      std::printf("cxlkv shared pool vs %-26s TTFT mean %.2fx lower (seen prompts %.2fx), throughput %.2fx\n",
                  cmp.summaries[i].name.c_str(), cmp.summaries[i].ttft_mean_ms / pool.ttft_mean_ms,
                  cmp.summaries[i].ttft_seen_mean_ms / pool.ttft_seen_mean_ms,
                  pool.requests_per_s / cmp.summaries[i].requests_per_s);
    }
  }
  if (d >= 0 && c >= 0) {
    const auto& dec = cmp.summaries[d];
    const auto& cen = cmp.summaries[c];
    std::printf("central metadata vs decentralized: TTFT mean %.1f vs %.1f ms, seen prompts %.1f vs %.1f ms, "
                "throughput %.2f vs %.2f req/s\n", cen.ttft_mean_ms, dec.ttft_mean_ms, cen.ttft_seen_mean_ms,
                dec.ttft_seen_mean_ms, cen.requests_per_s, dec.requests_per_s);
  }
  nlohmann::json results = serve::ComparisonJson(cmp);
  if (a.long_context) {
    CXLKV_ASSIGN_OR_RETURN(results["long_context"], RunLongContext(a, config, co));
  }
  if (a.long_attention) {
    std::printf("\n== a million-token context: dense vs near-memory sparse vs hybrid attention ==\n");
    serve::LongContextOptions lo;
    lo.model_config = config;
    lo.context_tokens = a.quick ? std::vector<uint64_t>{32768} : std::vector<uint64_t>{131072, 1048576};
    lo.budget_divisors = {8, 32};
    lo.decode_steps = a.quick ? 4 : 8;
    // The remote rows: the context in a pool in the workdir, a near-memory service over it.
    lo.remote_region = (a.path.empty() ? a.workdir + "/cxlkv-demo-" + std::to_string(::getpid()) : a.path) + "-longctx";
    lo.remote_optional = true;  // a workdir without room for it skips those rows, with a note
    CXLKV_ASSIGN_OR_RETURN(results["long_attention"], RunLongContextAttention(lo, /*print=*/true));
  }
  const std::string out = a.out.empty() ? "/tmp/cxlkv-demo-" + std::to_string(::getuid()) : a.out;
  ::mkdir(out.c_str(), 0755);
  std::ofstream json(out + "/e2e.json");
  json << results.dump(2) << "\n";
  if (!json) return IoError("cannot write " + out + "/e2e.json: choose a writable --out directory");
  Status plotted = serve::PlotTtftCdf(out + "/ttft_cdf.png", cmp.summaries);
  std::printf("\nresults: %s/e2e.json", out.c_str());
  if (plotted.ok()) {
    std::printf("   TTFT CDF plot: %s/ttft_cdf.png\n", out.c_str());
  } else {
    std::printf("   (no plot: %s)\n", plotted.message().c_str());
  }
  std::printf("every configuration's pool passed `cxlkv check` after its run\n");
  return Status::Ok();
}

}  // namespace

void AddDemoCommands(CLI::App& app, CommandResult& result) {
  auto a = std::make_shared<DemoArgs>();
  CLI::App* cmd = app.add_subcommand("demo", "The end-to-end demo: four KV configurations (the pool in both metadata modes), one workload, one table");
  cmd->add_option("--workdir", a->workdir, "Where the regions go (removed after)")->capture_default_str();
  cmd->add_option("--path", a->path, "Region path prefix: regions at PATH-<mode> (default: in --workdir)");
  cmd->add_option("--size", a->size, "Region size per configuration")->capture_default_str();
  cmd->add_option("--out", a->out, "Directory for e2e.json and ttft_cdf.png (default /tmp/cxlkv-demo-UID)");
  cmd->add_option("--prefill", a->prefill, "Prefill workers per configuration")->capture_default_str();
  cmd->add_option("--decode", a->decode, "Decode workers per configuration")->capture_default_str();
  cmd->add_option("--policy", a->policy, "Routing: least-loaded | prefix-affinity")->capture_default_str();
  cmd->add_option("--model-config", a->model_config, "Engine config JSON (default: the built-in tiny Llama)");
  cmd->add_option("--documents", a->documents, "Documents (each asked about twice)")->capture_default_str();
  cmd->add_option("--scale", a->scale, "Divide the papers' lengths (6144-token documents) by this")
      ->capture_default_str();
  cmd->add_flag("--quick", a->quick, "A smaller workload (tests)");
  cmd->add_flag("!--no-long-context", a->long_context, "Skip the long-context scenario (capacity tiers)");
  cmd->add_flag("!--no-long-attention", a->long_attention,
                "Skip the long-context attention scenario (dense vs near-memory sparse vs hybrid)");
  cmd->add_option("--long-size", a->long_size, "Region size of the long-context scenario (smaller than its KV)")
      ->capture_default_str();
  cmd->add_option("--tier-dir", a->tier_dir, "Where the long-context scenario's SSD tier file goes (removed after)")
      ->capture_default_str();
  cmd->callback([a, &result] { result.status = RunDemo(*a); });
}

}  // namespace cxlkv::cli
