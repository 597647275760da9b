#include "sync/local_node.h"

#include <errno.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <new>

#include "region/platform.h"
#include "sync/host_wake.h"

namespace cxlkv::sync {
namespace {

constexpr uint64_t kLocalMagic = 0x4c41434f4c4b5843ull;  // "CXKLOCAL"
constexpr uint32_t kLocalVersion = 3;  // 2: per-process beats, manager_mu, flock lifetime; 3: process slots
constexpr char kPrefix[] = "/dev/shm/cxlkv-node-";

size_t FileBytes(uint32_t max_locks) {
  size_t bytes = sizeof(LocalHeader) + size_t{max_locks} * sizeof(LocalLock);
  return (bytes + 4095) / 4096 * 4096;
}

void InitMutex(pthread_mutex_t* mu) {
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  pthread_mutex_init(mu, &attr);
  pthread_mutexattr_destroy(&attr);
}

// Makes the file under a private name and renames it into place, so a process never maps a file
// whose mutexes are not initialized yet. `created` tells whether ours won the race.
Status CreateFile(const std::string& path, size_t size, uint32_t max_locks, bool* created) {
  std::string staging = path + ".init-" + std::to_string(::getpid());
  int sfd = ::open(staging.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0660);
  if (sfd < 0) return IoError("cannot create node-local file " + staging + ": " + std::strerror(errno));
  if (::ftruncate(sfd, static_cast<off_t>(size)) != 0) {
    ::close(sfd);
    ::unlink(staging.c_str());
    return NoSpace("cannot size node-local file " + staging + ": " + std::strerror(errno));
  }
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, sfd, 0);
  ::close(sfd);
  if (p == MAP_FAILED) {
    ::unlink(staging.c_str());
    return IoError("cannot map node-local file: " + std::string(std::strerror(errno)));
  }
  auto* h = new (p) LocalHeader();
  h->magic = kLocalMagic;
  h->version = kLocalVersion;
  h->max_locks = max_locks;
  InitMutex(&h->beat_mu);
  InitMutex(&h->manager_mu);
  InitMutex(&h->heap_mu);
  InitMutex(&h->inbox_mu);
  for (LocalProcess& slot : h->processes) InitMutex(&slot.mu);
  auto* locks = reinterpret_cast<LocalLock*>(static_cast<uint8_t*>(p) + sizeof(LocalHeader));
  for (uint32_t k = 0; k < max_locks; ++k) {
    new (&locks[k]) LocalLock();
    InitMutex(&locks[k].mu);
  }
  ::munmap(p, size);
  *created = region::Platform::Default().RenameNoReplace(staging, path) == 0;
  if (!*created) ::unlink(staging.c_str());  // another process of this node won the race: use theirs
  return Status::Ok();
}

}  // namespace

bool LockRobust(pthread_mutex_t* mu) {
  int rc = pthread_mutex_lock(mu);
  if (rc == EOWNERDEAD) {
    pthread_mutex_consistent(mu);
    return true;
  }
  return false;
}

int TryLockRobust(pthread_mutex_t* mu) {
  int rc = pthread_mutex_trylock(mu);
  if (rc == 0) return 0;
  if (rc == EOWNERDEAD) {
    pthread_mutex_consistent(mu);
    return 1;
  }
  return -1;
}

std::string LocalNode::PathFor(const std::string& region_id, uint32_t node) {
  return kPrefix + region_id + "-" + std::to_string(node);
}

Result<std::unique_ptr<LocalNode>> LocalNode::Open(const std::string& region_id, uint32_t node,
                                                   uint32_t max_locks) {
  std::unique_ptr<LocalNode> local(new LocalNode());
  local->path_ = PathFor(region_id, node);
  local->size_ = FileBytes(max_locks);
  // A file whose last user is removing it may still be found by name: hold the shared flock,
  // then make sure the name still leads to the file we hold, or start over.
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    fd = ::open(local->path_.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT) {
      CXLKV_RETURN_IF_ERROR(CreateFile(local->path_, local->size_, max_locks, &local->created_));
      continue;
    }
    if (fd < 0) break;
    // Alone on the file? Then every earlier process of this node is gone (left or killed).
    local->first_user_ = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    int locked = SharedLockBounded(fd);
    if (locked < 0) {
      ::close(fd);
      return IoError("cannot lock node-local file " + local->path_ + ": " + std::strerror(-locked));
    }
    if (locked == 0) {  // held exclusively too long (by a remover or a sweeper): open it anew
      ::close(fd);
      fd = -1;
      local->created_ = false;
      continue;
    }
    struct stat held, named;
    if (::fstat(fd, &held) != 0 || ::stat(local->path_.c_str(), &named) != 0 || held.st_ino != named.st_ino ||
        held.st_dev != named.st_dev) {
      ::close(fd);  // removed (or replaced) under us: open the current one
      fd = -1;
      local->created_ = false;
    }
  }
  if (fd < 0) return IoError("cannot open node-local file " + local->path_ + ": " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < local->size_) {
    ::close(fd);
    return Corrupted("node-local file " + local->path_ + " is too small; remove it (no process of "
                     "node " + std::to_string(node) + " may be running) and retry");
  }
  void* p = ::mmap(nullptr, local->size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  local->fd_ = fd;  // closed (dropping the flock) by the destructor
  if (p == MAP_FAILED) return IoError("cannot map node-local file: " + std::string(std::strerror(errno)));
  local->base_ = p;
  local->header_ = static_cast<LocalHeader*>(p);
  local->locks_ = reinterpret_cast<LocalLock*>(static_cast<uint8_t*>(p) + sizeof(LocalHeader));
  if (local->header_->magic != kLocalMagic || local->header_->version != kLocalVersion ||
      local->header_->max_locks != max_locks) {
    return Corrupted("node-local file " + local->path_ + " does not match this region (other "
                     "version or lock count); remove it while node " + std::to_string(node) +
                     " is stopped");
  }
  return local;
}

bool LocalNode::LastUser() {
  if (fd_ < 0) return false;
  // Trade our shared lock for an exclusive one: it is granted only if no other process holds
  // the file. Between the two, a joiner may take its shared lock first: then we are not last.
  if (::flock(fd_, LOCK_EX | LOCK_NB) == 0) {
    last_ = true;
    return true;
  }
  return false;
}

LocalNode::~LocalNode() {
  if (base_ != nullptr) ::munmap(base_, size_);
  if (fd_ >= 0) {
    if (last_) ::unlink(path_.c_str());  // under the exclusive lock: joiners re-open by name
    ::close(fd_);
  }
}

void LocalNode::SweepUnused(const std::string& except) {
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
    // Unused: nobody holds it; and still the file of that name (not replaced since we opened it).
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0 && ::fstat(fd, &held) == 0 && ::stat(path.c_str(), &named) == 0 &&
        held.st_ino == named.st_ino && (name.find(".init-") == std::string::npos || held.st_size == 0 ||
                                        ::time(nullptr) - held.st_mtime > 60)) {
      ::unlink(path.c_str());
    }
    ::close(fd);
  }
  ::closedir(dir);
}

}  // namespace cxlkv::sync
