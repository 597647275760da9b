// Linux implementation of the Platform seam.
#include <fcntl.h>
#include <linux/magic.h>
#include <numa.h>
#include <numaif.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>

#include "region/platform.h"

namespace cxlkv::region {

namespace {
int NegErrno() { return -errno; }
}  // namespace

Platform& Platform::Default() {
  static Platform platform;
  return platform;
}

int Platform::Open(const std::string& path, int flags, mode_t mode) {
  int fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  return fd >= 0 ? fd : NegErrno();
}

int Platform::Close(int fd) { return ::close(fd) == 0 ? 0 : NegErrno(); }

int Platform::Facts(int fd, FileFacts* out) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return NegErrno();
  *out = FileFacts{};
  out->size = static_cast<uint64_t>(st.st_size);
  if (S_ISCHR(st.st_mode)) {
    out->kind = FsKind::kCharDevice;
    out->rdev = st.st_rdev;
    return 0;
  }
  struct statfs sfs {};
  if (::fstatfs(fd, &sfs) != 0) return NegErrno();
  out->block_size = static_cast<uint64_t>(sfs.f_bsize);
  out->fs_free_bytes = static_cast<uint64_t>(sfs.f_bavail) * static_cast<uint64_t>(sfs.f_bsize);
  if (static_cast<unsigned long>(sfs.f_type) == TMPFS_MAGIC) {
    out->kind = FsKind::kTmpfs;
  } else if (static_cast<unsigned long>(sfs.f_type) == HUGETLBFS_MAGIC) {
    out->kind = FsKind::kHugetlbfs;
  } else {
    out->kind = FsKind::kOther;
  }
  return 0;
}

bool Platform::IsCharDevice(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISCHR(st.st_mode);
}

int Platform::Ftruncate(int fd, uint64_t size) {
  return ::ftruncate(fd, static_cast<off_t>(size)) == 0 ? 0 : NegErrno();
}

int Platform::Fallocate(int fd, uint64_t size) {
  // posix_fallocate returns the error number instead of setting errno. tmpfs gives up a long
  // allocation with EINTR when anything makes a signal pending (seen under scripts/nvme-vm after
  // an io_uring ring's teardown in the same process, most likely its task work), and keeps what
  // it allocated: asking again goes on from there.
  int rc = EINTR;
  for (int tries = 0; rc == EINTR && tries < 1000; ++tries) rc = ::posix_fallocate(fd, 0, static_cast<off_t>(size));
  return rc == 0 ? 0 : -rc;
}

void* Platform::Mmap(void* addr, size_t len, int prot, int flags, int fd, uint64_t off, int* err) {
  void* p = ::mmap(addr, len, prot, flags, fd, static_cast<off_t>(off));
  if (p == MAP_FAILED) {
    *err = -errno;
    return nullptr;
  }
  return p;
}

int Platform::Munmap(void* addr, size_t len) { return ::munmap(addr, len) == 0 ? 0 : NegErrno(); }

int Platform::RenameNoReplace(const std::string& from, const std::string& to) {
  return ::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0
             ? 0
             : NegErrno();
}

int Platform::Rename(const std::string& from, const std::string& to) {
  return ::rename(from.c_str(), to.c_str()) == 0 ? 0 : NegErrno();
}

int Platform::Unlink(const std::string& path) {
  return ::unlink(path.c_str()) == 0 ? 0 : NegErrno();
}

Result<std::string> Platform::ReadSysfs(const std::string& path) {
  std::string full = sysfs_root + "/" + path;
  std::ifstream in(full);
  if (!in) return NotFound("cannot read " + full + ": " + std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int Platform::NumaMaxNode() { return numa_available() < 0 ? -1 : numa_max_node(); }

int Platform::Populate(void* addr, size_t len) {
#ifndef MADV_POPULATE_WRITE
  constexpr int MADV_POPULATE_WRITE = 23;  // Linux 5.14; older kernels answer EINVAL
#endif
  return ::madvise(addr, len, MADV_POPULATE_WRITE) == 0 ? 0 : NegErrno();
}

int Platform::NumaBind(void* addr, size_t len, int node) {
  if (numa_available() < 0) return -ENOSYS;
  struct bitmask* mask = numa_allocate_nodemask();
  numa_bitmask_setbit(mask, static_cast<unsigned>(node));
  long rc = ::mbind(addr, len, MPOL_BIND, mask->maskp, mask->size + 1, MPOL_MF_STRICT);
  int err = rc == 0 ? 0 : NegErrno();
  numa_free_nodemask(mask);
  return err;
}

int Platform::NumaNodeOf(const void* addr) {
  if (numa_available() < 0) return -ENOSYS;
  int node = -1;
  if (::get_mempolicy(&node, nullptr, 0, const_cast<void*>(addr), MPOL_F_NODE | MPOL_F_ADDR) != 0) return NegErrno();
  return node;
}

int Platform::RunThreadOnNode(int node) {
  // libnuma caches node CPU masks without a lock (numa_node_to_cpus): threads binding at once
  // race inside it, so binding is serialized.
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (numa_available() < 0) return -ENOSYS;
  return numa_run_on_node(node) == 0 ? 0 : NegErrno();
}

std::string ErrnoText(int neg_errno) {
  int e = -neg_errno;
  std::string name = strerrorname_np(e) ? strerrorname_np(e) : std::to_string(e);
  return std::string(std::strerror(e)) + " (" + name + ")";
}

}  // namespace cxlkv::region
