// A pool: one or more regions (CXL devices) used together — node membership, two-tier locks,
// the chunk allocator with per-node heaps (chunks interleaved across regions), and named roots.
//
//   cxlkv::Pool::Create({"/dev/shm/a", "/dev/shm/b"}, {.size = 1ull << 30});
//   auto pool = cxlkv::Pool::Open({"/dev/shm/a", "/dev/shm/b"}, {.node_id = 0});
//   auto off = (*pool)->Alloc(4096);           // an offset: valid in every process and host
//   (*pool)->Put("model/blocks", *off, 4096);   // publish it by name
//
// Thread-safety: all methods are thread-safe. One Pool per process and node id.
#ifndef CXLKV_POOL_H_
#define CXLKV_POOL_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cxlkv/cache.h"
#include "cxlkv/region.h"
#include "cxlkv/status.h"

namespace cxlkv {

// Who writes the prefix index (DESIGN.md; docs/metadata.md).
enum class MetadataMode : uint32_t {
  kDecentralized = 0,  // TraCT: every node updates the index in the region under stripe locks
  kCentral = 1,        // Beluga: one metadata service (a cxlkvd, or a serving process standing
                       // in) writes it; the others ask over the shared-memory RPC
};
const char* MetadataModeName(MetadataMode mode);

struct PoolCreateOptions {
  uint64_t size = 0;            // bytes per region; required for files
  uint32_t max_nodes = 16;      // default 16
  uint32_t max_locks = 256;     // global locks, 3 of them internal. Default 256.
  uint32_t max_roots = 1024;    // named roots. Default 1024.
  int numa_node = -1;           // default: not bound
  bool overwrite = false;       // default false
  uint64_t chunk_bytes = kDefaultChunkBytes;  // default 2 MiB
  // The prefix KV cache's index (in the first region).
  bool index = true;                // default: the pool has a prefix index
  uint64_t index_entries = 0;       // slots; 0: one per 16 KiB of data (1 Ki .. 4 Mi)
  uint32_t index_stripes = 0;       // lock stripes; 0: up to 32
  uint64_t cache_capacity = 0;      // payload budget of the cache; 0: all data
  uint32_t high_watermark_pct = 95; // eviction starts above this share of the capacity...
  uint32_t low_watermark_pct = 85;  // ...and stops below this one
  bool checksum = false;            // keep and verify an xxh3 checksum per block
  MetadataMode metadata = MetadataMode::kDecentralized;  // default decentralized
};

struct PoolOpenOptions {
  uint32_t node_id = 0;               // this process's node; processes of one host share one
  uint32_t lease_ms = 2000;           // liveness lease. Default 2 s.
  bool may_host_manager = true;       // default true
  bool recovers = true;               // false: never recover other nodes' lives here (a short-lived
                                      // client such as one CLI command). Default true.
  bool prefault = true;               // map every page at open (RegionAttachOptions::prefault);
                                      // a one-shot CLI command turns it off. Default true.
  RegionAttachOptions attach;         // coherence mode, simulator seed
};

struct PoolRoot {
  std::string name;
  uint64_t offset = 0;
  uint64_t size = 0;
};

class Pool {
 public:
  class Impl;

  // Formats every region: the first holds the node table, locks, rings and roots; all hold a
  // chunk table and data.
  static Status Create(const std::vector<std::string>& paths, const PoolCreateOptions& options);
  static Result<std::unique_ptr<Pool>> Open(const std::vector<std::string>& paths,
                                            const PoolOpenOptions& options);
  explicit Pool(std::unique_ptr<Impl> impl);
  ~Pool();

  Result<uint64_t> Alloc(uint64_t bytes);
  Status Free(uint64_t offset);
  uint8_t* Ptr(uint64_t offset, uint64_t bytes);

  Status Put(std::string_view name, uint64_t offset, uint64_t size);
  Result<PoolRoot> Get(std::string_view name);
  Status Destroy(std::string_view name);

  Result<uint32_t> AllocateLock();
  Status FreeLock(uint32_t lock);
  Status Lock(uint32_t lock, uint32_t timeout_ms);
  void Unlock(uint32_t lock);

  // The prefix KV cache. Errors: kNotFound (the pool was created without an index),
  // kNotSupported (central metadata, and this program lacks the metadata client library).
  Result<KvCache*> Cache();
  // Who writes the index (kDecentralized when the pool has none).
  MetadataMode metadata() const;

  // Every region's mapping in this process, for registering with a DMA engine (a GPU's
  // cudaHostRegister): payload pointers of the cache fall inside these ranges.
  std::vector<std::span<uint8_t>> MappedRanges();

  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace cxlkv

#endif  // CXLKV_POOL_H_
