#include "sync/local_node.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <new>

#include "region/platform.h"

namespace cxlkv::sync {
namespace {

constexpr uint64_t kLocalMagic = 0x4c41434f4c4b5843ull;  // "CXKLOCAL"
constexpr uint32_t kLocalVersion = 6;  // 2: per-process beats, manager_mu, flock lifetime; 3: process slots; 4: drain_mu;
                                       // 5: the drain claim; 6: heap classes keyed by slot size
constexpr char kNodeFilePrefix[] = "/dev/shm/cxlkv-node-";

size_t NodeFileBytes(uint32_t max_locks) {
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
  InitMutex(&h->drain_mu);
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
  return kNodeFilePrefix + region_id + "-" + std::to_string(node);
}

LocalNode::LocalNode(HostFile file)
    : file_(std::move(file)),
      header_(static_cast<LocalHeader*>(file_.base())),
      locks_(reinterpret_cast<LocalLock*>(static_cast<uint8_t*>(file_.base()) + sizeof(LocalHeader))) {}

Result<std::unique_ptr<LocalNode>> LocalNode::Open(const std::string& region_id, uint32_t node,
                                                   uint32_t max_locks) {
  const size_t size = NodeFileBytes(max_locks);
  auto create = [&](const std::string& path, bool* made) { return CreateFile(path, size, max_locks, made); };
  // The first process of a node on this host starts a new life: whatever its predecessors held
  // (they left or were killed) is recovered, never continued. Marked before any other process
  // of the node can attach, so a process that joins beside it never has its new life ended.
  auto first_use = [](void* base) {
    auto* h = static_cast<LocalHeader*>(base);
    if (h->magic == kLocalMagic && h->version == kLocalVersion) h->last_beat_ns.store(0);
  };
  CXLKV_ASSIGN_OR_RETURN(HostFile file,
                         HostFile::Open(PathFor(region_id, node), size, create, "node-local file", first_use));
  std::unique_ptr<LocalNode> local(new LocalNode(std::move(file)));
  const LocalHeader& h = *local->header_;
  if (h.magic != kLocalMagic || h.version != kLocalVersion || h.max_locks != max_locks) {
    return Corrupted("node-local file " + local->path() + " does not match this region (other "
                     "version or lock count); remove it while node " + std::to_string(node) +
                     " is stopped");
  }
  return local;
}

bool LocalNode::LastUser() { return file_.LastUser(); }

void LocalNode::SweepUnused(const std::string& except) { HostFile::SweepUnused(kNodeFilePrefix, except); }

}  // namespace cxlkv::sync
