// AttendPool: near-memory attention across threads — each request of a batch is a task, taken
// by the next free thread, the caller's included. Requests are independent (data parallelism,
// PNM §3.2). When a batch has fewer requests than threads, a long request's parts (attend.h:
// ranges of its pages, over every KV head) are tasks of their own, merged by log-sum-exp in
// part order afterwards: the same bits as Attend alone, whatever the thread count. KV head
// ranges, as this split once was, had two threads read alternate lines of the same token-major
// rows: 7–9 GB/s on two threads against 12–13 on one (fp32, head_dim 32, 2 KV heads, cold, AMD
// VM); page ranges read 21–25.
//
// Idle workers sleep on a condition variable (no spinning: the machine may have two cores).
// Thread-safety: one Run at a time per pool (Run serializes callers).
#ifndef CXLKV_SRC_PNM_ATTEND_POOL_H_
#define CXLKV_SRC_PNM_ATTEND_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "cxlkv/status.h"
#include "pnm/attend.h"
#include "pnm/select.h"

namespace cxlkv::pnm {

// One request's decode attention: Attend(*g, q, ctx, selection, scale, out), status its result.
struct AttendJob {
  const Geometry* g = nullptr;
  const float* q = nullptr;
  ContextView ctx;
  const Selection* selection = nullptr;  // every page when null
  float scale = 0;                       // 0: 1/sqrt(head_dim)
  Partial* out = nullptr;
  Status status;
};

// One request's page selection: SelectPages(*g, q, digests, tokens, options, out).
struct SelectJob {
  const Geometry* g = nullptr;
  const float* q = nullptr;
  const uint8_t* digests = nullptr;
  uint64_t tokens = 0;
  SelectOptions options;
  Selection* out = nullptr;
  Status status;
};

class AttendPool {
 public:
  // `threads` workers besides the caller (0: none — Run works alone on the caller's thread).
  // Each worker calls `on_start` first (e.g. to bind itself to the memory's NUMA node).
  explicit AttendPool(uint32_t threads, std::function<void()> on_start = {});
  ~AttendPool();
  AttendPool(const AttendPool&) = delete;
  AttendPool& operator=(const AttendPool&) = delete;

  // Runs every job; returns when all are done. A job that fails its checks gets its status and
  // no work; the others run. Returns the first failed job's status, or ok.
  Status Run(std::span<AttendJob> jobs);

  // Runs every selection across the workers and the caller. A batch with fewer requests than
  // threads shares a long context's KV heads out among them (SelectPagesOfKvHeads) and joins
  // the shares: each job gets exactly what SelectPages gives it alone. Returns the first failed
  // job's status, or ok. Selection scores every page's digest, so a lone long request would
  // otherwise hold one thread for as long as its attention over the selected pages takes on all.
  Status Select(std::span<SelectJob> jobs);

  // Calls fn(i) for every i < n across the workers and the caller; returns when all are done
  // (per-request work before the attention, such as selection). fn must not throw.
  void ForEach(size_t n, const std::function<void(size_t)>& fn);

  uint32_t threads() const { return static_cast<uint32_t>(workers_.size()); }

 private:
  struct Task {
    uint32_t job;
    uint32_t part;   // AttendPart's part of `parts`; parts = 0: the whole job (AttendAllParts)
    uint32_t parts;
    Partial* out;    // the job's own out for a whole job, else a slot of part_outs_
  };
  void WorkerLoop(const std::function<void()>& on_start);
  void Drain();  // takes tasks until none are left
  // Runs a batch of `total` tasks (tasks_, or each_ when set) on the workers and the caller.
  // REQUIRES: run_mu_ held.
  void RunBatch(uint64_t total);

  // A share of a selection: KV heads [kv_begin, kv_end) of jobs[job], into `out`.
  struct SelectTask {
    uint32_t job;
    uint32_t kv_begin, kv_end;
    Selection* out;
    Status status;
  };
  // Contexts of fewer pages are selected whole: a share's hand-off to a worker would cost more
  // than it saves.
  static constexpr uint64_t kMinSharedPages = 2048;

  std::mutex select_mu_;  // one Select at a time (its scratch below); taken before run_mu_
  std::vector<SelectTask> select_tasks_;
  std::vector<Selection> select_shares_;  // kept between calls: each Selection's own scratch
  std::vector<uint32_t> select_bounds_;
  std::mutex run_mu_;  // one Run at a time
  std::mutex mu_;
  std::condition_variable wake_;  // workers: a new batch (or stop)
  std::condition_variable done_;  // the caller: a worker left Drain
  uint64_t generation_ = 0;       // guarded by mu_
  bool stop_ = false;             // guarded by mu_
  bool open_ = false;             // guarded by mu_: a batch is running; workers may join it
  uint32_t active_ = 0;           // guarded by mu_: workers inside Drain
  // The batch: written by Run only while no worker is inside Drain (open_ false, active_ 0).
  std::span<AttendJob> jobs_;
  std::vector<Task> tasks_;
  std::vector<Partial> part_outs_;  // the split jobs' partials, merged after the batch
  const std::function<void(size_t)>* each_ = nullptr;  // ForEach's batch instead of tasks_
  uint64_t total_ = 0;
  std::atomic<uint64_t> next_{0};
  std::atomic<uint64_t> finished_{0};
  std::vector<std::thread> workers_;
};

}  // namespace cxlkv::pnm

#endif  // CXLKV_SRC_PNM_ATTEND_POOL_H_
