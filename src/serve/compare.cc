#include "serve/compare.h"

#include <sys/stat.h>
#include <unistd.h>

#include "cxlkv/pool.h"
#include "pool/pool_internal.h"
#include "tier/tier_store.h"

namespace cxlkv::serve {

namespace {

// An SSD tier's files (its file, catalog, namespace book), as a run left them. A device (a
// block device or an NVMe generic device) stays: only its catalog and book go, so the next run
// starts from an empty tier all the same.
void RemoveSsdFiles(const std::vector<std::string>& specs) {
  for (const std::string& text : specs) {
    auto spec = tier::ParseTierSpec(text);
    if (!spec.ok() || spec->kind != tier::TierKind::kSsd) continue;
    for (const std::string& f : tier::SsdStateFiles(spec->StateBase())) ::unlink(f.c_str());
    struct stat st {};
    if (::lstat(spec->path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) ::unlink(spec->path.c_str());
  }
}

}  // namespace

std::string ConfigName(KvMode mode, MetadataMode metadata, bool tiered) {
  if (mode == KvMode::kPool && tiered) return "(f) cxlkv pool + DRAM/SSD tiers";
  switch (mode) {
    case KvMode::kRecompute: return "(a) no KV reuse";
    case KvMode::kPrivate: return "(b) private DRAM cache";
    case KvMode::kTcp: return "(c) private + TCP handoff";
    case KvMode::kPool:
      return metadata == MetadataMode::kCentral ? "(e) cxlkv pool, central metadata" : "(d) cxlkv shared pool";
  }
  return "?";
}

int PoolIndex(const Comparison& c, MetadataMode metadata, bool tiered) {
  for (size_t i = 0; i < c.modes.size(); ++i) {
    if (c.modes[i] == KvMode::kPool && c.metadata[i] == metadata && c.tiered[i] == tiered) return static_cast<int>(i);
  }
  return -1;
}

Result<Comparison> CompareConfigurations(const CompareOptions& options, const std::vector<Request>& requests) {
  Comparison out;
  struct Config {
    KvMode mode;
    MetadataMode metadata;
    bool tiered;
  };
  std::vector<Config> configs;
  for (KvMode mode : options.modes) {
    if (mode != KvMode::kPool) {
      configs.push_back({mode, MetadataMode::kDecentralized, false});
      continue;
    }
    for (MetadataMode m : options.pool_metadata) configs.push_back({mode, m, false});
    if (!options.pool_tiers.empty()) configs.push_back({mode, MetadataMode::kDecentralized, true});
  }
  for (auto [mode, metadata, tiered] : configs) {
    const std::string name = ConfigName(mode, metadata, tiered);
    const std::string region =
        (options.region_prefix.empty() ? options.workdir + "/cxlkv-e2e-" + std::to_string(::getpid())
                                       : options.region_prefix) +
        "-" + std::string(KvModeName(mode)) + (metadata == MetadataMode::kCentral ? "-central" : "") +
        (tiered ? "-tiered" : "");
    PoolCreateOptions co;
    co.size = options.region_bytes;
    co.overwrite = true;
    co.metadata = metadata;
    CXLKV_RETURN_IF_ERROR(Pool::Create({region}, co));
    ServeOptions so = options.serve;
    so.region = region;
    so.mode = mode;
    if (tiered) so.tiers = options.pool_tiers;
    if (options.progress) {
      options.progress(name, 0, requests.size());
      so.progress = [&](size_t done, size_t total) { options.progress(name, done, total); };
    }
    auto run = Serve(so, requests);
    std::vector<std::string> problems;
    if (run.ok()) {
      // What the run left behind must pass `cxlkv check` (nothing WRITING, no leaked pins).
      auto regions = pool::AttachAll({region});
      problems = regions.ok() ? pool::Check(*regions, 0) : std::vector<std::string>{regions.status().ToString()};
    }
    ::unlink(region.c_str());
    if (tiered) RemoveSsdFiles(options.pool_tiers);
    if (!run.ok()) return Status(run.status().code(), name + ": " + run.status().message());
    if (!problems.empty()) return Corrupted(name + ": the pool failed its check after the run: " + problems[0]);
    out.summaries.push_back(Summarize(name, *run));
    out.modes.push_back(mode);
    out.metadata.push_back(metadata);
    out.tiered.push_back(tiered);
    out.second_half_hit_rate.push_back(HitRate(*run, requests.size() / 2, requests.size()));
    out.runs.push_back(std::move(*run));
  }
  out.tokens_identical = true;
  for (size_t c = 1; c < out.runs.size(); ++c) {
    for (size_t r = 0; r < requests.size(); ++r) {
      if (out.runs[c].records[r].tokens != out.runs[0].records[r].tokens) {
        return Internal("request " + std::to_string(r) + " generated different tokens under " +
                        out.summaries[c].name + " than under " + out.summaries[0].name +
                        ": greedy decoding must not depend on where the KV came from");
      }
    }
  }
  return out;
}

nlohmann::json ComparisonJson(const Comparison& c) {
  nlohmann::json configs = nlohmann::json::array();
  for (size_t i = 0; i < c.summaries.size(); ++i) {
    auto j = SummaryJson(c.summaries[i]);
    j["mode"] = c.runs[i].mode;
    j["policy"] = c.runs[i].policy;
    j["metadata"] = MetadataModeName(c.metadata[i]);
    j["tiered"] = c.tiered[i];
    if (!c.runs[i].tiers.is_null()) j["tiers"] = c.runs[i].tiers;
    j["second_half_hit_rate"] = c.second_half_hit_rate[i];
    configs.push_back(j);
  }
  return {{"configurations", configs}, {"tokens_identical", c.tokens_identical}};
}

}  // namespace cxlkv::serve
