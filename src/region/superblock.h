// The superblock: the first 4 KiB of every region. Written once by `init` and never modified,
// so it needs no lock: attaching invalidates its lines and validates it before trusting a byte.
//
// Layout version history (kLayoutVersion in cxlkv/region.h):
//   1  superblock + node table + data area.
//   2  areas carry a parameter; lock array, chunk table, object store (sync/alloc/objstore).
//   3  prefix index area (cache layer); the lock array also holds the index's stripe locks.
//   4  node lines publish one life word; manager line one holder word; per-node lock doorbells;
//      pool identity: pool id (random 128-bit at pool creation), this region's index in the
//      pool and the pool's region count, so a foreign or reordered region is refused.
//   5  remote-free rings: the closed word on a line of its own (the entries one line later).
//   6  allocator intent op 5 (end a lease line), which a version-5 build would call corrupt.
//   7  slabs: heap headers in the chunk table (a line per chunk), slabs of several chunks
//      (owner-word kind 7 for their tails), slots of exact sizes (detail: slot bytes / 64).
#ifndef CXLKV_SRC_REGION_SUPERBLOCK_H_
#define CXLKV_SRC_REGION_SUPERBLOCK_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "cxlkv/region.h"
#include "cxlkv/status.h"

namespace cxlkv::region {

// "CXLKVRGN" read as a little-endian word.
inline constexpr uint64_t kRegionMagic = 0x4e4752564b4c5843ull;
inline constexpr uint64_t kSuperblockBytes = 4096;
inline constexpr uint32_t kMaxAreas = 16;
inline constexpr uint64_t kNodeLineBytes = 64;

// Areas, in the order they are laid out. Values are stored in the region: never renumber.
enum class AreaKind : uint32_t {
  kNone = 0,
  kNodeTable = 1,    // one 64-byte line per node, written only by that node
  kLockArray = 2,    // (sync layer) global lock slots
  kChunkTable = 3,   // (alloc layer) chunk bitmap + owner table
  kObjectStore = 4,  // (objstore layer) named roots
  kIndex = 5,        // (cache layer) prefix index
  kData = 6,         // chunks of payload
};
std::string_view AreaKindName(AreaKind kind);

struct AreaDesc {
  uint32_t kind;      // AreaKind
  uint32_t reserved0;
  uint64_t offset;    // from the region's start; 4 KiB aligned (the data area: chunk aligned)
  uint64_t size;
  uint64_t param;     // what the owning layer sized it by (locks, chunks, roots)
};
static_assert(sizeof(AreaDesc) == 32);
static_assert(std::is_standard_layout_v<AreaDesc> && std::is_trivially_copyable_v<AreaDesc>);

struct Superblock {
  uint64_t magic;             // kRegionMagic
  uint32_t layout_version;    // kLayoutVersion of the build that formatted it
  uint32_t header_bytes;      // sizeof(Superblock) at that version
  uint64_t region_size;
  uint32_t max_nodes;
  uint32_t area_count;
  uint64_t created_unix_ns;
  uint8_t region_id[16];
  uint64_t chunk_bytes;
  int32_t numa_node;          // -1: not bound
  uint32_t reserved0;
  uint8_t pool_id[16];        // random at pool creation; the same in every region of a pool
  uint32_t pool_index;        // this region's position in its pool (0: the first region)
  uint32_t pool_regions;      // regions in the pool (>= 1)
  uint64_t reserved[4];
  AreaDesc areas[kMaxAreas];
  uint64_t checksum;          // xxh3-64 of every byte before this field
};
// The version and magic must stay where every past and future build looks for them.
static_assert(offsetof(Superblock, magic) == 0);
static_assert(offsetof(Superblock, layout_version) == 8);
static_assert(offsetof(Superblock, pool_id) == 72);
static_assert(offsetof(Superblock, areas) == 128);
static_assert(offsetof(Superblock, checksum) == 128 + 32 * kMaxAreas);
static_assert(sizeof(Superblock) == 648);
static_assert(sizeof(Superblock) <= kSuperblockBytes);
static_assert(std::is_standard_layout_v<Superblock> && std::is_trivially_copyable_v<Superblock>);

uint64_t SuperblockChecksum(const Superblock& sb);

// Which pool a region belongs to and where in it (layout version 4). Region::Create of a lone
// region makes a pool of one with a random id.
struct PoolIdentity {
  uint8_t id[16];
  uint32_t index = 0;
  uint32_t regions = 1;
};

// Lays out the areas of a region of `size` bytes for `options`; fills every field but
// created_unix_ns, region_id and checksum. Fails with kInvalidArgument when the options do not
// fit (too small, too many nodes).
struct AreaRequest {
  AreaKind kind;
  uint64_t bytes;
  uint64_t param;
};
// `extra` areas are placed after the node table, in order, 4 KiB aligned; the data area last.
Result<Superblock> PlanLayout(uint64_t size, const RegionCreateOptions& options,
                              const std::vector<AreaRequest>& extra = {});

// Validates the raw superblock bytes of a region mapped from a file of `file_size` bytes at
// `path`; the message names what is wrong and what to do. On success fills *out. Besides the
// header and the area table it checks the region layer's own parameters (node count, chunk
// size, pool position, node table and data area): every value it passes is safe to index with.
Status ValidateSuperblock(const void* raw, uint64_t file_size, const std::string& path,
                          Superblock* out);

// Finds an area; returns nullptr when the region has none of that kind.
const AreaDesc* FindArea(const Superblock& sb, AreaKind kind);

}  // namespace cxlkv::region

#endif  // CXLKV_SRC_REGION_SUPERBLOCK_H_
