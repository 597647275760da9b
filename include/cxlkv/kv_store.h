// The engine-keyed batch API: what a serving engine's connector calls.
//
// An engine registers its paged KV tensors once (one base pointer per layer, in one of the
// layouts of cxlkv/layout.h); later calls name engine *block ids*, never pointers. Keys are
// the engine's own block hashes folded into the namespace (KvCache::KeyFromEngineHash: vLLM's
// chained sha256/xxhash digests, SGLang's page hashes) or cxlkv's chained keys
// (KvCache::ChainKeys). The namespace carries model, layout, TP rank/size, PP stage and extra
// key, so the same engine hash under two TP ranks names two different blocks.
//
//   auto store = EngineKvStore::Register(cache, ns, layout);        // once, after allocating
//   size_t n = *(*store)->ExistsPrefix(keys);                        // scheduler: no pins
//   (*store)->PutMany(keys, block_ids);                              // skips cached blocks
//   size_t got = *(*store)->GetManyInto(keys, block_ids);            // the longest prefix
//
// StartGetManyInto / StartPutMany do the same layer by layer, so an engine computes layer l
// while layer l+1 moves (vLLM's wait_for_layer_load / save_kv_layer).
//
// Built on the batched index operations (ReserveMany/CommitMany, one stripe lock per stripe
// touched) and the transfer engine's gather-write / scatter-read.
//
// Thread-safety: one store's calls are serialized (its copy workers are its own); stores of
// different engines (or ranks) may run concurrently over one cache. A store must outlive the
// loads and saves it started.
#ifndef CXLKV_KV_STORE_H_
#define CXLKV_KV_STORE_H_

#include <cstdint>
#include <memory>
#include <span>

#include "cxlkv/cache.h"
#include "cxlkv/layout.h"
#include "cxlkv/pool.h"
#include "cxlkv/status.h"

namespace cxlkv {

// The engine request a load or save is for, as the engine names it to the store (any nonzero
// number; the Python adapters count requests). kAnyOwner: an untracked call.
using BlockOwner = uint64_t;
inline constexpr BlockOwner kAnyOwner = 0;

struct PutManyResult {
  uint64_t written = 0;  // blocks copied and published by this call
  uint64_t skipped = 0;  // READY already, or being written by another writer: not copied
};

// A layer-wise load in flight (EngineKvStore::StartGetManyInto): the hit's blocks are pinned
// until it is destroyed, which waits for the copy first (it writes into the engine's tensors).
class EngineKvLoad {
 public:
  class Impl;
  ~EngineKvLoad();
  EngineKvLoad(const EngineKvLoad&) = delete;
  EngineKvLoad& operator=(const EngineKvLoad&) = delete;
  // Blocks being loaded: the longest cached prefix of the keys when the load started.
  size_t blocks() const;
  // Blocks until layer `layer` of every loaded block is in the engine's tensors (layer 0
  // arrives first, so an engine computes layer l while layer l+1 moves). A layer past the last
  // returns at once.
  void WaitLayer(uint32_t layer) const;
  void Wait() const;

 private:
  friend class EngineKvStore;
  explicit EngineKvLoad(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A layer-wise save in flight (EngineKvStore::StartPutMany): the blocks are reserved (cached
// keys skipped); each layer is copied as soon as the engine reports it written, and Finish
// publishes them. Destroyed without Finish, it aborts the reservations: nothing is published.
class EngineKvSave {
 public:
  class Impl;
  ~EngineKvSave();
  EngineKvSave(const EngineKvSave&) = delete;
  EngineKvSave& operator=(const EngineKvSave&) = delete;
  // The engine has written `layer` of every block: copy it now. Errors: kInvalidArgument
  // (layer out of range or reported twice).
  Status LayerComputed(uint32_t layer);
  // Waits for every layer (all must have been reported) and publishes the blocks. Errors:
  // kInvalidArgument (a layer never reported: nothing published), the cache's commit errors
  // (kLeaseExpired: this node was paused past its lease; nothing published).
  Result<PutManyResult> Finish();

 private:
  friend class EngineKvStore;
  explicit EngineKvSave(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class EngineKvStore {
 public:
  class Impl;

  // Registers `layout`'s tensors (its `layers` pointers stay owned by the engine and must stay
  // allocated while the store lives) for namespace `ns`. `copy_threads` copy workers,
  // the caller included (default 1). Errors: kInvalidArgument (the layout's own errors, a
  // namespace registered with another block size, copy_threads == 0 or above 64).
  static Result<std::unique_ptr<EngineKvStore>> Register(KvCache& cache, const NamespaceHandle& ns,
                                                         const EngineKvLayout& layout, uint32_t copy_threads = 1);
  // The same for tensors in GPU memory (`layout.layers` are device pointers of CUDA device
  // `cuda_device`): copies run as one kernel per request through the CUDA transfer path, with
  // the pool's regions registered with the device (hence the Pool). Layer-wise calls complete
  // whole at start (loads) or at Finish (saves). Errors: kNotSupported (built without CUDA, or
  // no usable CUDA device: the message says which), Register's kInvalidArgument, kIoError.
  static Result<std::unique_ptr<EngineKvStore>> RegisterDevice(Pool& pool, const NamespaceHandle& ns,
                                                               const EngineKvLayout& layout, int cuda_device);
  // Whether this build has the CUDA transfer path (RegisterDevice may work where a GPU is).
  static bool DeviceBuilt();

  ~EngineKvStore();
  EngineKvStore(const EngineKvStore&) = delete;
  EngineKvStore& operator=(const EngineKvStore&) = delete;

  const EngineKvLayout& layout() const;
  const NamespaceHandle& ns() const;

  // Block ownership (src/kvstore/block_owners.h). An engine that tells the store which request
  // holds which blocks gets a checked invariant: nothing is published from, or loaded into, a
  // block its request does not hold. From the first AssignBlocks on, every load and save must
  // name its request (`owner`); one naming a block the request does not hold is refused whole
  // (kInvalidArgument, nothing moved), and a save publishes only if each of its blocks stayed
  // held by the same assignment until its copies were done. Stores never told keep the
  // untracked behaviour (owner kAnyOwner).
  //
  // `owner` now holds these blocks (a block may have several holders: shared prefixes).
  Status AssignBlocks(BlockOwner owner, std::span<const uint32_t> block_ids);
  // `owner` gives these blocks up (freed, or the request preempted), before the engine hands
  // them to another request: waits for the owner's loads into them first. Returns how many of
  // them it held.
  size_t ReleaseBlocks(BlockOwner owner, std::span<const uint32_t> block_ids);
  // The same for every block `owner` holds.
  size_t ReleaseOwner(BlockOwner owner);

  // How many leading keys the pool holds (READY, capacity tiers included), without a pin or a
  // write: a scheduler's question. May be stale at once.
  Result<size_t> ExistsPrefix(std::span<const BlockKey> keys);

  // Engine blocks block_ids[i] → the pool under keys[i]. Keys already cached (or being written
  // elsewhere) are skipped and counted. Errors (nothing of this call published): kInvalidArgument
  // (sizes differ, a block id out of range), the cache's reserve errors (kNoSpace...).
  Result<PutManyResult> PutMany(std::span<const BlockKey> keys, std::span<const uint32_t> block_ids,
                                 BlockOwner owner = kAnyOwner);

  // The longest cached prefix of `keys` → engine blocks block_ids[0..n); returns n. Blocks on
  // capacity tiers are brought in first. Engine blocks past n are untouched. Errors (engine
  // untouched): kInvalidArgument (sizes differ, a block id out of range or repeated), a pool
  // block of another size (layout signature mismatch), the cache's lookup errors.
  Result<size_t> GetManyInto(std::span<const BlockKey> keys, std::span<const uint32_t> block_ids,
                                 BlockOwner owner = kAnyOwner);

  // GetManyInto, layer by layer on the store's copy thread: returns once the prefix is pinned
  // and the copy queued. The engine waits per layer (EngineKvLoad::WaitLayer) before reading it.
  // Errors: as GetManyInto's, before anything is queued.
  Result<std::unique_ptr<EngineKvLoad>> StartGetManyInto(std::span<const BlockKey> keys,
                                                         std::span<const uint32_t> block_ids,
                                                         BlockOwner owner = kAnyOwner);
  // PutMany, layer by layer: reserves now, copies each layer when reported. Errors: as
  // PutMany's, before anything is reserved.
  Result<std::unique_ptr<EngineKvSave>> StartPutMany(std::span<const BlockKey> keys,
                                                     std::span<const uint32_t> block_ids,
                                                     BlockOwner owner = kAnyOwner);

 private:
  explicit EngineKvStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace cxlkv

#endif  // CXLKV_KV_STORE_H_
