// The OS behind one seam for the capacity tiers: every system call an SSD device makes (open,
// fallocate, pread/pwrite, fdatasync, fadvise, the block-device size ioctl, io_uring set-up and
// its submissions) goes through IoPlatform, so tests substitute a fault-injecting platform
// (tests/tier/fault_io_platform.h) that refuses io_uring with EPERM, buffer registration with
// ENOMEM, O_DIRECT with EINVAL, or turns a write into ENOSPC, an EINTR or a short transfer.
// One implementation: io_platform_linux.cc (liburing for the ring).
//
// Convention (as region::Platform): integer calls return >= 0 on success and -errno on failure;
// errno is never read by callers.
// Thread-safety: the default IoPlatform is stateless and safe from any thread. An IoRing is used
// by one thread at a time (the device's I/O path holds its lock around it).
#ifndef CXLKV_SRC_TIER_IO_PLATFORM_H_
#define CXLKV_SRC_TIER_IO_PLATFORM_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "cxlkv/status.h"
#include "tier/nvme_command.h"

namespace cxlkv::tier {

// What an SSD device path is.
struct DeviceFileFacts {
  bool exists = false;
  bool is_block_device = false;
  bool is_regular = false;
  bool is_char_device = false;   // e.g. an NVMe generic device /dev/ngXnY (driven by passthrough)
  uint64_t size = 0;             // st_size, or BLKGETSIZE64 for a block device
  uint64_t fs_free_bytes = 0;    // space left on the file system holding a regular file
  bool on_tmpfs = false;         // where O_DIRECT may be refused (kernels before 6.6)
};

// One buffer to register with an IoRing.
struct RegisteredSpan {
  void* base = nullptr;
  size_t len = 0;
};

// One read or write submitted to an IoRing.
struct RingOp {
  bool write = false;
  int fd = -1;               // the registered file's index when fixed_file, else a descriptor
  bool fixed_file = false;
  void* buf = nullptr;
  uint32_t len = 0;
  uint64_t offset = 0;
  int buf_index = -1;        // >= 0: a registered buffer (read/write_fixed), buf lies inside it
  uint64_t user_data = 0;
};

struct RingCompletion {
  uint64_t user_data = 0;
  int32_t res = 0;           // bytes transferred, or -errno
  uint32_t nvme_status = 0;  // a passthrough ring's NVMe status when the drive failed it (res -EIO)
};

// A submission/completion queue pair (io_uring). Queue → Submit (one system call per batch) →
// Peek/Wait for completions.
class IoRing {
 public:
  virtual ~IoRing() = default;
  // Registers one file as fixed file 0 (skips the per-I/O fget/fput).
  virtual int RegisterFile(int fd) = 0;
  // Registers the spans as fixed buffers 0, 1, ... (pinned once, not per I/O). May fail with
  // -ENOMEM under a low RLIMIT_MEMLOCK.
  virtual int RegisterBuffers(std::span<const RegisteredSpan> spans) = 0;
  // Adds an op to the submission queue; false when the queue is full (submit first).
  virtual bool Queue(const RingOp& op) = 0;
  // Submits everything queued: one io_uring_enter. Returns the count or -errno.
  virtual int Submit() = 0;
  // Takes one completion if one is ready: 1, or 0 when none is.
  virtual int Peek(RingCompletion* out) = 0;
  // Blocks until one completion is ready and takes it: 0, or -errno.
  virtual int Wait(RingCompletion* out) = 0;
};

class IoPlatform {
 public:
  virtual ~IoPlatform() = default;

  // The real operating system.
  static IoPlatform& Default();

  virtual int Open(const std::string& path, int flags, mode_t mode);
  virtual int Close(int fd);
  virtual int Unlink(const std::string& path);
  // Facts about `path` (exists=false when it does not; other errors as -errno).
  virtual int Stat(const std::string& path, DeviceFileFacts* out);
  // Facts about an open descriptor (size from BLKGETSIZE64 for a block device).
  virtual int Fstat(int fd, DeviceFileFacts* out);
  // Reserves [0, size) on the file's file system (fallocate mode 0).
  virtual int Fallocate(int fd, uint64_t size);
  virtual ssize_t Pread(int fd, void* buf, size_t len, uint64_t offset);
  virtual ssize_t Pwrite(int fd, const void* buf, size_t len, uint64_t offset);
  virtual int Fdatasync(int fd);
  // flock(LOCK_EX | LOCK_NB): -EWOULDBLOCK while another open file description holds it.
  // Released when the descriptor is closed (or its process dies).
  virtual int LockExclusive(int fd);
  // flock(LOCK_UN): releases it now, even while another reference to the file (an io_uring's
  // registered file, torn down asynchronously) keeps the file open a while longer.
  virtual int Unlock(int fd);
  // posix_fadvise(POSIX_FADV_DONTNEED): drops clean cached pages of the range.
  virtual int DropCache(int fd, uint64_t offset, uint64_t len);
  // An io_uring of `depth` entries, or the -errno io_uring_queue_init gave (-EPERM under a
  // seccomp filter, -ENOSYS on a kernel without io_uring).
  virtual int CreateRing(unsigned depth, std::unique_ptr<IoRing>* out);

  // NVMe passthrough on a generic device /dev/ngXnY (nvme_command.h). The namespace's id, its
  // identify page and the kernel's per-command transfer limit: -ENOTTY when fd is not an NVMe
  // device, -EACCES/-EPERM when identify is refused, -EINVAL when the page is out of range
  // (*why says which field).
  virtual int NvmeIdentify(int fd, const std::string& path, NvmeNamespace* out, std::string* why);
  // Flushes the namespace's volatile write cache (NVM flush): 0, -errno, or -EIO with the NVMe
  // status in *nvme_status.
  virtual int NvmeFlush(int fd, uint32_t nsid, uint32_t* nvme_status);
  // A ring of 128-byte submissions and 32-byte completions (IORING_SETUP_SQE128 | CQE32) whose
  // reads and writes become NVMe commands on `ns` (IORING_OP_URING_CMD): byte offsets and
  // lengths in, bytes moved out. A transfer past the namespace's per-command limit goes as
  // several commands, all in flight at once (`entries` submissions in all), completing as one;
  // with registered buffers, its command k uses buffer buf_index + k, so the caller registers
  // one buffer per command-sized piece (ssd_nvme.cc). Queue returns false when the queue has no
  // room for all of a transfer's commands. -EINVAL on a kernel without these ring flags (before
  // 5.19).
  virtual int CreateNvmeRing(unsigned entries, const NvmeNamespace& ns, std::unique_ptr<IoRing>* out);
};

// "No such file or directory (ENOENT)" for a negative errno return.
std::string IoErrnoText(int neg_errno);

}  // namespace cxlkv::tier

#endif  // CXLKV_SRC_TIER_IO_PLATFORM_H_
