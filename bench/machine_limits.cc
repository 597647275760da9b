// The machine block of the lock, rpc, transfer and cache reports: MachineJson() plus the two
// limits those suites' figures are built on, measured at the start of the same run, briefly so
// the suites' run time barely grows (well under a second; other suites do not pay it).
//
//   line_pingpong_ns  the cache-line ping-pong between two processes (LinePingPongNs): the
//                     least any cross-process message or grant over non-coherent memory costs
//   nt_copy_gbps      one thread's non-temporal copy (region::NtCopy) of 64 MiB (16 MiB with
//                     --quick) into shared memory: what one thread's payload copy can reach
#include <sys/mman.h>

#include <cstring>
#include <vector>

#include "bench_clock.h"
#include "region/coherence.h"
#include "suites.h"

namespace cxlkv::bench {
namespace {

// GB/s of NtCopy of `bytes` between two shared anonymous mappings (shmem, as /dev/shm is), the
// median of `reps` copies after one untimed copy; 0 when the mappings fail.
double NtCopyGbps(size_t bytes, int reps) {
  void* src = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  void* dst = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  double gbps = 0;
  if (src != MAP_FAILED && dst != MAP_FAILED) {
    std::memset(src, 0x5a, bytes);  // fault both in, so page faults stay out of the timed copies
    region::NtCopy(dst, src, bytes);
    std::vector<double> samples;
    for (int rep = 0; rep < reps; ++rep) {
      const auto t0 = Clock::now();
      region::NtCopy(dst, src, bytes);
      samples.push_back(static_cast<double>(bytes) / NsSince(t0));
    }
    gbps = Median(samples);
  }
  if (src != MAP_FAILED) ::munmap(src, bytes);
  if (dst != MAP_FAILED) ::munmap(dst, bytes);
  return gbps;
}

}  // namespace

nlohmann::json MachineJsonWithLimits(const BenchOptions& options) {
  nlohmann::json j = MachineJson();
  std::vector<double> pingpong;
  // Enough rounds that the child's start (inside the first round) does not show in the mean.
  const int rounds = options.quick ? 5000 : 20000;
  for (int rep = 0; rep < 3; ++rep) pingpong.push_back(LinePingPongNs(rounds, 0.5));
  j["line_pingpong_ns"] = Median(pingpong);
  j["nt_copy_gbps"] =
      NtCopyGbps(options.quick ? size_t{16} << 20 : size_t{64} << 20, options.quick ? 3 : 5);
  return j;
}

}  // namespace cxlkv::bench
