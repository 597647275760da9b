#include "sync/host_wake.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
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
constexpr char kWakeFilePrefix[] = "/dev/shm/cxlkv-wake-";

}  // namespace

struct HostWake::Header {
  uint64_t magic;
  uint32_t version;
  uint32_t max_nodes;
};

namespace {

size_t WakeFileBytes(uint32_t max_nodes) {
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

namespace {

long Futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the waiters are other processes mapping the same file.
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

}  // namespace

std::string HostWake::PathFor(const std::string& region_id) { return kWakeFilePrefix + region_id; }

Result<std::unique_ptr<HostWake>> HostWake::Open(const std::string& region_id, uint32_t max_nodes) {
  const size_t size = WakeFileBytes(max_nodes);
  auto create = [&](const std::string& path, bool* made) {
    *made = false;
    return CreateFile(path, size, max_nodes);
  };
  CXLKV_ASSIGN_OR_RETURN(HostFile file, HostFile::Open(PathFor(region_id), size, create, "wake file"));
  const auto* h = static_cast<const Header*>(file.base());
  if (h->magic != kWakeMagic || h->version != kWakeVersion || h->max_nodes != max_nodes) {
    return Corrupted("wake file " + file.path() + " does not match this region (other version or node "
                     "count); remove it while no process uses the region");
  }
  return std::unique_ptr<HostWake>(new HostWake(std::move(file), max_nodes));
}

HostWake::Channel& HostWake::manager() { return *reinterpret_cast<Channel*>(static_cast<uint8_t*>(file_.base()) + 64); }

HostWake::Channel& HostWake::grant(uint32_t node) {
  // Callers pass this node's own id or one from the lock layout, both below max_nodes.
  return reinterpret_cast<Channel*>(static_cast<uint8_t*>(file_.base()) + 128)[node < max_nodes_ ? node : 0];
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

void HostWake::SweepUnused(const std::string& except) { HostFile::SweepUnused(kWakeFilePrefix, except); }

}  // namespace cxlkv::sync
