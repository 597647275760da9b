// A latency histogram with fixed bucket bounds, for metrics (Prometheus histograms: cumulative
// buckets, a count and a sum). Recording is a few relaxed atomic adds: cheap enough for a lock
// acquire or an RPC batch.
//
// Thread-safety: Record and Read may run concurrently from any threads; a Read taken during
// Records is a consistent-enough snapshot for monitoring (each bucket is exact, their sum may
// lag the count by the records in flight).
#ifndef CXLKV_SRC_UTIL_HISTOGRAM_H_
#define CXLKV_SRC_UTIL_HISTOGRAM_H_

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace cxlkv::util {

class LatencyHistogram {
 public:
  // Upper bounds in seconds, 1 µs .. 1 s in 1-2-5 steps; one more bucket (+Inf) above them.
  static constexpr std::array<double, 19> kBoundsSeconds = {
      1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3,
      2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 1e-1, 2e-1, 5e-1, 1.0};

  struct Snapshot {
    std::array<uint64_t, kBoundsSeconds.size() + 1> buckets{};  // per bucket, not cumulative
    uint64_t count = 0;
    double sum_seconds = 0;
  };

  void Record(std::chrono::nanoseconds d, uint64_t times = 1) {
    const double s = static_cast<double>(d.count()) / 1e9;
    size_t b = 0;
    while (b < kBoundsSeconds.size() && s > kBoundsSeconds[b]) ++b;
    buckets_[b].fetch_add(times, std::memory_order_relaxed);
    count_.fetch_add(times, std::memory_order_relaxed);
    sum_ns_.fetch_add(static_cast<uint64_t>(d.count()) * times, std::memory_order_relaxed);
  }

  Snapshot Read() const {
    Snapshot s;
    for (size_t b = 0; b < buckets_.size(); ++b) s.buckets[b] = buckets_[b].load(std::memory_order_relaxed);
    s.count = count_.load(std::memory_order_relaxed);
    s.sum_seconds = static_cast<double>(sum_ns_.load(std::memory_order_relaxed)) / 1e9;
    return s;
  }

 private:
  std::array<std::atomic<uint64_t>, kBoundsSeconds.size() + 1> buckets_{};
  std::atomic<uint64_t> count_{0};
  std::atomic<uint64_t> sum_ns_{0};
};

}  // namespace cxlkv::util

#endif  // CXLKV_SRC_UTIL_HISTOGRAM_H_
