// BlockOwners (block_owners.h): per engine block, the requests holding it.
#include "kvstore/block_owners.h"

#include <algorithm>
#include <string>

namespace cxlkv::kvstore {

bool BlockOwners::tracking() const {
  std::lock_guard<std::mutex> lock(mu_);
  return tracking_;
}

const BlockOwners::Holder* BlockOwners::Find(uint32_t block, BlockOwner owner) const {
  for (const Holder& h : holders_[block]) {
    if (h.owner == owner) return &h;
  }
  return nullptr;
}

Status BlockOwners::Assign(BlockOwner owner, std::span<const uint32_t> block_ids) {
  if (owner == kAnyOwner) return InvalidArgument("assign blocks: owner 0 is reserved (untracked calls)");
  std::lock_guard<std::mutex> lock(mu_);
  for (uint32_t b : block_ids) {
    if (b >= holders_.size()) {
      return InvalidArgument("assign blocks: block id " + std::to_string(b) + " is out of range (the engine has " +
                             std::to_string(holders_.size()) + " blocks)");
    }
  }
  tracking_ = true;
  std::vector<uint32_t>& mine = by_owner_[owner];
  for (uint32_t b : block_ids) {
    if (Find(b, owner) != nullptr) continue;
    holders_[b].push_back({owner, next_serial_++});
    mine.push_back(b);
  }
  return Status::Ok();
}

void BlockOwners::WaitLoads(BlockOwner owner, const std::vector<bool>* blocks) {
  std::vector<std::shared_ptr<transfer::LayerLoad>> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [ticket, l] : loads_) {
      if (l.owner != owner || !l.load) continue;
      const bool touches = blocks == nullptr || std::any_of(l.blocks.begin(), l.blocks.end(), [&](uint32_t b) {
                             return b < blocks->size() && (*blocks)[b];
                           });
      if (touches) pending.push_back(l.load);
    }
  }
  // Outside the lock: the copy thread never takes it, and the shared_ptr keeps each load alive.
  for (auto& load : pending) load->Wait();
}

size_t BlockOwners::Release(BlockOwner owner, std::span<const uint32_t> block_ids) {
  std::vector<bool> wanted(holders_.size(), false);
  for (uint32_t b : block_ids) {
    if (b < wanted.size()) wanted[b] = true;
  }
  WaitLoads(owner, &wanted);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_owner_.find(owner);
  if (it == by_owner_.end()) return 0;
  size_t released = 0;
  for (uint32_t b : block_ids) {
    if (b >= holders_.size()) continue;
    auto& hs = holders_[b];
    auto h = std::find_if(hs.begin(), hs.end(), [&](const Holder& x) { return x.owner == owner; });
    if (h == hs.end()) continue;
    hs.erase(h);
    ++released;
  }
  std::erase_if(it->second, [&](uint32_t b) { return Find(b, owner) == nullptr; });
  if (it->second.empty()) by_owner_.erase(it);
  return released;
}

size_t BlockOwners::ReleaseAll(BlockOwner owner) {
  WaitLoads(owner, nullptr);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_owner_.find(owner);
  if (it == by_owner_.end()) return 0;
  size_t released = 0;
  for (uint32_t b : it->second) {
    auto& hs = holders_[b];
    released += std::erase_if(hs, [&](const Holder& x) { return x.owner == owner; });
  }
  by_owner_.erase(it);
  return released;
}

Result<std::vector<HeldBlock>> BlockOwners::Check(const char* what, BlockOwner owner,
                                                  std::span<const uint32_t> block_ids) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<HeldBlock> held;
  if (!tracking_) return held;
  if (owner == kAnyOwner) {
    return InvalidArgument(std::string(what) +
                           ": this store tracks which request holds each block (AssignBlocks): name the request");
  }
  held.reserve(block_ids.size());
  for (uint32_t b : block_ids) {
    const Holder* h = b < holders_.size() ? Find(b, owner) : nullptr;
    if (h == nullptr) {
      return InvalidArgument(std::string(what) + ": engine block " + std::to_string(b) +
                             " is not held by this request (never assigned to it, or given up since): nothing "
                             "moved, so no other request's KV is published or overwritten");
    }
    held.push_back({b, h->serial});
  }
  return held;
}

Status BlockOwners::StillHeld(const char* what, BlockOwner owner, std::span<const HeldBlock> held) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const HeldBlock& x : held) {
    const Holder* h = Find(x.block, owner);
    if (h == nullptr || h->serial != x.serial) {
      return InvalidArgument(std::string(what) + ": engine block " + std::to_string(x.block) +
                             " was given up by its request while it was being saved: nothing published");
    }
  }
  return Status::Ok();
}

uint64_t BlockOwners::AddLoad(BlockOwner owner, std::span<const uint32_t> block_ids,
                              std::shared_ptr<transfer::LayerLoad> load) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t ticket = next_ticket_++;
  loads_.emplace(ticket, Load{owner, {block_ids.begin(), block_ids.end()}, std::move(load)});
  return ticket;
}

void BlockOwners::Forget(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  loads_.erase(ticket);
}

}  // namespace cxlkv::kvstore
