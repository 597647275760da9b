#include "rack/chain_directory.h"

#include <algorithm>

namespace cxlkv::rack {

void ChainDirectory::DropChain(std::unordered_map<BlockKey, Chain, KeyHash>::iterator it) {
  for (const auto& [rack, held] : it->second.holders) stats_.blocks -= held.count;
  lru_.erase(it->second.lru);
  chains_.erase(it);
}

// Every chain is visited: membership changes are rare next to announces and lookups, and a
// rack-to-chains index would cost memory on every entry.
void ChainDirectory::ForgetLocked(const std::string& rack) {
  for (auto it = chains_.begin(); it != chains_.end();) {
    auto h = it->second.holders.find(rack);
    if (h != it->second.holders.end()) {
      stats_.blocks -= h->second.count;
      it->second.holders.erase(h);
    }
    if (it->second.holders.empty()) {
      lru_.erase(it->second.lru);
      it = chains_.erase(it);
    } else {
      ++it;
    }
  }
}

void ChainDirectory::Apply(const std::string& holder, const LinkAnnounce& batch) {
  std::lock_guard lock(mu_);
  auto [known, fresh] = newest_life_.try_emplace(holder, HolderLife{batch.life, false});
  HolderLife& life = known->second;
  if (!fresh && (batch.life < life.life || (batch.life == life.life && life.ended))) {
    ++stats_.stale_batches;
    return;
  }
  if (!fresh && batch.life > life.life) {
    ForgetLocked(holder);  // the old life's blocks: re-announced by the new one, or gone
    life = {batch.life, false};
  }
  for (const AnnouncedBlock& a : batch.blocks) {
    if (a.index >= kMaxChainBlocks || (a.index == 0 && !(a.key == a.chain))) {
      ++stats_.malformed;
      continue;
    }
    auto it = chains_.find(a.chain);
    if (it == chains_.end()) {
      if (a.op == AnnounceOp::kEvicted) continue;  // nothing known to forget
      it = chains_.emplace(a.chain, Chain{}).first;
      it->second.lru = lru_.insert(lru_.end(), a.chain);
    } else {
      lru_.splice(lru_.end(), lru_, it->second.lru);
    }
    Held& held = it->second.holders[holder];
    held.life = batch.life;
    if (a.op == AnnounceOp::kPublished) {
      if (held.keys.size() <= a.index) {
        held.keys.resize(a.index + 1);
        held.present.resize(a.index + 1, false);
      }
      if (!held.present[a.index]) ++held.count, ++stats_.blocks;
      held.keys[a.index] = a.key;
      held.present[a.index] = true;
    } else if (a.index < held.present.size() && held.present[a.index] && held.keys[a.index] == a.key) {
      held.present[a.index] = false;
      --held.count, --stats_.blocks;
    }
    if (held.count == 0) it->second.holders.erase(holder);
    if (it->second.holders.empty()) DropChain(it);
  }
  while (stats_.blocks > max_blocks_ && !lru_.empty()) {
    DropChain(chains_.find(lru_.front()));
    ++stats_.dropped_for_space;
  }
}

LinkLookupAnswer ChainDirectory::Lookup(const std::vector<BlockKey>& keys) const {
  LinkLookupAnswer answer;
  if (keys.empty()) return answer;
  std::lock_guard lock(mu_);
  auto it = chains_.find(keys[0]);
  if (it == chains_.end()) return answer;
  for (const auto& [rack, held] : it->second.holders) {
    uint32_t n = 0;
    while (n < keys.size() && n < held.present.size() && held.present[n] && held.keys[n] == keys[n]) ++n;
    if (n > 0) answer.holders.push_back({rack, held.life, n});
  }
  std::sort(answer.holders.begin(), answer.holders.end(), [](const ChainHolder& a, const ChainHolder& b) {
    return a.blocks != b.blocks ? a.blocks > b.blocks : a.rack < b.rack;
  });
  if (answer.holders.size() > kLinkMaxHolders) answer.holders.resize(kLinkMaxHolders);
  return answer;
}

void ChainDirectory::Forget(const std::string& rack) {
  std::lock_guard lock(mu_);
  ForgetLocked(rack);
  // Its life stays known as ended: a late batch of it is refused, a new life is welcome.
  if (auto it = newest_life_.find(rack); it != newest_life_.end()) it->second.ended = true;
}

size_t ChainDirectory::Retain(const std::function<bool(const BlockKey& chain)>& keep) {
  std::lock_guard lock(mu_);
  size_t dropped = 0;
  for (auto it = chains_.begin(); it != chains_.end();) {
    auto next = std::next(it);
    if (!keep(it->first)) {
      DropChain(it);
      ++dropped;
    }
    it = next;
  }
  return dropped;
}

ChainDirectoryStats ChainDirectory::stats() const {
  std::lock_guard lock(mu_);
  ChainDirectoryStats s = stats_;
  s.chains = chains_.size();
  return s;
}

}  // namespace cxlkv::rack
