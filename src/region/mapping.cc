#include "region/mapping.h"

#include <fcntl.h>
#include <sys/mman.h>

#include <cerrno>
#include <charconv>

#include "util/units.h"

namespace cxlkv::region {

namespace {

std::string DirOf(const std::string& path) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// Translates an errno from opening `path` into a Status that says what to do.
Status OpenError(const std::string& path, int neg_errno, bool creating) {
  switch (-neg_errno) {
    case ENOENT:
      if (creating) return NotFound("cannot create region " + path + ": directory " + DirOf(path) +
                                    " does not exist");
      return NotFound("no region at " + path + ": create one with 'cxlkv init --path " + path +
                      " --size S'");
    case EACCES:
    case EPERM:
      return PermissionDenied("cannot open " + path + ": " + ErrnoText(neg_errno) +
                              "; run as a user that may read and write it, or choose another path");
    case EEXIST:
      return AlreadyExists(path + " already exists");
    default:
      return IoError("cannot open " + path + ": " + ErrnoText(neg_errno));
  }
}

// Maps `size` bytes of fd at an address aligned to `align` (device DAX refuses faults on
// mappings that are not aligned to its page size).
Result<uint8_t*> MapAligned(Platform& platform, int fd, uint64_t size, uint64_t align,
                            const std::string& path) {
  int err = 0;
  if (align <= 4096) {
    void* p = platform.Mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0, &err);
    if (p == nullptr) return IoError("cannot map " + path + ": " + ErrnoText(err));
    return static_cast<uint8_t*>(p);
  }
  void* reserve = platform.Mmap(nullptr, size + align, PROT_NONE,
                                MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0, &err);
  if (reserve == nullptr) return IoError("cannot reserve address space for " + path + ": " + ErrnoText(err));
  uintptr_t start = reinterpret_cast<uintptr_t>(reserve);
  uintptr_t aligned = (start + align - 1) & ~(align - 1);
  void* p = platform.Mmap(reinterpret_cast<void*>(aligned), size, PROT_READ | PROT_WRITE,
                          MAP_SHARED | MAP_FIXED, fd, 0, &err);
  if (p == nullptr) {
    platform.Munmap(reserve, size + align);
    return IoError("cannot map " + path + ": " + ErrnoText(err));
  }
  // Give back the unaligned slop on both sides.
  if (aligned > start) platform.Munmap(reserve, aligned - start);
  uintptr_t end = aligned + size;
  uintptr_t reserve_end = start + size + align;
  if (reserve_end > end) platform.Munmap(reinterpret_cast<void*>(end), reserve_end - end);
  return static_cast<uint8_t*>(p);
}

}  // namespace

Mapping& Mapping::operator=(Mapping&& other) noexcept {
  if (this != &other) {
    Reset();
    platform_ = other.platform_;
    fd_ = other.fd_;
    base_ = other.base_;
    size_ = other.size_;
    kind_ = other.kind_;
    other.platform_ = nullptr;
    other.fd_ = -1;
    other.base_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

void Mapping::Reset() {
  if (platform_ == nullptr) return;
  if (base_ != nullptr) platform_->Munmap(base_, size_);
  if (fd_ >= 0) platform_->Close(fd_);
  base_ = nullptr;
  fd_ = -1;
  platform_ = nullptr;
}

bool IsDevDaxPath(const std::string& path) {
  return path.rfind("/dev/dax", 0) == 0;
}

Result<uint64_t> DevDaxSize(const std::string& path, Platform& platform) {
  std::string name = path.substr(path.rfind('/') + 1);
  auto text = platform.ReadSysfs("bus/dax/devices/" + name + "/size");
  if (!text.ok()) {
    return NotFound("cannot read the size of device-DAX " + path + " from sysfs (" +
                    text.status().message() + "); is the device configured in devdax mode "
                    "(daxctl list)?");
  }
  uint64_t size = 0;
  const std::string& s = *text;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), size);
  if (ec != std::errc() || size == 0) {
    return Corrupted("sysfs reports an unreadable size '" + s + "' for " + path);
  }
  return size;
}

Result<Mapping> CreateFileBacking(const std::string& path, uint64_t size, int numa_node,
                                  Platform& platform) {
  int fd = platform.Open(path, O_RDWR | O_CREAT | O_EXCL, 0660);
  if (fd < 0) return OpenError(path, fd, /*creating=*/true);
  auto fail = [&](Status s) -> Result<Mapping> {
    platform.Close(fd);
    platform.Unlink(path);
    return s;
  };

  FileFacts facts;
  if (int rc = platform.Facts(fd, &facts); rc < 0) return fail(IoError("cannot stat " + path + ": " + ErrnoText(rc)));
  BackendKind kind;
  uint64_t align = 4096;
  if (facts.kind == FsKind::kTmpfs) {
    kind = BackendKind::kShmFile;
  } else if (facts.kind == FsKind::kHugetlbfs) {
    kind = BackendKind::kHugetlbFile;
    align = facts.block_size;
  } else {
    return fail(InvalidArgument(
        path + " is on a disk file system; a region must live in memory: use a path under "
               "/dev/shm (tmpfs), a hugetlbfs mount, or a device-DAX device /dev/daxX.Y"));
  }
  if (size % align != 0) {
    return fail(InvalidArgument("region size " + std::to_string(size) + " is not a multiple of " +
                                util::FormatBytes(align) + " (the page size of " + path +
                                "'s file system)"));
  }
  if (facts.fs_free_bytes != 0 && size > facts.fs_free_bytes) {
    return fail(NoSpace("not enough memory for a " + util::FormatBytes(size) + " region at " +
                        path + ": its file system has " + util::FormatBytes(facts.fs_free_bytes) +
                        " free; choose a smaller --size or enlarge the mount"));
  }
  if (int rc = platform.Ftruncate(fd, size); rc < 0) {
    return fail(IoError("cannot size " + path + " to " + util::FormatBytes(size) + ": " + ErrnoText(rc)));
  }
  auto base = MapAligned(platform, fd, size, align, path);
  if (!base.ok()) return fail(base.status());
  Mapping mapping(&platform, fd, *base, size, kind);

  if (numa_node >= 0) {
    int max_node = platform.NumaMaxNode();
    if (max_node < 0) {
      mapping = Mapping();
      platform.Unlink(path);
      return NotSupported("--numa " + std::to_string(numa_node) +
                          " was asked for but this machine has no NUMA support");
    }
    if (numa_node > max_node) {
      mapping = Mapping();
      platform.Unlink(path);
      return InvalidArgument("NUMA node " + std::to_string(numa_node) +
                             " does not exist: this machine has nodes 0-" + std::to_string(max_node) +
                             " (numactl --hardware lists them)");
    }
    // Binding before the first touch makes every page of the file come from that node.
    if (int rc = platform.NumaBind(*base, size, numa_node); rc < 0) {
      mapping = Mapping();
      platform.Unlink(path);
      return IoError("cannot bind " + path + " to NUMA node " + std::to_string(numa_node) + ": " +
                     ErrnoText(rc));
    }
  }
  if (int rc = platform.Fallocate(fd, size); rc < 0) {
    mapping = Mapping();
    platform.Unlink(path);
    if (rc == -ENOSPC || rc == -ENOMEM) {
      return NoSpace("not enough memory to back a " + util::FormatBytes(size) + " region at " +
                     path + (numa_node >= 0 ? " on NUMA node " + std::to_string(numa_node) : "") +
                     "; choose a smaller --size or free memory");
    }
    return IoError("cannot reserve memory for " + path + ": " + ErrnoText(rc));
  }
  return mapping;
}

Result<Mapping> OpenBacking(const std::string& path, Platform& platform) {
  int fd = platform.Open(path, O_RDWR, 0);
  if (fd < 0) return OpenError(path, fd, /*creating=*/false);
  auto fail = [&](Status s) -> Result<Mapping> {
    platform.Close(fd);
    return s;
  };
  FileFacts facts;
  if (int rc = platform.Facts(fd, &facts); rc < 0) return fail(IoError("cannot stat " + path + ": " + ErrnoText(rc)));

  BackendKind kind;
  uint64_t size = facts.size;
  uint64_t align = 4096;
  switch (facts.kind) {
    case FsKind::kCharDevice: {
      auto dax = DevDaxSize(path, platform);
      if (!dax.ok()) return fail(dax.status());
      kind = BackendKind::kDevDax;
      size = *dax;
      align = kHugeAlign;
      break;
    }
    case FsKind::kHugetlbfs:
      kind = BackendKind::kHugetlbFile;
      align = facts.block_size;
      break;
    case FsKind::kTmpfs:
      kind = BackendKind::kShmFile;
      break;
    case FsKind::kOther:
    default:
      return fail(InvalidArgument(path + " is on a disk file system, not shared memory: a region "
                                  "lives under /dev/shm, on hugetlbfs, or on /dev/daxX.Y"));
  }
  if (size < 4096) {
    // Too small to hold a superblock; report it as the truncation it is without mapping.
    return fail(Corrupted("region " + path + " is truncated: " + std::to_string(size) +
                          " bytes, smaller than the 4096-byte superblock: re-create it with "
                          "'cxlkv init --path " + path + " --size S --force'"));
  }
  auto base = MapAligned(platform, fd, size, align, path);
  if (!base.ok()) return fail(base.status());
  return Mapping(&platform, fd, *base, size, kind);
}

}  // namespace cxlkv::region
