// Mapping a region's backing memory: a file on tmpfs or hugetlbfs, or a device-DAX character
// device (/dev/daxX.Y). All OS calls go through Platform (platform.h).
#ifndef CXLKV_SRC_REGION_MAPPING_H_
#define CXLKV_SRC_REGION_MAPPING_H_

#include <cstdint>
#include <string>

#include "cxlkv/region.h"
#include "cxlkv/status.h"
#include "region/platform.h"

namespace cxlkv::region {

inline constexpr uint64_t kHugeAlign = uint64_t{2} << 20;

// An owned MAP_SHARED mapping of a whole region (and the descriptor it came from).
class Mapping {
 public:
  Mapping() = default;
  Mapping(Platform* platform, int fd, uint8_t* base, uint64_t size, BackendKind kind)
      : platform_(platform), fd_(fd), base_(base), size_(size), kind_(kind) {}
  Mapping(Mapping&& other) noexcept { *this = std::move(other); }
  Mapping& operator=(Mapping&& other) noexcept;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { Reset(); }

  uint8_t* base() const { return base_; }
  uint64_t size() const { return size_; }
  BackendKind kind() const { return kind_; }

 private:
  void Reset();

  Platform* platform_ = nullptr;
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  BackendKind kind_ = BackendKind::kShmFile;
};

// Creates `path` (which must not exist: O_EXCL), sizes it, binds it to a NUMA node when
// numa_node >= 0, reserves its memory and maps it. The file is removed again on any failure.
Result<Mapping> CreateFileBacking(const std::string& path, uint64_t size, int numa_node,
                                  Platform& platform);

// Opens an existing region file or device-DAX device and maps all of it.
// `display_path` is what error messages call it.
Result<Mapping> OpenBacking(const std::string& path, Platform& platform);

// True when `path` names a device-DAX device (/dev/daxX.Y).
bool IsDevDaxPath(const std::string& path);

// The size of a device-DAX device, read from sysfs.
Result<uint64_t> DevDaxSize(const std::string& path, Platform& platform);

}  // namespace cxlkv::region

#endif  // CXLKV_SRC_REGION_MAPPING_H_
