// Region creation (formatting) and attachment (validation).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "region/coherence.h"
#include "region/region_internal.h"
#include "util/units.h"

namespace cxlkv {

using region::AreaDesc;
using region::AreaKind;
using region::Superblock;

std::string_view CoherenceModeName(CoherenceMode mode) {
  return mode == CoherenceMode::kSoftware ? "software-coherent" : "hardware-coherent";
}

Result<CoherenceMode> ParseCoherenceMode(std::string_view name) {
  if (name == "software-coherent" || name == "software") return CoherenceMode::kSoftware;
  if (name == "hardware-coherent" || name == "hardware") return CoherenceMode::kHardware;
  return InvalidArgument("unknown coherence mode '" + std::string(name) +
                         "': use software-coherent (multi-host CXL) or hardware-coherent "
                         "(one host)");
}

std::string_view BackendKindName(BackendKind kind) {
  switch (kind) {
    case BackendKind::kShmFile: return "shm-file";
    case BackendKind::kHugetlbFile: return "hugetlbfs-file";
    case BackendKind::kDevDax: return "devdax";
  }
  return "unknown";
}

Region::Region(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Region::~Region() = default;
const RegionInfo& Region::info() const { return impl_->info(); }

Region::Impl::Impl(region::Mapping mapping, const Superblock& sb, RegionInfo info,
                   CoherenceMode coherence)
    : mapping_(std::move(mapping)),
      sb_(sb),
      info_(std::move(info)),
      meta_(mapping_.base(), sb.region_size, coherence) {}

const AreaDesc& Region::Impl::area(AreaKind kind) const {
  const AreaDesc* a = region::FindArea(sb_, kind);
  if (a == nullptr) {
    std::fprintf(stderr, "cxlkv: region has no %s area (layout version %u)\n",
                 std::string(region::AreaKindName(kind)).c_str(), sb_.layout_version);
    std::abort();
  }
  return *a;
}

uint8_t* Region::Impl::PayloadPtr(uint64_t byte_offset, uint64_t len) const {
  // Every build: offsets come from the region; callers validate them first and
  // return kCorrupted, so reaching the abort means a decode site lacks its check.
  if (byte_offset > sb_.region_size || len > sb_.region_size - byte_offset) [[unlikely]] {
    std::fprintf(stderr, "cxlkv: payload [%llu, +%llu) outside region of %llu bytes\n",
                 static_cast<unsigned long long>(byte_offset), static_cast<unsigned long long>(len),
                 static_cast<unsigned long long>(sb_.region_size));
    std::abort();
  }
  return mapping_.base() + byte_offset;
}

namespace region {

namespace {

RegionInfo MakeInfo(const std::string& path, BackendKind backend, CoherenceMode coherence,
                    const Superblock& sb) {
  RegionInfo info;
  info.path = path;
  info.backend = backend;
  info.coherence = coherence;
  info.layout_version = sb.layout_version;
  info.region_size = sb.region_size;
  info.max_nodes = sb.max_nodes;
  info.chunk_bytes = sb.chunk_bytes;
  info.numa_node = sb.numa_node;
  info.created_unix_ns = sb.created_unix_ns;
  info.region_id = util::HexBytes(sb.region_id, sizeof(sb.region_id));
  info.pool_id = util::HexBytes(sb.pool_id, sizeof(sb.pool_id));
  info.pool_index = sb.pool_index;
  info.pool_regions = sb.pool_regions;
  info.checksum = sb.checksum;
  for (uint32_t i = 0; i < sb.area_count; ++i) {
    info.areas.push_back(AreaInfo{std::string(AreaKindName(static_cast<AreaKind>(sb.areas[i].kind))),
                                  sb.areas[i].offset, sb.areas[i].size,
                                  sb.areas[i].param});
  }
  return info;
}

// Writes a fresh superblock and zeroed metadata areas into `base`. The magic is stored last,
// after everything else is flushed, so a crash mid-format leaves a region Attach refuses.
void RandomBytes(uint8_t* out, size_t n) {
  std::random_device rd;
  for (size_t i = 0; i < n; i += 4) {
    uint32_t r = rd();
    std::memcpy(out + i, &r, std::min<size_t>(4, n - i));
  }
}

void Format(uint8_t* base, Superblock sb, const PoolIdentity& pool) {
  const AreaDesc* data = FindArea(sb, AreaKind::kData);
  uint64_t metadata_end = data != nullptr ? data->offset : sb.region_size;
  std::memset(base, 0, metadata_end);
  FlushLines(base, metadata_end);

  RandomBytes(sb.region_id, sizeof(sb.region_id));
  std::memcpy(sb.pool_id, pool.id, sizeof(sb.pool_id));
  sb.pool_index = pool.index;
  sb.pool_regions = pool.regions;
  sb.created_unix_ns = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::system_clock::now().time_since_epoch()).count());
  sb.checksum = SuperblockChecksum(sb);

  Superblock staged = sb;
  staged.magic = 0;
  std::memcpy(base, &staged, sizeof(staged));
  FlushLines(base, sizeof(staged));
  // Publish: the single 8-byte magic store makes the region attachable.
  __atomic_store_n(reinterpret_cast<uint64_t*>(base), sb.magic, __ATOMIC_RELEASE);
  FlushLines(base, sizeof(uint64_t));
}

uint64_t SimSeedFor(const RegionAttachOptions& options) {
  if (options.sim_seed != 0) return options.sim_seed;
  const char* env = std::getenv("CXLKV_SIM_SEED");
  return env != nullptr ? std::strtoull(env, nullptr, 10) : 0;
}

Result<std::unique_ptr<Region>> CreateOnDevDax(const std::string& path,
                                               const RegionCreateOptions& options,
                                               Platform& platform,
                                               const std::vector<AreaRequest>& areas,
                                               const PoolIdentity& pool) {
  // OpenBacking only opens and sizes the device; a brand-new device holds garbage, which is fine.
  auto mapping = OpenBacking(path, platform);
  if (!mapping.ok()) return mapping.status();
  uint64_t dev_size = mapping->size();
  if (options.size != 0 && options.size > dev_size) {
    return NoSpace("device " + path + " is too small: " + util::FormatBytes(dev_size) +
                   " but --size asks for " + util::FormatBytes(options.size));
  }
  uint64_t size = options.size != 0 ? options.size : dev_size;
  if (size % kHugeAlign != 0) {
    return InvalidArgument("region size on device-DAX must be a multiple of 2 MiB, got " +
                           std::to_string(size));
  }
  if (!options.overwrite &&
      __atomic_load_n(reinterpret_cast<uint64_t*>(mapping->base()), __ATOMIC_ACQUIRE) == kRegionMagic) {
    return AlreadyExists(path + " already holds a cxlkv region: pass --force to re-format it "
                         "(its contents are lost)");
  }
  CXLKV_ASSIGN_OR_RETURN(Superblock sb, PlanLayout(size, options, areas));
  Format(mapping->base(), sb, pool);
  Superblock formatted;
  std::memcpy(&formatted, mapping->base(), sizeof(formatted));
  RegionInfo info = MakeInfo(path, BackendKind::kDevDax, CoherenceMode::kSoftware, formatted);
  return std::make_unique<Region>(std::make_unique<Region::Impl>(
      std::move(mapping).value(), formatted, std::move(info), CoherenceMode::kSoftware));
}

}  // namespace

PoolIdentity NewPoolIdentity(uint32_t regions) {
  PoolIdentity id;
  RandomBytes(id.id, sizeof(id.id));
  id.regions = regions;
  return id;
}

Result<std::unique_ptr<Region>> CreateRegion(const std::string& path,
                                             const RegionCreateOptions& options,
                                             Platform& platform,
                                             const std::vector<AreaRequest>& areas,
                                             const PoolIdentity* pool_in) {
  if (path.empty()) return InvalidArgument("region path is empty");
  const PoolIdentity pool = pool_in != nullptr ? *pool_in : NewPoolIdentity(1);
  if (pool.regions == 0 || pool.index >= pool.regions) {
    return InvalidArgument("region " + std::to_string(pool.index) + " of a pool of " +
                           std::to_string(pool.regions) + " is out of range");
  }
  if (IsDevDaxPath(path) || platform.IsCharDevice(path)) {
    return CreateOnDevDax(path, options, platform, areas, pool);
  }

  if (options.size == 0) {
    return InvalidArgument("a file region needs a size (e.g. --size 1G); only /dev/daxX.Y "
                           "devices supply their own");
  }
  if (options.size < kMinRegionBytes) {
    return InvalidArgument("region size " + util::FormatBytes(options.size) +
                           " is too small: the minimum is " + util::FormatBytes(kMinRegionBytes));
  }
  if (options.size % 4096 != 0) {
    return InvalidArgument("region size " + std::to_string(options.size) +
                           " is not a multiple of the 4 KiB page size");
  }
  CXLKV_ASSIGN_OR_RETURN(Superblock sb, PlanLayout(options.size, options, areas));

  if (!options.overwrite) {
    int fd = platform.Open(path, O_RDONLY, 0);
    if (fd >= 0) {
      platform.Close(fd);
      return AlreadyExists(path + " already exists: pass --force to replace it (its contents "
                           "are lost), or attach to it");
    }
  }
  // Format under a private name and rename into place: attachers never see a half-made region.
  std::string staging = path + ".init-" + std::to_string(::getpid());
  CXLKV_ASSIGN_OR_RETURN(Mapping mapping,
                         CreateFileBacking(staging, options.size, options.numa_node, platform));
  Format(mapping.base(), sb, pool);
  int rc = options.overwrite ? platform.Rename(staging, path)
                             : platform.RenameNoReplace(staging, path);
  if (rc < 0) {
    platform.Unlink(staging);
    if (rc == -EEXIST) return AlreadyExists(path + " was created by someone else meanwhile");
    return IoError("cannot move the new region into place at " + path + ": " + ErrnoText(rc));
  }
  Superblock formatted;
  std::memcpy(&formatted, mapping.base(), sizeof(formatted));
  BackendKind kind = mapping.kind();
  RegionInfo info = MakeInfo(path, kind, CoherenceMode::kSoftware, formatted);
  return std::make_unique<Region>(std::make_unique<Region::Impl>(
      std::move(mapping), formatted, std::move(info), CoherenceMode::kSoftware));
}

Result<std::unique_ptr<Region>> AttachRegion(const std::string& path,
                                             const RegionAttachOptions& options,
                                             Platform& platform) {
  if (path.empty()) return InvalidArgument("region path is empty");
  CXLKV_ASSIGN_OR_RETURN(Mapping mapping, OpenBacking(path, platform));
  // Another host formatted it: drop any stale copy of the superblock before reading it (rule P2).
  if (options.coherence == CoherenceMode::kSoftware) {
    InvalidateLines(mapping.base(), sizeof(Superblock));
  }
  Superblock sb;
  CXLKV_RETURN_IF_ERROR(ValidateSuperblock(mapping.base(), mapping.size(), path, &sb));
  RegionInfo info = MakeInfo(path, mapping.kind(), options.coherence, sb);
  if (options.prefault) {
    // Only an optimization: a kernel without MADV_POPULATE_WRITE (before 5.14), or a backing
    // that refuses it, leaves the pages to be faulted in on first touch, as without it.
    (void)platform.Populate(mapping.base(), mapping.size());
  }
  auto impl = std::make_unique<Region::Impl>(std::move(mapping), sb, std::move(info),
                                             options.coherence);
  if (uint64_t seed = SimSeedFor(options); seed != 0) {
    SimOptions sim;
    sim.seed = seed;
    if (options.sim_quiet_cache) {
      sim.writeback_probability = 0;
      sim.evict_probability = 0;
      sim.capacity_lines = SIZE_MAX;
    }
    impl->meta().AttachSimulator(sim);
  }
  return std::make_unique<Region>(std::move(impl));
}

}  // namespace region

Result<std::unique_ptr<Region>> Region::Create(const std::string& path,
                                               const RegionCreateOptions& options) {
  return region::CreateRegion(path, options, region::Platform::Default());
}

Result<std::unique_ptr<Region>> Region::Attach(const std::string& path,
                                               const RegionAttachOptions& options) {
  return region::AttachRegion(path, options, region::Platform::Default());
}

}  // namespace cxlkv
