// Linux implementation of the tier layer's IoPlatform seam; the ring is liburing's io_uring.
#include <fcntl.h>
#include <sys/file.h>
#include <linux/fs.h>
#include <linux/magic.h>
#include <liburing.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

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

  int Init(unsigned depth) {
    int rc = io_uring_queue_init(depth, &ring_, 0);
    initialized_ = rc == 0;
    return rc;
  }

  int RegisterFile(int fd) override { return io_uring_register_files(&ring_, &fd, 1); }

  int RegisterBuffer(void* base, size_t len) override {
    struct iovec iov {base, len};
    return io_uring_register_buffers(&ring_, &iov, 1);
  }

  bool Queue(const RingOp& op) override {
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
    if (io_uring_peek_cqe(&ring_, &cqe) != 0 || cqe == nullptr) return 0;
    Take(cqe, out);
    return 1;
  }

  int Wait(RingCompletion* out) override {
    struct io_uring_cqe* cqe = nullptr;
    int rc;
    do {
      rc = io_uring_wait_cqe(&ring_, &cqe);
    } while (rc == -EINTR);  // a signal interrupted the wait, not the I/O: wait again
    if (rc < 0) return rc;
    Take(cqe, out);
    return 0;
  }

 private:
  void Take(struct io_uring_cqe* cqe, RingCompletion* out) {
    out->user_data = io_uring_cqe_get_data64(cqe);
    out->res = cqe->res;
    io_uring_cqe_seen(&ring_, cqe);
  }

  struct io_uring ring_ {};
  bool initialized_ = false;
};

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
  return ::fallocate(fd, 0, 0, static_cast<off_t>(size)) == 0 ? 0 : NegErrno();
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
  int rc = ring->Init(depth);
  if (rc < 0) return rc;
  *out = std::move(ring);
  return 0;
}

std::string IoErrnoText(int neg_errno) {
  int e = -neg_errno;
  const char* name = strerrorname_np(e);
  return std::string(std::strerror(e)) + " (" + (name ? name : std::to_string(e)) + ")";
}

}  // namespace cxlkv::tier
