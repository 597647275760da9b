// The node side of the two-tier lock: the local tier (a robust process-shared mutex per lock in
// the node-local file) and the global tier (request word + doorbell, then wait for the grant).
// Protocol: docs/protocol.md, "Two-tier lock".
#include <time.h>

#include <cstring>
#include <thread>

#include "region/coherence.h"

#if defined(__SANITIZE_THREAD__)
#define CXLKV_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define CXLKV_TSAN 1
#endif
#endif
#ifndef CXLKV_TSAN
#define CXLKV_TSAN 0
#endif
#if CXLKV_TSAN
#include <sanitizer/tsan_interface.h>
#endif
#include "sync/node.h"

namespace cxlkv::sync {
namespace {

// pthread_mutex_timedlock takes CLOCK_REALTIME; convert a steady deadline.
timespec RealtimeDeadline(Clock::time_point deadline) {
  auto left = deadline - Clock::now();
  if (left < std::chrono::nanoseconds(0)) left = std::chrono::nanoseconds(0);
  timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  int64_t ns = now.tv_nsec + std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
  timespec ts;
  ts.tv_sec = now.tv_sec + ns / 1000000000;
  ts.tv_nsec = ns % 1000000000;
  return ts;
}

// Waiting for a grant: spin briefly with pause, yield a while (two cores: the manager or the
// holder may need this one), then sleep on this node's wake channel (host_wake.h), where the
// manager wakes us when it grants on this host; the timeout re-polls for a manager elsewhere.
class GrantWait {
 public:
  GrantWait(HostWake* wake, uint32_t node) : wake_(wake), node_(node) {}
  ~GrantWait() {
    if (armed_) wake_->DisarmGrant(node_);
  }
  GrantWait(const GrantWait&) = delete;
  GrantWait& operator=(const GrantWait&) = delete;

  // Called after each look at the grant word that found nothing.
  void Pause() {
    ++round_;
    if (round_ <= 4) {
      for (int i = 0; i < 8; ++i) region::CpuRelax();
      return;
    }
    if (round_ <= kYieldRounds) {
      std::this_thread::yield();
      return;
    }
    const int shift = std::min(round_ - kYieldRounds - 1, 4);
    const auto timeout = std::chrono::microseconds(10 << shift);  // 10 .. 160 us
    if (wake_ == nullptr) {
      std::this_thread::sleep_for(timeout);
      return;
    }
    if (!armed_) {
      // Announce the sleep; the caller looks at the grant once more before we sleep on it.
      epoch_ = wake_->ArmGrant(node_);
      armed_ = true;
      --round_;
      return;
    }
    wake_->WaitGrant(node_, epoch_, timeout);
    wake_->DisarmGrant(node_);
    armed_ = false;
  }

 private:
  static constexpr int kYieldRounds = 64;
  HostWake* wake_;
  uint32_t node_;
  int round_ = 0;
  bool armed_ = false;
  uint32_t epoch_ = 0;
};

}  // namespace

// Publishes this node's request word for `lock` (single writer: this node, under the lock's
// local mutex) and tells the manager: the wanted bit and the sequence (local atomics: only this
// node's processes write its doorbell), then one flush of the doorbell and request lines under
// one fence (P1). The two lines may reach memory in either order, so a manager can read the new
// sequence over the old request (or the new request before its bit); it reads a request whose
// parity disagrees with its bit again on its next scans until they agree (lock_manager.cc), so
// neither order loses a request, and the release's second fence is not needed. The doorbell goes
// first in the batch: under the simulator it reaches memory first, the order that needs the
// manager's re-read.
void Node::PublishRequest(uint32_t lock, uint64_t request, bool want) {
  const uint32_t me = options_.node_id;
  const uint64_t word = layout_.wanted_word(me, lock);
  const uint64_t bit = uint64_t{1} << (lock % 64);
  const uint64_t bell = layout_.doorbell(me);
  const uint64_t req_off = layout_.request(lock, me);
  meta().Store(req_off, request);
  uint64_t cur = meta().Load(word);
  for (;;) {
    uint64_t next = want ? (cur | bit) : (cur & ~bit);
    if (next == cur || meta().LocalCompareExchange(word, cur, next)) break;
  }
  meta().LocalFetchAdd(bell, 1);
  if (word / 64 == bell / 64) {
    const uint64_t lines[2] = {bell, req_off};
    meta().FlushEach(lines, 8);
  } else {
    const uint64_t lines[3] = {bell, word, req_off};
    meta().FlushEach(lines, 8);
  }
  if (wake_ != nullptr) wake_->WakeManager();  // a manager on this host may sleep
}

Status Node::CheckHeld(uint32_t lock) const {
  if (lock >= layout_.max_locks() || !RequestWants(held_request_[lock])) {
    return Internal("lock " + std::to_string(lock) + " is not held by this process");
  }
  return heartbeat_->Fence("a write under a lock", RequestIncarnation(held_request_[lock]));
}

Result<AcquireInfo> Node::Acquire(uint32_t lock, Clock::time_point deadline) {
  if (lock >= layout_.max_locks()) {
    return InvalidArgument("lock " + std::to_string(lock) + " does not exist (this region has " +
                           std::to_string(layout_.max_locks()) + ")");
  }
  // The manager's polls evict both lines from every cache: start their misses now, while the
  // local tier is taken (they would otherwise queue behind each other in PublishRequest).
  meta().PrefetchForWrite(layout_.request(lock, options_.node_id));
  meta().PrefetchForWrite(layout_.doorbell(options_.node_id));
  LocalLock& ll = local_->lock(lock);
  AcquireInfo info;
  const auto started = Clock::now();
  // Local tier: one process per node competes for the global lock.
  timespec ts = RealtimeDeadline(deadline);
  int rc = pthread_mutex_timedlock(&ll.mu, &ts);
  if (rc == ETIMEDOUT) return Timeout("lock " + std::to_string(lock) + " not granted in time (local tier)");
  if (rc == EOWNERDEAD) {
    pthread_mutex_consistent(&ll.mu);
#if CXLKV_TSAN
    // ThreadSanitizer's timedlock interceptor records a lock only when it returns 0: say that
    // this thread holds the mutex now, or the Release below is reported as a foreign unlock.
    __tsan_mutex_pre_lock(&ll.mu, __tsan_mutex_try_lock);
    __tsan_mutex_post_lock(&ll.mu, __tsan_mutex_try_lock, 0);
#endif
    info.holder_died = true;
  } else if (rc != 0) {
    return Internal("pthread_mutex_timedlock: " + std::string(std::strerror(rc)));
  }
  const uint32_t me = options_.node_id;
  auto publish_request = [&](uint64_t inc) {
    // Global tier: a fresh odd request (single writer: this node, under the local mutex).
    uint32_t seq = ll.seq.load();
    seq = (seq | 1) == seq ? seq + 2 : seq + 1;
    ll.seq.store(seq);
    uint64_t r = MakeRequest(inc, seq);
    PublishRequest(lock, r, true);
    return r;
  };
  auto withdraw = [&](uint64_t r) {
    // An even request means "not wanted"; a grant racing with it matches nothing.
    uint32_t seq = static_cast<uint32_t>(r) + 1;
    ll.seq.store(seq);
    PublishRequest(lock, MakeRequest(RequestIncarnation(r), seq), false);
    pthread_mutex_unlock(&ll.mu);
  };
  uint64_t inc = heartbeat_->incarnation();
  // A process of this node died holding or wanting the lock in this life: inherit its request.
  // Otherwise this node is the request word's only writer and needs no read of it.
  uint64_t req = info.holder_died ? meta().Fetch(layout_.request(lock, me)) : 0;
  if (!(info.holder_died && RequestWants(req) && RequestIncarnation(req) == static_cast<uint32_t>(inc))) {
    req = publish_request(inc);
  } else {
    // The dead process may have stored its request without setting its bit or ringing: ring
    // for it, or the manager would not look at the request before its next resync.
    PublishRequest(lock, req, true);
  }
  GrantWait backoff(wake_.get(), me);
  for (;;) {
    if (meta().Fetch(layout_.grant(lock, me)) == req) {  // P2: the manager wrote it
      Status fenced = heartbeat_->Fence("lock grant", RequestIncarnation(req));
      if (!fenced.ok()) {
        withdraw(req);
        return fenced;
      }
      held_request_[lock] = req;
      info.token = req;
      lock_wait_.Record(Clock::now() - started);
      return info;
    }
    // The node started a new life while we waited: the manager ignores the old one's request.
    uint64_t now_inc = heartbeat_->incarnation();
    if (static_cast<uint32_t>(now_inc) != RequestIncarnation(req)) req = publish_request(now_inc);
    // A leaving node's own manager thread is gone: waiting out the deadline would only delay
    // the exit (recovery handlers still running hit this).
    const bool leaving = stop_.load();
    if (Clock::now() >= deadline || leaving) {
      withdraw(req);
      if (leaving) return Busy("lock " + std::to_string(lock) + " not taken: this node is leaving");
      return Timeout("lock " + std::to_string(lock) + " not granted within the deadline; is a "
                     "lock manager running (a live node with may_host_manager)?");
    }
    backoff.Pause();
  }
}

void Node::Release(uint32_t lock, std::span<const Range> written) {
  meta().PrefetchForWrite(layout_.request(lock, options_.node_id));  // as in Acquire
  meta().PrefetchForWrite(layout_.doorbell(options_.node_id));
  LocalLock& ll = local_->lock(lock);
  const uint64_t req = held_request_[lock];
  held_request_[lock] = 0;
  // Fence: a hold whose life ended (or whose lease may have lapsed) publishes nothing — the next
  // holder may already be writing the same lines.
  const bool valid = heartbeat_->Fence("release", RequestIncarnation(req)).ok();
  if (valid && !test_skip_release_flush_.load()) {
    for (const Range& r : written) meta().Flush(r.offset, r.bytes);  // P1 before the release
  }
  uint32_t seq = static_cast<uint32_t>(req) + 1;
  ll.seq.store(seq);
  PublishRequest(lock, MakeRequest(RequestIncarnation(req), seq), false);
  pthread_mutex_unlock(&ll.mu);
}

Result<uint32_t> Node::AllocateLock() {
  CXLKV_ASSIGN_OR_RETURN(auto held, AcquireFor(kLockTableLock, options_.lease * 4));
  (void)held;
  for (uint32_t k = kReservedLocks; k < layout_.max_locks(); ++k) {
    uint64_t off = layout_.bitmap_word(k);
    uint64_t word = meta().Fetch(off);
    if (word & (uint64_t{1} << (k % 64))) continue;
    Status fenced = CheckHeld(kLockTableLock);
    if (!fenced.ok()) {
      Release(kLockTableLock);
      return fenced;
    }
    meta().Store(off, word | (uint64_t{1} << (k % 64)));
    Range r{off, 8};
    Release(kLockTableLock, {&r, 1});
    return k;
  }
  Release(kLockTableLock);
  return NoSpace("all " + std::to_string(layout_.max_locks() - kReservedLocks) +
                 " user locks are allocated; free some or re-create the region with more locks");
}

Status Node::FreeLock(uint32_t lock) {
  if (lock < kReservedLocks || lock >= layout_.max_locks()) {
    return InvalidArgument("lock " + std::to_string(lock) + " is not a user lock");
  }
  CXLKV_ASSIGN_OR_RETURN(auto held, AcquireFor(kLockTableLock, options_.lease * 4));
  (void)held;
  uint64_t off = layout_.bitmap_word(lock);
  uint64_t word = meta().Fetch(off);
  if (!(word & (uint64_t{1} << (lock % 64)))) {
    Release(kLockTableLock);
    return InvalidArgument("lock " + std::to_string(lock) + " is not allocated");
  }
  Status fenced = CheckHeld(kLockTableLock);
  if (!fenced.ok()) {
    Release(kLockTableLock);
    return fenced;
  }
  meta().Store(off, word & ~(uint64_t{1} << (lock % 64)));
  Range r{off, 8};
  Release(kLockTableLock, {&r, 1});
  return Status::Ok();
}

}  // namespace cxlkv::sync
