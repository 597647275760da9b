// Host-local wake-ups for the lock protocol: futex words in a small file in /dev/shm shared by
// every process of every node on this host that uses the region.
//
// The lock protocol itself is polled: requests, grants and doorbells are words in the region,
// and a manager on another host can only see them by reading. Polling costs a core or costs
// latency: a manager that sleeps 1 ms when idle makes the next grant wait up to 1 ms; one that
// yields in a loop takes the CPU a holder or a copy needs (two cores). Here the waiting side
// announces that it sleeps and sleeps on a futex; the side that changes something this host
// waits for wakes it. The wake-up is only a hint: every sleeper also has a timeout and re-polls,
// so a requester on another host (which cannot reach this host's futex), a lost wake-up or a
// missing file costs latency, never correctness.
//
//   manager:   ArmManager() once idle; then each round: e = ManagerEpoch(), scan the doorbells,
//              WaitManager(e, timeout); DisarmManager() when something comes
//   requester: ring the doorbell (published) → WakeManager()
//   waiter:    ArmGrant(node) → one more read of its grant → WaitGrant(node, armed, timeout)
//   manager:   publish a grant to `node` → WakeGrant(node)
// Arm-then-recheck on one side and publish-then-check on the other is the Dekker pattern: with
// a full fence on both sides at least one of them sees the other, so no wake-up is lost.
//
// Lifetime: every process holds a shared flock on the file; the last one removes it, and a
// joiner removes files nobody holds (left by kill -9), as for the node-local file.
//
// Thread-safety: all methods are safe from any thread of any process on this host.
#ifndef CXLKV_SRC_SYNC_HOST_WAKE_H_
#define CXLKV_SRC_SYNC_HOST_WAKE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "cxlkv/status.h"
#include "sync/host_file.h"

namespace cxlkv::sync {

class HostWake {
 public:
  // Opens (creating on first use) the wake file of region `region_id`, sized for `max_nodes`.
  static Result<std::unique_ptr<HostWake>> Open(const std::string& region_id, uint32_t max_nodes);
  ~HostWake() = default;  // the last process of the host removes the file
  HostWake(const HostWake&) = delete;
  HostWake& operator=(const HostWake&) = delete;

  // The manager: announce a sleep (returns the epoch to wait on), then wait unless woken since.
  uint32_t ArmManager();
  uint32_t ManagerEpoch();
  void WaitManager(uint32_t armed, std::chrono::microseconds timeout);
  void DisarmManager();
  // A requester after publishing its doorbell: wakes a sleeping manager on this host.
  void WakeManager();

  // A process of `node` waiting for a grant, and the manager after granting to `node`.
  uint32_t ArmGrant(uint32_t node);
  void WaitGrant(uint32_t node, uint32_t armed, std::chrono::microseconds timeout);
  void DisarmGrant(uint32_t node);
  void WakeGrant(uint32_t node);

  // Removes wake files of any region that no process uses any more. Safe against joiners.
  static void SweepUnused(const std::string& except);
  static std::string PathFor(const std::string& region_id);
  const std::string& path() const { return file_.path(); }

  uint64_t wakes_sent() const { return wakes_sent_.load(std::memory_order_relaxed); }

 private:
  // One futex word and the count of its sleepers, alone on a cache line.
  struct alignas(64) Channel {
    std::atomic<uint32_t> epoch;    // bumped by every wake-up: the futex word
    std::atomic<uint32_t> sleepers; // armed waiters: a waker with none to wake skips the syscall
  };
  struct Header;

  HostWake(HostFile file, uint32_t max_nodes) : file_(std::move(file)), max_nodes_(max_nodes) {}
  Channel& manager();
  Channel& grant(uint32_t node);
  void Wake(Channel& c);
  static void Wait(Channel& c, uint32_t armed, std::chrono::microseconds timeout);

  HostFile file_;
  uint32_t max_nodes_ = 0;
  std::atomic<uint64_t> wakes_sent_{0};
};

}  // namespace cxlkv::sync

#endif  // CXLKV_SRC_SYNC_HOST_WAKE_H_
