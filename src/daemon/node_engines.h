// Near-memory attention engines, one per memory node (PNM §3.2; docs/pnm.md, "Engines per memory
// node"): a pool whose regions lie on several NUMA nodes (CXL devices, or sockets' DRAM) gets an
// AttendPool per node, its threads bound to that node, so every page is attended by threads
// next to the memory that holds it.
//
//   auto engines = NodeEngines::Create(pool.MappedRanges(), {.threads = 2, .platform = &os});
//   engines->BindServingThread();                 // on the serving thread, once
//   engines->Attend(jobs, engine_of_page);        // each engine its own pages, side by side
//
// The first engine is the node of region 0 (the RPC area's, which the serving thread polls):
// the serving thread leads its batches, as the caller of an AttendPool does. Every other engine
// has a lead thread of its own on its node that runs its batch, so the engines attend side by
// side and the serving thread waits only for the slowest. Selection scores digests this daemon
// keeps in its own memory (first touched by the serving thread), so it runs on the first engine.
//
// The pool's allocator interleaves chunks across regions, so one context's pages are usually
// on every node: the service splits each request by residence (each engine attends its node's
// pages) and merges the parts by log-sum-exp — only the per-head output and lse of each part
// move between nodes. A request whose pages lie on one node is that engine's alone.
//
// Threads: `threads` workers per engine, plus the serving thread (first engine) or the lead
// thread (the others). Idle threads sleep on condition variables (the machine may have two
// cores). Thread-safety: Create, stats from any thread; Attend from one thread at a time.
#ifndef CXLKV_SRC_DAEMON_NODE_ENGINES_H_
#define CXLKV_SRC_DAEMON_NODE_ENGINES_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "pnm/attend_pool.h"
#include "region/platform.h"

namespace cxlkv::daemon {

struct NodeEnginesOptions {
  uint32_t threads = 1;    // workers per engine besides its lead. Default 1.
  bool bind_numa = true;   // false: one engine, not bound ("not bound (--pnm-no-numa)")
  region::Platform* platform = nullptr;  // NUMA queries and binding; null: the operating system
};

struct NodeEngineStats {
  int numa_node = -1;          // -1: not bound
  uint32_t regions = 0;        // the pool's regions whose pages this engine attends
  uint32_t threads = 0;        // its workers and its lead
  uint64_t jobs = 0;           // attention jobs (or parts of one, split by residence) it ran
  uint64_t pages_attended = 0; // pages × KV heads
  uint64_t kv_bytes_read = 0;
  std::string note;            // why it is not bound, when not
};

class NodeEngines {
 public:
  // One engine per distinct NUMA node of the regions' memory, region 0's first. A region whose
  // node is unknown is the first engine's (bound only if region 0's node is known).
  // REQUIRES: regions non-empty, at most region::kMaxPoolRegions.
  static std::unique_ptr<NodeEngines> Create(std::span<const std::span<uint8_t>> regions,
                                             const NodeEnginesOptions& options);
  ~NodeEngines();
  NodeEngines(const NodeEngines&) = delete;
  NodeEngines& operator=(const NodeEngines&) = delete;

  size_t size() const { return engines_.size(); }
  // Which engine attends the pages of pool region `region` (0 for an index past the regions).
  uint32_t EngineOfRegion(uint32_t region) const {
    return region < engine_of_region_.size() ? engine_of_region_[region] : 0;
  }
  // The first engine's pool: selection runs here, on the serving thread and its workers.
  pnm::AttendPool& first();
  // Binds the calling thread (the serving thread) to the first engine's node.
  void BindServingThread();

  // Attends every job on the engines of the nodes that hold its pages, side by side; returns
  // when all are done, each job with its own status. engine_of_page[k][p] is the engine of job
  // k's page p (EngineOfRegion of its block's region). A job whose selected pages lie on several
  // nodes is split by residence and its parts merged by log-sum-exp in engine order (equal to
  // attention over the whole within fp32 rounding); a job on one node runs whole there.
  // REQUIRES: engine_of_page.size() == jobs.size(), every entry < size() and covering the
  // job's context.
  void Attend(std::span<pnm::AttendJob> jobs, std::span<const std::span<const uint8_t>> engine_of_page);

  std::vector<NodeEngineStats> stats() const;

 private:
  struct Engine;
  NodeEngines() = default;
  void Bind(Engine& e);
  void LeadLoop(Engine& e);
  // Runs per_engine[e] on engine e, all side by side: the first on the caller's thread, the
  // others on their lead threads. REQUIRES: per_engine.size() == size().
  void Run(std::span<std::vector<pnm::AttendJob>> per_engine);

  region::Platform* platform_ = nullptr;
  std::vector<std::unique_ptr<Engine>> engines_;
  std::vector<uint32_t> engine_of_region_;
};

}  // namespace cxlkv::daemon

#endif  // CXLKV_SRC_DAEMON_NODE_ENGINES_H_
