#include "sync/heartbeat.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <string>

namespace cxlkv::sync {

int64_t MonotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

Heartbeat::Heartbeat(region::MetaAccess& meta, LockArrayLayout locks, uint64_t line_offset, uint32_t node,
                     std::chrono::milliseconds lease, LocalNode& local)
    : meta_(meta),
      locks_(locks),
      line_(line_offset),
      node_(node),
      lease_(lease),
      local_(local) {}

// Whether some process of this node holds manager_mu (stands for the manager). Try-lock and
// give back at once: never waits.
bool Heartbeat::ManagerCandidateExists() {
  pthread_mutex_t* mu = &local_.header().manager_mu;
  if (TryLockRobust(mu) < 0) return true;
  pthread_mutex_unlock(mu);
  return false;
}

void Heartbeat::Tick() {
  if (test_stopped_.load()) return;
  LocalHeader& h = local_.header();
  // Try-lock: a process paused inside a beat must not stop the node's other processes beating.
  int got = TryLockRobust(&h.beat_mu);
  if (got < 0) return;
  const int64_t start = MonotonicNs();  // before the store: observers see the beat no earlier
  const int64_t last = h.last_beat_ns.load();
  if (last != 0 && start - last < interval().count() / 2 && h.incarnation.load() != 0) {
    pthread_mutex_unlock(&h.beat_mu);  // another process of the node beat a moment ago
    return;
  }
  meta_.Invalidate(line_, 64);  // P2: before a restart, another host may have used this id
  LifeWord line = LifeWord::Decode(meta_.Load(line_));
  uint64_t inc = h.incarnation.load();
  const bool lapsed = last == 0 || start - last >= (lease_ - margin()).count();
  if (inc == 0 || lapsed || line.incarnation != static_cast<uint32_t>(inc) || line.state != NodeState::kLive) {
    // A new life: observers may have declared the old one dead and recovered it, so nothing
    // of it is trusted again. A node that left, even a moment ago, also starts a new one.
    inc = std::max<uint64_t>(inc, line.incarnation) + 1;
    StartNewLife(inc);
  }
  uint64_t hb = h.heartbeat.fetch_add(1) + 1;
  Publish(static_cast<uint32_t>(inc), NodeState::kLive, hb);
  h.last_beat_ns.store(start);
  pthread_mutex_unlock(&h.beat_mu);
}

void Heartbeat::StartNewLife(uint64_t inc) {
  LocalHeader& h = local_.header();
  // Idle request words of the new life; the manager ignores every word of an older one.
  for (uint32_t k = 0; k < locks_.max_locks(); ++k) {
    local_.lock(k).seq.store(0);
    meta_.Store(locks_.request(k, node_), MakeRequest(inc, 0));
  }
  std::vector<uint64_t> offs;
  for (uint32_t k = 0; k < locks_.max_locks(); ++k) offs.push_back(locks_.request(k, node_));
  meta_.FlushEach(offs, 8);
  h.incarnation.store(inc);
  new_lives_.fetch_add(1);
}

void Heartbeat::Publish(uint32_t inc, NodeState state, uint64_t hb) {
  NodeLine line{};
  line.life = LifeWord{inc, state, static_cast<uint32_t>(hb)}.Encode();
  line.pid = static_cast<uint64_t>(::getpid());
  line.lease_ms = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(lease_).count());
  line.flags = ManagerCandidateExists() ? kNodeMayHostManager : 0;
  // Diagnostics first, then the life word: a reader relies on the life word alone (P4).
  meta_.Write(line_ + 8, reinterpret_cast<const uint8_t*>(&line) + 8, sizeof line - 8);
  meta_.Store(line_, line.life);
  meta_.Flush(line_, sizeof line);  // P1: the node's single-word publication
}

void Heartbeat::PublishLeft() {
  LocalHeader& h = local_.header();
  LockRobust(&h.beat_mu);
  uint64_t inc = h.incarnation.load();
  if (inc != 0) Publish(static_cast<uint32_t>(inc), NodeState::kLeft, h.heartbeat.fetch_add(1) + 1);
  pthread_mutex_unlock(&h.beat_mu);
}

Status Heartbeat::Fence(const char* act, uint64_t incarnation) const {
  const LocalHeader& h = local_.header();
  const uint64_t current = h.incarnation.load();
  if (incarnation != 0 && static_cast<uint32_t>(incarnation) != static_cast<uint32_t>(current)) {
    return LeaseExpired(std::string(act) + " refused: node " + std::to_string(node_) + "'s life " +
                        std::to_string(incarnation) + " has ended (it was paused or silent past its lease and "
                        "now runs as life " + std::to_string(current) + "); what it held was recovered, retry");
  }
  const int64_t age = MonotonicNs() - h.last_beat_ns.load();
  if (current == 0 || age >= (lease_ - margin()).count()) {
    return LeaseExpired(std::string(act) + " refused: node " + std::to_string(node_) + " has not beaten for " +
                        std::to_string(age / 1000000) + " ms (lease " +
                        std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(lease_).count()) +
                        " ms): it may have been declared dead; it rejoins as a new life, retry then");
  }
  return Status::Ok();
}

}  // namespace cxlkv::sync
