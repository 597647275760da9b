// The long-context scenario's remote rows (serve/long_context.h): the context's KV put into a
// pool region, a near-memory service over that pool (cxlkvd's, in this process's threads), and
// the engine decoding through it with RemoteDecodeAttention — queries, outputs and LSEs over the
// pool's RPC rings, the engine's decoded tokens attended by itself and merged by LSE. So the
// rows show what the daemon path costs next to the same attention run in the engine's process.
//
// Thread-safety: one thread at a time.
#ifndef CXLKV_SRC_SERVE_LONG_CONTEXT_REMOTE_H_
#define CXLKV_SRC_SERVE_LONG_CONTEXT_REMOTE_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cxlkv/cache.h"
#include "cxlkv/pool.h"
#include "cxlkv/status.h"
#include "daemon/pnm_service.h"
#include "engine/config.h"
#include "engine/kv_cache.h"
#include "engine/remote_attention.h"
#include "pnm/remote.h"

namespace cxlkv::serve {

class RemoteLongContext {
 public:
  // Creates a pool at `region_path` (replacing a file there) of `region_bytes`, or (0) big
  // enough for the context's full blocks, puts those blocks into it — `tokens` name them,
  // `cache` and `table` hold their KV — and starts a near-memory service with `threads` workers
  // over it. The region's file is removed once everything has it mapped.
  // Errors: kNoSpace (naming the bytes) when `region_bytes` cannot hold the KV or the region
  // cannot be created or filled; the pool's and the service's errors.
  static Result<std::unique_ptr<RemoteLongContext>> Create(const std::string& region_path,
                                                           const engine::ModelConfig& config,
                                                           const engine::PagedKvCache& cache,
                                                           std::span<const uint32_t> table,
                                                           std::span<const int32_t> tokens,
                                                           uint32_t threads, uint64_t region_bytes = 0);
  // Stops the service and closes the pool (its memory goes with the last mapping).
  ~RemoteLongContext();
  RemoteLongContext(const RemoteLongContext&) = delete;
  RemoteLongContext& operator=(const RemoteLongContext&) = delete;

  // An attention over the context at the service: budget 0 attends every page there; held_pages
  // (with a budget) makes it the hybrid. Not yet opened: Open(keys()). It uses this object's
  // client and pool: it must not outlive this object.
  Result<std::unique_ptr<engine::RemoteDecodeAttention>> Attention(const engine::ModelConfig& config,
                                                                   uint32_t budget_tokens,
                                                                   uint32_t held_pages);
  const std::vector<BlockKey>& keys() const { return keys_; }
  uint64_t region_bytes() const { return region_bytes_; }

 private:
  RemoteLongContext() = default;
  void RemoveRegionFile();

  std::string path_;
  uint64_t region_bytes_ = 0;
  uint32_t block_size_ = 0;
  std::unique_ptr<Pool> pool_;
  std::unique_ptr<daemon::NearMemoryService> service_;
  std::unique_ptr<pnm::NearMemoryClient> client_;
  KeyNamespace ns_;
  std::vector<BlockKey> keys_;
};

}  // namespace cxlkv::serve

#endif  // CXLKV_SRC_SERVE_LONG_CONTEXT_REMOTE_H_
