#include "sync/host_file.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <ctime>

namespace cxlkv::sync {
namespace {

bool SameFile(int fd, const std::string& path) {
  struct stat held, named;
  return ::fstat(fd, &held) == 0 && ::stat(path.c_str(), &named) == 0 && held.st_ino == named.st_ino &&
         held.st_dev == named.st_dev;
}

// The joiners' gate: an open-file-description lock (fcntl, independent of flock) on the file's
// first byte, held by one joiner at a time across its two flock calls and, for the first user,
// until its first use of the file is done. flock converts a lock from exclusive to shared by
// dropping it first: a second joiner taking the exclusive lock in that moment would take itself
// for the first user too. And a second joiner that attached before the first user's first use
// (a node's life reset) would have that life ended under it. Bounded: a stopped joiner holding
// the gate is passed after kGateWait (the races are then possible again). The bound is wall time,
// not a count of tries: a first user descheduled for tens of milliseconds on a loaded machine
// (its mmap and first use take microseconds of CPU) must not be passed.
constexpr int64_t kGateWaitNs = 2'000'000'000;
bool GateBounded(int fd, short type) {
  struct flock gate {};
  gate.l_type = type;
  gate.l_whence = SEEK_SET;
  gate.l_start = 0;
  gate.l_len = 1;
  timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (;;) {
    if (::fcntl(fd, F_OFD_SETLK, &gate) == 0) return true;
    if (type == F_UNLCK || (errno != EAGAIN && errno != EACCES && errno != EINTR)) return false;
    timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if ((now.tv_sec - t0.tv_sec) * 1'000'000'000 + (now.tv_nsec - t0.tv_nsec) >= kGateWaitNs) return false;
    ::usleep(250);
  }
}

}  // namespace

int SharedLockBounded(int fd) {
  // Exclusive holders (the last user removing the file, a sweeper) hold it for microseconds;
  // a stopped or forked holder could hold it for ever. Never block on it: retry for a while,
  // then let the caller open the file by name again.
  for (int i = 0; i < 200; ++i) {
    if (::flock(fd, LOCK_SH | LOCK_NB) == 0) return 1;
    if (errno != EWOULDBLOCK && errno != EINTR) return -errno;
    ::usleep(250);
  }
  return 0;
}

Result<HostFile> HostFile::Open(const std::string& path, size_t size, const Creator& create, const std::string& what,
                                const FirstUse& first_use) {
  HostFile f;
  f.path_ = path;
  f.size_ = size;
  // A file whose last user is removing it may still be found by name: hold the shared flock,
  // then make sure the name still leads to the file we hold, or start over.
  int fd = -1;
  bool gated = false;  // held on fd (closing fd drops it)
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT) {
      CXLKV_RETURN_IF_ERROR(create(path, &f.created_));
      continue;
    }
    if (fd < 0) break;
    // Alone on the file? Then every earlier holder is gone (left or killed).
    gated = GateBounded(fd, F_WRLCK);
    f.first_user_ = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    const int locked = SharedLockBounded(fd);
    if (gated && !f.first_user_) gated = !GateBounded(fd, F_UNLCK);
    if (locked < 0) {
      ::close(fd);
      return IoError("cannot lock " + what + " " + path + ": " + std::strerror(-locked));
    }
    if (locked == 0 || !SameFile(fd, path)) {  // held exclusively too long, or removed under us
      ::close(fd);
      fd = -1;
      f.created_ = false;
    }
  }
  if (fd < 0) return IoError("cannot open " + what + " " + path + ": " + std::strerror(errno));
  f.fd_ = fd;  // closed (dropping the flock) by the destructor
  struct stat st;
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < size) {
    return Corrupted(what + " " + path + " is too small; remove it while no process uses the region, and retry");
  }
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return IoError("cannot map " + what + " " + path + ": " + std::strerror(errno));
  f.base_ = p;
  if (f.first_user_ && first_use) first_use(p);
  if (gated) (void)GateBounded(fd, F_UNLCK);
  return f;
}

HostFile::HostFile(HostFile&& other) noexcept
    : path_(std::move(other.path_)), base_(other.base_), size_(other.size_), fd_(other.fd_),
      created_(other.created_), first_user_(other.first_user_), last_(other.last_) {
  other.base_ = nullptr;
  other.fd_ = -1;
}

bool HostFile::LastUser() {
  if (fd_ < 0) return false;
  // Trade our shared lock for an exclusive one: granted only if no other process holds the
  // file. Between the two, a joiner may take its shared lock first: then we are not last.
  if (!last_) last_ = ::flock(fd_, LOCK_EX | LOCK_NB) == 0;
  return last_;
}

HostFile::~HostFile() {
  if (base_ != nullptr) ::munmap(base_, size_);
  if (fd_ >= 0) {
    if (LastUser()) ::unlink(path_.c_str());  // under the exclusive lock: joiners re-open by name
    ::close(fd_);
  }
}

void HostFile::SweepUnused(const std::string& prefix, const std::string& except) {
  const size_t slash = prefix.rfind('/');
  const std::string dir_path = prefix.substr(0, slash);
  const std::string name_prefix = prefix.substr(slash + 1);
  DIR* dir = ::opendir(dir_path.c_str());
  if (dir == nullptr) return;
  while (dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (name.compare(0, name_prefix.size(), name_prefix) != 0) continue;
    const std::string path = dir_path + "/" + name;
    if (path == except) continue;
    int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat held;
    // Nobody holds it; it is still the file of that name; and it is not a creator's staging
    // file still being written (those are young and already sized).
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0 && ::fstat(fd, &held) == 0 && SameFile(fd, path) &&
        (name.find(".init-") == std::string::npos || held.st_size == 0 || ::time(nullptr) - held.st_mtime > 60)) {
      ::unlink(path.c_str());
    }
    ::close(fd);
  }
  ::closedir(dir);
}

}  // namespace cxlkv::sync
