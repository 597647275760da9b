#include "pnm/steady.h"

#include <algorithm>
#include <string>

namespace cxlkv::pnm {

ResidentPages::ResidentPages(uint32_t capacity, uint64_t context_pages) : slots_(capacity, kEmpty) {
  GrowTo(context_pages);
}

void ResidentPages::GrowTo(uint64_t context_pages) {
  if (context_pages <= pages_) return;
  pages_ = context_pages;
  resident_.resize((pages_ + 63) / 64, 0);
  in_budget_.resize((pages_ + 63) / 64, 0);
}

std::vector<uint32_t> ResidentPages::EvictFrom(uint64_t first_page) {
  std::vector<uint32_t> evicted;
  for (uint32_t& page : slots_) {
    if (page == kEmpty || page < first_page) continue;
    SetBit(resident_, page, false);
    evicted.push_back(page);
    page = kEmpty;
    --size_;
  }
  return evicted;
}

void ResidentPages::SetBit(std::vector<uint64_t>& m, uint32_t page, bool on) {
  const uint64_t bit = uint64_t{1} << (page % 64);
  m[page / 64] = on ? (m[page / 64] | bit) : (m[page / 64] & ~bit);
}

Status ResidentPages::MarkBudget(std::span<const uint32_t> budget) {
  for (size_t i = 0; i < budget.size(); ++i) {
    const uint32_t p = budget[i];
    Status bad;
    if (p >= pages_) {
      bad = InvalidArgument("budget page " + std::to_string(p) + " is past the context's " + std::to_string(pages_) +
                            " pages");
    } else if (InBudget(p)) {
      bad = InvalidArgument("budget page " + std::to_string(p) + " appears twice");
    }
    if (!bad.ok()) {
      ClearBudget(budget.first(i));
      return bad;
    }
    SetBit(in_budget_, p, true);
  }
  return Status::Ok();
}

void ResidentPages::ClearBudget(std::span<const uint32_t> budget) {
  for (uint32_t p : budget) SetBit(in_budget_, p, false);
}

void ResidentPages::Place(uint32_t slot, uint32_t page, ResidentStep& step) {
  if (slots_[slot] != kEmpty) {
    SetBit(resident_, slots_[slot], false);
    step.evicted.push_back(slots_[slot]);
    --size_;
  }
  slots_[slot] = page;
  SetBit(resident_, page, true);
  step.recalled.push_back(page);
  ++size_;
}

Result<ResidentStep> ResidentPages::SteadyStep(std::span<const uint32_t> budget_best_first) {
  if (Status s = MarkBudget(budget_best_first); !s.ok()) return s;
  ResidentStep step;
  // Eviction mask: resident and no longer in the budget set. Those slots, and empty ones, are
  // what this step may fill.
  std::vector<uint32_t> open;
  for (uint32_t slot = 0; slot < slots_.size(); ++slot) {
    const uint32_t page = slots_[slot];
    if (page == kEmpty) {
      open.push_back(slot);
    } else if (!InBudget(page)) {
      SetBit(resident_, page, false);
      step.evicted.push_back(page);
      slots_[slot] = kEmpty;
      --size_;
      open.push_back(slot);
    }
  }
  // Recall candidates: in the budget set and not resident, best first, one per open slot.
  size_t next = 0;
  for (uint32_t page : budget_best_first) {
    if (next == open.size()) break;
    if (Resident(page)) continue;
    slots_[open[next++]] = page;
    SetBit(resident_, page, true);
    step.recalled.push_back(page);
    ++size_;
  }
  ClearBudget(budget_best_first);
  return step;
}

Result<ResidentStep> ResidentPages::ArkValeStep(std::span<const uint32_t> budget_best_first) {
  const std::span<const uint32_t> top = budget_best_first.first(std::min<size_t>(budget_best_first.size(), capacity()));
  if (Status s = MarkBudget(top); !s.ok()) return s;
  ResidentStep step;
  // Slots to overwrite: empty ones first, then those whose page left the top set.
  std::vector<uint32_t> open, stale;
  for (uint32_t slot = 0; slot < slots_.size(); ++slot) {
    if (slots_[slot] == kEmpty) {
      open.push_back(slot);
    } else if (!InBudget(slots_[slot])) {
      stale.push_back(slot);
    }
  }
  open.insert(open.end(), stale.begin(), stale.end());
  size_t next = 0;
  for (uint32_t page : top) {
    if (Resident(page)) continue;
    Place(open[next++], page, step);  // |top| <= capacity: a slot is always left
  }
  ClearBudget(top);
  return step;
}

std::vector<uint32_t> ResidentPages::Pages() const {
  std::vector<uint32_t> out;
  for (uint32_t p : slots_) {
    if (p != kEmpty) out.push_back(p);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void SplitByResidence(const Selection& selection, std::span<const ResidentPages> residents, Selection* engine,
                      Selection* near_memory) {
  std::vector<std::vector<uint32_t>> mine(selection.num_kv_heads()), rest(selection.num_kv_heads());
  for (uint32_t h = 0; h < selection.num_kv_heads(); ++h) {
    for (uint32_t p : selection.RankedOf(h)) (residents[h].Resident(p) ? mine[h] : rest[h]).push_back(p);
  }
  *engine = Selection::PerHead(std::move(mine));
  *near_memory = Selection::PerHead(std::move(rest));
}

Selection SelectionNotHeld(const Selection& selection, std::span<const std::vector<uint32_t>> held, uint64_t pages) {
  std::vector<uint8_t> is_held(pages);
  std::vector<std::vector<uint32_t>> rest(selection.num_kv_heads());
  for (uint32_t h = 0; h < selection.num_kv_heads(); ++h) {
    for (uint32_t p : held[h]) is_held[p] = 1;
    for (uint32_t p : selection.Of(h)) {
      if (is_held[p] == 0) rest[h].push_back(p);
    }
    for (uint32_t p : held[h]) is_held[p] = 0;
  }
  return Selection::PerHead(std::move(rest));
}

}  // namespace cxlkv::pnm
