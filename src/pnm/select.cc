#include "pnm/select.h"

#include <algorithm>
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

namespace {

// An fp32 sum of n terms is within (n - 1)·2^-24·Σ|term| of the exact sum, and each product
// within 2^-24·|term|: twice that covers the bound's own rounding too.
float WithRoundingSlack(const Geometry& g, float score, float magnitude) {
  return score + magnitude * static_cast<float>(g.head_dim + 4) * 0x1p-23f;
}

}  // namespace

float PageScoreBound(const Geometry& g, const float* q_head, const uint16_t* digest_lo) {
  float magnitude = 0, score = 0;
  internal::Active().group_digest_score(q_head, 1, digest_lo, digest_lo + g.head_dim, g.head_dim, &score, &magnitude);
  return WithRoundingSlack(g, score, magnitude);
}

namespace {

using Scored = std::pair<float, uint32_t>;
// Better first. Ties keep the later page (nearer the query).
struct Better {
  bool operator()(const Scored& a, const Scored& b) const {
    return a.first > b.first || (a.first == b.first && a.second > b.second);
  }
};

// How many pages ahead SelectPages asks for digests (1, 2, 4 and 12 measured alike within 5%).
constexpr uint64_t kAhead = 4;

}  // namespace

Status SelectPages(const Geometry& g, const float* q, const uint16_t* digests, uint64_t tokens,
                   const SelectOptions& o, Selection* out) {
  if (Status s = g.Validate(); !s.ok()) return s;
  if (tokens == 0) return InvalidArgument("page selection over an empty context");
  const uint64_t pages = g.PagesFor(tokens);
  if (pages >= std::numeric_limits<uint32_t>::max()) {
    return InvalidArgument("page selection over " + std::to_string(pages) + " pages: at most 2^32 - 2");
  }
  const uint32_t kv_heads = g.num_kv_heads;
  const uint64_t wanted = std::max<uint64_t>(o.budget_tokens / g.page_tokens, 1);
  // Forced pages: [0, sinks) and [pages - recent, pages), overlapping on short contexts.
  const uint64_t sinks = std::min<uint64_t>(o.sink_pages, pages);
  const uint64_t recent_from = pages - std::min<uint64_t>(o.recent_pages, pages - sinks);
  const uint64_t forced = sinks + (pages - recent_from);
  if (wanted >= pages || forced >= pages) {
    *out = Selection::All(kv_heads, pages);
    return Status::Ok();
  }
  const uint64_t cap = wanted > forced ? wanted - forced : 0;  // pages chosen by score, per head

  const uint32_t heads = g.num_heads, group = g.group(), dim = g.head_dim;
  // Per query head, the best `cap` pages as the digests stream by. Not a heap: most pages fail
  // a single compare against the head's threshold (the worst kept score), and the few that pass
  // are appended to a buffer of 2·cap; a full buffer keeps its best cap (nth_element) and raises
  // the threshold. Appends cost O(1) where a heap paid two sifts per admitted page, and the
  // result is the same: the top cap by (score, page), a later page winning a tie.
  const uint64_t room = 2 * cap;
  out->scores_.resize(4 * uint64_t{heads});  // [page a, page b][scores, magnitudes][heads]
  out->kept_.resize(room * heads);
  out->kept_size_.assign(heads, 0);
  out->threshold_.assign(heads, -std::numeric_limits<float>::infinity());
  const internal::Kernels& k = internal::Active();
  float* scores = out->scores_.data();
  float* magnitudes = scores + heads;
  auto keep_best = [&](uint32_t head, uint64_t keep) {  // the best `keep` first in the buffer
    Scored* c = out->kept_.data() + head * room;
    std::nth_element(c, c + keep - 1, c + out->kept_size_[head], Better{});
    out->kept_size_[head] = static_cast<uint32_t>(keep);
  };
  if (cap > 0) {
    const uint64_t page_elems = DigestElemsPerPage(g);
    const uint32_t head_bytes = 2 * dim * sizeof(uint16_t);
    auto admit = [&](uint32_t head, uint64_t p, float score) {
      if (std::isnan(score)) score = std::numeric_limits<float>::infinity();
      // Pages come in increasing order: a tie with the threshold's page is a win.
      if (!(score >= out->threshold_[head])) return;
      uint32_t& size = out->kept_size_[head];
      out->kept_[head * room + size++] = {score, static_cast<uint32_t>(p)};
      if (size == room) {
        keep_best(head, cap);
        out->threshold_[head] = out->kept_[head * room + cap - 1].first;
      }
    };
    // Pages two at a time where the table scores two at once (a query chunk loaded once for
    // both), in page order either way.
    const uint64_t step = k.group_digest_score2 != nullptr ? 2 : 1;
    for (uint64_t p = sinks; p < recent_from; p += step) {
      const bool two = step == 2 && p + 1 < recent_from;
      const uint16_t* page = digests + p * page_elems;
      for (uint32_t h = 0; h < kv_heads; ++h) {
        // Each page's digests are a few KiB of their own: ask for those a few pages ahead, a
        // KV head's at a time (the hardware prefetchers stop at 4 KiB page boundaries).
        for (uint64_t ahead = p + kAhead; ahead < p + kAhead + step && ahead < recent_from; ++ahead) {
          const auto* next = reinterpret_cast<const uint8_t*>(digests + ahead * page_elems + uint64_t{h} * 2 * dim);
          for (uint32_t b = 0; b < head_bytes; b += 64) __builtin_prefetch(next + b, 0, 3);
        }
        const uint16_t* lo = page + uint64_t{h} * 2 * dim;  // the group's scores at once
        const uint64_t first = uint64_t{h} * group;
        if (two) {
          const uint16_t* lo_b = lo + page_elems;
          k.group_digest_score2(q + first * dim, group, lo, lo + dim, lo_b, lo_b + dim, dim, scores + first,
                                magnitudes + first, scores + 2 * heads + first, magnitudes + 2 * heads + first);
        } else {
          k.group_digest_score(q + first * dim, group, lo, lo + dim, dim, scores + first, magnitudes + first);
        }
      }
      for (uint32_t head = 0; head < heads; ++head) admit(head, p, WithRoundingSlack(g, scores[head], magnitudes[head]));
      if (two) {
        const float* s2 = scores + 2 * heads;
        for (uint32_t head = 0; head < heads; ++head) admit(head, p + 1, WithRoundingSlack(g, s2[head], s2[heads + head]));
      }
    }
    // Best first within each head's buffer.
    for (uint32_t head = 0; head < heads; ++head) {
      if (out->kept_size_[head] > cap) keep_best(head, cap);
      Scored* c = out->kept_.data() + head * room;
      std::sort(c, c + out->kept_size_[head], Better{});
    }
  }

  out->pages_.clear();
  out->ranked_.clear();
  out->taken_.resize(pages);  // all 0 between uses
  out->begin_.resize(kv_heads);
  out->count_.resize(kv_heads);
  for (uint32_t h = 0; h < kv_heads; ++h) {
    out->begin_[h] = out->pages_.size();
    for (uint64_t p = 0; p < sinks; ++p) out->pages_.push_back(static_cast<uint32_t>(p));
    const size_t scored_from = out->pages_.size();
    // Rank by rank across the group's heads, skipping pages already taken, until cap pages.
    uint64_t taken = 0;
    for (uint64_t rank = 0; rank < cap && taken < cap; ++rank) {
      for (uint32_t i = 0; i < group && taken < cap; ++i) {
        const uint32_t head = h * group + i;
        if (rank >= out->kept_size_[head]) continue;
        const uint32_t page = out->kept_[head * 2 * cap + rank].second;  // buffers of 2·cap
        if (out->taken_[page]) continue;
        out->taken_[page] = 1;
        out->pages_.push_back(page);
        ++taken;
      }
    }
    for (size_t i = scored_from; i < out->pages_.size(); ++i) out->taken_[out->pages_[i]] = 0;
    // Best first: the forced pages, then the scored ones in the order they were taken.
    for (uint64_t p = 0; p < sinks; ++p) out->ranked_.push_back(static_cast<uint32_t>(p));
    for (uint64_t p = recent_from; p < pages; ++p) out->ranked_.push_back(static_cast<uint32_t>(p));
    out->ranked_.insert(out->ranked_.end(), out->pages_.begin() + static_cast<std::ptrdiff_t>(scored_from),
                        out->pages_.end());
    std::sort(out->pages_.begin() + static_cast<std::ptrdiff_t>(scored_from), out->pages_.end());
    for (uint64_t p = recent_from; p < pages; ++p) out->pages_.push_back(static_cast<uint32_t>(p));
    out->count_[h] = static_cast<uint32_t>(out->pages_.size() - out->begin_[h]);
  }
  return Status::Ok();
}

}  // namespace cxlkv::pnm
