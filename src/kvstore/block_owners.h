// Which engine request holds which engine blocks, for one EngineKvStore (include/cxlkv/kv_store.h).
//
// A serving engine hands a block to a request, and takes it back when the request finishes or is
// preempted; a freed block is soon another request's. A save that pairs a request's block hashes
// with a block the request no longer holds would publish another request's KV under those hashes
// into a pool every host reads; a load into such a block would overwrite another request's KV.
// BlockOwners makes both impossible: every load and save names its request, every block it
// touches must be held by that request when it starts, and a save publishes only if each of its
// blocks is still held by the same assignment once its copies are done (so the bytes it copied
// were the request's throughout).
//
// A block may have several holders at once: engines share full blocks between requests with the
// same prefix (vLLM's prefix caching), and their contents agree.
//
// Thread-safety: every method may be called from any thread.
#ifndef CXLKV_KVSTORE_BLOCK_OWNERS_H_
#define CXLKV_KVSTORE_BLOCK_OWNERS_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "cxlkv/kv_store.h"
#include "cxlkv/status.h"
#include "transfer/transfer.h"

namespace cxlkv::kvstore {

// One (block, assignment serial) a load or save checked at its start.
struct HeldBlock {
  uint32_t block = 0;
  uint64_t serial = 0;
};

class BlockOwners {
 public:
  explicit BlockOwners(uint32_t num_blocks) : holders_(num_blocks) {}

  // Whether any block was ever assigned: from then on every load and save must name its owner.
  bool tracking() const;

  // `owner` now holds these blocks (again: a repeated assignment keeps the first). Errors:
  // kInvalidArgument (owner kAnyOwner, a block id out of range): nothing assigned.
  Status Assign(BlockOwner owner, std::span<const uint32_t> block_ids);
  // `owner` gives these blocks up: first waits for its loads into them, which write the
  // engine's memory. Returns how many of them it held.
  size_t Release(BlockOwner owner, std::span<const uint32_t> block_ids);
  // The same for every block `owner` holds (a request finished or preempted).
  size_t ReleaseAll(BlockOwner owner);

  // Checks that `owner` holds every block (or, while nothing is tracked, that owner is
  // kAnyOwner or anything) and returns the assignments seen. Errors: kInvalidArgument naming
  // the first block it does not hold, or an untracked call on a tracking store.
  Result<std::vector<HeldBlock>> Check(const char* what, BlockOwner owner, std::span<const uint32_t> block_ids) const;
  // Whether every block is still held by the assignment Check saw. Errors: kInvalidArgument
  // naming the block given up or handed on since.
  Status StillHeld(const char* what, BlockOwner owner, std::span<const HeldBlock> held) const;

  // A load in flight into `block_ids` for `owner`: Release of any of them waits for it.
  // Returns a ticket for Forget.
  uint64_t AddLoad(BlockOwner owner, std::span<const uint32_t> block_ids, std::shared_ptr<transfer::LayerLoad> load);
  void Forget(uint64_t ticket);

 private:
  struct Holder {
    BlockOwner owner;
    uint64_t serial;
  };
  struct Load {
    BlockOwner owner;
    std::vector<uint32_t> blocks;
    std::shared_ptr<transfer::LayerLoad> load;
  };
  const Holder* Find(uint32_t block, BlockOwner owner) const;  // REQUIRES: mu_
  // Waits for `owner`'s loads that write any of `blocks` (all of its loads when null).
  void WaitLoads(BlockOwner owner, const std::vector<bool>* blocks);

  mutable std::mutex mu_;
  bool tracking_ = false;
  uint64_t next_serial_ = 1;
  std::vector<std::vector<Holder>> holders_;                      // per engine block
  std::unordered_map<BlockOwner, std::vector<uint32_t>> by_owner_;  // what each owner holds
  uint64_t next_ticket_ = 1;
  std::unordered_map<uint64_t, Load> loads_;
};

}  // namespace cxlkv::kvstore

#endif  // CXLKV_KVSTORE_BLOCK_OWNERS_H_
