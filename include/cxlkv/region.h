// A region: one shared memory area that every host (node) of a rack maps — a CXL memory device
// exposed as /dev/daxX.Y, or on one host a file in /dev/shm or on hugetlbfs — formatted with a
// cxlkv superblock that names the layout version and where each area lives.
//
//   auto region = cxlkv::Region::Create("/dev/shm/cxlkv", {.size = 1ull << 30});
//   auto again  = cxlkv::Region::Attach("/dev/shm/cxlkv");   // from any process or host
//
// Create formats a fresh region; it is atomic for files (formatted under a temporary name, then
// renamed into place), so a concurrent Attach sees either nothing or a complete region. Attach
// validates everything before handing the region out and reports exactly what is wrong: not a
// cxlkv region, another layout version, truncated, checksum mismatch.
//
// Thread-safety: a Region is immutable after Create/Attach returns; share it between threads.
#ifndef CXLKV_REGION_H_
#define CXLKV_REGION_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cxlkv/status.h"

namespace cxlkv {

// The superblock's layout version. It changes whenever any shared structure changes; a region
// made by another version is refused with both versions named.
inline constexpr uint32_t kLayoutVersion = 7;
// Most hosts one region supports (a CXL switch connects up to ~16; headroom for processes that
// attach as separate nodes on one host).
inline constexpr uint32_t kMaxNodes = 64;
inline constexpr uint64_t kMinRegionBytes = uint64_t{8} << 20;
inline constexpr uint64_t kDefaultChunkBytes = uint64_t{2} << 20;

// How an attachment treats the hardware (see docs/protocol.md).
enum class CoherenceMode : uint8_t {
  kSoftware = 0,  // multi-host CXL: every flush/invalidate is executed. The default everywhere,
                  // so the path tested on one host is the path that runs on CXL.
  kHardware = 1,  // one coherent host: metadata flushes/invalidates become fences.
};
std::string_view CoherenceModeName(CoherenceMode mode);  // "software-coherent" | "hardware-coherent"
Result<CoherenceMode> ParseCoherenceMode(std::string_view name);

enum class BackendKind : uint8_t {
  kShmFile = 0,      // a file on tmpfs (/dev/shm)
  kHugetlbFile = 1,  // a file on hugetlbfs (2 MiB or 1 GiB pages)
  kDevDax = 2,       // /dev/daxX.Y: device DAX, how CXL memory is exposed for sharing
};
std::string_view BackendKindName(BackendKind kind);

struct RegionCreateOptions {
  uint64_t size = 0;          // Region bytes. Required: >= kMinRegionBytes and a multiple of 4 KiB
                              // (of the huge page size on hugetlbfs). Ignored for devdax, whose
                              // size is the device's; if given there, the device must hold it.
  uint32_t max_nodes = 16;    // Hosts (nodes) that may attach: 1..kMaxNodes. Default 16.
  int numa_node = -1;         // Bind the backing memory to this NUMA node (CXL memory in
                              // system-ram mode is a CPU-less node). Default -1: no binding.
  bool overwrite = false;     // Replace an existing region at the path. Default false.
  uint64_t chunk_bytes = kDefaultChunkBytes;  // Allocation granule of the data area. Default 2 MiB.
};

struct RegionAttachOptions {
  CoherenceMode coherence = CoherenceMode::kSoftware;  // Default: software-coherent.
  // Testing only: when non-zero, every metadata access of this attachment goes through a
  // simulated non-coherent host cache seeded with this value (docs/protocol.md, "Simulator").
  // Default 0: off. The environment variable CXLKV_SIM_SEED sets it too.
  uint64_t sim_seed = 0;
  // Testing only, with the simulator: the simulated cache never writes a line back or evicts one
  // on its own (no random write-backs or evictions, no capacity limit), so a line reaches memory
  // only when it is flushed. A flush a protocol needs for progress rather than safety is masked
  // by random write-backs; this shows it. Default false.
  bool sim_quiet_cache = false;
  // Maps every page of the region into this process at attach (MADV_POPULATE_WRITE), so the
  // first store into a payload block does not take a fault per 4 KiB page: on a fresh mapping a
  // 2 MiB block costs 512 minor faults, more than its copy. Worth it for a process that lives
  // long (a serving worker, the daemon); an inspecting tool leaves it off. Default false; Pool
  // turns it on (PoolOpenOptions::prefault).
  bool prefault = false;
};

struct AreaInfo {
  std::string name;  // "node-table", "data", ...
  uint64_t offset = 0;
  uint64_t size = 0;
  uint64_t param = 0;  // the owning layer's sizing parameter (locks, chunks, roots)
};

struct RegionInfo {
  std::string path;
  BackendKind backend = BackendKind::kShmFile;
  CoherenceMode coherence = CoherenceMode::kSoftware;
  uint32_t layout_version = 0;
  uint64_t region_size = 0;
  uint32_t max_nodes = 0;
  uint64_t chunk_bytes = 0;
  int numa_node = -1;          // as requested at creation; -1: none
  uint64_t created_unix_ns = 0;
  std::string region_id;       // 32 hex digits, random at creation
  std::string pool_id;         // 32 hex digits, random at pool creation; equal across its regions
  uint32_t pool_index = 0;     // this region's position in its pool
  uint32_t pool_regions = 1;   // regions in its pool
  uint64_t checksum = 0;       // xxh3-64 of the superblock header
  std::vector<AreaInfo> areas;
};

class Region {
 public:
  class Impl;

  // Creates and formats a region at `path`. Errors: kInvalidArgument (bad size, max_nodes or
  // NUMA node), kAlreadyExists (path exists and !overwrite), kNotFound (no such directory or
  // device), kPermissionDenied, kNoSpace (the file system or device is too small).
  static Result<std::unique_ptr<Region>> Create(const std::string& path,
                                                const RegionCreateOptions& options);
  // Maps and validates an existing region. Errors: kNotFound, kPermissionDenied, kCorrupted
  // (bad magic, truncated, checksum mismatch, inconsistent area table), kVersionMismatch.
  static Result<std::unique_ptr<Region>> Attach(const std::string& path,
                                                const RegionAttachOptions& options = {});

  // Used by Create/Attach; Impl is opaque outside src/.
  explicit Region(std::unique_ptr<Impl> impl);
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  const RegionInfo& info() const;

  // Internal state; only code under src/ can use it (region/region_internal.h).
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace cxlkv

#endif  // CXLKV_REGION_H_
