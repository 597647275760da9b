// Node: the processes of a node, one slot each in the node-local file, and the reclaiming of
// what a process that died left behind while its node lives on.
//
// A node is alive as long as one of its processes beats, so the node's own recovery never runs
// for a single dead process. Its slot tells: the beat thread holds the slot's robust mutex for
// the process's whole attachment, so when the process dies the mutex turns owner-dead, and the
// tasks thread of any surviving process of the node finds it, runs the process-recovery
// handlers (the cache layer tombstones the dead process's WRITING entries and frees their
// payloads) and withdraws the global locks it held. Only then does the slot become free again:
// writer words name the slot, so a slot is never reused while entries may still name it.
#include <signal.h>
#include <unistd.h>

#include <cerrno>

#include <cstdio>

#include "sync/node.h"

namespace cxlkv::sync {

int Node::ClaimProcessSlot() {
  for (uint32_t s = 0; s < kLocalProcessSlots; ++s) {
    LocalProcess& p = local_->header().processes[s];
    uint32_t expected = kSlotFree;
    if (!p.state.compare_exchange_strong(expected, kSlotUsed)) continue;
    // A free slot's mutex is unlocked (a scanner may hold it for an instant): ours for life.
    (void)LockRobust(&p.mu);
    p.pid.store(::getpid());
    process_slot_ = s;
    return static_cast<int>(s);
  }
  return -1;
}

void Node::ReleaseProcessSlot() {
  LocalProcess& p = local_->header().processes[process_slot_];
  // Before the unlock: a scanner never takes a clean exit for a death, and recovers a slot
  // left recovering (the scan takes it like an unfinished recovery).
  p.state.store(slot_needs_recovery_.load() ? kSlotRecovering : kSlotFree);
  if (!slot_needs_recovery_.load()) p.pid.store(0);
  pthread_mutex_unlock(&p.mu);
}

bool Node::LeavingLast() {
  // Sequentially consistent, store then load on both sides: of two leavers, one sees the other.
  local_->header().processes[process_slot_].state.store(kSlotLeaving);
  for (uint32_t s = 0; s < kLocalProcessSlots; ++s) {
    if (s == process_slot_) continue;
    const LocalProcess& p = local_->header().processes[s];
    if (p.state.load() != kSlotUsed) continue;
    // Not its robust mutex: taking a dead owner's would hide the death from the slot's recovery.
    const int64_t pid = p.pid.load();
    if (pid <= 0 || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM) return false;
  }
  return true;
}

void Node::AddProcessRecoveryHandler(std::function<bool(uint32_t, uint64_t)> handler) {
  std::lock_guard<std::mutex> lock(hooks_mu_);
  process_handlers_.push_back(std::move(handler));
}

void Node::RecoverDeadProcesses() {
  std::vector<std::function<bool(uint32_t, uint64_t)>> handlers;
  {
    std::lock_guard<std::mutex> lock(hooks_mu_);
    if (!recovery_started_) return;  // not every handler is registered yet
    handlers = process_handlers_;
  }
  for (uint32_t s = 0; s < kLocalProcessSlots; ++s) {
    if (s == process_slot_) continue;
    LocalProcess& p = local_->header().processes[s];
    const uint32_t state = p.state.load();
    if (state == kSlotFree) continue;
    const int rc = TryLockRobust(&p.mu);
    if (rc < 0) continue;  // its process lives
    if (rc == 0 && state != kSlotRecovering) {
      pthread_mutex_unlock(&p.mu);  // a joiner between its claim and its lock
      continue;
    }
    // Its process died (or an earlier recovery of it did not finish).
    p.state.store(kSlotRecovering);
    const uint64_t inc = heartbeat_->incarnation();
    bool done = true;
    for (auto& h : handlers) done = h(s, inc) && done;
    WithdrawDeadHolds();
    if (done) {
      std::fprintf(stderr, "cxlkv: node %u: process %lld (slot %u) died; what it left half-done is reclaimed\n",
                   options_.node_id, static_cast<long long>(p.pid.load()), s);
      p.pid.store(0);
      p.state.store(kSlotFree);
    }
    pthread_mutex_unlock(&p.mu);
  }
}

void Node::WithdrawDeadHolds() {
  const uint32_t me = options_.node_id;
  for (uint32_t k = 0; k < layout_.max_locks(); ++k) {
    LocalLock& ll = local_->lock(k);
    const int rc = TryLockRobust(&ll.mu);
    if (rc < 0) continue;  // held by a live process
    if (rc == 1) {
      // Its holder died holding or wanting lock k and no process of the node took it since:
      // withdraw the node's request, or other nodes would wait for it as long as the node lives.
      const uint64_t req = meta().Fetch(layout_.request(k, me));  // P2: the dead process wrote it
      if (RequestWants(req)) {
        const uint32_t seq = static_cast<uint32_t>(req) + 1;
        ll.seq.store(seq);
        PublishRequest(k, MakeRequest(RequestIncarnation(req), seq), false);
      }
    }
    pthread_mutex_unlock(&ll.mu);
  }
}

}  // namespace cxlkv::sync
