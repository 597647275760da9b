// The directory a home rack keeps (docs/racks.md, "The directory"): for the chains the home ring
// (home_ring.h) places here, as home or replica, which racks announced which of their blocks.
// Holders announce in batches (link_messages.h, LinkAnnounce); a rack that misses locally asks
// the chain's home once and learns who holds the longest prefix.
//
// It is a hint, never the truth: an entry may be stale (the block evicted since, the holder
// gone), which costs the asker one failed fetch and a recompute, never wrong data — a fetch
// checks every key and checksum. So the directory favours staying small and current:
//   - a batch from an older life of its holder than one already seen is dropped, and a newer
//     life first forgets everything of the older one (what a rack held before it lost its lease
//     it re-announces, or it is gone);
//   - a rack that leaves the membership is forgotten at once (Forget);
//   - when the ring changes, chains no longer placed here are dropped (Retain);
//   - past `max_blocks` entries, the least recently announced chains are dropped first.
// Announced values are untrusted: an index past kMaxChainBlocks, or a first block whose key is
// not the chain's, is left out and counted.
//
// Thread-safety: every method may be called from any thread.
#ifndef CXLKV_SRC_RACK_CHAIN_DIRECTORY_H_
#define CXLKV_SRC_RACK_CHAIN_DIRECTORY_H_

#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "rack/link_messages.h"

namespace cxlkv::rack {

struct ChainDirectoryStats {
  uint64_t chains = 0;        // chains with at least one block announced
  uint64_t blocks = 0;        // announced blocks held, over all holders
  uint64_t stale_batches = 0; // batches dropped: an older life of their holder
  uint64_t malformed = 0;     // announced blocks left out: bad index, or a first key not the chain's
  uint64_t dropped_for_space = 0;  // chains dropped past max_blocks
};

class ChainDirectory {
 public:
  static constexpr uint32_t kMaxChainBlocks = 1u << 17;  // 2M tokens at 16 per block
  explicit ChainDirectory(uint64_t max_blocks = 1u << 22) : max_blocks_(max_blocks) {}

  // One holder's batch, in order.
  void Apply(const std::string& holder, const LinkAnnounce& batch);
  // Who holds the longest prefix of `keys` (keys[0] names the chain): longest first, ties by
  // rack name, at most kLinkMaxHolders, holders with no leading block left out.
  LinkLookupAnswer Lookup(const std::vector<BlockKey>& keys) const;
  // A rack that left: everything it announced goes.
  void Forget(const std::string& rack);
  // Keeps only the chains `keep` accepts (the ring changed); returns how many were dropped.
  size_t Retain(const std::function<bool(const BlockKey& chain)>& keep);

  ChainDirectoryStats stats() const;

 private:
  struct KeyHash {
    size_t operator()(const BlockKey& k) const { return static_cast<size_t>(k.lo ^ (k.hi * 0x9e3779b97f4a7c15ull)); }
  };
  struct Held {  // one holder's blocks of one chain, by index
    int64_t life = 0;
    std::vector<BlockKey> keys;
    std::vector<bool> present;
    uint64_t count = 0;
  };
  struct Chain {
    std::map<std::string, Held> holders;
    std::list<BlockKey>::iterator lru;  // position in lru_: most recent at the back
  };
  void DropChain(std::unordered_map<BlockKey, Chain, KeyHash>::iterator it);
  void ForgetLocked(const std::string& rack);

  const uint64_t max_blocks_;
  mutable std::mutex mu_;
  std::unordered_map<BlockKey, Chain, KeyHash> chains_;
  std::list<BlockKey> lru_;
  struct HolderLife {
    int64_t life;
    bool ended;  // the rack left (Forget): this life announces nothing more
  };
  std::map<std::string, HolderLife> newest_life_;
  ChainDirectoryStats stats_;
};

}  // namespace cxlkv::rack

#endif  // CXLKV_SRC_RACK_CHAIN_DIRECTORY_H_
