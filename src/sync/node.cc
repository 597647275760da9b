// Membership (join, leave, observation of other nodes, election, recovery of ended lives).
// The node side of the lock is in lock_client.cc, the manager in lock_manager.cc, the heartbeat
// and fence in heartbeat.cc. Protocol: docs/protocol.md, "Two-tier lock" and "Leases and fencing".
#include "sync/node.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

namespace cxlkv::sync {

NodeView ReadNodeLine(region::MetaAccess& meta, uint64_t node_table, uint32_t node) {
  uint64_t off = node_table + uint64_t{node} * 64;
  meta.Invalidate(off, 64);  // P2: the node wrote it
  auto line = meta.ReadStruct<NodeLine>(off);
  LifeWord life = LifeWord::Decode(line.life);
  NodeView v;
  v.id = node;
  v.state = life.state;
  v.incarnation = life.incarnation;
  v.heartbeat = life.heartbeat;
  v.pid = line.pid;
  v.may_host = (line.flags & kNodeMayHostManager) != 0;
  return v;
}

Node::Node(Region& region, const NodeOptions& options, std::unique_ptr<LocalNode> local,
           std::unique_ptr<HostWake> wake, LockArrayLayout layout, uint64_t node_table)
    : region_(region),
      options_(options),
      local_(std::move(local)),
      wake_(std::move(wake)),
      layout_(layout),
      node_table_(node_table),
      max_nodes_(region.info().max_nodes),
      observed_(max_nodes_),
      recovered_incarnation_(max_nodes_, 0),
      held_request_(layout.max_locks(), 0) {
  heartbeat_ = std::make_unique<Heartbeat>(meta(), layout_, NodeLineOffset(options.node_id), options.node_id,
                                           options.lease, *local_);
  manager_ = std::make_unique<LockManager>(meta(), layout_, options.node_id, *heartbeat_,
                                           [this](std::vector<uint32_t>& out) { LiveIncarnations(out); },
                                           wake_.get());
}

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
  // Node-local files of regions and nodes nobody uses any more go (kill -9 leaves them).
  LocalNode::SweepUnused(LocalNode::PathFor(info.region_id, options.node_id));
  CXLKV_ASSIGN_OR_RETURN(auto local, LocalNode::Open(info.region_id, options.node_id,
                                                     layout.max_locks()));
  const bool fresh_local = local->created();
  // The host's wake file only speeds wake-ups (host_wake.h): without it the lock still works,
  // by polling, so a failure to open it is said once and not fatal.
  HostWake::SweepUnused(HostWake::PathFor(info.region_id));
  auto wake = HostWake::Open(info.region_id, info.max_nodes);
  if (!wake.ok()) {
    std::fprintf(stderr, "cxlkv: lock wake-ups by polling only: %s\n", wake.status().ToString().c_str());
  }
  std::unique_ptr<Node> node(new Node(region, options, std::move(local),
                                      wake.ok() ? std::move(wake).value() : nullptr, layout, nodes->offset));
  LocalHeader& h = node->local_->header();

  if (fresh_local) {
    // No process of this node ran on this host before: is the id live on another host?
    NodeView line = ReadNodeLine(node->meta(), nodes->offset, options.node_id);
    if (line.state == NodeState::kLive) {
      auto until = Clock::now() + options.lease;
      while (Clock::now() < until) {
        std::this_thread::sleep_for(options.lease / 10);
        NodeView now = ReadNodeLine(node->meta(), nodes->offset, options.node_id);
        // A process of this node on this host (joining beside us) beats through our local file:
        // its beats match the local counter. Only a beat we cannot account for is elsewhere.
        const bool ours = now.incarnation == static_cast<uint32_t>(h.incarnation.load()) &&
                          now.heartbeat == (h.heartbeat.load() & LifeWord::kHeartbeatMask);
        if (ours) break;
        if (now.heartbeat != line.heartbeat || now.incarnation != line.incarnation) {
          return AlreadyExists("node " + std::to_string(options.node_id) + " is live elsewhere "
                               "(pid " + std::to_string(line.pid) + "): choose another --node");
        }
      }
    }
  }
  // (A first user's new life was marked in LocalNode::Open, before anyone else could attach.)
  h.attached.fetch_add(1);
  node->heartbeat_->Tick();
  // Another process of this node may be mid-beat (our Tick's try-lock then gave way): wait
  // (bounded) until the node has a life and has beaten in it (a first user's reset leaves no
  // beat: a write fenced before the next one would be refused).
  auto until = Clock::now() + options.lease;
  while ((h.incarnation.load() == 0 || h.last_beat_ns.load() == 0) && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    node->heartbeat_->Tick();
  }
  if (h.incarnation.load() == 0) {
    h.attached.fetch_sub(1);
    return Timeout("node " + std::to_string(options.node_id) + " has no life after a lease: another process "
                   "of it is stuck inside a heartbeat; stop it and retry");
  }
  node->ObserveNodes();
  auto claimed = node->slot_claimed_.get_future();
  node->beat_thread_ = std::thread([n = node.get()] { n->BeatLoop(); });
  if (claimed.get() < 0) {
    return NoSpace("node " + std::to_string(options.node_id) + " already has " + std::to_string(kLocalProcessSlots) +
                   " processes attached on this host: close some (or use another node id) and retry");
  }
  node->tasks_thread_ = std::thread([n = node.get()] { n->TasksLoop(); });
  node->recovery_thread_ = std::thread([n = node.get()] { n->RecoveryLoop(); });
  return node;
}

Node::~Node() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stop_.store(true);
  }
  stop_cv_.notify_all();
  {
    // RecoveryLoop tests stop_ under hooks_mu_, not stop_mu_: notified without it, a loop that
    // had just found stop_ false missed the notify and slept for good, and the join below hung
    // (a pool opened and closed at once: about one close in a thousand, on two cores).
    std::lock_guard<std::mutex> lock(hooks_mu_);
    recovery_cv_.notify_all();
  }
  // The tasks and recovery threads first, while this node still beats (and may still grant
  // locks): a last drain or recovery that waits on a lock must not leave the node silent long
  // enough to be presumed dead, its rings consumed by a recoverer under its feet.
  if (tasks_thread_.joinable()) tasks_thread_.join();
  if (recovery_thread_.joinable()) recovery_thread_.join();
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stop_beats_.store(true);
  }
  stop_cv_.notify_all();
  if (beat_thread_.joinable()) beat_thread_.join();  // stops the manager, drops manager_mu
  local_->header().attached.fetch_sub(1);
  // The last process of the node marks it left; the node-local file goes with it.
  if (local_->LastUser()) heartbeat_->PublishLeft();
  manager_.reset();
  heartbeat_.reset();
  local_.reset();
}

void Node::ObserveNodes() {
  auto now = Clock::now();
  std::vector<uint64_t> offs(max_nodes_);
  for (uint32_t j = 0; j < max_nodes_; ++j) offs[j] = NodeLineOffset(j);
  meta().InvalidateEach(offs, 64);  // P2: other nodes wrote them; one fence for all
  std::vector<NodeLine> lines(max_nodes_);
  for (uint32_t j = 0; j < max_nodes_; ++j) lines[j] = meta().ReadStruct<NodeLine>(offs[j]);
  std::lock_guard<std::mutex> lock(view_mu_);
  for (uint32_t j = 0; j < max_nodes_; ++j) {
    Observed& o = observed_[j];
    LifeWord life = LifeWord::Decode(lines[j].life);
    const uint64_t old_word = LifeWord{static_cast<uint32_t>(o.view.incarnation), o.view.state,
                                       static_cast<uint32_t>(o.view.heartbeat)}.Encode();
    if (!o.seen || lines[j].life != old_word) {
      // A new incarnation ends the previous life even if no one saw it silent (a quick rejoin).
      if (o.seen && o.view.incarnation != 0 && life.incarnation != o.view.incarnation) {
        ended_lives_.emplace_back(j, o.view.incarnation);
      }
      o.last_change = now;
      o.seen = true;
    }
    o.view.id = j;
    o.view.state = life.state;
    o.view.incarnation = life.incarnation;
    o.view.heartbeat = life.heartbeat;
    o.view.pid = lines[j].pid;
    o.view.may_host = (lines[j].flags & kNodeMayHostManager) != 0;
    o.view.live = o.view.state == NodeState::kLive && now - o.last_change < options_.lease;
  }
}

std::vector<NodeView> Node::Nodes() {
  std::lock_guard<std::mutex> lock(view_mu_);
  std::vector<NodeView> out;
  for (const Observed& o : observed_) out.push_back(o.view);
  return out;
}

std::optional<NodeView> Node::ViewOf(uint32_t node) {
  std::lock_guard<std::mutex> lock(view_mu_);
  if (node >= observed_.size()) return std::nullopt;
  return observed_[node].view;
}

void Node::LiveIncarnations(std::vector<uint32_t>& out) {
  out.assign(max_nodes_, 0);
  std::lock_guard<std::mutex> lock(view_mu_);
  for (uint32_t j = 0; j < max_nodes_; ++j) {
    if (observed_[j].view.live) out[j] = static_cast<uint32_t>(observed_[j].view.incarnation);
  }
}

bool Node::SurelyLive(uint32_t node, uint64_t incarnation, uint64_t inc_mask) {
  if (node >= max_nodes_) return false;
  NodeView line = ReadNodeLine(meta(), node_table_, node);
  if (line.state != NodeState::kLive || (line.incarnation & inc_mask) != (incarnation & inc_mask)) {
    return false;
  }
  if (node == options_.node_id) return heartbeat_->Fence("liveness").ok();
  std::lock_guard<std::mutex> lock(view_mu_);
  const Observed& o = observed_[node];
  if (!o.seen) return true;  // not observed yet: the line says live
  return Clock::now() - o.last_change < options_.lease / 2;
}

bool Node::LifeOver(uint32_t node, uint64_t incarnation, uint64_t inc_mask) {
  if (node >= max_nodes_) return true;
  NodeView line = ReadNodeLine(meta(), node_table_, node);
  if ((line.incarnation & inc_mask) != (incarnation & inc_mask)) return true;
  if (line.state == NodeState::kLeft) return true;
  std::lock_guard<std::mutex> lock(view_mu_);
  const Observed& o = observed_[node];
  return o.seen && (o.view.incarnation & inc_mask) == (incarnation & inc_mask) && !o.view.live;
}

void Node::WaitOrStop(std::chrono::nanoseconds d, const std::atomic<bool>& flag) {
  std::unique_lock<std::mutex> lock(stop_mu_);
  stop_cv_.wait_for(lock, d, [&flag] { return flag.load(); });
}

// The beat thread: beat, observe, elect. Nothing here waits on a lock, I/O or another node
// (stopping the manager joins a thread that polls its stop flag at least every millisecond).
void Node::BeatLoop() {
  // This thread holds the process slot's mutex for the whole attachment (see process_slots.cc).
  const int slot = ClaimProcessSlot();
  slot_claimed_.set_value(slot);
  if (slot < 0) return;
  const auto interval = heartbeat_->interval();
  while (!stop_beats_.load()) {
    heartbeat_->Tick();
    ObserveNodes();
    Elect();
    WaitOrStop(interval / 2, stop_beats_);  // half the interval: a beat is never later than one interval
  }
  StopManager();
  if (manager_candidate_) {
    pthread_mutex_unlock(&local_->header().manager_mu);  // by the thread that locked it
    manager_candidate_ = false;
  }
  ReleaseProcessSlot();
}

void Node::Elect() {
  // One process per node stands for the manager: the one holding the node's manager_mu.
  if (options_.may_host_manager && !manager_candidate_) {
    manager_candidate_ = TryLockRobust(&local_->header().manager_mu) >= 0;
  }
  std::vector<NodeView> views = Nodes();
  if (manager_candidate_) views[options_.node_id].may_host = true;  // before our next beat says so
  uint32_t lowest = max_nodes_;
  for (const NodeView& v : views) {
    if (v.live && v.may_host) {  // election skips nodes none of whose processes may host
      lowest = v.id;
      break;
    }
  }
  const bool fenced = !heartbeat_->Fence("election").ok();
  const bool elect = manager_candidate_ && !fenced && !heartbeat_->test_stopped() && lowest == options_.node_id;
  // A manager of an ended life stops even if this node is elected again: its successor in the
  // new life starts with a fresh claim and a fresh read of the region.
  if (manager_running_.load() && (!elect || !manager_->running() || manager_life_ != heartbeat_->incarnation())) {
    StopManager();
  }
  if (elect && !manager_running_.load() && ManagerLineFree(views)) {
    if (manager_thread_.joinable()) manager_thread_.join();
    manager_running_.store(true);
    manager_->Arm();
    manager_life_ = heartbeat_->incarnation();
    manager_thread_ = std::thread([this, inc = manager_life_] { manager_->Run(inc); });
  }
  if (manager_running_.load() && options_.recovers) {
    // Recover every life that ended: nodes seen dead or left, and lives replaced by a new one.
    for (const NodeView& v : views) {
      if (v.live || v.incarnation == 0 || v.id == options_.node_id) continue;
      if (recovered_incarnation_[v.id] == v.incarnation) continue;
      QueueRecovery(v.id, v.incarnation);
    }
    for (auto [node, inc] : ended_lives_) {
      if (recovered_incarnation_[node] != inc) QueueRecovery(node, inc);
    }
  }
  ended_lives_.clear();
}

void Node::QueueRecovery(uint32_t node, uint64_t incarnation) {
  recovered_incarnation_[node] = incarnation;
  {
    std::lock_guard<std::mutex> lock(hooks_mu_);
    recovery_queue_.emplace_back(node, incarnation);
  }
  recovery_cv_.notify_all();
}

// Single-writer handoff of the manager line: a manager writes it when it starts and clears it
// after it has stopped granting; a newly elected node starts only once it is clear, or names
// this node (in any life), or a node that is dead or in another life. A manager paused past its
// lease is fenced: it resumes into a refused fence and grants nothing more.
bool Node::ManagerLineFree(const std::vector<NodeView>& views) {
  meta().Invalidate(layout_.manager_line(), 64);  // P2: the previous manager wrote it
  uint64_t holder = meta().Load(layout_.manager_line());
  if (!ManagerNamed(holder)) return true;
  uint32_t node = ManagerNode(holder);
  if (node == options_.node_id) return true;
  return node >= views.size() || !views[node].live ||
         static_cast<uint32_t>(views[node].incarnation) != ManagerIncarnation(holder);
}

void Node::StopManager() {
  if (manager_thread_.joinable()) {
    manager_->Stop();
    manager_thread_.join();
    meta().Invalidate(layout_.manager_line(), 64);
    // Hand over (no grant follows from us) — only if the line is still ours in this life.
    if (meta().Load(layout_.manager_line()) == ManagerHolder(options_.node_id, manager_life_) &&
        manager_life_ == heartbeat_->incarnation() &&
        heartbeat_->Fence("manager handover").ok()) {
      meta().Publish(layout_.manager_line(), 0);
    }
  }
  manager_running_.store(false);
}

void Node::TasksLoop() {
  const auto tick = heartbeat_->interval() / kMaxTaskRunsPerBeat;
  for (uint64_t n = 0; !stop_.load(); ++n) {
    std::vector<PeriodicTask> tasks;
    {
      std::lock_guard<std::mutex> lock(hooks_mu_);
      tasks = periodic_tasks_;
    }
    for (auto& t : tasks) {
      if (n % t.every_ticks == 0) t.run();
    }
    if (n % kMaxTaskRunsPerBeat == 0) RecoverDeadProcesses();
    WaitOrStop(tick);
  }
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
    lives_recovered_.fetch_add(1, std::memory_order_relaxed);
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

void Node::AddPeriodicTask(std::function<void()> task, uint32_t per_beat) {
  per_beat = std::clamp<uint32_t>(per_beat, 1, kMaxTaskRunsPerBeat);
  std::lock_guard<std::mutex> lock(hooks_mu_);
  periodic_tasks_.push_back({std::move(task), kMaxTaskRunsPerBeat / per_beat});
}

}  // namespace cxlkv::sync
