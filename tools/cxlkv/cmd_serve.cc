// cxlkv serve: a router and P prefill + D decode worker processes on one pool region, fed a
// generated workload or a JSONL trace; prints what it measured. cxlkv serve-worker is the
// worker process the router starts (not for people).
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>

#include "commands.h"
#include "engine/config.h"
#include "engine/sparse_attention.h"
#include "serve/report.h"
#include "serve/router.h"
#include "serve/worker.h"
#include "util/units.h"

namespace cxlkv::cli {

Result<nlohmann::json> LoadModelConfig(const std::string& path) {
  if (path.empty()) return engine::ModelConfig{}.ToJson();
  CXLKV_ASSIGN_OR_RETURN(auto c, engine::ModelConfig::Load(path));
  return c.ToJson();
}

void ProgressBar(const std::string& label, size_t done, size_t total) {
  constexpr int kWidth = 30;
  const int filled = total ? static_cast<int>(kWidth * done / total) : 0;
  std::fprintf(stderr, "\r  %-28s [%s%s] %zu/%zu", label.c_str(), std::string(filled, '#').c_str(),
               std::string(kWidth - filled, '.').c_str(), done, total);
  if (done == total) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

namespace {

struct ServeArgs {
  std::string path;
  std::string size = "512M";
  uint32_t prefill = 2, decode = 1;
  std::string mode = "pool", policy = "least-loaded";
  std::string model_config, weights, trace;
  std::string workload = "docqa";
  serve::WorkloadOptions w;
  double qps = 0;
  uint32_t concurrency = 4;
  int kill_prefill_after = -1;
  uint32_t lease_ms = 1000;
  bool json = false;
  std::string metadata = "decentralized";  // for a pool this command creates
  std::vector<std::string> tiers;          // capacity tiers the router's node serves
  std::string capacity_read = "promote";   // what a hit on a capacity tier does
  std::string attention = "dense";          // decode workers' attention
  uint32_t attention_budget = 2048;
};

Result<std::vector<serve::Request>> MakeRequests(const ServeArgs& a, uint32_t vocab) {
  if (!a.trace.empty()) return serve::LoadTrace(a.trace, vocab, a.w.seed);
  serve::WorkloadOptions w = a.w;
  CXLKV_ASSIGN_OR_RETURN(w.kind, serve::ParseWorkloadKind(a.workload));
  w.vocab_size = vocab;
  return serve::GenerateWorkload(w);
}

Status RunServe(const ServeArgs& a) {
  CXLKV_ASSIGN_OR_RETURN(auto config, LoadModelConfig(a.model_config));
  serve::ServeOptions so;
  so.region = a.path;
  so.prefill = a.prefill;
  so.decode = a.decode;
  CXLKV_ASSIGN_OR_RETURN(so.mode, serve::ParseKvMode(a.mode));
  CXLKV_ASSIGN_OR_RETURN(so.policy, serve::ParseRoutePolicy(a.policy));
  so.model_config = config;
  so.weights = a.weights;
  so.lease_ms = a.lease_ms;
  so.concurrency = a.concurrency;
  so.kill_prefill_after = a.kill_prefill_after;
  so.tiers = a.tiers;
  if (a.capacity_read != "promote" && a.capacity_read != "stream") {
    return InvalidArgument("--capacity-read must be promote or stream, not '" + a.capacity_read + "'");
  }
  so.stream_capacity = a.capacity_read == "stream";
  if (serve::IsRemoteAttention(a.attention)) {
    if (so.mode != serve::KvMode::kPool) {
      return InvalidArgument("--attention " + a.attention + " needs --mode pool: the prompts' blocks stay in the pool");
    }
  } else {
    auto parsed = engine::ParseAttentionMode(a.attention);
    if (!parsed.ok()) return InvalidArgument(parsed.status().message() + ", remote, remote-hybrid");
  }
  if (a.attention_budget == 0) return InvalidArgument("--attention-budget must be at least 1 token");
  so.attention = a.attention;
  so.attention_budget = a.attention_budget;
  CXLKV_ASSIGN_OR_RETURN(auto requests, MakeRequests(a, config.at("vocab_size").get<uint32_t>()));
  if (a.qps > 0) {
    CXLKV_RETURN_IF_ERROR(serve::AssignPoissonArrivals(requests, a.qps, a.w.seed));
    so.open_loop = true;
  }
  if (::access(SplitPaths(a.path).front().c_str(), F_OK) != 0) {  // a new pool: create it
    CXLKV_ASSIGN_OR_RETURN(uint64_t size, util::ParseByteSize(a.size));
    PoolCreateOptions co;
    co.size = size;
    co.metadata = a.metadata == "central" ? MetadataMode::kCentral : MetadataMode::kDecentralized;
    CXLKV_RETURN_IF_ERROR(Pool::Create(SplitPaths(a.path), co));
  }
  if (!a.json) {
    std::printf("== serve: %u prefill + %u decode workers, KV mode %s, routing %s, %zu requests ==\n", a.prefill,
                a.decode, a.mode.c_str(), a.policy.c_str(), requests.size());
    so.progress = [](size_t done, size_t total) { ProgressBar("requests", done, total); };
  }
  CXLKV_ASSIGN_OR_RETURN(auto run, serve::Serve(so, requests));
  auto summary = serve::Summarize(a.mode + " / " + a.policy, run);
  // Hit rate per pass of a doc-QA set (pass p = requests [p*documents, (p+1)*documents)).
  nlohmann::json passes = nlohmann::json::array();
  if (a.trace.empty() && a.workload == "docqa" && a.w.documents > 0) {
    for (size_t p = 0; p * a.w.documents < run.records.size(); ++p) {
      passes.push_back(serve::HitRate(run, p * a.w.documents, (p + 1) * a.w.documents));
    }
  }
  // What the decode workers' attention read and moved, over every request (sparse and hybrid).
  serve::KvStats att;
  for (const auto& r : run.records) {
    att.attention_layer_steps += r.decode.attention_layer_steps;
    att.attention_selected_pages += r.decode.attention_selected_pages;
    att.attention_context_pages += r.decode.attention_context_pages;
    att.attention_link_bytes += r.decode.attention_link_bytes;
    att.attention_kv_bytes += r.decode.attention_kv_bytes;
    att.attention_remote_tokens += r.decode.attention_remote_tokens;
    att.attention_remote_fallbacks += r.decode.attention_remote_fallbacks;
    att.bytes_loaded += r.decode.bytes_loaded;
  }
  const double steps = std::max<double>(1, att.attention_layer_steps);
  const double selected_share =
      att.attention_context_pages ? double(att.attention_selected_pages) / att.attention_context_pages : 1.0;
  if (a.json) {
    nlohmann::json out = serve::SummaryJson(summary);
    out["attention"] = {{"mode", a.attention},
                        {"budget_tokens", a.attention == "dense" ? 0 : a.attention_budget},
                        {"layer_steps", att.attention_layer_steps},
                        {"selected_page_share", selected_share},
                        {"link_bytes_per_layer_step", att.attention_link_bytes / steps},
                        {"kv_bytes_per_layer_step", att.attention_kv_bytes / steps},
                        {"remote_prompt_tokens", att.attention_remote_tokens},
                        {"remote_fallbacks", att.attention_remote_fallbacks},
                        {"decode_bytes_loaded", att.bytes_loaded}};
    out["mode"] = run.mode;
    out["policy"] = run.policy;
    out["pass_hit_rates"] = passes;
    out["workers_killed"] = run.workers_killed;
    if (!run.tiers.is_null()) out["tiers"] = run.tiers;
    nlohmann::json reqs = nlohmann::json::array();
    for (const auto& r : run.records) {
      reqs.push_back({{"id", r.id},
                      {"tokens", r.tokens},
                      {"prompt_tokens", r.prompt_tokens},
                      {"hit_blocks", r.prefill.hit_blocks},
                      {"prompt_blocks", r.prefill.prompt_blocks},
                      {"prefill_worker", r.prefill_worker},
                      {"retries", r.retries}});
    }
    out["requests"] = reqs;
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    serve::PrintTable(stdout, std::span(&summary, 1));
    if (a.attention != "dense") {
      std::printf("decode attention %s, budget %u tokens: %.1f%% of context pages attended; per layer step %s of KV "
                  "read, %s to the engine\n", a.attention.c_str(), a.attention_budget, 100 * selected_share,
                  util::FormatBytes(static_cast<uint64_t>(att.attention_kv_bytes / steps)).c_str(),
                  util::FormatBytes(static_cast<uint64_t>(att.attention_link_bytes / steps)).c_str());
    }
    if (serve::IsRemoteAttention(a.attention)) {
      std::printf("remote attention: %llu prompt tokens attended next to the memory, not loaded (%u fallback(s)); "
                  "decode workers loaded %s into their engines\n",
                  static_cast<unsigned long long>(att.attention_remote_tokens), att.attention_remote_fallbacks,
                  util::FormatBytes(att.bytes_loaded).c_str());
    }
    if (!a.tiers.empty()) serve::PrintTierHits(stdout, std::span(&summary, 1));
    for (size_t p = 0; p < passes.size(); ++p) {
      std::printf("pass %zu: %.1f%% of prompt blocks hit\n", p + 1, 100 * passes[p].get<double>());
    }
    if (run.workers_killed) {
      std::printf("%u worker(s) killed, %u request(s) retried elsewhere\n", run.workers_killed, run.retries);
    }
  }
  return Status::Ok();
}

}  // namespace

void AddServeCommands(CLI::App& app, CommandResult& result) {
  auto a = std::make_shared<ServeArgs>();
  a->path = "/dev/shm/cxlkv-serve-" + std::to_string(::getuid());
  CLI::App* cmd = app.add_subcommand("serve", "Run a router and prefill/decode worker processes on a pool region");
  cmd->add_option("--path", a->path, "Region path(s); created if absent")->capture_default_str();
  cmd->add_option("--size", a->size, "Region size when created")->capture_default_str();
  cmd->add_option("--metadata", a->metadata, "Metadata mode when created: decentralized | central (an existing pool keeps its own)")
      ->check(CLI::IsMember({"decentralized", "central"}))
      ->capture_default_str();
  cmd->add_option("--prefill", a->prefill, "Prefill worker processes")->capture_default_str();
  cmd->add_option("--decode", a->decode, "Decode worker processes")->capture_default_str();
  cmd->add_option("--mode", a->mode, "KV mode: recompute | private | tcp | pool")->capture_default_str();
  cmd->add_option("--policy", a->policy, "Routing: least-loaded | prefix-affinity")->capture_default_str();
  cmd->add_option("--model-config", a->model_config, "Engine config JSON (default: the built-in tiny Llama)");
  cmd->add_option("--weights", a->weights, "safetensors weights (default: seeded random)");
  cmd->add_option("--workload", a->workload, "Generated workload: docqa | tract | chat")->capture_default_str();
  cmd->add_option("--trace", a->trace, "JSONL trace instead of a generated workload");
  cmd->add_option("--requests", a->w.requests, "Requests (tract)")->capture_default_str();
  cmd->add_option("--seed", a->w.seed, "Workload seed")->capture_default_str();
  cmd->add_option("--scale", a->w.scale, "Divide the papers' lengths by this")->capture_default_str();
  cmd->add_option("--documents", a->w.documents, "docqa: documents")->capture_default_str();
  cmd->add_option("--doc-tokens", a->w.doc_tokens, "docqa: tokens per document before scaling")->capture_default_str();
  cmd->add_option("--passes", a->w.passes, "docqa: passes over the documents")->capture_default_str();
  cmd->add_option("--answer-tokens", a->w.answer_tokens, "tokens to generate before scaling")->capture_default_str();
  cmd->add_option("--qps", a->qps, "Open loop: Poisson arrivals at this rate (default: closed loop)");
  cmd->add_option("--concurrency", a->concurrency, "Closed loop: requests in flight")->capture_default_str();
  cmd->add_option("--lease-ms", a->lease_ms, "Node liveness lease")->capture_default_str();
  cmd->add_option("--kill-prefill-after", a->kill_prefill_after,
                  "Fault injection: kill -9 prefill worker 0 after N requests completed");
  cmd->add_option("--tier", a->tiers,
                  "A capacity tier the router's node serves, as cxlkvd's: dram:SIZE[:numa=N] | ssd:PATH:SIZE[:catalog=DIR] "
                  "(repeat for several; decentralized metadata)");
  cmd->add_option("--attention", a->attention,
                  "Decode attention: dense | sparse (top-K pages next to the memory) | hybrid (engine + near memory) | "
                  "remote (--mode pool: the prompt stays in the pool, attended by the router node's near-memory engines) | "
                  "remote-hybrid (remote, the decode engine holding half the budget's pages and attending those)")
      ->capture_default_str();
  cmd->add_option("--attention-budget", a->attention_budget, "Sparse/hybrid/remote: tokens attended per KV head")
      ->capture_default_str();
  cmd->add_option("--capacity-read", a->capacity_read,
                  "A prefix hit on a capacity tier: promote (into the region, then load) | stream (straight into "
                  "the engine, left where it is)")->capture_default_str();
  cmd->add_flag("--json", a->json, "Print the result as JSON");
  cmd->callback([a, &result] { result.status = RunServe(*a); });

  auto options = std::make_shared<std::string>();
  CLI::App* worker = app.add_subcommand("serve-worker", "A worker process of `cxlkv serve` (started by it)");
  worker->group("");  // hidden from --help
  worker->add_option("--options", *options, "Worker options as JSON")->required();
  worker->callback([options, &result] {
    auto j = nlohmann::json::parse(*options, nullptr, false);
    auto o = j.is_discarded() ? Result<serve::WorkerOptions>(InvalidArgument("serve-worker: --options is not JSON"))
                              : serve::WorkerOptionsFromJson(j);
    if (!o.ok()) {
      result.status = o.status();
      return;
    }
    std::exit(serve::RunWorker(*o));
  });
}

}  // namespace cxlkv::cli
