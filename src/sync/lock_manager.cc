#include "sync/lock_manager.h"

#include <bit>
#include <thread>

#include "region/coherence.h"

namespace cxlkv::sync {

LockManager::LockManager(region::MetaAccess& meta, LockArrayLayout layout, uint32_t me, Heartbeat& heartbeat,
                         std::function<void(std::vector<uint32_t>&)> live, HostWake* wake)
    : meta_(meta),
      layout_(layout),
      me_(me),
      heartbeat_(heartbeat),
      live_fn_(std::move(live)),
      wake_(wake),
      nodes_(layout.max_nodes()),
      locks_(layout.max_locks()),
      words_((layout.max_locks() + 63) / 64) {}

bool LockManager::Wants(uint32_t lock, uint32_t node, uint64_t r) const {
  (void)lock;
  return live_[node] != 0 && RequestWants(r) && RequestIncarnation(r) == live_[node];
}

void LockManager::MarkDirty(uint32_t lock) {
  if (lock >= locks_ || is_dirty_[lock]) return;
  is_dirty_[lock] = true;
  dirty_.push_back(lock);
}

// Re-reads node `n`'s wanted bitmap and the request words of every lock it tracks: named by the
// bitmap now, or tracked at the last read. A lock stays tracked while its request word was last
// read odd, bit or no bit: a node publishes its request before it sets the bit, so a request can
// be read (and granted) while the bit is clear — the node's previous release of the lock just
// cleared it — and the node may then set the bit, hold, release and clear it between two reads
// of this doorbell. Tracked by the bitmap alone, that release was never read, and the lock stayed
// held by a request its node had long dropped; the resync, which reads only tracked locks, did
// not see it either.
bool LockManager::ReadDoorbell(uint32_t n, bool first_line_fresh) {
  const uint64_t bitmap = layout_.wanted_word(n, 0);
  const uint64_t line_end = layout_.doorbell(n) + 64;
  // The first line was just fetched with the sequence; later lines need their own invalidate (P2).
  if (!first_line_fresh) meta_.Invalidate(bitmap, std::min<uint64_t>(layout_.wanted_bytes(), line_end - bitmap));
  if (bitmap + layout_.wanted_bytes() > line_end) meta_.Invalidate(line_end, bitmap + layout_.wanted_bytes() - line_end);
  // The request lines of every lock to read, and the manager line (Decide checks it before a
  // grant), under one invalidate fence: their misses overlap instead of queueing (P2).
  fetch_.clear();
  for (uint32_t w = 0; w < words_; ++w) {
    uint64_t touch = meta_.Load(bitmap + w * 8) | wanted_[size_t{n} * words_ + w];
    while (touch != 0) {
      const uint32_t k = w * 64 + static_cast<uint32_t>(std::countr_zero(touch));
      touch &= touch - 1;
      if (k < locks_) fetch_.push_back(layout_.request(k, n));
    }
  }
  const bool line_stale = line_scan_ != scan_;  // not read with this scan's doorbells
  if (line_stale) fetch_.push_back(layout_.manager_line());
  meta_.InvalidateEach(fetch_, 8);
  if (line_stale) {
    line_ = meta_.Load(layout_.manager_line());
    line_scan_ = scan_;
  }
  bool news = false;
  bool settled = true;
  for (uint32_t w = 0; w < words_; ++w) {
    uint64_t now = meta_.Load(bitmap + w * 8);
    uint64_t& tracked = wanted_[size_t{n} * words_ + w];
    uint64_t touch = (now | tracked);
    news = news || now != tracked;
    tracked = now;
    while (touch != 0) {
      const uint32_t bit = static_cast<uint32_t>(std::countr_zero(touch));
      const uint32_t k = w * 64 + bit;
      touch &= touch - 1;
      if (k >= locks_) break;
      const uint64_t r = meta_.Load(layout_.request(k, n));  // invalidated above: node n wrote it
      const bool wants = RequestWants(r);
      if (wants) tracked |= uint64_t{1} << bit;  // until its release is read
      // A set bit over an even request, or an odd request without its bit: one of the two lines
      // of a ring has reached memory and the other not yet (or a process is between the two
      // stores). Read it again next scan.
      settled = settled && wants == (((now >> bit) & 1) != 0);
      if (r != req(k, n)) {
        req(k, n) = r;
        news = true;
      }
      MarkDirty(k);
    }
  }
  unsettled_[n] = !settled;
  return news;
}

void LockManager::Resync(bool read_grants) {
  for (uint32_t n = 0; n < nodes_; ++n) {
    if (live_[n] == 0) continue;
    seq_seen_[n] = meta_.Fetch(layout_.doorbell(n));
    ReadDoorbell(n, true);
    if (!read_grants) continue;
    for (uint32_t w = 0; w < words_; ++w) {
      uint64_t bits = wanted_[size_t{n} * words_ + w];
      while (bits != 0) {
        uint32_t k = w * 64 + static_cast<uint32_t>(std::countr_zero(bits));
        bits &= bits - 1;
        if (k < locks_) grant(k, n) = meta_.Fetch(layout_.grant(k, n));  // a previous manager's grant
      }
    }
  }
}

void LockManager::RefreshLiveness() {
  live_fn_(live_next_);
  for (uint32_t n = 0; n < nodes_; ++n) {
    if (live_next_[n] == live_[n]) continue;
    const bool was = live_[n] != 0;
    live_[n] = live_next_[n];
    if (was) {
      // That life ended: its holds and waits count no more, and its grant words go back to 0
      // ("slots of a dead node are reset"; the manager is their single writer).
      for (uint32_t k = 0; k < locks_; ++k) {
        req(k, n) = 0;  // untracked from here on (below): no cached request may outlive that
        if (grant(k, n) != 0) {
          meta_.Publish(layout_.grant(k, n), 0);
          grant(k, n) = 0;
          MarkDirty(k);
        }
      }
      for (uint32_t w = 0; w < words_; ++w) {
        uint64_t bits = wanted_[size_t{n} * words_ + w];
        while (bits != 0) {
          MarkDirty(w * 64 + static_cast<uint32_t>(std::countr_zero(bits)));
          bits &= bits - 1;
        }
        wanted_[size_t{n} * words_ + w] = 0;
      }
      unsettled_[n] = false;
    }
    if (live_[n] != 0) {
      seq_seen_[n] = meta_.Fetch(layout_.doorbell(n));
      ReadDoorbell(n, true);
    }
  }
}

void LockManager::Decide(uint32_t k) {
  for (uint32_t n = 0; n < nodes_; ++n) {
    uint64_t r = req(k, n);
    if (Wants(k, n, r) && grant(k, n) == r) return;  // held
  }
  for (uint32_t step = 1; step <= nodes_; ++step) {
    uint32_t n = (last_granted_[k] + step) % nodes_;
    uint64_t r = req(k, n);
    if (!Wants(k, n, r)) continue;
    if (!StillManager()) {
      running_.store(false);  // paused past our lease, or another manager claimed the line
      return;
    }
    meta_.Publish(layout_.grant(k, n), r);  // W→L: the grant is the request echoed (the token)
    if (wake_ != nullptr) wake_->WakeGrant(n);  // a waiter of node n on this host may sleep
    grant(k, n) = r;
    last_granted_[k] = n;
    ++grants_;
    return;
  }
}

bool LockManager::StillManager() {
  // The line as read with this scan's requests (ReadDoorbell), or afresh. Either read comes a
  // few microseconds at most before the grant, far inside a rival's claim settle (kClaimSettle);
  // a pause longer than that is a pause past the lease, which the fence below refuses.
  if (line_scan_ != scan_) {
    meta_.Invalidate(layout_.manager_line(), 64);
    line_ = meta_.Load(layout_.manager_line());
    line_scan_ = scan_;
  }
  return line_ == ManagerHolder(me_, incarnation_) &&
         heartbeat_.Fence("lock management", incarnation_).ok();
}

void LockManager::Run(uint64_t incarnation) {
  incarnation_ = incarnation;
  grants_ = 0;
  live_.assign(nodes_, 0);
  live_next_.assign(nodes_, 0);
  seq_seen_.assign(nodes_, 0);
  unsettled_.assign(nodes_, false);
  line_scan_ = ~uint64_t{0};  // the claim's checks below read the line afresh
  wanted_.assign(size_t{nodes_} * words_, 0);
  req_.assign(size_t{locks_} * nodes_, 0);
  grant_.assign(size_t{locks_} * nodes_, 0);
  last_granted_.assign(locks_, nodes_ - 1);
  is_dirty_.assign(locks_, false);
  dirty_.clear();

  // Claim the line, let any rival claim made in the same moment land, and run only if ours is
  // the claim that stands (the last writer wins; the loser sees the winner and steps back). A
  // rival that was paused between its check and its claim is caught before our next grant.
  ManagerLine line{};
  line.holder = ManagerHolder(me_, incarnation);
  if (!heartbeat_.Fence("lock manager claim", incarnation).ok()) {
    running_.store(false);
    return;
  }
  meta_.Write(layout_.manager_line() + 8, reinterpret_cast<const uint8_t*>(&line) + 8, sizeof line - 8);
  meta_.Publish(layout_.manager_line(), line.holder);  // P4: the identity word last
  std::this_thread::sleep_for(kClaimSettle);
  if (!StillManager()) {
    running_.store(false);
    return;
  }
  live_fn_(live_);
  Resync(/*read_grants=*/true);
  for (uint32_t k = 0; k < locks_; ++k) MarkDirty(k);

  const auto resync_every = heartbeat_.interval();
  auto next_resync = std::chrono::steady_clock::now() + resync_every;
  uint32_t idle = 0;
  auto last_change = std::chrono::steady_clock::now();
  bool armed = false;  // this manager announced that it sleeps (host wake channel)
  while (running_.load()) {
    // Armed: the epoch before the scan. A wake-up after it makes the sleep below return at
    // once; a doorbell rung before it is seen by the scan (host_wake.h).
    const uint32_t epoch = armed ? wake_->ManagerEpoch() : 0;
    const uint64_t grants_before = grants_;
    ++scan_;
    RefreshLiveness();
    bool changed = false;  // a doorbell rang or a lock changed hands (the resync's re-decisions are not news)
    // Every live node's doorbell and the manager line under one invalidate fence: a scan costs
    // one miss's latency, not one per node (P2: node n rang it).
    fetch_.clear();
    for (uint32_t n = 0; n < nodes_; ++n) {
      if (live_[n] != 0) fetch_.push_back(layout_.doorbell(n));
    }
    fetch_.push_back(layout_.manager_line());
    meta_.InvalidateEach(fetch_, 8);
    line_ = meta_.Load(layout_.manager_line());
    line_scan_ = scan_;
    for (uint32_t n = 0; n < nodes_; ++n) {
      if (live_[n] == 0) continue;
      uint64_t seq = meta_.Load(layout_.doorbell(n));
      if (seq == seq_seen_[n]) {
        // A ring half in memory: news only once its other line has landed.
        if (unsettled_[n]) changed = ReadDoorbell(n, true) || changed;
        continue;
      }
      seq_seen_[n] = seq;
      ReadDoorbell(n, true);
      changed = true;
    }
    for (size_t i = 0; i < dirty_.size() && running_.load(); ++i) {
      is_dirty_[dirty_[i]] = false;
      Decide(dirty_[i]);
    }
    dirty_.clear();
    changed = changed || grants_ != grants_before;
    auto now = std::chrono::steady_clock::now();
    if (now >= next_resync) {
      next_resync = now + resync_every;
      if (!StillManager()) break;
      Resync(/*read_grants=*/false);
      for (uint32_t k = 0; k < locks_; ++k) MarkDirty(k);
    }
    // Two cores: stay hot while requests come; with nothing new, yield at once (a holder or a
    // waiter on this core needs it more than a poll does). Past the hot window, sleep: on the
    // host's wake channel when there is one (a requester here wakes us at once), with a
    // timeout that grows to ~2 ms either way (requesters on other hosts can only be polled; an
    // idle manager costs one doorbell read per live node per wake-up).
    if (changed) {
      if (armed) wake_->DisarmManager();
      armed = false;
      idle = 0;
      last_change = now;
      region::CpuRelax();
      continue;
    }
    if (now - last_change < kHotWindow) {
      std::this_thread::yield();
      continue;
    }
    if (wake_ != nullptr && !armed) {
      // Announce the sleep and scan once more before the first one; stay announced while idle.
      wake_->ArmManager();
      armed = true;
      continue;
    }
    Sleep(idle++, armed, epoch);
  }
  if (armed) wake_->DisarmManager();
  running_.store(false);
}

void LockManager::Sleep(uint32_t rounds, bool armed, uint32_t epoch) {
  // 16 us .. ~2 ms: a wake-up costs ~25 us of CPU on a VM, so an idle manager at a 1 ms cap
  // used 2.1-2.4% of a core (goal < 2%). Requesters on this host wake it at once; one on
  // another host waits at most the cap after a long idle spell.
  const auto timeout = std::chrono::microseconds(16 << std::min<uint32_t>(rounds / 16, 7));
  if (armed) {
    wake_->WaitManager(epoch, timeout);  // returns at once if woken since `epoch` was read
  } else {
    std::this_thread::sleep_for(timeout);
  }
}

}  // namespace cxlkv::sync
