// A node's membership of a region and the two-tier lock (TraCT §3.3), per process.
//
//   auto node = sync::Node::Join(region, {.node_id = 3});
//   CXLKV_ASSIGN_OR_RETURN(auto held, node->Acquire(lock, deadline));
//   CXLKV_RETURN_IF_ERROR(node->CheckHeld(lock));   // fence: right before writing under it
//   ... read shared data after Invalidate, write it, then:
//   node->Release(lock, {{offset, bytes}});   // flushes what was written, then frees the lock
//
// Parts (one job each):
//   Heartbeat     (heartbeat.h)     the node's life word, lease and fence; every process beats
//   LockManager   (lock_manager.h)  grants, in one process of the elected node
//   Node          (this file)       joins and leaves; observes other nodes; elects; queues and
//                                   runs recovery of ended lives; runs periodic tasks; the node
//                                   side of the lock (lock_client.cc)
// Threads: the beat thread only beats, observes node lines and elects (it never waits on a lock,
// I/O or another node); periodic tasks (drains) run on their own thread, recovery handlers on
// another, the manager on another.
//
// Locks: a process first takes the node-local robust mutex of the lock (so one process per node
// competes), then publishes an odd request word in its node's request line, rings its doorbell,
// and waits until the manager publishes a grant equal to it. Release publishes the next (even)
// request word. Nothing uses a cross-node atomic read-modify-write.
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
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "cxlkv/region.h"
#include "region/region_internal.h"
#include "sync/heartbeat.h"
#include "sync/layout.h"
#include "sync/host_wake.h"
#include "sync/local_node.h"
#include "sync/lock_manager.h"
#include "util/histogram.h"

namespace cxlkv::sync {

using Clock = std::chrono::steady_clock;

struct NodeOptions {
  uint32_t node_id = 0;                            // 0..max_nodes-1; required
  std::chrono::milliseconds lease{2000};           // dead after this long without a heartbeat. Default 2 s.
  bool may_host_manager = true;                    // false: never run the lock manager here. Default true.
  bool recovers = true;                            // false: never run recovery of other nodes here (a
                                                   // short-lived client such as a CLI command). Default true.
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
  bool may_host = false;
};

// One node line read now (no observation over time): for inspection tools.
NodeView ReadNodeLine(region::MetaAccess& meta, uint64_t node_table, uint32_t node);

struct AcquireInfo {
  bool holder_died = false;  // a process of this node died holding this lock; we took over
  uint64_t token = 0;        // the hold's fencing token: the granted request (life << 32 | sequence)
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
  // This process's slot among the node's processes (< kLocalProcessSlots), fixed while joined.
  uint32_t process_slot() const { return process_slot_; }
  // At close, when this process could not drop everything it left half-done: its slot is left
  // for another process of the node to recover, as if this one had died.
  void LeaveProcessSlotForRecovery() { slot_needs_recovery_.store(true); }
  // Marks this process as leaving, then returns true when no other process of the node is
  // attached and not leaving (a slot whose process id no longer exists counts as gone). Of two
  // processes leaving at once, at least one sees itself last (both may). A hint for what a
  // leaving process gives back: a process may join right after and find the node live.
  bool LeavingLast();
  uint64_t incarnation() const { return heartbeat_->incarnation(); }
  region::MetaAccess& meta() { return region_.impl().meta(); }
  Region& region() { return region_; }
  LocalNode& local() { return *local_; }
  std::chrono::milliseconds lease() const { return options_.lease; }
  uint32_t max_locks() const { return layout_.max_locks(); }
  uint32_t max_nodes() const { return max_nodes_; }

  // Ok iff this node's lease is surely valid and `incarnation` (0: any) is still its life; else
  // kLeaseExpired naming `act`. Call before every act others rely on (a publish, a commit, a
  // recovery step).
  Status Fence(const char* act, uint64_t incarnation = 0) const { return heartbeat_->Fence(act, incarnation); }
  // Ok iff this process holds `lock` in the node's current life with a valid lease.
  Status CheckHeld(uint32_t lock) const;

  // Lock ids >= kReservedLocks are handed out here; kNoSpace when full.
  Result<uint32_t> AllocateLock();
  Status FreeLock(uint32_t lock);

  // Blocks until granted or `deadline`; kTimeout then (the request is withdrawn).
  Result<AcquireInfo> Acquire(uint32_t lock, Clock::time_point deadline);
  Result<AcquireInfo> AcquireFor(uint32_t lock, std::chrono::milliseconds timeout) {
    return Acquire(lock, Clock::now() + timeout);
  }
  // Flushes `written` (rule P1), then publishes the release. REQUIRES: held by this thread.
  // A hold whose life ended (paused past the lease) publishes nothing: the flush is skipped.
  void Release(uint32_t lock, std::span<const Range> written = {});

  bool is_manager() const { return manager_running_.load(); }
  bool leaving() const { return stop_.load(); }  // the destructor has begun
  std::vector<NodeView> Nodes();  // this process's current view of every node
  std::optional<NodeView> ViewOf(uint32_t node);  // ... of one node (none past max_nodes): no copy of the rest
  // True when `node` runs life `incarnation` (compared modulo `inc_mask`) and, reading its line
  // now, has not left, and its heartbeat moved within half a lease. Stricter than `live`: a
  // caller about to hand work to that node (a remote free) stops doing so well before the
  // manager could declare it dead and recover it.
  bool SurelyLive(uint32_t node, uint64_t incarnation, uint64_t inc_mask);
  // True when that life is over: the node left, restarted, or (this view) stayed silent a
  // whole lease — what recovery itself assumes. Between the two, callers wait.
  bool LifeOver(uint32_t node, uint64_t incarnation, uint64_t inc_mask);

  // Called (on a worker thread of the manager's process) for every life seen ended (dead, left
  // or replaced by a new incarnation), with that incarnation; the layers reclaim what it held.
  // May be called again for the same life: handlers must be idempotent.
  void AddRecoveryHandler(std::function<void(uint32_t node, uint64_t incarnation)> handler);
  // Called on the tasks thread of a surviving process of this node for every process of the
  // node that died (kill -9, a crash) while the node lives on, with its slot and the node's
  // life: the layers reclaim what that process left half-done. Returns false when it could not
  // finish (a lock timed out): the scan calls it again later. Must be idempotent. After the
  // handlers, locks that process held are withdrawn (their local tier was owner-dead).
  void AddProcessRecoveryHandler(std::function<bool(uint32_t slot, uint64_t incarnation)> handler);
  // Recovery jobs queue until this is called: a joiner registers every handler first, so no
  // node is ever "recovered" by only some of them (or none) — this node may be elected manager
  // on its first beat, before its owner has added them. Idempotent.
  void StartRecovery();
  // Runs `task` `per_beat` times per beat interval (1..kMaxTaskRunsPerBeat) on the tasks
  // thread (e.g. draining remote frees). A task may block on locks: it never delays a heartbeat.
  static constexpr uint32_t kMaxTaskRunsPerBeat = 8;
  void AddPeriodicTask(std::function<void()> task, uint32_t per_beat = 1);

  // Test hooks: stop heartbeating (as if hung), or make Release skip its data flush.
  void TestStopHeartbeat() { heartbeat_->TestStop(true); }
  void TestSkipReleaseFlush(bool skip) { test_skip_release_flush_.store(skip); }
  uint64_t new_lives() const { return heartbeat_->new_lives(); }

  // For metrics: how long this process's lock acquisitions waited (granted ones), and how many
  // ended lives of other nodes this process's recovery thread ran the handlers for.
  const util::LatencyHistogram& lock_wait() const { return lock_wait_; }
  uint64_t lives_recovered() const { return lives_recovered_.load(std::memory_order_relaxed); }

 private:
  Node(Region& region, const NodeOptions& options, std::unique_ptr<LocalNode> local,
       std::unique_ptr<HostWake> wake, LockArrayLayout layout, uint64_t node_table);

  uint64_t NodeLineOffset(uint32_t node) const { return node_table_ + uint64_t{node} * 64; }
  void ObserveNodes();
  void Elect();
  void BeatLoop();
  void TasksLoop();
  void RecoveryLoop();
  bool ManagerLineFree(const std::vector<NodeView>& views);
  void StopManager();
  void QueueRecovery(uint32_t node, uint64_t incarnation);
  void LiveIncarnations(std::vector<uint32_t>& out);
  // Waits `d` or until `flag` (stop_ or stop_beats_) is set.
  void WaitOrStop(std::chrono::nanoseconds d, const std::atomic<bool>& flag);
  void WaitOrStop(std::chrono::nanoseconds d) { WaitOrStop(d, stop_); }
  // Stores `request` as this node's request word for `lock` and rings the doorbell (one fence).
  void PublishRequest(uint32_t lock, uint64_t request, bool want);
  // Process slots (process_slots.cc). Claim/Release run on the beat thread, which holds the
  // slot's mutex for the process's whole attachment; the scan runs on the tasks thread.
  int ClaimProcessSlot();
  void ReleaseProcessSlot();
  void RecoverDeadProcesses();
  void WithdrawDeadHolds();

  Region& region_;
  NodeOptions options_;
  std::unique_ptr<LocalNode> local_;
  std::unique_ptr<HostWake> wake_;  // null when the host's wake file could not be opened
  LockArrayLayout layout_;
  uint64_t node_table_;
  uint32_t max_nodes_;
  std::unique_ptr<Heartbeat> heartbeat_;
  std::unique_ptr<LockManager> manager_;

  std::atomic<bool> stop_{false};        // the destructor has begun: tasks and recovery stop
  std::atomic<bool> stop_beats_{false};  // ... and they have stopped: the beat thread stops
  std::atomic<bool> manager_running_{false};
  bool manager_candidate_ = false;  // beat thread only: this process holds the node's manager_mu
  uint64_t manager_life_ = 0;       // beat thread only: the life the running manager serves
  std::atomic<bool> test_skip_release_flush_{false};
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;

  // Liveness as observed by this process (beat thread writes, others read).
  struct Observed {
    NodeView view;
    Clock::time_point last_change;
    bool seen = false;
  };
  std::mutex view_mu_;
  std::vector<Observed> observed_;
  std::vector<std::pair<uint32_t, uint64_t>> ended_lives_;  // beat thread only

  std::mutex hooks_mu_;
  std::vector<std::function<void(uint32_t, uint64_t)>> recovery_handlers_;
  struct PeriodicTask {
    std::function<void()> run;
    uint32_t every_ticks;  // of the tasks thread's tick, interval / kMaxTaskRunsPerBeat
  };
  std::vector<PeriodicTask> periodic_tasks_;
  std::vector<std::function<bool(uint32_t, uint64_t)>> process_handlers_;
  std::deque<std::pair<uint32_t, uint64_t>> recovery_queue_;
  std::condition_variable recovery_cv_;
  bool recovery_started_ = false;                // guarded by hooks_mu_
  std::vector<uint64_t> recovered_incarnation_;  // beat thread only: per node, last life queued

  std::vector<uint64_t> held_request_;  // per lock: the request word this process holds
  uint32_t process_slot_ = 0;
  std::atomic<bool> slot_needs_recovery_{false};
  std::promise<int> slot_claimed_;       // the beat thread's claim, for Join

  util::LatencyHistogram lock_wait_;
  std::atomic<uint64_t> lives_recovered_{0};

  std::thread beat_thread_;
  std::thread tasks_thread_;
  std::thread manager_thread_;
  std::thread recovery_thread_;
};

}  // namespace cxlkv::sync

#endif  // CXLKV_SRC_SYNC_NODE_H_
