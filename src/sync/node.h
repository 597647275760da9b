// A node's membership of a region and the two-tier lock (TraCT §3.3), per process.
//
//   auto node = sync::Node::Join(region, {.node_id = 3});
//   CXLKV_RETURN_IF_ERROR(node->Acquire(lock, Deadline::After(1s)));
//   ... read shared data after Invalidate, write it, then:
//   node->Release(lock, {{offset, bytes}});   // flushes what was written, then frees the lock
//
// Membership: one process of each node (the holder of the node-local beat_owner mutex)
// publishes a heartbeat in the node's line every lease/8. A node whose heartbeat has not moved
// for a lease is dead. A node that restarts after a lease of silence takes a new incarnation;
// requests of its old incarnation never match a grant again.
//
// Locks: a process first takes the node-local robust mutex of the lock (so one process per node
// competes), then publishes an odd request word in its node's request line, and waits until the
// manager publishes a grant equal to it. Release publishes the next (even) request word. The
// manager — a thread of the lowest-numbered live node's heartbeat owner — grants one node at a
// time, round-robin among waiters, and ignores dead nodes (and, on their death, zeroes their
// grants). Nothing uses a cross-node atomic read-modify-write.
//
// Thread-safety: all methods are thread-safe. A lock is held by the *process* (the local
// mutex is owned by the acquiring thread: release it from the thread that acquired it).
#ifndef CXLKV_SRC_SYNC_NODE_H_
#define CXLKV_SRC_SYNC_NODE_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "cxlkv/region.h"
#include "region/region_internal.h"
#include "sync/layout.h"
#include "sync/local_node.h"

namespace cxlkv::sync {

using Clock = std::chrono::steady_clock;

struct NodeOptions {
  uint32_t node_id = 0;                            // 0..max_nodes-1; required
  std::chrono::milliseconds lease{2000};           // dead after this long without a heartbeat. Default 2 s.
  bool may_host_manager = true;                    // false: never run the lock manager here. Default true.
};

// A byte range of shared metadata a critical section wrote (flushed by Release).
struct Range {
  uint64_t offset;
  uint64_t bytes;
};

// What one observer currently believes about a node.
struct NodeView {
  uint32_t id = 0;
  bool live = false;
  NodeState state = NodeState::kNever;
  uint64_t incarnation = 0;
  uint64_t heartbeat = 0;
  uint64_t pid = 0;
};

struct AcquireInfo {
  bool holder_died = false;  // a process of this node died holding this lock; we took over
};

class Node {
 public:
  // Joins `region` as node options.node_id. Errors: kInvalidArgument (node id out of range, no
  // lock array), kAlreadyExists (the node id is live elsewhere), kIoError (node-local file).
  static Result<std::unique_ptr<Node>> Join(Region& region, const NodeOptions& options);
  ~Node();  // leaves: stops threads; the last process of the node marks it left
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  uint32_t id() const { return options_.node_id; }
  uint64_t incarnation() const { return local_->header().incarnation.load(); }
  region::MetaAccess& meta() { return region_.impl().meta(); }
  Region& region() { return region_; }
  LocalNode& local() { return *local_; }
  std::chrono::milliseconds lease() const { return options_.lease; }

  // Lock ids >= kReservedLocks are handed out here; kResourceExhausted-like kNoSpace when full.
  Result<uint32_t> AllocateLock();
  Status FreeLock(uint32_t lock);

  // Blocks until granted or `deadline`; kTimeout then (the request is withdrawn).
  Result<AcquireInfo> Acquire(uint32_t lock, Clock::time_point deadline);
  Result<AcquireInfo> AcquireFor(uint32_t lock, std::chrono::milliseconds timeout) {
    return Acquire(lock, Clock::now() + timeout);
  }
  // Flushes `written` (rule P1), then publishes the release. REQUIRES: held by this thread.
  void Release(uint32_t lock, std::span<const Range> written = {});

  bool is_manager() const { return manager_running_.load(); }
  bool leaving() const { return stop_.load(); }  // the destructor has begun
  std::vector<NodeView> Nodes();  // this process's current view of every node
  // True when `node` runs life `incarnation` (compared modulo `inc_mask`) and, reading its line
  // now, has not left, and its heartbeat moved within half a lease. Stricter than `live`: a
  // caller about to hand work to that node (a remote free) stops doing so well before the
  // manager could declare it dead and recover it.
  bool SurelyLive(uint32_t node, uint64_t incarnation, uint64_t inc_mask);
  // True when that life is over: the node left, restarted, or (this view) stayed silent a
  // whole lease — what recovery itself assumes. Between the two, callers wait.
  bool LifeOver(uint32_t node, uint64_t incarnation, uint64_t inc_mask);

  // Called (on a worker thread of the manager's process) for every node seen dead or left, with
  // the incarnation that died; the alloc layer reclaims what it held. May be called again for
  // the same node: handlers must be idempotent.
  void AddRecoveryHandler(std::function<void(uint32_t node, uint64_t incarnation)> handler);
  // Recovery jobs queue until this is called: a joiner registers every handler first, so no
  // node is ever "recovered" by only some of them (or none) — this node may be elected manager
  // on its first beat, before its owner has added them. Idempotent.
  void StartRecovery();
  // Runs `task` on the membership thread every beat (e.g. draining remote frees).
  void AddPeriodicTask(std::function<void()> task);

  // Test hooks: stop heartbeating (as if hung), or make Release skip its data flush.
  void TestStopHeartbeat() { test_stop_heartbeat_.store(true); }
  void TestSkipReleaseFlush(bool skip) { test_skip_release_flush_.store(skip); }

 private:
  Node(Region& region, const NodeOptions& options, std::unique_ptr<LocalNode> local,
       LockArrayLayout layout, uint64_t node_table);

  uint64_t NodeLineOffset(uint32_t node) const { return node_table_ + uint64_t{node} * 64; }
  void PublishNodeLine(NodeState state);
  bool TryBecomeBeatOwner();
  void Beat();
  void ObserveNodes();
  void MembershipLoop();
  void ManagerLoop();
  bool ManagerLineFree(const std::vector<NodeView>& views);
  void StopManager();
  bool ManagerScan();
  void RecoveryLoop();
  void ResetGrantsOf(uint32_t node);
  void WaitOrStop(std::chrono::nanoseconds d);

  Region& region_;
  NodeOptions options_;
  std::unique_ptr<LocalNode> local_;
  LockArrayLayout layout_;
  uint64_t node_table_;
  uint32_t max_nodes_;

  uint64_t heartbeat_counter_ = 0;  // beat owner only
  std::atomic<bool> stop_{false};
  std::atomic<bool> beat_owner_{false};
  std::atomic<bool> manager_running_{false};
  std::atomic<bool> test_stop_heartbeat_{false};
  std::atomic<bool> test_skip_release_flush_{false};
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;

  // Liveness as observed by this process (membership thread writes, others read).
  struct Observed {
    NodeView view;
    Clock::time_point last_change;
    bool seen = false;
  };
  std::mutex view_mu_;
  std::vector<Observed> observed_;

  std::mutex hooks_mu_;
  std::vector<std::function<void(uint32_t, uint64_t)>> recovery_handlers_;
  std::vector<std::function<void()>> periodic_tasks_;
  std::deque<std::pair<uint32_t, uint64_t>> recovery_queue_;
  std::condition_variable recovery_cv_;
  bool recovery_started_ = false;                // guarded by hooks_mu_
  std::vector<uint64_t> recovered_incarnation_;  // per node: last incarnation queued

  std::vector<uint32_t> last_granted_;  // manager: per lock, the node granted last (fairness)
  std::vector<bool> scan_live_;         // manager thread only: scratch of ManagerScan
  std::vector<uint32_t> scan_inc_;
  std::vector<uint64_t> scan_req_;
  std::vector<uint64_t> held_request_;  // per lock: the request word this process holds

  std::thread membership_thread_;
  std::thread manager_thread_;
  std::thread recovery_thread_;
};

}  // namespace cxlkv::sync

#endif  // CXLKV_SRC_SYNC_NODE_H_
