#include "sync/local_node.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <new>

#include "region/platform.h"

namespace cxlkv::sync {
namespace {

constexpr uint64_t kLocalMagic = 0x4c41434f4c4b5843ull;  // "CXKLOCAL"
constexpr uint32_t kLocalVersion = 1;

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
  return "/dev/shm/cxlkv-node-" + region_id + "-" + std::to_string(node);
}

Result<std::unique_ptr<LocalNode>> LocalNode::Open(const std::string& region_id, uint32_t node,
                                                   uint32_t max_locks) {
  std::unique_ptr<LocalNode> local(new LocalNode());
  local->path_ = PathFor(region_id, node);
  local->size_ = FileBytes(max_locks);
  // Made under a private name and renamed into place, so a process never maps a file whose
  // mutexes are not initialized yet.
  int fd = ::open(local->path_.c_str(), O_RDWR);
  if (fd < 0 && errno == ENOENT) {
    std::string staging = local->path_ + ".init-" + std::to_string(::getpid());
    int sfd = ::open(staging.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0660);
    if (sfd < 0) return IoError("cannot create node-local file " + staging + ": " + std::strerror(errno));
    if (::ftruncate(sfd, static_cast<off_t>(local->size_)) != 0) {
      ::close(sfd);
      ::unlink(staging.c_str());
      return NoSpace("cannot size node-local file " + staging + ": " + std::strerror(errno));
    }
    void* p = ::mmap(nullptr, local->size_, PROT_READ | PROT_WRITE, MAP_SHARED, sfd, 0);
    if (p == MAP_FAILED) {
      ::close(sfd);
      ::unlink(staging.c_str());
      return IoError("cannot map node-local file: " + std::string(std::strerror(errno)));
    }
    auto* h = new (p) LocalHeader();
    h->magic = kLocalMagic;
    h->version = kLocalVersion;
    h->max_locks = max_locks;
    InitMutex(&h->beat_owner);
    InitMutex(&h->heap_mu);
    InitMutex(&h->inbox_mu);
    auto* locks = reinterpret_cast<LocalLock*>(static_cast<uint8_t*>(p) + sizeof(LocalHeader));
    for (uint32_t k = 0; k < max_locks; ++k) {
      new (&locks[k]) LocalLock();
      InitMutex(&locks[k].mu);
    }
    ::munmap(p, local->size_);
    if (region::Platform::Default().RenameNoReplace(staging, local->path_) == 0) {
      local->created_ = true;
    } else {
      ::unlink(staging.c_str());  // another process of this node won the race: use theirs
    }
    ::close(sfd);
    fd = ::open(local->path_.c_str(), O_RDWR);
  }
  if (fd < 0) return IoError("cannot open node-local file " + local->path_ + ": " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < local->size_) {
    ::close(fd);
    return Corrupted("node-local file " + local->path_ + " is too small; remove it (no process of "
                     "node " + std::to_string(node) + " may be running) and retry");
  }
  void* p = ::mmap(nullptr, local->size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
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

LocalNode::~LocalNode() {
  if (base_ != nullptr) ::munmap(base_, size_);
}

}  // namespace cxlkv::sync
