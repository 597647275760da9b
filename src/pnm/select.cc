#include "pnm/select.h"

#include <algorithm>
#include <bit>
#include <functional>
#include <cmath>
#include <limits>
#include <string>

#include "pnm/digest.h"
#include "pnm/kernels.h"

namespace cxlkv::pnm {

Selection Selection::SamePagesForAllHeads(uint32_t num_kv_heads, std::vector<uint32_t> pages) {
  Selection s;
  s.ranked_ = pages;
  std::sort(pages.begin(), pages.end());
  s.begin_.assign(num_kv_heads, 0);
  s.count_.assign(num_kv_heads, static_cast<uint32_t>(pages.size()));
  s.pages_ = std::move(pages);
  return s;
}

Selection Selection::PerHead(std::vector<std::vector<uint32_t>> pages_per_head) {
  Selection s;
  for (auto& pages : pages_per_head) {
    s.begin_.push_back(s.pages_.size());
    s.count_.push_back(static_cast<uint32_t>(pages.size()));
    s.ranked_.insert(s.ranked_.end(), pages.begin(), pages.end());
    std::sort(pages.begin(), pages.end());
    s.pages_.insert(s.pages_.end(), pages.begin(), pages.end());
  }
  return s;
}

Selection Selection::All(uint32_t num_kv_heads, uint64_t pages) {
  std::vector<uint32_t> all(pages);
  for (uint64_t p = 0; p < pages; ++p) all[p] = static_cast<uint32_t>(p);
  return SamePagesForAllHeads(num_kv_heads, std::move(all));
}

void JoinKvHeadShares(std::span<const Selection> shares, std::span<const uint32_t> bounds, Selection* out) {
  const uint32_t kv_heads = bounds.empty() ? 0 : bounds.back();
  out->pages_.clear();
  out->ranked_.clear();
  out->begin_.resize(kv_heads);
  out->count_.resize(kv_heads);
  out->rescanned_heads_ = 0;
  for (size_t i = 0; i < shares.size(); ++i) {
    const Selection& share = shares[i];
    out->rescanned_heads_ += share.rescanned_heads_;
    for (uint32_t h = bounds[i]; h < bounds[i + 1]; ++h) {
      out->begin_[h] = out->pages_.size();
      out->count_[h] = static_cast<uint32_t>(share.Of(h).size());
      out->pages_.insert(out->pages_.end(), share.Of(h).begin(), share.Of(h).end());
      out->ranked_.insert(out->ranked_.end(), share.RankedOf(h).begin(), share.RankedOf(h).end());
    }
  }
}

namespace {

// A query head in bytes: for each dimension its positive part then its negative part (one of
// them 0), in units of `scale` (max |q_d| / kDigestQueryMax), rounded to nearest: each is off by
// at most half a unit. Returns the scale; NaN when a component is not finite (every page is then
// the best), 0 for a zero query.
double QuantizeQuery(const float* q, uint32_t dim, uint8_t* out) {
  double m = 0;
  bool finite = true;
  for (uint32_t d = 0; d < dim; ++d) {
    finite = finite && std::isfinite(q[d]);
    m = std::max(m, std::fabs(double{q[d]}));
  }
  if (!finite) return std::numeric_limits<double>::quiet_NaN();
  const double scale = m / internal::kDigestQueryMax;
  for (uint32_t d = 0; d < dim; ++d) {
    const double units = m > 0 ? std::min(std::nearbyint(std::fabs(double{q[d]}) / scale), double{internal::kDigestQueryMax}) : 0;
    out[2 * d] = static_cast<uint8_t>(q[d] > 0 ? units : 0);
    out[2 * d + 1] = static_cast<uint8_t>(q[d] < 0 ? units : 0);
  }
  return scale;
}

// 2^e for every stored exponent, so a bound costs two multiplies and no ldexp.
struct Pow2Table {
  double v[256];
  Pow2Table() {
    for (int e = -128; e < 128; ++e) v[e + 128] = std::ldexp(1.0, e);
  }
};
const Pow2Table kPow2;

// The upper bound from a page head's integer score `dot`:
//   Σ_d max(q_d·lo_d, q_d·hi_d) <= 2^e·Σ_d (q⁺_d·hi'_d + q⁻_d·nlo'_d)      (digest.h: outward)
//                              <= 2^e·scale·(dot + Σ_d ½·|v_d|)         (query rounding)
// with |v_d| <= 127, so the slack is 64·dim units (63.5 and the division's rounding). The product
// is in double (errors near 2^-52, far inside the slack). Its float is then nudged up by 2^-20
// of itself and the smallest subnormal, more than the conversion's rounding (2^-24 relative, or
// 2^-150), without a branch: this runs per query head and page. `unit` = scale·2^e. A NaN scale
// (the query head is not finite) gives NaN, which selection takes as the best.
inline float BoundOf(int32_t dot, double unit, uint32_t dim) {
  const double x = (static_cast<double>(dot) + 64.0 * dim) * unit;
  // Below −FLT_MAX the float would be −inf, and −inf + inf is NaN.
  const float f = static_cast<float>(std::max(x, -double{std::numeric_limits<float>::max()}));
  return f + std::fabs(f) * 0x1p-20f + 0x1p-149f;
}

// The same with the page head's exponent: −inf for an empty head, +inf for an unbounded one.
float BoundFrom(int32_t dot, double scale, int8_t e, uint32_t dim) {
  if (e == kDigestEmpty) return -std::numeric_limits<float>::infinity();
  if (e == kDigestUnbounded) return std::numeric_limits<float>::infinity();
  return BoundOf(dot, scale * kPow2.v[e + 128], dim);
}

// The selection filter's table entry before it is asked for: below every integer score
// (|score| <= dim·kDigestQueryMax·127 < 2^31 - 1), so the first page to meet it computes it.
constexpr int32_t kPassUnknown = std::numeric_limits<int32_t>::min();

// The least integer score whose bound (BoundFrom, NaN taken as +inf, as selection does) reaches
// `threshold`, for a query head of scale `scale` and a page head of exponent `e`; one past the
// largest score when none does. A binary search over the bound itself, which rises with the
// score (every step of BoundOf is monotone), so the filter `score >= PassFrom(...)` admits
// exactly the page heads whose bound reaches the threshold, with no margin of its own to
// prove. About 32 bounds, paid once per exponent seen after the threshold last moved.
int32_t PassFrom(double scale, int8_t e, uint32_t dim, float threshold) {
  auto passes = [&](int64_t dot) {
    const float bound = BoundFrom(static_cast<int32_t>(dot), scale, e, dim);
    return std::isnan(bound) || bound >= threshold;
  };
  const int64_t top = int64_t{dim} * internal::kDigestQueryMax * 127;
  if (!passes(top)) return static_cast<int32_t>(top + 1);
  if (passes(-top)) return static_cast<int32_t>(-top);
  int64_t fails = -top, reaches = top;
  while (reaches - fails > 1) {
    const int64_t mid = fails + (reaches - fails) / 2;
    (passes(mid) ? reaches : fails) = mid;
  }
  return static_cast<int32_t>(reaches);
}

}  // namespace

float PageScoreBound(const Geometry& g, const float* q_head, const uint8_t* page_digest, uint32_t kv_head) {
  std::vector<uint8_t> quantized(2 * size_t{g.head_dim});
  const double scale = QuantizeQuery(q_head, g.head_dim, quantized.data());
  int32_t dot = 0;
  internal::Active().digest_dot(quantized.data(), 1, DigestValues(g, page_digest, kv_head), g.head_dim, &dot);
  const float bound = BoundFrom(dot, scale, DigestExponent(page_digest, kv_head), g.head_dim);
  return std::isnan(bound) ? std::numeric_limits<float>::infinity() : bound;  // as selection takes it
}

namespace {

// A kept page as one integer, larger is better: the score's bits made order-preserving (a
// negative float's bits reversed, a positive one's sign bit set), then the page, so equal scores
// keep the later page (nearer the query). nth_element and sort on these plain integers cost
// about half what they did on (float, page) pairs with a two-field comparison, and they ran
// on every fill of a head's buffer (a third of SelectPages on random keys).
// REQUIRES: score is not NaN; −0 is taken as +0 so the two compare equal as floats do.
inline uint64_t KeyOf(float score, uint32_t page) {
  uint32_t bits = std::bit_cast<uint32_t>(score == 0 ? 0.0f : score);
  bits = (bits & 0x80000000u) != 0 ? ~bits : bits | 0x80000000u;
  return uint64_t{bits} << 32 | page;
}
inline float ScoreOf(uint64_t key) {
  const uint32_t bits = static_cast<uint32_t>(key >> 32);
  return std::bit_cast<float>((bits & 0x80000000u) != 0 ? bits & 0x7fffffffu : ~bits);
}
inline uint32_t PageOf(uint64_t key) { return static_cast<uint32_t>(key); }

// Pages scored per KV head at a time (the scan's block; the next block's digests are asked for
// while one is scored).
constexpr uint64_t kBlockPages = 16;

}  // namespace

namespace internal {

SeedSample SeedSampleFor(uint64_t cap, uint64_t scored_from, uint64_t scored_end, uint32_t query_heads) {
  // A rank of about 32 in the sample: a query head's count of pages above its seed then varies
  // by about 1/sqrt(32) = 18% on unordered scores. A head whose count falls short of cap is
  // scanned again (its KV head only), and a call pays that when any of its heads does, so the
  // margin grows with the head count. Measured on random keys: expecting 1.6·cap (cap 2.1σ
  // below), some head rescanned in 4% of the calls of 8 query heads at 1M tokens but in 84% of
  // those of 32 at 128K; expecting 2·cap there, in none of 45, at 10% less time per page. A
  // larger margin admits more pages: 1.6·cap up to 8 query heads, rising to 2·cap at 32.
  // Below a stride of 8 the sample costs more of a scan than the seed saves (and short budgets
  // admit few pages anyway: about 14% of pairs at 32K, budget 1/32).
  constexpr uint64_t kSampleRank = 32;
  const uint64_t tenths = std::clamp<uint64_t>((960 + 10 * uint64_t{query_heads}) / 64, 16, 20);  // margin·10
  const uint64_t stride = (cap * tenths + 10 * kSampleRank - 1) / (10 * kSampleRank);  // rounded up
  if (stride < 8 || scored_end - scored_from < 4 * stride * kSampleRank) return {};
  return {stride, scored_from + stride / 2, kSampleRank};
}

}  // namespace internal

namespace {

// What a budget leaves to choose: the forced pages [0, sinks) and [recent_from, pages), and
// `cap` pages per KV head chosen by score; `every` when the budget or the forced pages cover
// the context.
struct BudgetSplit {
  uint64_t pages = 0, sinks = 0, recent_from = 0, cap = 0;
  bool every = false;
};
BudgetSplit SplitBudget(const Geometry& g, uint64_t tokens, const SelectOptions& o) {
  BudgetSplit b;
  b.pages = g.PagesFor(tokens);
  const uint64_t wanted = std::max<uint64_t>(o.budget_tokens / g.page_tokens, 1);
  // Forced pages: [0, sinks) and [pages - recent, pages), overlapping on short contexts.
  b.sinks = std::min<uint64_t>(o.sink_pages, b.pages);
  b.recent_from = b.pages - std::min<uint64_t>(o.recent_pages, b.pages - b.sinks);
  const uint64_t forced = b.sinks + (b.pages - b.recent_from);
  b.every = wanted >= b.pages || forced >= b.pages;
  b.cap = wanted > forced ? wanted - forced : 0;
  return b;
}

}  // namespace

bool SelectsEveryPage(const Geometry& g, uint64_t tokens, const SelectOptions& o) {
  return SplitBudget(g, tokens, o).every;
}

Status SelectPages(const Geometry& g, const float* q, const uint8_t* digests, uint64_t tokens,
                   const SelectOptions& o, Selection* out) {
  return SelectPagesOfKvHeads(g, q, digests, tokens, o, 0, g.num_kv_heads, out);
}

Status SelectPagesOfKvHeads(const Geometry& g, const float* q, const uint8_t* digests, uint64_t tokens,
                            const SelectOptions& o, uint32_t kv_begin, uint32_t kv_end, Selection* out) {
  if (Status s = g.Validate(); !s.ok()) return s;
  if (tokens == 0) return InvalidArgument("page selection over an empty context");
  if (kv_begin >= kv_end || kv_end > g.num_kv_heads) {
    return InvalidArgument("page selection for KV heads [" + std::to_string(kv_begin) + ", " + std::to_string(kv_end) +
                           ") of " + std::to_string(g.num_kv_heads));
  }
  const uint64_t pages = g.PagesFor(tokens);
  if (pages >= std::numeric_limits<uint32_t>::max()) {
    return InvalidArgument("page selection over " + std::to_string(pages) + " pages: at most 2^32 - 2");
  }
  const uint32_t kv_heads = g.num_kv_heads;
  const BudgetSplit budget = SplitBudget(g, tokens, o);
  const uint64_t sinks = budget.sinks, recent_from = budget.recent_from;
  if (budget.every) {
    *out = Selection::All(kv_heads, pages);
    return Status::Ok();
  }
  const uint64_t cap = budget.cap;  // pages chosen by score, per head

  const uint32_t heads = g.num_heads, group = g.group(), dim = g.head_dim;
  // The query heads of KV heads [kv_begin, kv_end): the others are neither scored nor chosen.
  const uint32_t head_begin = kv_begin * group, head_end = kv_end * group;
  // Per query head, the best `cap` pages as the digests stream by. Not a heap: most pages fail
  // a single compare against the head's threshold (the worst kept score), and the few that pass
  // are appended to a buffer of 2·cap; a full buffer keeps its best cap (nth_element) and raises
  // the threshold. Appends cost O(1) where a heap paid two sifts per admitted page, and the
  // result is the same: the top cap by (score, page), a later page winning a tie.
  const uint64_t room = 2 * cap;
  out->kept_.resize(room * heads);
  out->kept_size_.assign(heads, 0);
  out->threshold_.assign(heads, -std::numeric_limits<float>::infinity());
  out->dots_.resize(heads);
  out->pass_from_.assign(256 * uint64_t{heads}, kPassUnknown);
  out->query_.resize(uint64_t{heads} * 2 * dim);
  out->query_scale_.resize(heads);
  out->rescanned_heads_ = 0;
  for (uint32_t head = head_begin; head < head_end; ++head) {
    out->query_scale_[head] = QuantizeQuery(q + uint64_t{head} * dim, dim, out->query_.data() + uint64_t{head} * 2 * dim);
  }
  const internal::Kernels& k = internal::Active();
  auto keep_best = [&](uint32_t head, uint64_t keep) {  // the best `keep` first in the buffer
    uint64_t* c = out->kept_.data() + head * room;
    std::nth_element(c, c + keep - 1, c + out->kept_size_[head], std::greater<>());
    out->kept_size_[head] = static_cast<uint32_t>(keep);
  };
  if (cap > 0) {
    const uint64_t page_bytes = DigestBytesPerPage(g);
    const uint64_t header = DigestHeaderBytes(g);
    const uint32_t head_bytes = 2 * dim;
    // Most pages fail one compare against their head's threshold; the rest take this path.
    uint64_t* kept = out->kept_.data();
    uint32_t* kept_size = out->kept_size_.data();
    float* threshold = out->threshold_.data();
    int32_t* pass_from = out->pass_from_.data();
    const uint8_t* quantized = out->query_.data();
    const double* scale = out->query_scale_.data();
    int32_t* dots = out->dots_.data();
    auto head_scores = [&](const uint8_t* page, uint32_t h) {  // KV head h's group into dots
      k.digest_dot(quantized + uint64_t{h} * group * 2 * dim, group,
                   reinterpret_cast<const int8_t*>(page + header + h * head_bytes), dim, dots + h * group);
    };
    auto admit = [&](uint32_t head, uint64_t p, float score) {
      if (std::isnan(score)) score = std::numeric_limits<float>::infinity();
      else if (!(score >= threshold[head])) return;  // pages come in order: a tie is a win
      uint32_t& size = kept_size[head];
      kept[head * room + size++] = KeyOf(score, static_cast<uint32_t>(p));
      if (size == room) {
        keep_best(head, cap);
        threshold[head] = ScoreOf(kept[head * room + cap - 1]);
        for (uint32_t e = 0; e < 256; ++e) pass_from[e * heads + head] = kPassUnknown;
      }
    };
    // The filter: one integer compare per query head against the least score that can reach
    // its threshold at this exponent. Below it, the page head's bound is below the threshold
    // exactly (PassFrom searches with the bound itself), so only the pages that pass pay for
    // the float bound. `pass` takes one (page, query head) pair that passed a compare, perhaps
    // against a threshold since raised: it compares again.
    auto pass = [&](uint64_t p, const uint8_t* page, uint32_t head, int32_t dot) {
      const int8_t e = static_cast<int8_t>(page[head / group]);
      int32_t& from = pass_from[(e + 128) * heads + head];
      if (dot < from) return;
      if (from == kPassUnknown) {
        from = PassFrom(scale[head], e, dim, threshold[head]);
        if (dot < from) return;
      }
      admit(head, p, BoundFrom(dot, scale[head], e, dim));
    };
    // A block's compares first, without a branch, into a mask; then the few pairs that passed
    // (about 5% at 1M tokens, budget 1/32), in page order. A branch on every compare, which
    // mispredicts on most pairs that pass, cost a quarter of the scan: cold, per page and KV
    // head, 30 → 26 ns at 1M tokens (2 KV heads) and 34 → 30 at 128K (8), AMD VM. Thresholds
    // only rise while a block is filtered, so a pair that failed the mask's compare fails the
    // current one too; `pass` compares the others again. Above a group of 64, page by page.
    const uint32_t mask_pages = group <= 64 ? 64 / group : 0;
    auto filter_block = [&](uint64_t p0, const uint8_t* block, uint32_t np, uint32_t h, const int32_t* dots_of) {
      const uint32_t first = h * group;
      if (mask_pages == 0) {
        for (uint32_t j = 0; j < np; ++j) {
          for (uint32_t i = 0; i < group; ++i) pass(p0 + j, block + j * page_bytes, first + i, dots_of[uint64_t{j} * group + i]);
        }
        return;
      }
      for (uint32_t j0 = 0; j0 < np; j0 += mask_pages) {
        const uint32_t end = std::min(np, j0 + mask_pages);
        uint64_t mask = 0;
        for (uint32_t j = j0; j < end; ++j) {
          const int8_t e = static_cast<int8_t>(block[j * page_bytes + h]);
          const int32_t* from = pass_from + (e + 128) * heads + first;
          const int32_t* d = dots_of + uint64_t{j} * group;
          const uint32_t at = (j - j0) * group;
          for (uint32_t i = 0; i < group; ++i) mask |= uint64_t{d[i] >= from[i]} << (at + i);
        }
        for (; mask != 0; mask &= mask - 1) {
          const uint32_t bit = static_cast<uint32_t>(std::countr_zero(mask));
          const uint32_t j = j0 + bit / group, i = bit % group;
          pass(p0 + j, block + j * page_bytes, first + i, dots_of[uint64_t{j} * group + i]);
        }
      }
    };
    out->scan_kv_.assign(kv_heads, 0);
    std::fill(out->scan_kv_.begin() + kv_begin, out->scan_kv_.begin() + kv_end, uint8_t{1});
    const uint8_t* scan_kv = out->scan_kv_.data();
    // Scored a block of pages at a time per KV head: the table's digest_dot_block keeps the
    // group's query in registers across the block (page by page, reloading it for every page
    // held the dot product to the load ports: about 17 against 10 ns per page and KV head in
    // cache). Each head still sees its pages in order.
    out->block_dots_.resize(kBlockPages * uint64_t{group});
    int32_t* block_dots = out->block_dots_.data();
    auto scan = [&] {
      for (uint64_t p0 = sinks; p0 < recent_from; p0 += kBlockPages) {
        const uint32_t np = static_cast<uint32_t>(std::min<uint64_t>(kBlockPages, recent_from - p0));
        const uint8_t* block = digests + p0 * page_bytes;
        const uint64_t next = p0 + kBlockPages;
        const uint32_t next_np = next < recent_from ? static_cast<uint32_t>(std::min<uint64_t>(kBlockPages, recent_from - next)) : 0;
        for (uint32_t h = 0; h < kv_heads; ++h) {
          if (scan_kv[h] == 0) continue;
          // The head's rows of the next block are asked for while this one is scored: a KV head at
          // a time, as a burst of whole pages' lines filled the miss buffers and stalled the scan.
          for (uint32_t j = 0; j < next_np; ++j) {
            const uint8_t* from = digests + (next + j) * page_bytes + header + h * head_bytes;  // not line-aligned
            const uint8_t* line = from - reinterpret_cast<uintptr_t>(from) % 64;
            for (; line < from + head_bytes; line += 64) __builtin_prefetch(line, 0, 1);
          }
          const uint8_t* hq = quantized + uint64_t{h} * group * 2 * dim;
          const auto* rows = reinterpret_cast<const int8_t*>(block + header + h * head_bytes);
          if (k.digest_dot_block == nullptr || !k.digest_dot_block(hq, group, rows, page_bytes, np, dim, block_dots)) {
            for (uint32_t j = 0; j < np; ++j) k.digest_dot(hq, group, rows + j * page_bytes, dim, block_dots + j * group);
          }
          filter_block(p0, block, np, h, block_dots);
        }
      }
    };
    // Seeding. Started from −inf, a head's threshold climbs as the scan goes, and on unordered
    // scores about cap·(1 + ln(pages/cap)) pages pass it on the way (19% of page and query head
    // pairs at 1M tokens, budget 1/32), each paying for a bound, a buffer slot and a mispredicted
    // branch. So first a strided sample of the scored pages is bounded, and each head starts at
    // its sample's `rank`-th best bound, which 1.6–2·cap pages reach (SeedSampleFor): nearly
    // every page then fails the first compare. A seed is a guess, never trusted: a head that ends
    // with fewer than cap pages kept (its seed was above its cap-th best score) is scanned again
    // from −inf, so the result is the exact top cap either way.
    const internal::SeedSample seed = internal::SeedSampleFor(cap, sinks, recent_from, heads);
    if (seed.stride > 0) {
      std::vector<float>& sample = out->sample_;
      const uint64_t n = (recent_from - seed.first + seed.stride - 1) / seed.stride;
      sample.resize(n * heads);
      for (uint64_t i = 0; i < n; ++i) {
        const uint8_t* page = digests + (seed.first + i * seed.stride) * page_bytes;
        // Sample pages are far apart, so no prefetcher follows them: every line of the page two
        // ahead is asked for (a page is 33 lines at 8 KV heads). Against the first line only:
        // 34–35 vs 36–37 ns per page and KV head at 128K (best of 9 calls, 3 runs each, AMD VM).
        if (i + 2 < n) {
          const uint8_t* ahead = page + 2 * seed.stride * page_bytes;
          const uint8_t* line = ahead - reinterpret_cast<uintptr_t>(ahead) % 64;
          for (; line < ahead + page_bytes; line += 64) __builtin_prefetch(line, 0, 1);
        }
        for (uint32_t h = kv_begin; h < kv_end; ++h) {
          head_scores(page, h);
          const int8_t e = static_cast<int8_t>(page[h]);
          for (uint32_t head = h * group; head < (h + 1) * group; ++head) {
            const float bound = BoundFrom(dots[head], scale[head], e, dim);
            sample[head * n + i] = std::isnan(bound) ? std::numeric_limits<float>::infinity() : bound;
          }
        }
      }
      const uint64_t rank = std::min(seed.rank, n);
      for (uint32_t head = head_begin; head < head_end; ++head) {
        float* s = sample.data() + head * n;
        std::nth_element(s, s + rank - 1, s + n, std::greater<>());
        threshold[head] = s[rank - 1];
      }
    }
    scan();
    if (seed.stride > 0) {
      // Heads whose seed was too high start over; the others are shut out of the second scan
      // (no integer score reaches INT32_MAX: |score| < 2^31 - 1, see kPassUnknown), and only the
      // KV heads of their groups are scored again. Scoring every KV head again cost a whole second
      // scan, and some head rescans in most calls of 32 query heads (each about 3% at 128K).
      std::fill(out->scan_kv_.begin(), out->scan_kv_.end(), uint8_t{0});  // the scan's pointer stays valid
      for (uint32_t head = head_begin; head < head_end; ++head) {
        const bool again = kept_size[head] < cap;
        out->rescanned_heads_ += again ? 1 : 0;
        if (again) {
          out->scan_kv_[head / group] = 1;
          threshold[head] = -std::numeric_limits<float>::infinity();
          kept_size[head] = 0;
        }
        for (uint32_t e = 0; e < 256; ++e) {
          pass_from[e * heads + head] = again ? kPassUnknown : std::numeric_limits<int32_t>::max();
        }
      }
      if (out->rescanned_heads_ > 0) scan();
    }
  }

  // Each head's buffer is put in order lazily, best first: the union below reads a group's
  // heads rank by rank and stops once it has cap pages, which on unrelated heads is near rank
  // cap/group. Sorting every buffer whole (cap keys per query head) was a sixth of
  // SelectPages at 1M tokens.
  out->sorted_.assign(heads, 0);
  auto best_first = [&](uint32_t head, uint64_t upto) {  // buffer ranks [0, upto) in order
    uint64_t* c = out->kept_.data() + head * 2 * cap;  // buffers of 2·cap
    const uint64_t size = out->kept_size_[head];
    uint32_t& done = out->sorted_[head];
    if (upto <= done) return;
    const uint64_t next = std::min(size, std::max({upto, 2 * uint64_t{done}, cap / group + 16}));
    if (next < size) std::nth_element(c + done, c + next - 1, c + size, std::greater<>());
    std::sort(c + done, c + next, std::greater<>());
    done = static_cast<uint32_t>(next);
  };
  out->pages_.clear();
  out->ranked_.clear();
  out->taken_.assign((pages + 63) / 64, 0);  // a bit per page, all 0 between KV heads
  uint64_t* taken_bits = out->taken_.data();
  out->begin_.resize(kv_heads);
  out->count_.resize(kv_heads);
  for (uint32_t h = 0; h < kv_heads; ++h) {
    out->begin_[h] = out->pages_.size();
    if (h < kv_begin || h >= kv_end) {  // another share's head
      out->count_[h] = 0;
      continue;
    }
    for (uint64_t p = 0; p < sinks; ++p) out->ranked_.push_back(static_cast<uint32_t>(p));
    for (uint64_t p = recent_from; p < pages; ++p) out->ranked_.push_back(static_cast<uint32_t>(p));
    // Rank by rank across the group's heads, skipping pages already taken, until cap pages;
    // ranked_ gets them in the order taken (best first).
    uint64_t taken = 0;
    for (uint64_t rank = 0; rank < cap && taken < cap; ++rank) {
      for (uint32_t i = 0; i < group && taken < cap; ++i) {
        const uint32_t head = h * group + i;
        if (rank >= out->kept_size_[head]) continue;
        best_first(head, rank + 1);
        const uint32_t page = PageOf(out->kept_[head * 2 * cap + rank]);
        uint64_t& word = taken_bits[page / 64];
        const uint64_t bit = uint64_t{1} << (page % 64);
        if ((word & bit) != 0) continue;
        word |= bit;
        out->ranked_.push_back(page);
        ++taken;
      }
    }
    // In page order: the sinks, the taken pages off the bitmap (clearing it), the recent ones.
    for (uint64_t p = 0; p < sinks; ++p) out->pages_.push_back(static_cast<uint32_t>(p));
    for (uint64_t w = sinks / 64; w < (recent_from + 63) / 64; ++w) {
      for (uint64_t bits = taken_bits[w]; bits != 0; bits &= bits - 1) {
        out->pages_.push_back(static_cast<uint32_t>(w * 64 + static_cast<uint64_t>(std::countr_zero(bits))));
      }
      taken_bits[w] = 0;
    }
    for (uint64_t p = recent_from; p < pages; ++p) out->pages_.push_back(static_cast<uint32_t>(p));
    out->count_[h] = static_cast<uint32_t>(out->pages_.size() - out->begin_[h]);
  }
  return Status::Ok();
}

}  // namespace cxlkv::pnm
