// Engines per memory node (node_engines.h).
#include "daemon/node_engines.h"

#include <algorithm>
#include <deque>

namespace cxlkv::daemon {

struct NodeEngines::Engine {
  int node = -1;  // bound to this node, or -1
  std::string note;
  uint32_t regions = 0;
  std::atomic<int> bind_error{0};  // a thread's failed binding (-errno)
  std::unique_ptr<pnm::AttendPool> pool;
  std::atomic<uint64_t> jobs{0}, pages{0}, kv_bytes{0};
  // The lead thread (every engine but the first): runs `batch` when posted.
  std::thread lead;
  std::mutex mu;
  std::condition_variable posted;  // the lead: a batch (or stop)
  std::condition_variable done;    // the poster: the batch ran
  std::span<pnm::AttendJob> batch;  // guarded by mu
  bool pending = false;             // guarded by mu: batch posted, not yet run
  bool stop = false;                // guarded by mu
};

std::unique_ptr<NodeEngines> NodeEngines::Create(std::span<const std::span<uint8_t>> regions,
                                                 const NodeEnginesOptions& options) {
  auto self = std::unique_ptr<NodeEngines>(new NodeEngines());
  self->platform_ = options.platform != nullptr ? options.platform : &region::Platform::Default();
  self->engine_of_region_.assign(regions.size(), 0);
  Engine& first = *self->engines_.emplace_back(std::make_unique<Engine>());
  if (!options.bind_numa) {
    first.note = "not bound (--pnm-no-numa)";
  } else {
    // Bound where the memory is: attention streams it (PNM §3.2).
    std::vector<int> nodes;
    for (const auto& r : regions) nodes.push_back(self->platform_->NumaNodeOf(r.data()));
    if (nodes[0] < 0) {
      first.note = "not bound: the region's NUMA node is unknown (" + region::ErrnoText(nodes[0]) + ")";
    } else {
      first.node = nodes[0];
    }
    for (size_t i = 1; i < regions.size(); ++i) {
      if (nodes[i] < 0) continue;  // unknown: the first engine's
      auto same = std::find_if(self->engines_.begin(), self->engines_.end(),
                               [&](const auto& e) { return e->node == nodes[i]; });
      if (same == self->engines_.end()) {
        auto e = std::make_unique<Engine>();
        e->node = nodes[i];
        self->engines_.push_back(std::move(e));
        same = self->engines_.end() - 1;
      }
      self->engine_of_region_[i] = static_cast<uint32_t>(same - self->engines_.begin());
    }
  }
  for (uint32_t idx : self->engine_of_region_) ++self->engines_[idx]->regions;
  NodeEngines* s = self.get();
  for (size_t i = 0; i < self->engines_.size(); ++i) {
    Engine& e = *self->engines_[i];
    e.pool = std::make_unique<pnm::AttendPool>(options.threads, [s, &e] { s->Bind(e); });
    if (i > 0) e.lead = std::thread([s, &e] { s->LeadLoop(e); });
  }
  return self;
}

NodeEngines::~NodeEngines() {
  for (auto& e : engines_) {
    if (!e->lead.joinable()) continue;
    {
      std::lock_guard<std::mutex> lock(e->mu);
      e->stop = true;
    }
    e->posted.notify_one();
    e->lead.join();
  }
}

void NodeEngines::Bind(Engine& e) {
  if (e.node < 0) return;
  const int rc = platform_->RunThreadOnNode(e.node);
  if (rc < 0) e.bind_error.store(rc);  // stats() words it
}

pnm::AttendPool& NodeEngines::first() { return *engines_[0]->pool; }

void NodeEngines::BindServingThread() { Bind(*engines_[0]); }

void NodeEngines::LeadLoop(Engine& e) {
  Bind(e);
  std::unique_lock<std::mutex> lock(e.mu);
  for (;;) {
    e.posted.wait(lock, [&] { return e.stop || e.pending; });
    if (e.stop) return;
    const std::span<pnm::AttendJob> batch = e.batch;
    lock.unlock();
    (void)e.pool->Run(batch);  // per-job statuses
    lock.lock();
    e.pending = false;
    e.done.notify_one();
  }
}

void NodeEngines::Run(std::span<std::vector<pnm::AttendJob>> per_engine) {
  for (size_t i = 1; i < engines_.size(); ++i) {
    if (per_engine[i].empty()) continue;
    Engine& e = *engines_[i];
    {
      std::lock_guard<std::mutex> lock(e.mu);
      e.batch = per_engine[i];
      e.pending = true;
    }
    e.posted.notify_one();
  }
  if (!per_engine[0].empty()) (void)engines_[0]->pool->Run(per_engine[0]);
  for (size_t i = 1; i < engines_.size(); ++i) {
    if (per_engine[i].empty()) continue;
    Engine& e = *engines_[i];
    std::unique_lock<std::mutex> lock(e.mu);
    e.done.wait(lock, [&] { return !e.pending; });
  }
  for (size_t i = 0; i < engines_.size(); ++i) {
    Engine& e = *engines_[i];
    for (const pnm::AttendJob& j : per_engine[i]) {
      if (!j.status.ok()) continue;
      const uint64_t pages = pnm::PageHeadsAttended(*j.g, j.g->PagesFor(j.ctx.tokens), j.selection);
      e.jobs.fetch_add(1);
      e.pages.fetch_add(pages);
      e.kv_bytes.fetch_add(pages * j.g->HeadPageKvBytes());
    }
  }
}

void NodeEngines::Attend(std::span<pnm::AttendJob> work, std::span<const std::span<const uint8_t>> engine_of_page) {
  const size_t engines = engines_.size();
  std::vector<std::vector<pnm::AttendJob>> per_engine(engines);
  if (engines == 1) {
    per_engine[0].assign(work.begin(), work.end());
    Run(per_engine);
    for (size_t k = 0; k < work.size(); ++k) work[k].status = per_engine[0][k].status;
    return;
  }
  // Each item's pages by the engine of their node: per item and engine, a selection of them.
  // An item on one node is that engine's whole (its own selection: the same bits as one engine).
  struct Part {
    size_t item;
    uint32_t engine;
    size_t index;  // in per_engine[engine]
  };
  std::vector<Part> parts;                 // in item order, then engine order: the merge order
  std::deque<pnm::Selection> part_selections;  // deques: jobs point into them as they grow
  std::deque<pnm::Partial> part_outs;
  std::vector<std::vector<std::vector<uint32_t>>> lists(engines);  // [engine][kv head] pages
  for (size_t k = 0; k < work.size(); ++k) {
    const uint32_t kv_heads = work[k].g->num_kv_heads;
    const std::span<const uint8_t> of_page = engine_of_page[k];
    const pnm::Selection* sel = work[k].selection;
    // Dense, or one list for every head: the parts keep one list each, so the kernel still
    // reads each page once for all heads (a token-major page read head by head costs ~2×).
    const bool same = sel == nullptr || sel->SameForAllHeads();
    const uint32_t listed = same ? 1 : kv_heads;
    for (auto& l : lists) l.assign(listed, {});
    for (uint32_t h = 0; h < listed; ++h) {
      if (sel != nullptr) {
        for (uint32_t p : sel->Of(h)) lists[p < of_page.size() ? of_page[p] : 0][h].push_back(p);
      } else {
        for (uint32_t p = 0; p < of_page.size(); ++p) lists[of_page[p]][h].push_back(p);
      }
    }
    std::vector<uint32_t> used;
    for (uint32_t e = 0; e < engines; ++e) {
      if (std::any_of(lists[e].begin(), lists[e].end(), [](const auto& l) { return !l.empty(); })) used.push_back(e);
    }
    if (used.size() <= 1) {
      const uint32_t e = used.empty() ? 0 : used[0];
      parts.push_back({k, e, per_engine[e].size()});
      per_engine[e].push_back(work[k]);
      continue;
    }
    for (uint32_t e : used) {
      pnm::AttendJob j = work[k];
      j.selection = &part_selections.emplace_back(same ? pnm::Selection::SamePagesForAllHeads(kv_heads, std::move(lists[e][0]))
                                                       : pnm::Selection::PerHead(std::move(lists[e])));
      j.out = &part_outs.emplace_back();
      parts.push_back({k, e, per_engine[e].size()});
      per_engine[e].push_back(j);
    }
  }
  Run(per_engine);
  // Each item's status from its parts, its output merged from them in engine order.
  for (size_t i = 0; i < parts.size();) {
    const size_t item = parts[i].item;
    size_t end = i;
    while (end < parts.size() && parts[end].item == item) ++end;
    Status st;
    if (end - i > 1) *work[item].out = pnm::Partial{};  // MergeInto takes the first part's shape
    for (size_t k = i; k < end && st.ok(); ++k) {
      const pnm::AttendJob& done = per_engine[parts[k].engine][parts[k].index];
      st = done.status;
      if (st.ok() && end - i > 1) st = pnm::MergeInto(*done.out, work[item].out);
    }
    work[item].status = st;
    i = end;
  }
}

std::vector<NodeEngineStats> NodeEngines::stats() const {
  std::vector<NodeEngineStats> out;
  for (const auto& e : engines_) {
    NodeEngineStats s;
    const int bind_error = e->bind_error.load();
    s.numa_node = bind_error == 0 ? e->node : -1;
    s.note = bind_error != 0 ? "binding to NUMA node " + std::to_string(e->node) + " failed: " +
                                   region::ErrnoText(bind_error)
                             : e->note;
    s.regions = e->regions;
    s.threads = e->pool->threads() + 1;
    s.jobs = e->jobs.load();
    s.pages_attended = e->pages.load();
    s.kv_bytes_read = e->kv_bytes.load();
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace cxlkv::daemon
