#include "rack/home_ring.h"

#include <xxhash.h>

#include <algorithm>

namespace cxlkv::rack {

HomeRing HomeRing::Build(std::vector<std::string> racks, uint32_t tokens_per_rack) {
  HomeRing ring;
  std::sort(racks.begin(), racks.end());
  racks.erase(std::unique(racks.begin(), racks.end()), racks.end());
  ring.racks_ = std::move(racks);
  const uint32_t per = std::max<uint32_t>(tokens_per_rack, 1);
  ring.tokens_.reserve(ring.racks_.size() * per);
  for (uint32_t r = 0; r < ring.racks_.size(); ++r) {
    const std::string& name = ring.racks_[r];
    for (uint32_t t = 0; t < per; ++t) ring.tokens_.push_back({XXH64(name.data(), name.size(), t), r});
  }
  // Ties (a 64-bit collision) break by rack name, so every builder orders them alike.
  std::sort(ring.tokens_.begin(), ring.tokens_.end(), [](const Token& a, const Token& b) {
    return a.position != b.position ? a.position < b.position : a.rack < b.rack;
  });
  return ring;
}

size_t HomeRing::FirstAtOrAfter(uint64_t hash) const {
  auto it = std::lower_bound(tokens_.begin(), tokens_.end(), hash,
                             [](const Token& t, uint64_t h) { return t.position < h; });
  return it == tokens_.end() ? 0 : static_cast<size_t>(it - tokens_.begin());
}

HomeRing::Homes HomeRing::HomesOf(uint64_t chain_hash) const {
  Homes h;
  if (tokens_.empty()) return h;
  const size_t first = FirstAtOrAfter(chain_hash);
  const uint32_t home = tokens_[first].rack;
  h.home = racks_[home];
  for (size_t i = 1; i < tokens_.size(); ++i) {
    const uint32_t next = tokens_[(first + i) % tokens_.size()].rack;
    if (next != home) {
      h.replica = racks_[next];
      break;
    }
  }
  return h;
}

double HomeRing::Share(const std::string& rack) const {
  auto it = std::lower_bound(racks_.begin(), racks_.end(), rack);
  if (it == racks_.end() || *it != rack || tokens_.empty()) return 0;
  const auto r = static_cast<uint32_t>(it - racks_.begin());
  // A token owns the arc from its predecessor (exclusive) to itself; the first token's arc wraps.
  long double owned = 0;
  for (size_t i = 0; i < tokens_.size(); ++i) {
    if (tokens_[i].rack != r) continue;
    const uint64_t prev = tokens_[(i + tokens_.size() - 1) % tokens_.size()].position;
    owned += static_cast<long double>(tokens_[i].position - prev);  // unsigned: wraps for i == 0
  }
  if (racks_.size() == 1) return 1.0;
  return static_cast<double>(owned / 18446744073709551616.0L);
}

}  // namespace cxlkv::rack
