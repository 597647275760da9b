// The engine-keyed batch API (issue 16): what a serving engine's connector calls.
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
// Built on the batched index operations (ReserveMany/CommitMany, one stripe lock per stripe
// touched) and the transfer engine's gather-write / scatter-read.
//
// Thread-safety: one store's calls are serialized (its copy workers are its own); stores of
// different engines (or ranks) may run concurrently over one cache.
#ifndef CXLKV_KV_STORE_H_
#define CXLKV_KV_STORE_H_

#include <cstdint>
#include <memory>
#include <span>

#include "cxlkv/cache.h"
#include "cxlkv/layout.h"
#include "cxlkv/status.h"

namespace cxlkv {

struct PutManyResult {
  uint64_t written = 0;  // blocks copied and published by this call
  uint64_t skipped = 0;  // READY already, or being written by another writer: not copied
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
  ~EngineKvStore();
  EngineKvStore(const EngineKvStore&) = delete;
  EngineKvStore& operator=(const EngineKvStore&) = delete;

  const EngineKvLayout& layout() const;
  const NamespaceHandle& ns() const;

  // How many leading keys the pool holds (READY, capacity tiers included), without a pin or a
  // write: a scheduler's question. May be stale at once.
  Result<size_t> ExistsPrefix(std::span<const BlockKey> keys);

  // Engine blocks block_ids[i] → the pool under keys[i]. Keys already cached (or being written
  // elsewhere) are skipped and counted. Errors (nothing of this call published): kInvalidArgument
  // (sizes differ, a block id out of range), the cache's reserve errors (kNoSpace...).
  Result<PutManyResult> PutMany(std::span<const BlockKey> keys, std::span<const uint32_t> block_ids);

  // The longest cached prefix of `keys` → engine blocks block_ids[0..n); returns n. Blocks on
  // capacity tiers are brought in first. Engine blocks past n are untouched. Errors (engine
  // untouched): kInvalidArgument (sizes differ, a block id out of range or repeated), a pool
  // block of another size (layout signature mismatch), the cache's lookup errors.
  Result<size_t> GetManyInto(std::span<const BlockKey> keys, std::span<const uint32_t> block_ids);

 private:
  explicit EngineKvStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace cxlkv

#endif  // CXLKV_KV_STORE_H_
