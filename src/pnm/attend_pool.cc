#include "pnm/attend_pool.h"

#include <algorithm>

namespace cxlkv::pnm {

AttendPool::AttendPool(uint32_t threads) {
  workers_.reserve(threads);
  for (uint32_t i = 0; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
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
  const uint64_t total = tasks_.size();
  for (uint64_t i = next_.fetch_add(1); i < total; i = next_.fetch_add(1)) {
    const Task t = tasks_[i];
    AttendJob& j = jobs_[t.job];
    internal::AttendKvHeads(*j.g, j.q, j.ctx, j.selection, j.scale, t.h_begin, t.h_end, j.out);
    finished_.fetch_add(1);
  }
}

void AttendPool::WorkerLoop() {
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
  const bool split_heads = jobs.size() < threads;
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
    const uint32_t heads = job.g->num_kv_heads;
    const uint32_t parts = split_heads ? std::min(threads, heads) : 1;
    for (uint32_t part = 0; part < parts; ++part) {
      tasks_.push_back({j, heads * part / parts, heads * (part + 1) / parts});
    }
  }
  if (tasks_.empty()) return first;
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_ = jobs;
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
  done_.wait(lock, [&] { return finished_.load() == tasks_.size() && active_ == 0; });
  open_ = false;
  return first;
}

}  // namespace cxlkv::pnm
