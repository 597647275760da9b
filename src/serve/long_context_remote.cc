#include "serve/long_context_remote.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "transfer/transfer.h"
#include "util/units.h"

namespace cxlkv::serve {

namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

// The region for `blocks` of `block_bytes`: the payload with room to spare (the allocator's
// rounding, the cache's watermarks: eviction starts at 95% of the data) and the pool's own
// metadata (index, locks, RPC rings), rounded to its 2 MiB chunks.
uint64_t RegionBytesFor(uint64_t blocks, uint64_t block_bytes) {
  const uint64_t payload = blocks * block_bytes;
  const uint64_t bytes = payload + payload / 4 + 128 * kMiB;
  return (bytes + kDefaultChunkBytes - 1) / kDefaultChunkBytes * kDefaultChunkBytes;
}

}  // namespace

Result<std::unique_ptr<RemoteLongContext>> RemoteLongContext::Create(const std::string& region_path,
                                                                     const engine::ModelConfig& config,
                                                                     const engine::PagedKvCache& cache,
                                                                     std::span<const uint32_t> table,
                                                                     std::span<const int32_t> tokens,
                                                                     uint32_t threads, uint64_t region_bytes) {
  std::unique_ptr<RemoteLongContext> r(new RemoteLongContext());
  const uint32_t bs = cache.block_size();
  const uint64_t full_blocks = tokens.size() / bs;
  if (full_blocks > table.size()) {
    return InvalidArgument("the remote context's block table holds " + std::to_string(table.size()) +
                           " blocks, fewer than its " + std::to_string(full_blocks) + " full blocks");
  }
  const EngineKvLayout layout = cache.Layout();  // pool block format 1, what the service reads
  const uint64_t block_bytes = layout.PoolBlockBytes();
  r->block_size_ = bs;
  const uint64_t payload = full_blocks * block_bytes;
  r->region_bytes_ = region_bytes != 0 ? region_bytes : RegionBytesFor(full_blocks, block_bytes);
  if (r->region_bytes_ < payload) {
    return NoSpace("a remote context's pool of " + util::FormatBytes(r->region_bytes_) + " cannot hold its " +
                   util::FormatBytes(payload) + " of KV: give it " + util::FormatBytes(RegionBytesFor(full_blocks, block_bytes)) +
                   " (0 sizes it), or pass shorter contexts");
  }
  PoolCreateOptions co;
  co.size = r->region_bytes_;
  co.max_nodes = 4;
  co.overwrite = true;
  if (Status created = Pool::Create({region_path}, co); !created.ok()) {
    return Status(created.code(), "the remote context's pool of " + util::FormatBytes(r->region_bytes_) + " at " +
                                      region_path + ": " + created.message() +
                                      " (pass shorter contexts, or a path with room)");
  }
  r->path_ = region_path;  // ours to remove from here on
  CXLKV_ASSIGN_OR_RETURN(r->pool_, Pool::Open({region_path}, PoolOpenOptions{}));
  CXLKV_ASSIGN_OR_RETURN(KvCache * kv, r->pool_->Cache());
  r->ns_.model_id = config.name.empty() ? "longctx" : config.name;
  r->ns_.layout = layout.Signature();
  CXLKV_ASSIGN_OR_RETURN(NamespaceHandle handle, kv->Namespace(r->ns_));
  r->keys_ = KvCache::ChainKeys(handle, tokens.first(full_blocks * bs));
  // The engine's blocks into the pool as the serving path stores them, a batch at a time.
  transfer::CpuTransfer transfer(*kv);
  constexpr uint64_t kBatch = 4096;
  for (uint64_t b = 0; b < full_blocks; b += kBatch) {
    const uint64_t n = std::min(kBatch, full_blocks - b);
    auto put = transfer.GatherWrite(handle, layout, table.subspan(b, n), std::span(r->keys_).subspan(b, n));
    if (!put.ok()) {
      return Status(put.status().code(), "putting blocks " + std::to_string(b) + ".." + std::to_string(b + n) +
                                             " of " + std::to_string(full_blocks) +
                                             " of the remote context into its pool: " + put.status().message());
    }
  }
  daemon::NearMemoryServiceOptions so;
  so.threads = threads;
  CXLKV_ASSIGN_OR_RETURN(r->service_, daemon::NearMemoryService::Start(*r->pool_, so));
  if (!r->service_->server().WaitServing(std::chrono::seconds(10))) {
    return Unavailable("the near-memory service over the remote context's pool did not start serving in 10 s");
  }
  CXLKV_ASSIGN_OR_RETURN(r->client_, pnm::NearMemoryClient::Open(*r->pool_, PoolOpenOptions{}.node_id));
  // Everything that uses the region has it mapped: its name can go now, so a run killed or
  // interrupted leaves no gigabytes behind in /dev/shm (the memory is freed at the last unmap).
  r->RemoveRegionFile();
  return r;
}

void RemoteLongContext::RemoveRegionFile() {
  struct stat st {};
  // Only a file this object created: a device (a DAX path) is never unlinked.
  if (!path_.empty() && ::lstat(path_.c_str(), &st) == 0 && S_ISREG(st.st_mode)) ::unlink(path_.c_str());
  path_.clear();
}

RemoteLongContext::~RemoteLongContext() {
  client_.reset();
  service_.reset();  // releases its contexts' pins while the pool is open
  pool_.reset();
  RemoveRegionFile();  // a Create that failed half way
}

Result<std::unique_ptr<engine::RemoteDecodeAttention>> RemoteLongContext::Attention(const engine::ModelConfig& config,
                                                                                    uint32_t budget_tokens,
                                                                                    uint32_t held_pages) {
  engine::RemoteAttentionOptions o;
  o.budget_tokens = budget_tokens;
  o.held_pages = held_pages;
  CXLKV_ASSIGN_OR_RETURN(KvCache * kv, pool_->Cache());
  return engine::RemoteDecodeAttention::Create(config, block_size_, *client_, ns_, o, kv);
}

}  // namespace cxlkv::serve
