// Which pages the engine keeps resident, per (request, KV head), in the engine/near-memory hybrid
// (PNM §3.3): the engine attends over its resident pages, the near-memory side over the rest of
// the step's budget set, and the two partials merge by log-sum-exp (attend.h).
//
// Steady-token selection (Algorithm 1, Fig. 9): the engine holds `capacity` pages, fewer than
// the budget. Each step it evicts the resident pages that left the budget set and recalls only
// as many of the best budget pages it lacks as slots came free — pages that stay in the top set
// step after step stay resident, and the recall volume follows the drift of the top set, not
// its size. The ArkVale-style step it is compared with holds the whole top set (capacity ≥
// budget) and recalls every top page it lacks.
//
// Bookkeeping is bitmasks, as the paper's selector: a bit per context page for "resident" and a
// scratch bit per page for "in this step's budget set"; eviction = resident AND NOT budget,
// recall candidates = budget AND NOT resident, taken best first.
//
// Thread-safety: none; one per (request, KV head), used by that request's decode loop.
#ifndef CXLKV_SRC_PNM_STEADY_H_
#define CXLKV_SRC_PNM_STEADY_H_

#include <cstdint>
#include <span>
#include <vector>

#include "cxlkv/status.h"
#include "pnm/select.h"

namespace cxlkv::pnm {

struct ResidentStep {
  std::vector<uint32_t> evicted;   // pages that left the engine
  std::vector<uint32_t> recalled;  // pages copied to the engine this step (the recall volume)
};

class ResidentPages {
 public:
  static constexpr uint32_t kEmpty = 0xffffffffu;

  // `capacity` page slots for a context of `context_pages` pages (it may grow: GrowTo).
  ResidentPages(uint32_t capacity, uint64_t context_pages);

  // Steady selection. `budget_best_first`: this step's budget set, best first (RankedOf).
  // Errors: kInvalidArgument for a page past the context or repeated; nothing changes then.
  Result<ResidentStep> SteadyStep(std::span<const uint32_t> budget_best_first);
  // ArkVale-style replacement: the best min(capacity, budget) pages all become resident.
  Result<ResidentStep> ArkValeStep(std::span<const uint32_t> budget_best_first);

  // Evicts every resident page >= first_page (their KV was rewritten: the engine's copies are
  // stale); returns them. Their slots come free for the next step.
  std::vector<uint32_t> EvictFrom(uint64_t first_page);

  // Decode appended pages: the context now has `context_pages` (never fewer than before).
  void GrowTo(uint64_t context_pages);

  bool Resident(uint32_t page) const { return page < pages_ && ((resident_[page / 64] >> (page % 64)) & 1); }
  // Resident pages, ascending.
  std::vector<uint32_t> Pages() const;
  uint32_t size() const { return size_; }
  uint32_t capacity() const { return static_cast<uint32_t>(slots_.size()); }

 private:
  Status MarkBudget(std::span<const uint32_t> budget);  // sets in_budget_ bits; refuses bad input
  void ClearBudget(std::span<const uint32_t> budget);
  bool InBudget(uint32_t page) const { return (in_budget_[page / 64] >> (page % 64)) & 1; }
  void SetBit(std::vector<uint64_t>& m, uint32_t page, bool on);
  // Evicts the slot's page (if any) and puts `page` there.
  void Place(uint32_t slot, uint32_t page, ResidentStep& step);

  uint64_t pages_ = 0;
  std::vector<uint64_t> resident_;
  std::vector<uint64_t> in_budget_;  // scratch, all 0 between steps
  std::vector<uint32_t> slots_;      // the page in each engine slot, or kEmpty
  uint32_t size_ = 0;
};

// Splits a selection by residence, per KV head: the engine's part (budget pages it holds) and
// the near-memory part (the rest). Together they are the selection, disjoint, so their partials
// merge into the selection's attention. REQUIRES: residents.size() == selection.num_kv_heads().
void SplitByResidence(const Selection& selection, std::span<const ResidentPages> residents, Selection* engine,
                      Selection* near_memory);

// The near-memory part of a selection when the engine's held pages come as lists (a split
// attend, service_protocol.h): per KV head, the selected pages `held[h]` does not list.
// REQUIRES: held.size() == selection.num_kv_heads(), every held page < pages.
Selection SelectionNotHeld(const Selection& selection, std::span<const std::vector<uint32_t>> held, uint64_t pages);

}  // namespace cxlkv::pnm

#endif  // CXLKV_SRC_PNM_STEADY_H_
