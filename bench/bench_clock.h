// The clock every bench times with, and its two readings.
#ifndef CXLKV_BENCH_BENCH_CLOCK_H_
#define CXLKV_BENCH_BENCH_CLOCK_H_

#include <chrono>

namespace cxlkv::bench {

using Clock = std::chrono::steady_clock;

inline double NsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::nano>(Clock::now() - t0).count();
}
inline double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace cxlkv::bench

#endif  // CXLKV_BENCH_BENCH_CLOCK_H_
