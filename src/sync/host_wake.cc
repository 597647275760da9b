#include "sync/host_wake.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <cstring>
#include <new>

#include "region/platform.h"

namespace cxlkv::sync {
namespace {

constexpr uint64_t kWakeMagic = 0x454b41574b4c5843ull;  // "CXLKWAKE"
constexpr uint32_t kWakeVersion = 1;
constexpr char kPrefix[] = "/dev/shm/cxlkv-wake-";

}  // namespace

struct HostWake::Header {
  uint64_t magic;
  uint32_t version;
  uint32_t max_nodes;
};

namespace {

size_t FileBytes(uint32_t max_nodes) {
  // The header's line, the manager's channel, one channel per node.
  return 64 + 64 + size_t{max_nodes} * 64;
}

// Builds the file under a private name and renames it into place, so nobody maps a file whose
// header is not written yet. Losing the race to another process is fine: use theirs.
Status CreateFile(const std::string& path, size_t size, uint32_t max_nodes) {
  std::string staging = path + ".init-" + std::to_string(::getpid());
  int fd = ::open(staging.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0660);
  if (fd < 0) return IoError("cannot create wake file " + staging + ": " + std::strerror(errno));
  uint8_t line[64] = {};
  const uint64_t magic = kWakeMagic;
  const uint32_t version = kWakeVersion;
  std::memcpy(line, &magic, 8);
  std::memcpy(line + 8, &version, 4);
  std::memcpy(line + 12, &max_nodes, 4);
  // The channels start at zero: the file's holes read as zeros.
  bool ok = ::ftruncate(fd, static_cast<off_t>(size)) == 0 && ::pwrite(fd, line, sizeof line, 0) == sizeof line;
  int err = errno;
  ::close(fd);
  if (!ok) {
    ::unlink(staging.c_str());
    return NoSpace("cannot write wake file " + staging + ": " + std::strerror(err));
  }
  if (region::Platform::Default().RenameNoReplace(staging, path) != 0) ::unlink(staging.c_str());
  return Status::Ok();
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

namespace {

long Futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the waiters are other processes mapping the same file.
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

}  // namespace

std::string HostWake::PathFor(const std::string& region_id) { return kPrefix + region_id; }

Result<std::unique_ptr<HostWake>> HostWake::Open(const std::string& region_id, uint32_t max_nodes) {
  std::unique_ptr<HostWake> w(new HostWake());
  w->path_ = PathFor(region_id);
  w->size_ = FileBytes(max_nodes);
  w->max_nodes_ = max_nodes;
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    fd = ::open(w->path_.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT) {
      CXLKV_RETURN_IF_ERROR(CreateFile(w->path_, w->size_, max_nodes));
      continue;
    }
    if (fd < 0) break;
    int locked = SharedLockBounded(fd);
    if (locked < 0) {
      ::close(fd);
      return IoError("cannot lock wake file " + w->path_ + ": " + std::strerror(-locked));
    }
    if (locked == 0) {  // held exclusively too long (by a remover or a sweeper): open it anew
      ::close(fd);
      fd = -1;
      continue;
    }
    // The last user may have removed it between our open and our lock: use the current one.
    struct stat held, named;
    if (::fstat(fd, &held) != 0 || ::stat(w->path_.c_str(), &named) != 0 || held.st_ino != named.st_ino ||
        held.st_dev != named.st_dev) {
      ::close(fd);
      fd = -1;
    }
  }
  if (fd < 0) return IoError("cannot open wake file " + w->path_ + ": " + std::strerror(errno));
  w->fd_ = fd;  // closed (dropping the flock) by the destructor
  struct stat st;
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < w->size_) {
    return Corrupted("wake file " + w->path_ + " is too small; remove it and retry");
  }
  void* p = ::mmap(nullptr, w->size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return IoError("cannot map wake file " + w->path_ + ": " + std::strerror(errno));
  w->base_ = p;
  const auto* h = static_cast<const Header*>(p);
  if (h->magic != kWakeMagic || h->version != kWakeVersion || h->max_nodes != max_nodes) {
    return Corrupted("wake file " + w->path_ + " does not match this region (other version or node "
                     "count); remove it while no process uses the region");
  }
  return w;
}

HostWake::~HostWake() {
  if (base_ != nullptr) ::munmap(base_, size_);
  if (fd_ >= 0) {
    // Exclusive only if no other process holds it: then we are the last, and remove it.
    if (::flock(fd_, LOCK_EX | LOCK_NB) == 0) ::unlink(path_.c_str());
    ::close(fd_);
  }
}

HostWake::Channel& HostWake::manager() { return *reinterpret_cast<Channel*>(static_cast<uint8_t*>(base_) + 64); }

HostWake::Channel& HostWake::grant(uint32_t node) {
  // Callers pass this node's own id or one from the lock layout, both below max_nodes.
  return reinterpret_cast<Channel*>(static_cast<uint8_t*>(base_) + 128)[node < max_nodes_ ? node : 0];
}

void HostWake::Wake(Channel& c) {
  // The caller published its change; the fence orders that before reading `sleepers` (Dekker).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (c.sleepers.load(std::memory_order_seq_cst) == 0) return;
  c.epoch.fetch_add(1, std::memory_order_seq_cst);
  Futex(&c.epoch, FUTEX_WAKE, INT_MAX, nullptr);
  wakes_sent_.fetch_add(1, std::memory_order_relaxed);
}

void HostWake::Wait(Channel& c, uint32_t armed, std::chrono::microseconds timeout) {
  timespec ts{static_cast<time_t>(timeout.count() / 1000000), static_cast<long>(timeout.count() % 1000000) * 1000};
  // EAGAIN: woken between arming and now. EINTR/ETIMEDOUT: the caller re-polls either way.
  Futex(&c.epoch, FUTEX_WAIT, armed, &ts);
}

uint32_t HostWake::ArmManager() {
  manager().sleepers.fetch_add(1, std::memory_order_seq_cst);
  return manager().epoch.load(std::memory_order_seq_cst);
}
uint32_t HostWake::ManagerEpoch() { return manager().epoch.load(std::memory_order_seq_cst); }
void HostWake::WaitManager(uint32_t armed, std::chrono::microseconds timeout) { Wait(manager(), armed, timeout); }
void HostWake::DisarmManager() { manager().sleepers.fetch_sub(1, std::memory_order_seq_cst); }
void HostWake::WakeManager() { Wake(manager()); }

uint32_t HostWake::ArmGrant(uint32_t node) {
  grant(node).sleepers.fetch_add(1, std::memory_order_seq_cst);
  return grant(node).epoch.load(std::memory_order_seq_cst);
}
void HostWake::WaitGrant(uint32_t node, uint32_t armed, std::chrono::microseconds timeout) {
  Wait(grant(node), armed, timeout);
}
void HostWake::DisarmGrant(uint32_t node) { grant(node).sleepers.fetch_sub(1, std::memory_order_seq_cst); }
void HostWake::WakeGrant(uint32_t node) { Wake(grant(node)); }

void HostWake::SweepUnused(const std::string& except) {
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return;
  const std::string prefix = std::string(kPrefix).substr(std::strlen("/dev/shm/"));
  while (dirent* e = ::readdir(dir)) {
    std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    std::string path = "/dev/shm/" + name;
    if (path == except) continue;
    int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat held, named;
    // Nobody holds it, it is still the file of that name, and it is not a creator's staging
    // file still being written (those are young).
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0 && ::fstat(fd, &held) == 0 && ::stat(path.c_str(), &named) == 0 &&
        held.st_ino == named.st_ino &&
        (name.find(".init-") == std::string::npos || ::time(nullptr) - held.st_mtime > 60)) {
      ::unlink(path.c_str());
    }
    ::close(fd);
  }
  ::closedir(dir);
}

}  // namespace cxlkv::sync
