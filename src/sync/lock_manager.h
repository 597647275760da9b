// The lock manager (TraCT §3.3): grants W→L to one live node at a time per lock, round-robin
// among waiters so no node starves. It runs in one process of the elected node (the lowest live
// node that may host it). Everything that matters is in the region — request, grant and
// doorbell words — so a new manager needs nothing from the old one.
//
// Cost: an idle scan reads one doorbell word per live node, O(live nodes), not O(locks × nodes).
// A node bumps its doorbell after every request or release it publishes and keeps in it the
// bitmap of locks it wants; on a changed doorbell the manager re-reads that node's request words
// of the locks it tracks — named by the bitmap now or at the last read, or last read with an odd
// request (a request may be read, and granted, before its bit is set; see ReadDoorbell) — and
// decides only those locks. A request and its doorbell are flushed under one fence, so either may
// reach memory first: a request read with a parity its bit disagrees with is read again on every
// scan until the two agree. A full resync of every tracked lock runs every beat interval anyway,
// so nothing depends on a doorbell never being missed.
//
// Fencing: before each grant the manager passes Heartbeat::Fence with its own life; a manager
// paused past its lease resumes into a refused fence (its node started a new life, or its lease
// is stale) and stops without granting. Its successor took over the manager line meanwhile.
//
// Thread-safety: Run() is one thread; Stop() may be called from any thread.
#ifndef CXLKV_SRC_SYNC_LOCK_MANAGER_H_
#define CXLKV_SRC_SYNC_LOCK_MANAGER_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

#include "region/meta.h"
#include "sync/heartbeat.h"
#include "sync/host_wake.h"
#include "sync/layout.h"

namespace cxlkv::sync {

class LockManager {
 public:
  // How long a new manager waits between claiming the line and trusting its claim: far longer
  // than the moment between a rival's check of the line and its own claim.
  static constexpr std::chrono::milliseconds kClaimSettle{2};

  // How long a manager stays hot (polling, yielding its core) after the last change it saw,
  // before it sleeps: requests tend to come in bursts (a reserve, its commit; a handoff chain).
  static constexpr std::chrono::microseconds kHotWindow{250};

  // `live` fills, per node, its current incarnation if it is live, else 0. `wake` (may be null:
  // then idle sleeps are plain timeouts) lets requesters on this host wake a sleeping manager
  // and lets the manager wake this host's waiters after a grant.
  LockManager(region::MetaAccess& meta, LockArrayLayout layout, uint32_t me, Heartbeat& heartbeat,
              std::function<void(std::vector<uint32_t>&)> live, HostWake* wake);

  // Grants until Stop(), the end of life `incarnation`, or another manager taking the line.
  void Run(uint64_t incarnation);
  void Stop() { running_.store(false); }
  void Arm() { running_.store(true); }
  bool running() const { return running_.load(); }
  uint64_t grants() const { return grants_; }

 private:
  bool Wants(uint32_t lock, uint32_t node, uint64_t req) const;
  // Returns whether a request word or the bitmap changed since the last read.
  bool ReadDoorbell(uint32_t node, bool first_line_fresh);
  void Resync(bool read_grants);
  void RefreshLiveness();
  void Decide(uint32_t lock);
  bool StillManager();
  void MarkDirty(uint32_t lock);
  // Sleeps after `rounds` idle rounds: on the wake channel when `armed` (unless woken since
  // `epoch` was read), else a plain timeout.
  void Sleep(uint32_t rounds, bool armed, uint32_t epoch);

  uint64_t& req(uint32_t lock, uint32_t node) { return req_[size_t{lock} * nodes_ + node]; }
  uint64_t& grant(uint32_t lock, uint32_t node) { return grant_[size_t{lock} * nodes_ + node]; }

  region::MetaAccess& meta_;
  LockArrayLayout layout_;
  uint32_t me_;
  Heartbeat& heartbeat_;
  std::function<void(std::vector<uint32_t>&)> live_fn_;
  HostWake* wake_;
  uint32_t nodes_;
  uint32_t locks_;
  uint32_t words_;  // bitmap words per doorbell
  std::atomic<bool> running_{false};
  uint64_t incarnation_ = 0;
  uint64_t grants_ = 0;

  std::vector<uint32_t> live_;        // per node: incarnation if live, else 0
  std::vector<uint32_t> live_next_;
  std::vector<uint64_t> seq_seen_;    // per node: doorbell sequence last processed
  std::vector<bool> unsettled_;       // per node: a tracked request's parity disagreed with its
                                      // bit at the last read (a ring still on its way): re-read
  std::vector<uint64_t> fetch_;       // ReadDoorbell's batch of request lines to invalidate
  uint64_t scan_ = 0;                 // scans of Run's loop; the manager line read in scan
  uint64_t line_scan_ = ~uint64_t{0};  // `line_scan_` (with the requests) holds `line_`
  uint64_t line_ = 0;
  std::vector<uint64_t> wanted_;      // per node × word: the locks tracked (ReadDoorbell): named
                                      // by the bitmap last read, or last read with an odd request
  std::vector<uint64_t> req_;         // per lock × node: request word last read
  std::vector<uint64_t> grant_;       // per lock × node: grant word (this manager writes it)
  std::vector<uint32_t> last_granted_;  // per lock: the node granted last (fairness)
  std::vector<uint32_t> dirty_;       // locks to decide
  std::vector<bool> is_dirty_;
};

}  // namespace cxlkv::sync

#endif  // CXLKV_SRC_SYNC_LOCK_MANAGER_H_
