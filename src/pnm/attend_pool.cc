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

Status AttendPool::Select(std::span<SelectJob> jobs) {
  std::lock_guard<std::mutex> select(select_mu_);
  const uint32_t threads = static_cast<uint32_t>(workers_.size()) + 1;
  const bool share = jobs.size() < threads;
  auto shares_of = [&](const SelectJob& job) -> uint32_t {
    if (!share || job.g->num_kv_heads < 2 || job.g->PagesFor(job.tokens) < kMinSharedPages ||
        SelectsEveryPage(*job.g, job.tokens, job.options)) {
      return 1;
    }
    return std::min(threads, job.g->num_kv_heads);
  };
  select_tasks_.clear();
  size_t slots = 0;
  for (SelectJob& job : jobs) {
    job.status = job.g == nullptr || job.q == nullptr || job.digests == nullptr || job.out == nullptr
                     ? InvalidArgument("selection job without a geometry, a query, digests or an output")
                     : Status::Ok();
    if (job.status.ok() && (job.status = job.g->Validate()).ok()) slots += shares_of(job);
  }
  if (select_shares_.size() < slots) select_shares_.resize(slots);
  size_t slot = 0;
  for (uint32_t j = 0; j < jobs.size(); ++j) {
    const SelectJob& job = jobs[j];
    if (!job.status.ok()) continue;
    const uint32_t shares = shares_of(job), kv_heads = job.g->num_kv_heads;
    if (shares == 1) {
      select_tasks_.push_back({j, 0, kv_heads, job.out, Status::Ok()});
      continue;
    }
    for (uint32_t i = 0; i < shares; ++i) {
      select_tasks_.push_back({j, i * kv_heads / shares, (i + 1) * kv_heads / shares, &select_shares_[slot++], Status::Ok()});
    }
  }
  ForEach(select_tasks_.size(), [&](size_t i) {
    SelectTask& t = select_tasks_[i];
    const SelectJob& job = jobs[t.job];
    t.status = SelectPagesOfKvHeads(*job.g, job.q, job.digests, job.tokens, job.options, t.kv_begin, t.kv_end, t.out);
  });
  // Each job's shares are consecutive tasks, in KV head order: joined into the job's out.
  Status first;
  for (size_t i = 0; i < select_tasks_.size();) {
    const uint32_t j = select_tasks_[i].job;
    size_t end = i;
    for (; end < select_tasks_.size() && select_tasks_[end].job == j; ++end) {
      if (jobs[j].status.ok()) jobs[j].status = select_tasks_[end].status;
    }
    if (jobs[j].status.ok() && end - i > 1) {
      select_bounds_.clear();
      for (size_t k = i; k < end; ++k) select_bounds_.push_back(select_tasks_[k].kv_begin);
      select_bounds_.push_back(select_tasks_[end - 1].kv_end);
      JoinKvHeadShares({select_tasks_[i].out, end - i}, select_bounds_, jobs[j].out);
    }
    i = end;
  }
  for (const SelectJob& job : jobs) {
    if (!job.status.ok() && first.ok()) first = job.status;
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
