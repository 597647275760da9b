// HeldPages: the engine's side of the engine/near-memory hybrid (PNM §3.3) for one layer of one
// sequence. Per KV head, the pages the engine holds — chosen by steady-token selection
// (pnm::ResidentPages: a page stays while it stays in the budget set, and only as many are
// recalled as were evicted) — and a copy of each: the head's K rows then its V rows,
// [page_tokens][head_dim] fp32 each. Recalls are real copies out of wherever the page lives (the
// engine's paged cache, or a pool block), and the engine attends its held selected pages from
// the copies. Used in-process (SparseDecodeAttention) and against a cxlkvd's engines
// (RemoteDecodeAttention), which attend the rest of the selection.
//
// Thread-safety: none; one per (sequence, layer), used by that sequence's decode loop.
#ifndef CXLKV_ENGINE_HELD_PAGES_H_
#define CXLKV_ENGINE_HELD_PAGES_H_

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "cxlkv/status.h"
#include "pnm/attend.h"
#include "pnm/geometry.h"
#include "pnm/select.h"
#include "pnm/steady.h"

namespace cxlkv::engine {

class HeldPages {
 public:
  // Where a page's rows are for one KV head: K row t at k + t·row_floats, V row t likewise.
  struct Rows {
    const float* k = nullptr;
    const float* v = nullptr;
    uint64_t row_floats = 0;
  };
  using RowsOf = std::function<Rows(uint32_t page)>;

  // `capacity` pages per KV head (at least 1) of geometry g (fp32), a context of `pages` so far.
  HeldPages(const pnm::Geometry& g, uint32_t capacity, uint64_t pages);

  // The context grew to `pages` (decode filled pages).
  void GrowTo(uint64_t pages);
  // Forgets the held pages from `first_page` on: their KV was rewritten, the copies are stale.
  void DropFrom(uint64_t first_page);

  // Steady step of KV head h on its budget pages, best first (full pages only: a partial page is
  // still being written): evicts the held pages that left the set and recalls as many of the
  // best missing ones as slots came free, copying each page's rows from rows_of(page). The
  // remote hybrid passes the held pages that stayed and then the daemon's recalls, in page
  // order: the same step, since those recalls are never more than the slots that come free
  // (pnm::SplitHeadOf), so every one is taken and their order decides nothing. Errors:
  // pnm::ResidentPages' (a page past the context or repeated); nothing changes then.
  Result<pnm::ResidentStep> Step(uint32_t h, std::span<const uint32_t> ranked, const RowsOf& rows_of);

  // The held pages, per KV head (for pnm::SplitByResidence), and one head's, ascending.
  std::span<const pnm::ResidentPages> residents() const { return residents_; }
  std::vector<uint32_t> Held(uint32_t h) const { return residents_[h].Pages(); }
  bool Holds(uint32_t h, uint32_t page) const { return residents_[h].Resident(page); }

  // Attention of each KV head's query group over `part`'s pages for that head, all held, from
  // the copies: out covers every query head (a head with no pages has lse −∞). q is the whole
  // query [num_heads][head_dim], scaled already. Errors: kInvalidArgument for a page not held.
  Status Attend(const float* q, const pnm::Selection& part, pnm::Partial* out);

  // Bytes of one recalled page (one KV head's K and V rows).
  uint64_t PageBytes() const { return uint64_t{2} * g_.page_tokens * g_.head_dim * sizeof(float); }

 private:
  static constexpr uint32_t kNoSlot = 0xffffffffu;
  pnm::Geometry g_;
  pnm::Geometry head_g_;  // one KV head and its query group
  std::vector<pnm::ResidentPages> residents_;
  std::vector<std::vector<uint32_t>> slot_of_page_;  // per KV head: page -> slot, or kNoSlot
  std::vector<std::vector<uint32_t>> free_slots_;
  std::vector<std::vector<float>> slots_;  // per KV head: per slot K [page_tokens][head_dim], then V
  std::vector<pnm::PageKv> scratch_;       // one head's held pages, for Attend
  pnm::Partial head_part_;
};

}  // namespace cxlkv::engine

#endif  // CXLKV_ENGINE_HELD_PAGES_H_
