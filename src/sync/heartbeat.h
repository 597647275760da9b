// A node's life as one process sees it: the heartbeat it publishes, the lease it holds, and the
// fence every act that other nodes rely on passes first.
//
// Every process of a node runs a Heartbeat; whichever finds the node's last beat older than a
// beat interval publishes the next one (a try-locked local mutex serializes them, so a paused
// process never holds the others up). The beat is one 8-byte life word (incarnation, heartbeat,
// state) in the node's line. Observers declare the node dead after a lease without a change.
//
// Fencing (docs/protocol.md, "Leases and fencing"): a beat that began at time t keeps every
// observer from declaring the node dead before t + lease. So a process may act for the node
// until t + lease - margin; past that it may already have been declared dead and recovered,
// and `Fence` refuses. A beat that finds the previous one older than lease - margin does not
// extend the old life: it starts a new incarnation, and whatever was held under the old one
// (locks, WRITING entries, the manager role) is refused by `Fence(…, old incarnation)` for good.
//
// Thread- and process-safety: all methods are thread-safe; the node's processes coordinate
// through the node-local file (one host: coherent atomics and robust mutexes).
#ifndef CXLKV_SRC_SYNC_HEARTBEAT_H_
#define CXLKV_SRC_SYNC_HEARTBEAT_H_

#include <atomic>
#include <chrono>
#include <cstdint>

#include "cxlkv/status.h"
#include "region/meta.h"
#include "sync/layout.h"
#include "sync/local_node.h"

namespace cxlkv::sync {

int64_t MonotonicNs();

class Heartbeat {
 public:
  Heartbeat(region::MetaAccess& meta, LockArrayLayout locks, uint64_t line_offset, uint32_t node,
            std::chrono::milliseconds lease, LocalNode& local);

  // Beats if the node's last beat is a beat interval old (starting a new life if it is older
  // than the lease allows). Never waits on another process, node, lock or I/O.
  void Tick();
  // Ok iff this node's lease is surely valid now and `incarnation` (0: any) is its current life.
  // Otherwise a kLeaseExpired status naming `act`, the node and how stale the lease is.
  Status Fence(const char* act, uint64_t incarnation = 0) const;
  // Publishes "left" for the current life (call only as the node's last process).
  void PublishLeft();

  uint64_t incarnation() const { return local_.header().incarnation.load(); }
  std::chrono::nanoseconds interval() const { return lease_ / 8; }
  std::chrono::nanoseconds margin() const { return lease_ / 8; }
  uint64_t new_lives() const { return new_lives_.load(); }  // lives this process started

  void TestStop(bool stop) { test_stopped_.store(stop); }  // as if hung: no more beats
  bool test_stopped() const { return test_stopped_.load(); }

 private:
  void Publish(uint32_t incarnation, NodeState state, uint64_t heartbeat);
  bool ManagerCandidateExists();
  void StartNewLife(uint64_t incarnation);

  region::MetaAccess& meta_;
  LockArrayLayout locks_;
  uint64_t line_;
  uint32_t node_;
  std::chrono::nanoseconds lease_;
  LocalNode& local_;
  std::atomic<bool> test_stopped_{false};
  std::atomic<uint64_t> new_lives_{0};
};

}  // namespace cxlkv::sync

#endif  // CXLKV_SRC_SYNC_HEARTBEAT_H_
