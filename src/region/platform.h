// The OS behind one seam: every syscall the region layer makes goes through Platform, so tests
// can inject ENOSPC, EACCES or a short sysfs file (tests/region/fault_platform.h) and the code
// paths that report them are exercised. One implementation per OS: platform_linux.cc.
//
// Convention: integer calls return >= 0 on success and -errno on failure (never set errno).
// Thread-safety: the default Platform is stateless and safe to use from any thread.
#ifndef CXLKV_SRC_REGION_PLATFORM_H_
#define CXLKV_SRC_REGION_PLATFORM_H_

#include <sys/stat.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "cxlkv/status.h"

namespace cxlkv::region {

// What kind of file system or device a path lives on.
enum class FsKind : uint8_t { kTmpfs, kHugetlbfs, kCharDevice, kOther };

struct FileFacts {
  FsKind kind = FsKind::kOther;
  uint64_t size = 0;          // st_size (0 for a character device)
  uint64_t block_size = 0;    // f_bsize of the file system: the huge page size on hugetlbfs
  uint64_t fs_free_bytes = 0; // space left on the file system (tmpfs/hugetlbfs)
  dev_t rdev = 0;             // for a character device: major/minor
};

class Platform {
 public:
  virtual ~Platform() = default;

  // The real operating system.
  static Platform& Default();

  virtual int Open(const std::string& path, int flags, mode_t mode);
  virtual int Close(int fd);
  virtual int Facts(int fd, FileFacts* out);
  // True when `path` exists and is a character device (how /dev/daxX.Y appears).
  virtual bool IsCharDevice(const std::string& path);
  virtual int Ftruncate(int fd, uint64_t size);
  // Reserves the file's backing memory now, so a region that does not fit fails at init with
  // ENOSPC instead of a SIGBUS on first touch.
  virtual int Fallocate(int fd, uint64_t size);
  // Returns MAP_FAILED-equivalent nullptr and sets *err on failure.
  virtual void* Mmap(void* addr, size_t len, int prot, int flags, int fd, uint64_t off, int* err);
  virtual int Munmap(void* addr, size_t len);
  // Atomic rename that fails with -EEXIST when `to` exists.
  virtual int RenameNoReplace(const std::string& from, const std::string& to);
  virtual int Rename(const std::string& from, const std::string& to);
  virtual int Unlink(const std::string& path);
  // Reads a small text file (sysfs attribute). `path` is relative to the sysfs root, which
  // tests point elsewhere.
  virtual Result<std::string> ReadSysfs(const std::string& path);
  // Highest NUMA node id, or -1 when NUMA is unavailable.
  virtual int NumaMaxNode();
  // Binds [addr, addr+len) to `node` (mbind MPOL_BIND) before it is first touched.
  virtual int NumaBind(void* addr, size_t len, int node);
  // The NUMA node of the memory backing `addr` (touched already), or -errno (-ENOSYS without NUMA).
  virtual int NumaNodeOf(const void* addr);
  // Runs the calling thread on the CPUs of `node` from now on (numa_run_on_node).
  virtual int RunThreadOnNode(int node);
  // Maps every page of [addr, addr+len) now, for writing (madvise MADV_POPULATE_WRITE).
  virtual int Populate(void* addr, size_t len);

  std::string sysfs_root = "/sys";
};

// "No such file or directory (ENOENT)"-style text for a negative errno return.
std::string ErrnoText(int neg_errno);

}  // namespace cxlkv::region

#endif  // CXLKV_SRC_REGION_PLATFORM_H_
