// Linux implementation of the tier layer's IoPlatform seam; the ring is liburing's io_uring.
#include <fcntl.h>
#include <sys/file.h>
#include <linux/fs.h>
#include <linux/magic.h>
#include <liburing.h>
#include <linux/nvme_ioctl.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/statfs.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <unordered_map>
#include <vector>

#include "tier/io_platform.h"

namespace cxlkv::tier {

namespace {

int NegErrno() { return -errno; }

void FillFsFacts(const struct statfs& fs, DeviceFileFacts* out) {
  out->fs_free_bytes = static_cast<uint64_t>(fs.f_bavail) * static_cast<uint64_t>(fs.f_bsize);
  out->on_tmpfs = fs.f_type == TMPFS_MAGIC;
}

class LinuxRing final : public IoRing {
 public:
  ~LinuxRing() override {
    if (initialized_) io_uring_queue_exit(&ring_);
  }

  // A plain ring, or (nvme != nullptr) a passthrough ring whose reads and writes become NVMe
  // commands on that namespace.
  int Init(unsigned depth, const NvmeNamespace* nvme) {
    unsigned flags = 0;
    if (nvme != nullptr) {
      nvme_ = *nvme;
      passthrough_ = true;
      flags = IORING_SETUP_SQE128 | IORING_SETUP_CQE32;
    }
    int rc = io_uring_queue_init(depth, &ring_, flags);
    initialized_ = rc == 0;
    return rc;
  }

  int RegisterFile(int fd) override { return io_uring_register_files(&ring_, &fd, 1); }

  int RegisterBuffers(std::span<const RegisteredSpan> spans) override {
    std::vector<struct iovec> iov;
    for (const RegisteredSpan& s : spans) iov.push_back({s.base, s.len});
    return io_uring_register_buffers(&ring_, iov.data(), static_cast<unsigned>(iov.size()));
  }

  bool Queue(const RingOp& op) override {
    if (passthrough_) return QueueNvme(op);
    struct io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) return false;
    if (op.buf_index >= 0) {
      if (op.write) {
        io_uring_prep_write_fixed(sqe, op.fd, op.buf, op.len, op.offset, op.buf_index);
      } else {
        io_uring_prep_read_fixed(sqe, op.fd, op.buf, op.len, op.offset, op.buf_index);
      }
    } else if (op.write) {
      io_uring_prep_write(sqe, op.fd, op.buf, op.len, op.offset);
    } else {
      io_uring_prep_read(sqe, op.fd, op.buf, op.len, op.offset);
    }
    if (op.fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data64(sqe, op.user_data);
    return true;
  }

  int Submit() override { return io_uring_submit(&ring_); }

  int Peek(RingCompletion* out) override {
    struct io_uring_cqe* cqe = nullptr;
    while (io_uring_peek_cqe(&ring_, &cqe) == 0 && cqe != nullptr) {
      if (Take(cqe, out)) return 1;  // else one command of a transfer still in flight
    }
    return 0;
  }

  int Wait(RingCompletion* out) override {
    for (;;) {
      struct io_uring_cqe* cqe = nullptr;
      int rc = io_uring_wait_cqe(&ring_, &cqe);
      if (rc == -EINTR) continue;  // a signal interrupted the wait, not the I/O: wait again
      if (rc < 0) return rc;
      if (Take(cqe, out)) return 0;
    }
  }

 private:
  // A transfer as NVMe commands (nvme_command.h's SplitNvmeIo, into a vector kept between
  // transfers), all queued at once, each in the 80 bytes a 128-byte submission carries. Command
  // k's submission carries (user_data << 20) | k. With registered buffers, command k uses buffer
  // buf_index + k (CreateNvmeRing's contract). False, queuing nothing, when the submission queue
  // has no room for all of them. Allocates nothing once the op's user_data has been seen (its
  // Transfer is kept, see Take) and a transfer as long has been split.
  bool QueueNvme(const RingOp& op) {
    SplitNvmeIo(op.write, nvme_, op.buf, op.len, op.offset, &commands_);
    if (io_uring_sq_space_left(&ring_) < commands_.size() || commands_.size() >= (1u << 20)) return false;
    Transfer& t = transfers_[op.user_data];
    t.result = NvmeTransferResult(static_cast<uint32_t>(commands_.size()));
    t.moved.clear();
    t.in_flight = true;
    for (uint32_t k = 0; k < commands_.size(); ++k) {
      const NvmeIoCommand& c = commands_[k];
      struct io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) return false;  // not with the room checked above
      std::memset(sqe, 0, 2 * sizeof(*sqe));  // SQE128: a submission spans two 64-byte entries
      sqe->opcode = IORING_OP_URING_CMD;
      sqe->fd = op.fd;
      sqe->cmd_op = NVME_URING_CMD_IO;
      if (op.fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
      if (op.buf_index >= 0) {
        sqe->uring_cmd_flags = IORING_URING_CMD_FIXED;
        sqe->buf_index = static_cast<uint16_t>(op.buf_index + static_cast<int>(k));
      }
      struct nvme_uring_cmd cmd {};
      cmd.opcode = c.opcode;
      cmd.nsid = c.nsid;
      cmd.addr = c.addr;
      cmd.data_len = c.data_len;
      cmd.cdw10 = c.cdw10;
      cmd.cdw11 = c.cdw11;
      cmd.cdw12 = c.cdw12;
      static_assert(sizeof(cmd) <= 80, "struct nvme_uring_cmd must fit a 128-byte submission's command area");
      std::memcpy(sqe->cmd, &cmd, sizeof cmd);
      io_uring_sqe_set_data64(sqe, (op.user_data << 20) | k);
      t.moved.push_back(c.data_len);
    }
    return true;
  }

  // Consumes one completion; true when it completes an op (*out filled). A passthrough command
  // reports 0 for success, not a byte count: the op's result is the bytes of all its commands,
  // or the first failure, once the last one is back.
  bool Take(struct io_uring_cqe* cqe, RingCompletion* out) {
    const uint64_t data = io_uring_cqe_get_data64(cqe);
    const int32_t res = cqe->res;
    io_uring_cqe_seen(&ring_, cqe);
    out->nvme_status = 0;
    if (!passthrough_) {
      out->user_data = data;
      out->res = res;
      return true;
    }
    auto it = transfers_.find(data >> 20);
    const uint32_t k = static_cast<uint32_t>(data & ((1u << 20) - 1));
    // Not ours: never queued, or its op already completed.
    if (it == transfers_.end() || !it->second.in_flight || k >= it->second.moved.size()) return false;
    Transfer& t = it->second;
    if (!t.result.Fold(res, t.moved[k])) return false;
    out->user_data = it->first;
    out->res = t.result.Bytes();
    out->nvme_status = t.result.nvme_status();
    t.in_flight = false;
    // Kept for the next op with this user_data (the engine's stage numbers: a few dozen), so
    // queuing allocates nothing; a caller with ever-new user_data is bounded here.
    if (transfers_.size() > kKeptTransfers) transfers_.erase(it);
    return true;
  }

  // A passthrough op's commands in flight.
  struct Transfer {
    NvmeTransferResult result{0};
    std::vector<uint32_t> moved;  // bytes of command k
    bool in_flight = false;
  };
  static constexpr size_t kKeptTransfers = 8192;  // above the deepest ring's stages (4096 + 4)
  std::vector<NvmeIoCommand> commands_;  // QueueNvme's scratch

  struct io_uring ring_ {};
  bool initialized_ = false;
  bool passthrough_ = false;
  NvmeNamespace nvme_;
  std::unordered_map<uint64_t, Transfer> transfers_;  // passthrough: op user_data → its commands
};

// One number from a sysfs attribute file; 0 when it cannot be read.
uint64_t ReadSysfsNumber(const std::string& file) {
  std::ifstream in(file);
  uint64_t v = 0;
  return (in >> v) ? v : 0;
}

// The largest transfer one passthrough command may make on the namespace behind `fd`: the
// kernel maps the user buffer page by page, so both its sector limit and its segment limit (one
// 4 KiB page a segment, the worst case) bound it. Read from the block device of the same
// namespace (/dev/ngXnY ↔ /sys/block/nvmeXnY); 128 KiB, which every NVMe drive takes, when
// sysfs does not say.
uint32_t NvmeMaxTransfer(int fd) {
  constexpr uint32_t kFallback = 128 << 10;
  struct stat st {};
  if (::fstat(fd, &st) != 0) return kFallback;
  char link[256];
  const std::string dev = "/sys/dev/char/" + std::to_string(major(st.st_rdev)) + ":" + std::to_string(minor(st.st_rdev));
  ssize_t n = ::readlink(dev.c_str(), link, sizeof link - 1);
  if (n <= 0) return kFallback;
  std::string name(link, static_cast<size_t>(n));
  name = name.substr(name.rfind('/') + 1);
  if (name.rfind("ng", 0) != 0) return kFallback;
  const std::string queue = "/sys/block/nvme" + name.substr(2) + "/queue/";
  const uint64_t kb = ReadSysfsNumber(queue + "max_hw_sectors_kb");
  const uint64_t segments = ReadSysfsNumber(queue + "max_segments");
  if (kb == 0 || segments == 0) return kFallback;
  return static_cast<uint32_t>(std::min<uint64_t>({kb * 1024, segments * 4096, uint64_t{1} << 30}));
}

}  // namespace

IoPlatform& IoPlatform::Default() {
  static IoPlatform platform;
  return platform;
}

int IoPlatform::Open(const std::string& path, int flags, mode_t mode) {
  int fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  return fd >= 0 ? fd : NegErrno();
}

int IoPlatform::Close(int fd) { return ::close(fd) == 0 ? 0 : NegErrno(); }

int IoPlatform::Unlink(const std::string& path) { return ::unlink(path.c_str()) == 0 ? 0 : NegErrno(); }

int IoPlatform::Stat(const std::string& path, DeviceFileFacts* out) {
  *out = DeviceFileFacts{};
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return 0;
    return NegErrno();
  }
  out->exists = true;
  out->is_block_device = S_ISBLK(st.st_mode);
  out->is_regular = S_ISREG(st.st_mode);
  out->is_char_device = S_ISCHR(st.st_mode);
  out->size = static_cast<uint64_t>(st.st_size);
  struct statfs fs {};
  if (::statfs(path.c_str(), &fs) == 0) FillFsFacts(fs, out);
  return 0;
}

int IoPlatform::Fstat(int fd, DeviceFileFacts* out) {
  *out = DeviceFileFacts{};
  struct stat st {};
  if (::fstat(fd, &st) != 0) return NegErrno();
  out->exists = true;
  out->is_block_device = S_ISBLK(st.st_mode);
  out->is_regular = S_ISREG(st.st_mode);
  out->is_char_device = S_ISCHR(st.st_mode);
  out->size = static_cast<uint64_t>(st.st_size);
  if (out->is_block_device) {
    uint64_t bytes = 0;
    if (::ioctl(fd, BLKGETSIZE64, &bytes) != 0) return NegErrno();
    out->size = bytes;
  }
  struct statfs fs {};
  if (::fstatfs(fd, &fs) == 0) FillFsFacts(fs, out);
  return 0;
}

int IoPlatform::Fallocate(int fd, uint64_t size) {
  // A long allocation may stop with EINTR at a pending signal (seen after an io_uring ring's
  // teardown, most likely its task work), keeping what it allocated: ask again.
  int rc = -EINTR;
  for (int tries = 0; rc == -EINTR && tries < 1000; ++tries) {
    rc = ::fallocate(fd, 0, 0, static_cast<off_t>(size)) == 0 ? 0 : NegErrno();
  }
  return rc;
}

ssize_t IoPlatform::Pread(int fd, void* buf, size_t len, uint64_t offset) {
  ssize_t n = ::pread(fd, buf, len, static_cast<off_t>(offset));
  return n >= 0 ? n : NegErrno();
}

ssize_t IoPlatform::Pwrite(int fd, const void* buf, size_t len, uint64_t offset) {
  ssize_t n = ::pwrite(fd, buf, len, static_cast<off_t>(offset));
  return n >= 0 ? n : NegErrno();
}

int IoPlatform::Fdatasync(int fd) { return ::fdatasync(fd) == 0 ? 0 : NegErrno(); }

int IoPlatform::LockExclusive(int fd) { return ::flock(fd, LOCK_EX | LOCK_NB) == 0 ? 0 : NegErrno(); }

int IoPlatform::Unlock(int fd) { return ::flock(fd, LOCK_UN) == 0 ? 0 : NegErrno(); }

int IoPlatform::DropCache(int fd, uint64_t offset, uint64_t len) {
  // posix_fadvise returns the error number rather than setting errno.
  return -::posix_fadvise(fd, static_cast<off_t>(offset), static_cast<off_t>(len), POSIX_FADV_DONTNEED);
}

int IoPlatform::CreateRing(unsigned depth, std::unique_ptr<IoRing>* out) {
  auto ring = std::make_unique<LinuxRing>();
  int rc = ring->Init(depth, nullptr);
  if (rc < 0) return rc;
  *out = std::move(ring);
  return 0;
}

int IoPlatform::CreateNvmeRing(unsigned entries, const NvmeNamespace& ns, std::unique_ptr<IoRing>* out) {
  auto ring = std::make_unique<LinuxRing>();
  int rc = ring->Init(entries, &ns);
  if (rc < 0) return rc;
  *out = std::move(ring);
  return 0;
}

int IoPlatform::NvmeIdentify(int fd, const std::string& path, NvmeNamespace* out, std::string* why) {
  const int nsid = ::ioctl(fd, NVME_IOCTL_ID);
  if (nsid < 0) return NegErrno();
  std::vector<std::byte> page(kNvmeIdentifyBytes);
  struct nvme_admin_cmd cmd {};
  cmd.opcode = kNvmeAdminIdentify;
  cmd.nsid = static_cast<uint32_t>(nsid);
  cmd.addr = reinterpret_cast<uint64_t>(page.data());
  cmd.data_len = kNvmeIdentifyBytes;
  cmd.cdw10 = 0;  // CNS 0: the namespace's own data structure
  int rc = ::ioctl(fd, NVME_IOCTL_ADMIN_CMD, &cmd);
  if (rc < 0) return NegErrno();
  if (rc > 0) {
    *why = path + ": identify namespace failed: " + NvmeStatusText(static_cast<uint32_t>(rc));
    return -EIO;
  }
  Status s = ParseIdentifyNamespace(page, out);
  if (!s.ok()) {
    *why = path + ": " + s.message();
    return -EINVAL;
  }
  out->nsid = static_cast<uint32_t>(nsid);
  out->max_transfer_bytes = NvmeMaxTransfer(fd);
  return 0;
}

int IoPlatform::NvmeFlush(int fd, uint32_t nsid, uint32_t* nvme_status) {
  *nvme_status = 0;
  struct nvme_passthru_cmd cmd {};
  cmd.opcode = kNvmeOpFlush;
  cmd.nsid = nsid;
  int rc = ::ioctl(fd, NVME_IOCTL_IO_CMD, &cmd);
  if (rc < 0) return NegErrno();
  if (rc > 0) {
    *nvme_status = static_cast<uint32_t>(rc);
    return -EIO;
  }
  return 0;
}

std::string IoErrnoText(int neg_errno) {
  int e = -neg_errno;
  const char* name = strerrorname_np(e);
  return std::string(std::strerror(e)) + " (" + (name ? name : std::to_string(e)) + ")";
}

}  // namespace cxlkv::tier
