// Top-K page selection (PNM §3.1, Quest): score every page's digest against the query and keep
// the best pages under a token budget, per KV head — scoring and selection fused in one pass
// (per query head a threshold and a bounded buffer fed while the digests stream by; no array
// of all scores). Thresholds start from a small strided sample of the pages (select.cc), and a
// head whose start proves too high is scanned again, so the result never depends on the sample.
//
// Grouped-query attention: each query head ranks pages by its own score, and its KV head
// attends to the union of its group's choices, taken rank by rank (every head's best page,
// then every head's second, ...) until the budget is spent. Heads differ in scale: ranking
// by the group's largest score (or its sum) lets the head with the largest query norm choose
// for all, and a needle that only a quieter head attends to is lost.

// Always selected, outside the budget's competition: the first `sink_pages` pages (attention
// sinks) and the last `recent_pages` pages (where the query sits, often partial).
//
// Scores are integer multiply-adds (digest.h): the query head is rounded to bytes (|q_d| scaled
// to at most 255, split into its positive and negative parts), dotted with the page's int8
// bounds exactly, and the sum of the rounding (half a step per dimension, at most 127 units)
// is added back, so the score stays >= the exact max of q·k over the page.
//
// Thread-safety: a Selection is one caller's; SelectPages reads digests it does not change.
#ifndef CXLKV_SRC_PNM_SELECT_H_
#define CXLKV_SRC_PNM_SELECT_H_

#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "cxlkv/status.h"
#include "pnm/geometry.h"

namespace cxlkv::pnm {

struct SelectOptions {
  uint32_t budget_tokens = 2048;  // tokens attended per KV head, in whole pages (forced pages count)
  uint32_t sink_pages = 1;        // the first pages, always kept
  uint32_t recent_pages = 1;      // the last pages, always kept
};

class Selection;

// Selects pages of a context of `tokens` tokens whose digests (PagesFor(tokens) ×
// DigestBytesPerPage, see digest.h) are at `digests`, for query q ([num_heads][head_dim] fp32;
// any positive scale). A page with non-finite keys, or any page for a query head that is not
// finite, counts as the best. When the
// budget covers every page, every page is selected. Errors: kInvalidArgument for a bad geometry,
// an empty context, or a context of 2^32 pages or more.
Status SelectPages(const Geometry& g, const float* q, const uint8_t* digests, uint64_t tokens,
                   const SelectOptions& o, Selection* out);

// Whether the budget (or the forced pages) covers the context: SelectPages then selects every
// page for every head, without scoring.
bool SelectsEveryPage(const Geometry& g, uint64_t tokens, const SelectOptions& o);

// SelectPages for KV heads [kv_begin, kv_end) only: one thread's share of a selection split by
// KV heads (AttendPool::Select). `out` holds those heads' pages and none for the others. A KV
// head's pages depend only on its group's query heads and its own digests, so the shares
// joined (JoinKvHeadShares) are exactly SelectPages' result. Errors: SelectPages', and
// kInvalidArgument for an empty or out-of-range interval.
Status SelectPagesOfKvHeads(const Geometry& g, const float* q, const uint8_t* digests, uint64_t tokens,
                            const SelectOptions& o, uint32_t kv_begin, uint32_t kv_end, Selection* out);

// Joins shares made by SelectPagesOfKvHeads: shares[i] covers KV heads [bounds[i], bounds[i + 1]),
// so bounds has shares.size() + 1 entries, from 0 to the KV head count, rising. `out` (not one
// of the shares) gets each head's pages and ranks from its share.
void JoinKvHeadShares(std::span<const Selection> shares, std::span<const uint32_t> bounds, Selection* out);

// Pages chosen per KV head, ascending within each head (so reads walk memory forward).
class Selection {
 public:
  // The same pages for every head (a hybrid's split, or dense attention), ranked in the order
  // given. Pages must be distinct.
  static Selection SamePagesForAllHeads(uint32_t num_kv_heads, std::vector<uint32_t> pages);
  // Each head its own pages, ranked in the order given. Pages must be distinct within a head.
  static Selection PerHead(std::vector<std::vector<uint32_t>> pages_per_head);
  // Every page of a context of `pages` pages, for every head.
  static Selection All(uint32_t num_kv_heads, uint64_t pages);

  uint32_t num_kv_heads() const { return static_cast<uint32_t>(begin_.size()); }
  std::span<const uint32_t> Of(uint32_t kv_head) const {
    return {pages_.data() + begin_[kv_head], count_[kv_head]};
  }
  uint64_t TotalPages() const { return pages_.size(); }
  // The same pages best first: the forced ones, then by the group's ranks (SelectPages), or in
  // the order given (SamePagesForAllHeads). Steady-token selection recalls in this order.
  std::span<const uint32_t> RankedOf(uint32_t kv_head) const {
    return {ranked_.data() + begin_[kv_head], count_[kv_head]};
  }
  // Query heads whose seeded threshold (select.cc) turned out too high in the last SelectPages,
  // so their pages were scanned a second time: 0 almost always; for tests and tuning.
  uint32_t rescanned_heads() const { return rescanned_heads_; }
  // Whether every head has the one list (SamePagesForAllHeads, All).
  bool SameForAllHeads() const {
    return std::all_of(begin_.begin(), begin_.end(), [&](uint64_t b) { return b == begin_[0]; });
  }

 private:
  friend Status SelectPagesOfKvHeads(const Geometry&, const float*, const uint8_t*, uint64_t,
                                     const SelectOptions&, uint32_t, uint32_t, Selection*);
  friend void JoinKvHeadShares(std::span<const Selection>, std::span<const uint32_t>, Selection*);
  std::vector<uint32_t> pages_;
  std::vector<uint32_t> ranked_;  // pages_ per head again, best first
  std::vector<uint64_t> begin_;
  std::vector<uint32_t> count_;
  // Scratch kept between calls: per query head, a buffer of up to 2·cap (score, page) as one
  // integer each (select.cc), its fill, and the score a page must reach to enter it.
  std::vector<uint64_t> kept_;
  std::vector<uint32_t> kept_size_;
  std::vector<float> threshold_;
  std::vector<uint64_t> taken_;  // a bit per page, while one KV head's union is taken
  std::vector<uint32_t> sorted_;  // per query head, how many of its buffer's best are in order
  std::vector<uint8_t> query_;   // per query head, its one-byte form (select.cc)
  std::vector<double> query_scale_;
  std::vector<int32_t> dots_;     // one page's integer scores, every query head
  // Per exponent and query head ([e + 128][head]), the least integer score whose bound reaches
  // the head's threshold: the selection filter (select.cc).
  std::vector<int32_t> pass_from_;
  std::vector<float> sample_;  // per query head, the seed sample's bounds
  uint32_t rescanned_heads_ = 0;
  std::vector<int32_t> block_dots_;  // a block of pages' integer scores for one KV head's group
  std::vector<uint8_t> scan_kv_;  // per KV head, whether the scan scores it (the second: only rescanned groups)
};

namespace internal {
// SelectPages' seed sample: every `stride`-th scored page from `first`, whose `rank`-th best
// bound starts a query head's threshold (select.cc). stride 0: no sample (short budgets).
struct SeedSample {
  uint64_t stride = 0;
  uint64_t first = 0;
  uint64_t rank = 0;
};
// For `cap` pages chosen by score among the scored pages [scored_from, scored_end), for a call
// of `query_heads` query heads.
SeedSample SeedSampleFor(uint64_t cap, uint64_t scored_from, uint64_t scored_end, uint32_t query_heads);
}  // namespace internal

// The upper bound that SelectPages ranks by, for one query head (of KV head `kv_head`) and one
// page's digest: >= the exact max of q·k over the page's keys.
float PageScoreBound(const Geometry& g, const float* q_head, const uint8_t* page_digest, uint32_t kv_head);

}  // namespace cxlkv::pnm

#endif  // CXLKV_SRC_PNM_SELECT_H_
