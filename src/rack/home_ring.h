// The home ring (docs/racks.md, "The directory"): which rack keeps the directory entries of a
// prefix chain. A chain's home is found by consistent hashing of its first key over the live
// racks; its replica is the next distinct rack clockwise. Every rack builds the ring from the
// same membership view (membership.h) and gets the same answer: the ring itself is derived from
// the member names, so etcd holds it without one more key.
//
// Each rack places `tokens_per_rack` points on a 64-bit circle, at xxHash64 of its name seeded by
// the token's index. A chain belongs to the first token at or after its hash (wrapping). So:
//   - a rack that leaves moves only the chains it was home to, each to that chain's replica
//     (the next rack clockwise is exactly the next token's owner once its own tokens are gone);
//   - a rack that joins takes chains only for itself; every other chain keeps its home;
//   - with 128 tokens a rack's share of the circle stays within about ±30% of 1/N.
//
// Thread-safety: immutable after Build; share freely.
#ifndef CXLKV_SRC_RACK_HOME_RING_H_
#define CXLKV_SRC_RACK_HOME_RING_H_

#include <cstdint>
#include <string>
#include <vector>

namespace cxlkv::rack {

class HomeRing {
 public:
  static constexpr uint32_t kDefaultTokensPerRack = 128;

  // The ring of `racks` (order and duplicates do not matter). No racks: an empty ring.
  static HomeRing Build(std::vector<std::string> racks, uint32_t tokens_per_rack = kDefaultTokensPerRack);

  struct Homes {
    std::string home;     // "" on an empty ring
    std::string replica;  // "" unless the ring has two racks or more
  };
  // Where the directory entries of the chain whose first key hashes to `chain_hash` live.
  Homes HomesOf(uint64_t chain_hash) const;

  // The fraction of the circle `rack` is home to (0 when it is not on the ring).
  double Share(const std::string& rack) const;

  const std::vector<std::string>& racks() const { return racks_; }  // sorted, distinct
  bool empty() const { return racks_.empty(); }

 private:
  struct Token {
    uint64_t position;
    uint32_t rack;  // index into racks_
  };
  size_t FirstAtOrAfter(uint64_t hash) const;

  std::vector<std::string> racks_;
  std::vector<Token> tokens_;  // by position
};

}  // namespace cxlkv::rack

#endif  // CXLKV_SRC_RACK_HOME_RING_H_
