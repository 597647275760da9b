#include "serve/long_context.h"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <memory>

#include "engine/config.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/sparse_attention.h"
#include "engine/weights.h"
#include "serve/long_context_remote.h"
#include "util/units.h"

namespace cxlkv::serve {

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// A counter-based generator (SplitMix64's finalizer): the synthetic context is a pure function
// of (seed, layer, position, element), cheap enough for a gigabyte of KV.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
// Uniform in [-1, 1).
float Uniform(uint64_t x) {
  return static_cast<float>(static_cast<double>(Mix(x) >> 11) * 0x1.0p-52 - 1.0);
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

double RelativeError(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size() && i < a.size(); ++i) {
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : 0;
}

// The RMS of one element of K and of V per layer, over the first block of `tokens` prefilled
// alone: the scale the synthetic context is drawn at.
Result<std::vector<std::pair<float, float>>> MeasureKvScale(const engine::Model& model,
                                                            std::span<const int32_t> tokens,
                                                            uint32_t bs) {
  engine::PagedKvCache cache(model.config(), 1, bs);
  CXLKV_ASSIGN_OR_RETURN(auto table, cache.AllocateBlocks(1));
  CXLKV_RETURN_IF_ERROR(model.Prefill(tokens.first(bs), 0, cache, table).status());
  std::vector<std::pair<float, float>> out;
  for (uint32_t l = 0; l < cache.num_layers(); ++l) {
    double kk = 0, vv = 0;
    for (uint32_t r = 0; r < bs; ++r) {
      for (uint32_t i = 0; i < cache.row_floats(); ++i) {
        kk += double(cache.Key(l, table[0], r)[i]) * cache.Key(l, table[0], r)[i];
        vv += double(cache.Value(l, table[0], r)[i]) * cache.Value(l, table[0], r)[i];
      }
    }
    const double n = double(bs) * cache.row_floats();
    out.emplace_back(static_cast<float>(std::sqrt(kk / n)), static_cast<float>(std::sqrt(vv / n)));
  }
  return out;
}

// Positions [0, end) of every layer: keys uniform at the model's key RMS (uniform on [-1, 1) has
// RMS 1/sqrt(3)), a heavy_fraction of (position, KV head) keys heavy_scale times longer, values
// uniform at the model's value RMS.
void FillSyntheticContext(const LongContextOptions& o,
                          const std::vector<std::pair<float, float>>& scale,
                          engine::PagedKvCache& cache, std::span<const uint32_t> table,
                          uint32_t end) {
  const uint32_t bs = cache.block_size(), hd = cache.head_dim(), kvh = cache.num_kv_heads();
  const uint64_t heavy_cut = static_cast<uint64_t>(o.heavy_fraction * 18446744073709551615.0);
  for (uint32_t l = 0; l < cache.num_layers(); ++l) {
    const float ks = scale[l].first * std::sqrt(3.0f), vs = scale[l].second * std::sqrt(3.0f);
    const float heavy = ks * static_cast<float>(o.heavy_scale);
    for (uint32_t pos = 0; pos < end; ++pos) {
      float* k = cache.Key(l, table[pos / bs], pos % bs);
      float* v = cache.Value(l, table[pos / bs], pos % bs);
      const uint64_t base = ((o.seed * 1315423911ull + l) << 40) ^ (uint64_t{pos} << 8);
      for (uint32_t h = 0; h < kvh; ++h) {
        const float s = Mix(base ^ (0xabcdull + h)) < heavy_cut ? heavy : ks;
        for (uint32_t d = 0; d < hd; ++d) {
          const uint64_t e = (base ^ h) * 4096 + d;
          k[h * hd + d] = s * Uniform(e);
          v[h * hd + d] = vs * Uniform(e ^ 0x5555555555ull);
        }
      }
    }
  }
}

struct Decoded {
  std::vector<std::vector<float>> logits;
  std::vector<double> step_s;
};

// Decodes o.decode_steps tokens from `first` at position `pos`: greedy when `forced` is empty,
// else teacher-forced with it.
Result<Decoded> DecodeRun(const engine::Model& model, engine::PagedKvCache& cache,
                          std::span<const uint32_t> table, uint32_t pos, int32_t first,
                          uint32_t steps, engine::DecodeAttention* attention,
                          const std::vector<int32_t>& forced) {
  Decoded d;
  int32_t token = first;
  for (uint32_t i = 0; i < steps; ++i) {
    const auto t0 = Clock::now();
    CXLKV_ASSIGN_OR_RETURN(auto logits, model.Decode(token, pos + i, cache, table, attention));
    d.step_s.push_back(Seconds(t0));
    token = forced.empty() ? engine::Model::Argmax(logits) : forced[i];
    d.logits.push_back(std::move(logits));
  }
  return d;
}

// A sparse, hybrid or remote run's row: its step times, the bytes its stats counted per step,
// and its agreement with the dense run it was teacher-forced by.
LongContextRow RowOf(uint64_t n, const std::string& mode, uint32_t budget, const Decoded& run,
                     const engine::SparseAttentionStats& st, const Decoded& dense,
                     const std::vector<int32_t>& forced) {
  LongContextRow r;
  r.context_tokens = n;
  r.mode = mode;
  r.budget_tokens = budget;
  r.step_ms = Median(run.step_s) * 1e3;
  for (double s : run.step_s) r.step_ms_samples.push_back(s * 1e3);
  r.steps = static_cast<uint32_t>(run.step_s.size());
  const double steps = std::max<double>(1, r.steps);
  r.engine_bytes_per_step = double(st.link_bytes) / steps;
  r.kv_read_bytes_per_step = double(st.near_kv_bytes + st.engine_kv_bytes) / steps;
  r.recalled_bytes_per_step = double(st.recalled_bytes) / steps;
  for (uint32_t i = 0; i < run.logits.size(); ++i) {
    if (engine::Model::Argmax(run.logits[i]) == forced[i]) r.tokens_agree++;
    r.logits_rel_err_max =
        std::max(r.logits_rel_err_max, RelativeError(run.logits[i], dense.logits[i]));
  }
  return r;
}

}  // namespace

Result<LongContextResult> RunLongContextDecode(const LongContextOptions& o) {
  auto say = [&](const std::string& s) {
    if (o.progress) o.progress(s);
  };
  LongContextResult result;
  if (!(o.heavy_fraction >= 0 && o.heavy_fraction <= 1) ||
      !(o.heavy_scale >= 0 && o.heavy_scale <= 1e3)) {
    return InvalidArgument("heavy-hitter fraction must be in [0, 1] and scale in [0, 1000]");
  }
  for (uint64_t n : o.context_tokens) {
    CXLKV_ASSIGN_OR_RETURN(engine::ModelConfig config,
                           engine::ModelConfig::FromJson(o.model_config));
    const uint32_t bs = 16;
    if (n < 4 * bs || n % bs != 0 || n > (1ull << 31)) {
      return InvalidArgument("long-context length " + std::to_string(n) +
                             " must be a multiple of " + std::to_string(bs) + " between " +
                             std::to_string(4 * bs) + " and 2^31");
    }
    config.max_position = static_cast<uint32_t>(n + o.decode_steps + bs);
    CXLKV_ASSIGN_OR_RETURN(engine::Weights weights, engine::Weights::Random(config));
    const engine::Model model(config, std::move(weights));
    CXLKV_RETURN_IF_ERROR(model.status());
    const auto t_fill = Clock::now();
    const uint32_t blocks = static_cast<uint32_t>((n + o.decode_steps + bs - 1) / bs);
    say("context " + util::FormatBytes(n * config.KvBytesPerToken()) + " of KV (" +
        std::to_string(n) + " tokens): synthesizing and prefilling the last block");
    engine::PagedKvCache cache(config, blocks, bs);
    auto table = cache.AllocateBlocks(blocks);
    if (!table.ok()) {
      return Status(StatusCode::kNoSpace, "long context of " + std::to_string(n) +
                                              " tokens: " + table.status().message() +
                                              " (pass shorter contexts)");
    }
    std::vector<int32_t> tokens(n);
    for (uint64_t i = 0; i < n; ++i)
      tokens[i] = static_cast<int32_t>(Mix(o.seed ^ (i << 1)) % config.vocab_size);
    const uint32_t tail = static_cast<uint32_t>(n - bs);
    CXLKV_ASSIGN_OR_RETURN(auto scale, MeasureKvScale(model, std::span(tokens).subspan(tail), bs));
    FillSyntheticContext(o, scale, cache, *table, tail);
    CXLKV_ASSIGN_OR_RETURN(auto prefill_logits, model.Prefill(tokens, tail, cache, *table));
    const int32_t first = engine::Model::Argmax(prefill_logits);
    result.fill_s.push_back(Seconds(t_fill));

    say("  dense decode, " + std::to_string(o.decode_steps) + " steps");
    CXLKV_ASSIGN_OR_RETURN(Decoded dense, DecodeRun(model, cache, *table, static_cast<uint32_t>(n),
                                                    first, o.decode_steps, nullptr, {}));
    std::vector<int32_t> forced;
    for (const auto& l : dense.logits) forced.push_back(engine::Model::Argmax(l));
    LongContextRow d;
    d.context_tokens = n;
    d.mode = "dense";
    d.step_ms = Median(dense.step_s) * 1e3;
    for (double s : dense.step_s) d.step_ms_samples.push_back(s * 1e3);
    d.kv_read_bytes_per_step = double(n) * config.KvBytesPerToken();
    d.engine_bytes_per_step =
        d.kv_read_bytes_per_step;  // the engine reads every page from the pool
    d.steps = d.tokens_agree = o.decode_steps;
    result.rows.push_back(d);

    // The steps of one sparse, hybrid or remote attention, teacher-forced with dense's tokens,
    // counted from here (what preparing or opening it cost is not in them), as a row.
    auto decoded_row = [&](auto& attention, const std::string& label,
                           uint32_t budget) -> Result<LongContextRow> {
      attention.ResetStats();
      CXLKV_ASSIGN_OR_RETURN(Decoded run,
                             DecodeRun(model, cache, *table, static_cast<uint32_t>(n), first,
                                       o.decode_steps, &attention, forced));
      LongContextRow r = RowOf(n, label, budget, run, attention.stats(), dense, forced);
      r.speedup = d.step_ms / r.step_ms;
      return r;
    };
    double digest_rate = 0;
    // One sparse or hybrid run at `budget` tokens, teacher-forced with dense's tokens.
    auto run_sparse = [&](engine::AttentionMode mode, uint32_t budget, const std::string& label,
                          bool audit) -> Result<LongContextRow> {
      say("  " + label + " decode, budget " + std::to_string(budget) + " tokens");
      engine::SparseAttentionOptions so;
      so.mode = mode;
      so.select.budget_tokens = budget;
      so.threads = o.near_threads;
      CXLKV_ASSIGN_OR_RETURN(auto attention, engine::SparseDecodeAttention::Create(config, bs, so));
      const auto t_digest = Clock::now();
      CXLKV_RETURN_IF_ERROR(attention->Prepare(cache, *table, n));
      if (digest_rate == 0) digest_rate = double(n) * config.num_layers / Seconds(t_digest);
      CXLKV_ASSIGN_OR_RETURN(LongContextRow r, decoded_row(*attention, label, budget));
      if (audit) {  // the attention mass the selection kept, measured apart: the audit attends
                    // densely too
        so.audit = true;
        CXLKV_ASSIGN_OR_RETURN(auto audited, engine::SparseDecodeAttention::Create(config, bs, so));
        CXLKV_RETURN_IF_ERROR(DecodeRun(model, cache, *table, static_cast<uint32_t>(n), first,
                                        std::min<uint32_t>(o.decode_steps, 2), audited.get(),
                                        forced)
                                  .status());
        const auto& as = audited->stats();
        if (as.mass_recall_count > 0) {
          r.mass_recall_mean = as.mass_recall_sum / as.mass_recall_count;
          r.mass_recall_min = as.mass_recall_min;
        }
      }
      return r;
    };
    // Dense attention with the near-memory kernel (every page selected): the fair baseline for
    // the kernels' speed; the engine's own dense attention is the one a serving engine runs.
    const uint32_t whole = static_cast<uint32_t>(n + o.decode_steps + bs);
    CXLKV_ASSIGN_OR_RETURN(LongContextRow nm_dense,
                           run_sparse(engine::AttentionMode::kSparse, whole, "dense-nm", false));
    nm_dense.budget_tokens = 0;
    result.rows.push_back(nm_dense);
    for (uint32_t div : o.budget_divisors) {
      const uint32_t budget =
          static_cast<uint32_t>(std::max<uint64_t>(bs, n / std::max<uint32_t>(div, 1)));
      CXLKV_ASSIGN_OR_RETURN(LongContextRow sparse,
                             run_sparse(engine::AttentionMode::kSparse, budget, "sparse", true));
      CXLKV_ASSIGN_OR_RETURN(LongContextRow hybrid,
                             run_sparse(engine::AttentionMode::kHybrid, budget, "hybrid", false));
      hybrid.mass_recall_mean = sparse.mass_recall_mean;  // the same selection
      hybrid.mass_recall_min = sparse.mass_recall_min;
      sparse.speedup_vs_nm_dense = nm_dense.step_ms / sparse.step_ms;
      hybrid.speedup_vs_nm_dense = nm_dense.step_ms / hybrid.step_ms;
      result.rows.push_back(sparse);
      result.rows.push_back(hybrid);
    }
    // The remote rows: the context in a pool, decoded through a near-memory service over it.
    auto remote_rows = [&]() -> Status {
      say("  remote: the context's blocks into a pool at " + o.remote_region +
          ", a near-memory service over it");
      auto made = RemoteLongContext::Create(o.remote_region, config, cache, *table, tokens,
                                            o.near_threads, o.remote_region_bytes);
      if (!made.ok() && o.remote_optional && made.status().code() == StatusCode::kNoSpace) {
        result.notes.push_back("no remote rows at " + std::to_string(n / 1024) +
                               "K tokens: " + made.status().message());
        say("  " + result.notes.back());
        return Status::Ok();
      }
      CXLKV_RETURN_IF_ERROR(made.status());
      std::unique_ptr<RemoteLongContext> remote = std::move(made).value();
      // One run through the service, teacher-forced with dense's tokens; opening the context
      // there (its digests built for a budget) is timed apart from the steps.
      auto run_remote = [&](uint32_t budget, uint32_t held_pages,
                            const std::string& label) -> Result<LongContextRow> {
        say("  " + label + " decode" +
            (budget ? ", budget " + std::to_string(budget) + " tokens" : std::string()));
        CXLKV_ASSIGN_OR_RETURN(auto attention, remote->Attention(config, budget, held_pages));
        const auto t_open = Clock::now();
        CXLKV_RETURN_IF_ERROR(attention->Open(remote->keys()));
        const double open_s = Seconds(t_open);
        CXLKV_ASSIGN_OR_RETURN(LongContextRow r, decoded_row(*attention, label, budget));
        r.mass_measured = false;
        r.open_ms = open_s * 1e3;
        return r;
      };
      CXLKV_ASSIGN_OR_RETURN(LongContextRow remote_dense, run_remote(0, 0, "remote-dense"));
      result.rows.push_back(remote_dense);
      for (uint32_t div : o.budget_divisors) {
        const uint32_t budget =
            static_cast<uint32_t>(std::max<uint64_t>(bs, n / std::max<uint32_t>(div, 1)));
        // The hybrid holds half the budget's pages, as the in-process one and `cxlkv serve` do.
        const uint32_t held = std::max<uint32_t>(1, budget / bs / 2);
        for (const auto& [label, held_pages] :
             {std::pair<std::string, uint32_t>{"remote-sparse", 0}, {"remote-hybrid", held}}) {
          CXLKV_ASSIGN_OR_RETURN(LongContextRow r, run_remote(budget, held_pages, label));
          r.speedup_vs_nm_dense = remote_dense.step_ms / r.step_ms;
          result.rows.push_back(r);
        }
      }
      return Status::Ok();
    };
    if (!o.remote_region.empty()) CXLKV_RETURN_IF_ERROR(remote_rows());
    result.digest_build_tokens_per_s.push_back(digest_rate);
  }
  return result;
}

void PrintLongContext(FILE* out, const LongContextResult& r) {
  std::fprintf(out, "%-8s %-13s %-7s %9s %8s %9s %14s %13s %9s %11s %9s\n", "context", "mode",
               "budget", "step ms", "speedup", "vs nm", "to engine/step", "KV read/step",
               "mass kept", "tokens same", "logit err");
  for (const LongContextRow& row : r.rows) {
    const std::string budget =
        row.budget_tokens ? "1/" + std::to_string(row.context_tokens / row.budget_tokens) : "-";
    char mass[32] = "-";
    if (row.budget_tokens && row.mass_measured)
      std::snprintf(mass, sizeof mass, "%.3f", row.mass_recall_mean);
    char vs_nm[32] = "-";
    if (row.budget_tokens) std::snprintf(vs_nm, sizeof vs_nm, "%.2fx", row.speedup_vs_nm_dense);
    std::fprintf(out, "%-8s %-13s %-7s %9.2f %7.2fx %9s %14s %13s %9s %8u/%-2u %9.2e\n",
                 (std::to_string(row.context_tokens / 1024) + "K").c_str(), row.mode.c_str(),
                 budget.c_str(), row.step_ms, row.speedup, vs_nm,
                 util::FormatBytes(static_cast<uint64_t>(row.engine_bytes_per_step)).c_str(),
                 util::FormatBytes(static_cast<uint64_t>(row.kv_read_bytes_per_step)).c_str(), mass,
                 row.tokens_agree, row.steps, row.logits_rel_err_max);
  }
  for (const std::string& note : r.notes) std::fprintf(out, "note: %s\n", note.c_str());
}

nlohmann::json LongContextJson(const LongContextResult& r) {
  nlohmann::json rows = nlohmann::json::array();
  for (const LongContextRow& x : r.rows) {
    rows.push_back({{"context_tokens", x.context_tokens},
                    {"mode", x.mode},
                    {"budget_tokens", x.budget_tokens},
                    {"step_ms", x.step_ms},
                    {"speedup_vs_dense", x.speedup},
                    {"speedup_vs_nm_dense", x.speedup_vs_nm_dense},
                    {"engine_bytes_per_step", x.engine_bytes_per_step},
                    {"kv_read_bytes_per_step", x.kv_read_bytes_per_step},
                    {"recalled_bytes_per_step", x.recalled_bytes_per_step},
                    {"mass_recall_mean", x.mass_measured ? nlohmann::json(x.mass_recall_mean) : nlohmann::json()},
                    {"mass_recall_min", x.mass_measured ? nlohmann::json(x.mass_recall_min) : nlohmann::json()},
                    {"open_ms", x.open_ms},
                    {"tokens_agree", x.tokens_agree},
                    {"steps", x.steps},
                    {"logits_rel_err_max", x.logits_rel_err_max}});
  }
  return {{"rows", rows},
          {"digest_build_tokens_per_s", r.digest_build_tokens_per_s},
          {"fill_s", r.fill_s},
          {"notes", r.notes}};
}

}  // namespace cxlkv::serve
