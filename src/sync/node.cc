// Membership (join, heartbeat, liveness, election) and the node side of the two-tier lock.
// The manager side is in lock_manager.cc. Protocol: docs/protocol.md, "Two-tier lock".
#include "sync/node.h"

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "region/coherence.h"

namespace cxlkv::sync {
namespace {

int64_t MonotonicNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             Clock::now().time_since_epoch()).count();
}

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

// Waiting for another node: spin briefly with pause, then sleep with growing intervals, so
// several waiting processes on a 2-core machine do not starve the holder.
class Backoff {
 public:
  void Pause() {
    if (round_ < 16) {
      for (int i = 0; i < 32; ++i) region::CpuRelax();
    } else if (round_ < 48) {
      std::this_thread::yield();
    } else {
      int shift = std::min(round_ - 48, 3);  // at most 40 us: a grant is not left waiting long
      std::this_thread::sleep_for(std::chrono::microseconds(5 << shift));
    }
    ++round_;
  }

 private:
  int round_ = 0;
};

}  // namespace

Node::Node(Region& region, const NodeOptions& options, std::unique_ptr<LocalNode> local,
           LockArrayLayout layout, uint64_t node_table)
    : region_(region),
      options_(options),
      local_(std::move(local)),
      layout_(layout),
      node_table_(node_table),
      max_nodes_(region.info().max_nodes),
      observed_(max_nodes_),
      recovered_incarnation_(max_nodes_, 0),
      last_granted_(layout.max_locks(), max_nodes_ - 1),
      held_request_(layout.max_locks(), 0) {}

Result<std::unique_ptr<Node>> Node::Join(Region& region, const NodeOptions& options) {
  const RegionInfo& info = region.info();
  if (options.node_id >= info.max_nodes) {
    return InvalidArgument("node id " + std::to_string(options.node_id) + " is out of range: this "
                           "region admits nodes 0.." + std::to_string(info.max_nodes - 1));
  }
  if (options.lease < std::chrono::milliseconds(50)) {
    return InvalidArgument("lease must be at least 50 ms");
  }
  const auto* locks = region.impl().find_area(region::AreaKind::kLockArray);
  const auto* nodes = region.impl().find_area(region::AreaKind::kNodeTable);
  if (locks == nullptr || nodes == nullptr) {
    return InvalidArgument("region " + info.path + " has no lock array: it is a data-only region "
                           "of a pool; join the pool's first region");
  }
  CXLKV_RETURN_IF_ERROR(ValidateLockArea(*locks, info.max_nodes, info.path));
  LockArrayLayout layout(locks->offset, info.max_nodes, static_cast<uint32_t>(locks->param));
  CXLKV_ASSIGN_OR_RETURN(auto local, LocalNode::Open(info.region_id, options.node_id,
                                                     layout.max_locks()));
  bool fresh_local = local->created();
  std::unique_ptr<Node> node(new Node(region, options, std::move(local), layout, nodes->offset));
  node->local_->header().attached.fetch_add(1);

  region::MetaAccess& meta = node->meta();
  if (fresh_local) {
    // No process of this node ran here before: is the id live on another host?
    uint64_t off = node->NodeLineOffset(options.node_id);
    meta.Invalidate(off, 64);
    auto line = meta.ReadStruct<NodeLine>(off);
    if (line.state == static_cast<uint64_t>(NodeState::kLive)) {
      auto until = Clock::now() + options.lease;
      while (Clock::now() < until) {
        std::this_thread::sleep_for(options.lease / 10);
        if (meta.Fetch(off + offsetof(NodeLine, heartbeat)) != line.heartbeat) {
          node->local_->header().attached.fetch_sub(1);
          return AlreadyExists("node " + std::to_string(options.node_id) + " is live elsewhere "
                               "(pid " + std::to_string(line.pid) + "): choose another --node");
        }
      }
    }
  }
  if (!node->TryBecomeBeatOwner()) {
    // Another process of this node heartbeats; wait until it has an incarnation.
    auto until = Clock::now() + options.lease;
    while (node->local_->header().incarnation.load() == 0 && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  node->membership_thread_ = std::thread([n = node.get()] { n->MembershipLoop(); });
  node->recovery_thread_ = std::thread([n = node.get()] { n->RecoveryLoop(); });
  return node;
}

Node::~Node() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stop_.store(true);
  }
  stop_cv_.notify_all();
  recovery_cv_.notify_all();
  if (membership_thread_.joinable()) membership_thread_.join();
  if (recovery_thread_.joinable()) recovery_thread_.join();
  LocalHeader& h = local_->header();
  uint32_t left = h.attached.fetch_sub(1) - 1;
  if (beat_owner_.load()) {
    if (left == 0) PublishNodeLine(NodeState::kLeft);
    pthread_mutex_unlock(&h.beat_owner);
  }
}

void Node::PublishNodeLine(NodeState state) {
  NodeLine line{};
  line.incarnation = local_->header().incarnation.load();
  line.state = static_cast<uint64_t>(state);
  line.heartbeat = heartbeat_counter_;
  line.pid = static_cast<uint64_t>(::getpid());
  line.lease_ms = static_cast<uint64_t>(options_.lease.count());
  uint64_t off = NodeLineOffset(options_.node_id);
  meta().WriteStruct(off, line);
  meta().Flush(off, sizeof line);  // P1: the line is this node's single-writer publication
}

bool Node::TryBecomeBeatOwner() {
  LocalHeader& h = local_->header();
  if (TryLockRobust(&h.beat_owner) < 0) return false;
  beat_owner_.store(true);
  uint64_t off = NodeLineOffset(options_.node_id);
  meta().Invalidate(off, 64);
  auto line = meta().ReadStruct<NodeLine>(off);
  heartbeat_counter_ = line.heartbeat;
  int64_t last = h.last_beat_ns.load();
  bool silent_for_a_lease =
      last == 0 || MonotonicNs() - last > std::chrono::nanoseconds(options_.lease).count();
  if (h.incarnation.load() == 0 || silent_for_a_lease || line.incarnation != h.incarnation.load()) {
    // A new life: whatever the old one left in the region is recovered, never trusted.
    uint64_t inc = std::max<uint64_t>(h.incarnation.load(), line.incarnation) + 1;
    for (uint32_t k = 0; k < layout_.max_locks(); ++k) {
      local_->lock(k).seq.store(0);
      meta().Publish(layout_.request(k, options_.node_id), MakeRequest(inc, 0));
    }
    h.incarnation.store(inc);
  }
  Beat();
  return true;
}

void Node::Beat() {
  ++heartbeat_counter_;
  PublishNodeLine(NodeState::kLive);
  local_->header().last_beat_ns.store(MonotonicNs());
}

void Node::ObserveNodes() {
  auto now = Clock::now();
  std::vector<NodeLine> lines(max_nodes_);
  for (uint32_t j = 0; j < max_nodes_; ++j) {
    uint64_t off = NodeLineOffset(j);
    meta().Invalidate(off, 64);  // P2: another node wrote it
    lines[j] = meta().ReadStruct<NodeLine>(off);
  }
  std::lock_guard<std::mutex> lock(view_mu_);
  for (uint32_t j = 0; j < max_nodes_; ++j) {
    Observed& o = observed_[j];
    const NodeLine& l = lines[j];
    if (!o.seen || l.heartbeat != o.view.heartbeat || l.incarnation != o.view.incarnation ||
        l.state != static_cast<uint64_t>(o.view.state)) {
      o.last_change = now;
      o.seen = true;
    }
    o.view.id = j;
    o.view.state = static_cast<NodeState>(l.state);
    o.view.incarnation = l.incarnation;
    o.view.heartbeat = l.heartbeat;
    o.view.pid = l.pid;
    bool self_beating = j == options_.node_id && beat_owner_.load() && !test_stop_heartbeat_.load();
    o.view.live = o.view.state == NodeState::kLive &&
                  (self_beating || now - o.last_change < options_.lease);
  }
}

std::vector<NodeView> Node::Nodes() {
  std::lock_guard<std::mutex> lock(view_mu_);
  std::vector<NodeView> out;
  for (const Observed& o : observed_) out.push_back(o.view);
  return out;
}

bool Node::SurelyLive(uint32_t node, uint64_t incarnation, uint64_t inc_mask) {
  if (node >= max_nodes_) return false;
  uint64_t off = NodeLineOffset(node);
  meta().Invalidate(off, 64);  // P2: the node wrote it
  auto line = meta().ReadStruct<NodeLine>(off);
  if (line.state != static_cast<uint64_t>(NodeState::kLive) || (line.incarnation & inc_mask) != (incarnation & inc_mask)) {
    return false;
  }
  if (node == options_.node_id) return true;
  std::lock_guard<std::mutex> lock(view_mu_);
  const Observed& o = observed_[node];
  if (!o.seen) return true;  // not observed yet: the line says live
  return Clock::now() - o.last_change < options_.lease / 2;
}

bool Node::LifeOver(uint32_t node, uint64_t incarnation, uint64_t inc_mask) {
  if (node >= max_nodes_) return true;
  uint64_t off = NodeLineOffset(node);
  meta().Invalidate(off, 64);
  auto line = meta().ReadStruct<NodeLine>(off);
  if ((line.incarnation & inc_mask) != (incarnation & inc_mask)) return true;
  if (line.state == static_cast<uint64_t>(NodeState::kLeft)) return true;
  std::lock_guard<std::mutex> lock(view_mu_);
  const Observed& o = observed_[node];
  return o.seen && (o.view.incarnation & inc_mask) == (incarnation & inc_mask) && !o.view.live;
}

void Node::WaitOrStop(std::chrono::nanoseconds d) {
  std::unique_lock<std::mutex> lock(stop_mu_);
  stop_cv_.wait_for(lock, d, [this] { return stop_.load(); });
}

void Node::MembershipLoop() {
  const auto interval = options_.lease / 8;
  while (!stop_.load()) {
    if (!beat_owner_.load()) TryBecomeBeatOwner();
    if (beat_owner_.load() && !test_stop_heartbeat_.load()) Beat();
    ObserveNodes();

    // Election: the lowest-numbered live node's heartbeat owner hosts the manager.
    uint32_t lowest = max_nodes_;
    std::vector<NodeView> views = Nodes();
    for (const NodeView& v : views) {
      if (v.live) {
        lowest = v.id;
        break;
      }
    }
    bool elect = beat_owner_.load() && options_.may_host_manager && !test_stop_heartbeat_.load() &&
                 lowest == options_.node_id;
    if (elect && !manager_running_.load() && ManagerLineFree(views)) {
      if (manager_thread_.joinable()) manager_thread_.join();
      manager_running_.store(true);
      manager_thread_ = std::thread([this] { ManagerLoop(); });
    } else if (!elect && manager_running_.load()) {
      StopManager();
    }
    if (manager_running_.load()) {
      // Recover every node that is not live and has a life we have not recovered yet.
      for (const NodeView& v : views) {
        if (v.live || v.incarnation == 0 || v.id == options_.node_id) continue;
        if (recovered_incarnation_[v.id] == v.incarnation) continue;
        recovered_incarnation_[v.id] = v.incarnation;
        ResetGrantsOf(v.id);
        {
          std::lock_guard<std::mutex> lock(hooks_mu_);
          recovery_queue_.emplace_back(v.id, v.incarnation);
        }
        recovery_cv_.notify_all();
      }
    }
    std::vector<std::function<void()>> tasks;
    {
      std::lock_guard<std::mutex> lock(hooks_mu_);
      tasks = periodic_tasks_;
    }
    for (auto& t : tasks) t();
    WaitOrStop(interval);
  }
  StopManager();
}

// Single-writer handoff of the manager line: a manager writes it when it starts and clears it
// after it has stopped granting; a newly elected node starts only once it is clear (or names a
// node that is dead or in another life). Two managers never grant at the same time, short of
// a process paused longer than a lease.
bool Node::ManagerLineFree(const std::vector<NodeView>& views) {
  meta().Invalidate(layout_.manager_line(), 64);  // P2: the previous manager wrote it
  auto line = meta().ReadStruct<ManagerLine>(layout_.manager_line());
  if (line.node_plus_one == 0) return true;
  uint32_t holder = static_cast<uint32_t>(line.node_plus_one - 1);
  if (holder == options_.node_id) return true;
  return holder >= views.size() || !views[holder].live || views[holder].incarnation != line.incarnation;
}

void Node::StopManager() {
  if (manager_thread_.joinable()) {
    manager_running_.store(false);
    manager_thread_.join();
    meta().Invalidate(layout_.manager_line(), 64);
    if (meta().Load(layout_.manager_line()) == options_.node_id + 1) {
      meta().Publish(layout_.manager_line(), 0);  // hand over: no grant follows from us
    }
  }
  manager_running_.store(false);
}

void Node::RecoveryLoop() {
  for (;;) {
    std::pair<uint32_t, uint64_t> job;
    std::vector<std::function<void(uint32_t, uint64_t)>> handlers;
    {
      std::unique_lock<std::mutex> lock(hooks_mu_);
      recovery_cv_.wait(lock, [this] { return stop_.load() || (recovery_started_ && !recovery_queue_.empty()); });
      if (stop_.load()) return;
      job = recovery_queue_.front();
      recovery_queue_.pop_front();
      handlers = recovery_handlers_;
    }
    for (auto& h : handlers) h(job.first, job.second);
  }
}

void Node::AddRecoveryHandler(std::function<void(uint32_t, uint64_t)> handler) {
  std::lock_guard<std::mutex> lock(hooks_mu_);
  recovery_handlers_.push_back(std::move(handler));
}

void Node::StartRecovery() {
  {
    std::lock_guard<std::mutex> lock(hooks_mu_);
    recovery_started_ = true;
  }
  recovery_cv_.notify_all();
}

void Node::AddPeriodicTask(std::function<void()> task) {
  std::lock_guard<std::mutex> lock(hooks_mu_);
  periodic_tasks_.push_back(std::move(task));
}

Result<AcquireInfo> Node::Acquire(uint32_t lock, Clock::time_point deadline) {
  if (lock >= layout_.max_locks()) {
    return InvalidArgument("lock " + std::to_string(lock) + " does not exist (this region has " +
                           std::to_string(layout_.max_locks()) + ")");
  }
  LocalLock& ll = local_->lock(lock);
  AcquireInfo info;
  // Local tier: one process per node competes for the global lock.
  timespec ts = RealtimeDeadline(deadline);
  int rc = pthread_mutex_timedlock(&ll.mu, &ts);
  if (rc == ETIMEDOUT) return Timeout("lock " + std::to_string(lock) + " not granted in time (local tier)");
  if (rc == EOWNERDEAD) {
    pthread_mutex_consistent(&ll.mu);
    info.holder_died = true;
  } else if (rc != 0) {
    return Internal("pthread_mutex_timedlock: " + std::string(std::strerror(rc)));
  }
  const uint32_t me = options_.node_id;
  const uint64_t inc = local_->header().incarnation.load();
  uint64_t req = meta().Fetch(layout_.request(lock, me));
  if (!(info.holder_died && RequestWants(req) && RequestIncarnation(req) == static_cast<uint32_t>(inc))) {
    // Global tier: publish a fresh odd request (single writer: this node, under the local mutex).
    uint32_t seq = ll.seq.load();
    seq = (seq | 1) == seq ? seq + 2 : seq + 1;
    ll.seq.store(seq);
    req = MakeRequest(inc, seq);
    meta().Publish(layout_.request(lock, me), req);
  }
  Backoff backoff;
  for (;;) {
    if (meta().Fetch(layout_.grant(lock, me)) == req) {  // P2: the manager wrote it
      held_request_[lock] = req;
      return info;
    }
    // A leaving node's own manager thread is gone: waiting out the deadline would only delay
    // the exit (recovery handlers still running hit this).
    const bool leaving = stop_.load();
    if (Clock::now() >= deadline || leaving) {
      // Withdraw: an even request means "not wanted"; a grant racing with it matches nothing.
      uint32_t seq = static_cast<uint32_t>(req) + 1;
      ll.seq.store(seq);
      meta().Publish(layout_.request(lock, me), MakeRequest(RequestIncarnation(req), seq));
      pthread_mutex_unlock(&ll.mu);
      if (leaving) return Busy("lock " + std::to_string(lock) + " not taken: this node is leaving");
      return Timeout("lock " + std::to_string(lock) + " not granted within the deadline; is a "
                     "lock manager running (a live node with may_host_manager)?");
    }
    backoff.Pause();
  }
}

void Node::Release(uint32_t lock, std::span<const Range> written) {
  LocalLock& ll = local_->lock(lock);
  if (!test_skip_release_flush_.load()) {
    for (const Range& r : written) meta().Flush(r.offset, r.bytes);  // P1 before the release
  }
  uint64_t req = held_request_[lock];
  uint32_t seq = static_cast<uint32_t>(req) + 1;
  ll.seq.store(seq);
  meta().Publish(layout_.request(lock, options_.node_id), MakeRequest(RequestIncarnation(req), seq));
  pthread_mutex_unlock(&ll.mu);
}

Result<uint32_t> Node::AllocateLock() {
  CXLKV_ASSIGN_OR_RETURN(auto held, AcquireFor(kLockTableLock, options_.lease * 4));
  (void)held;
  for (uint32_t k = kReservedLocks; k < layout_.max_locks(); ++k) {
    uint64_t off = layout_.bitmap_word(k);
    uint64_t word = meta().Fetch(off);
    if (word & (uint64_t{1} << (k % 64))) continue;
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
  meta().Store(off, word & ~(uint64_t{1} << (lock % 64)));
  Range r{off, 8};
  Release(kLockTableLock, {&r, 1});
  return Status::Ok();
}

}  // namespace cxlkv::sync
