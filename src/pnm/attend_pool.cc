#include "pnm/attend_pool.h"

#include <algorithm>

namespace cxlkv::pnm {

AttendPool::AttendPool(uint32_t threads, std::function<void()> on_start) {
  workers_.reserve(threads);
  for (uint32_t i = 0; i < threads; ++i) workers_.emplace_back([this, on_start] { WorkerLoop(on_start); });
}

AttendPool::~AttendPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void AttendPool::Drain() {
  const uint64_t total = total_;
  for (uint64_t i = next_.fetch_add(1); i < total; i = next_.fetch_add(1)) {
    if (each_ != nullptr) {
      (*each_)(i);
      finished_.fetch_add(1);
      continue;
    }
    const Task t = tasks_[i];
    const AttendJob& j = jobs_[t.job];
    if (t.parts == 0) {
      internal::AttendAllParts(*j.g, j.q, j.ctx, j.selection, j.scale, t.out);
    } else {
      internal::AttendPart(*j.g, j.q, j.ctx, j.selection, j.scale, t.part, t.parts, t.out);
    }
    finished_.fetch_add(1);
  }
}

void AttendPool::WorkerLoop(const std::function<void()>& on_start) {
  if (on_start) on_start();
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (!open_) continue;  // woke after that batch closed: nothing of it is left
      ++active_;
    }
    Drain();
    {
      std::lock_guard<std::mutex> lock(mu_);  // the caller checks under mu_: no lost wake-up
      --active_;
    }
    done_.notify_one();
  }
}

Status AttendPool::Run(std::span<AttendJob> jobs) {
  std::lock_guard<std::mutex> run(run_mu_);
  Status first;
  tasks_.clear();
  const uint32_t threads = static_cast<uint32_t>(workers_.size()) + 1;
  const bool split = jobs.size() < threads;
  auto parts_of = [&](const AttendJob& job) { return split ? internal::AttendParts(job.ctx) : 1u; };
  // Slots first (part_outs_ does not move once tasks point into it).
  size_t slots = 0;
  for (const AttendJob& job : jobs) slots += parts_of(job) > 1 ? parts_of(job) : 0;
  if (part_outs_.size() < slots) part_outs_.resize(slots);
  size_t slot = 0;
  for (uint32_t j = 0; j < jobs.size(); ++j) {
    AttendJob& job = jobs[j];
    job.status = job.g == nullptr || job.q == nullptr || job.out == nullptr
                     ? InvalidArgument("attention job without a geometry, a query or an output")
                     : CheckAttend(*job.g, job.ctx, job.selection);
    if (!job.status.ok()) {
      if (first.ok()) first = job.status;
      continue;
    }
    job.out->Reset(job.g->num_heads, job.g->head_dim);
    const uint32_t parts = parts_of(job);
    if (parts == 1) {
      tasks_.push_back({j, 0, 0, job.out});
      continue;
    }
    for (uint32_t part = 0; part < parts; ++part) {
      Partial* out = &part_outs_[slot++];
      out->Reset(job.g->num_heads, job.g->head_dim);
      tasks_.push_back({j, part, parts, out});
    }
  }
  jobs_ = jobs;  // published to the workers by RunBatch's lock
  if (!tasks_.empty()) RunBatch(tasks_.size());
  // A split job's parts merged in part order, as AttendAllParts merges them, whichever thread
  // attended each.
  for (const Task& t : tasks_) {
    if (t.parts == 0) continue;
    const Status merged = MergeInto(*t.out, jobs[t.job].out);
    // Fails only for partials of different shapes, which the parts of one job never are.
    if (!merged.ok() && first.ok()) first = jobs[t.job].status = merged;
  }
  return first;
}

void AttendPool::ForEach(size_t n, const std::function<void(size_t)>& fn) {
  std::lock_guard<std::mutex> run(run_mu_);
  if (n == 0) return;
  each_ = &fn;
  RunBatch(n);
  each_ = nullptr;
}

void AttendPool::RunBatch(uint64_t total) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    total_ = total;
    next_.store(0);
    finished_.store(0);
    open_ = true;
    ++generation_;
  }
  wake_.notify_all();
  Drain();  // the caller works too
  // Closed only when every task is done and no worker is still inside Drain: until then the
  // batch's tasks and jobs stay as they are, and after it no worker reads them.
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return finished_.load() == total_ && active_ == 0; });
  open_ = false;
}

}  // namespace cxlkv::pnm
