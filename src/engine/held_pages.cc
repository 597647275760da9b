#include "engine/held_pages.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace cxlkv::engine {

HeldPages::HeldPages(const pnm::Geometry& g, uint32_t capacity, uint64_t pages) : g_(g), head_g_(g) {
  head_g_.num_heads = g.group();
  head_g_.num_kv_heads = 1;
  capacity = std::max<uint32_t>(capacity, 1);
  const uint64_t slot_floats = PageBytes() / sizeof(float);
  for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
    residents_.emplace_back(capacity, pages);
    slot_of_page_.emplace_back(pages, kNoSlot);
    std::vector<uint32_t> free(capacity);
    for (uint32_t s = 0; s < capacity; ++s) free[s] = capacity - 1 - s;  // slot 0 first
    free_slots_.push_back(std::move(free));
    slots_.emplace_back(capacity * slot_floats);
  }
}

void HeldPages::GrowTo(uint64_t pages) {
  for (uint32_t h = 0; h < residents_.size(); ++h) {
    residents_[h].GrowTo(pages);
    if (slot_of_page_[h].size() < pages) slot_of_page_[h].resize(pages, kNoSlot);
  }
}

void HeldPages::DropFrom(uint64_t first_page) {
  for (uint32_t h = 0; h < residents_.size(); ++h) {
    for (uint32_t p : residents_[h].EvictFrom(first_page)) {
      free_slots_[h].push_back(slot_of_page_[h][p]);
      slot_of_page_[h][p] = kNoSlot;
    }
  }
}

Result<pnm::ResidentStep> HeldPages::Step(uint32_t h, std::span<const uint32_t> ranked, const RowsOf& rows_of) {
  CXLKV_ASSIGN_OR_RETURN(pnm::ResidentStep step, residents_[h].SteadyStep(ranked));
  for (uint32_t p : step.evicted) {
    free_slots_[h].push_back(slot_of_page_[h][p]);
    slot_of_page_[h][p] = kNoSlot;
  }
  const uint32_t bs = g_.page_tokens, hd = g_.head_dim;
  const uint64_t slot_floats = PageBytes() / sizeof(float);
  for (uint32_t p : step.recalled) {
    // ResidentPages recalls no more pages than it evicted or had free: a slot is always there.
    const uint32_t slot = free_slots_[h].back();
    free_slots_[h].pop_back();
    slot_of_page_[h][p] = slot;
    float* k = &slots_[h][slot * slot_floats];
    float* v = k + uint64_t{bs} * hd;
    const Rows rows = rows_of(p);
    for (uint32_t t = 0; t < bs; ++t) {
      std::memcpy(k + uint64_t{t} * hd, rows.k + t * rows.row_floats, hd * sizeof(float));
      std::memcpy(v + uint64_t{t} * hd, rows.v + t * rows.row_floats, hd * sizeof(float));
    }
  }
  return step;
}

Status HeldPages::Attend(const float* q, const pnm::Selection& part, pnm::Partial* out) {
  const uint32_t group = g_.group(), hd = g_.head_dim, bs = g_.page_tokens;
  const uint64_t slot_floats = PageBytes() / sizeof(float);
  out->Reset(g_.num_heads, hd);
  for (uint32_t h = 0; h < g_.num_kv_heads; ++h) {
    scratch_.clear();
    for (uint32_t p : part.Of(h)) {
      if (p >= slot_of_page_[h].size() || slot_of_page_[h][p] == kNoSlot) {
        return InvalidArgument("held-page attention: KV head " + std::to_string(h) + " does not hold page " +
                               std::to_string(p));
      }
      const float* k = &slots_[h][slot_of_page_[h][p] * slot_floats];
      scratch_.push_back({k, k + uint64_t{bs} * hd});
    }
    if (scratch_.empty()) continue;
    const pnm::ContextView mine{scratch_, scratch_.size() * bs};
    CXLKV_RETURN_IF_ERROR(pnm::Attend(head_g_, q + uint64_t{h} * group * hd, mine, nullptr, 1.0f, &head_part_));
    std::copy(head_part_.out.begin(), head_part_.out.end(), out->out.begin() + uint64_t{h} * group * hd);
    std::copy(head_part_.lse.begin(), head_part_.lse.end(), out->lse.begin() + uint64_t{h} * group);
  }
  return Status::Ok();
}

}  // namespace cxlkv::engine
