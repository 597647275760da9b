// `cxlkv bench region`: what the coherence primitives cost on this machine.
//
//   flush/*     store to a line, then write it back with clflush / clflushopt / clwb, per line,
//               over a 64 KiB batch (one fence per batch), and the single-line publish the
//               protocol does (store, clflush, mfence). Reference: one DRAM round trip
//               (dependent loads over a buffer much larger than the caches), because a
//               write-back to memory is what a flush waits for.
//   copy/*      non-temporal copy (the payload path, rule P3) vs memcpy at 4 KiB, 64 KiB,
//               2 MiB and 256 MiB, GB/s; the ratio is nt / memcpy of the same size.
#include <sys/mman.h>

#include <immintrin.h>

#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>

#include "gbench_runner.h"
#include "region/coherence.h"
#include "region/cpu.h"
#include "suites.h"
#include "util/units.h"

namespace cxlkv::bench {
namespace {

using region::kCacheLine;

// An anonymous mapping, touched so page faults stay out of the timed loops.
class Buffer {
 public:
  explicit Buffer(size_t n) : n_(n) {
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return;
    p_ = static_cast<uint8_t*>(p);
    madvise(p_, n_, MADV_HUGEPAGE);
    std::memset(p_, 0x5a, n_);
  }
  ~Buffer() {
    if (p_) munmap(p_, n_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  uint8_t* data() const { return p_; }
  bool ok() const { return p_ != nullptr; }

 private:
  uint8_t* p_ = nullptr;
  size_t n_;
};

constexpr size_t kFlushBatchBytes = 64 * 1024;
constexpr size_t kFlushBatchLines = kFlushBatchBytes / kCacheLine;
constexpr size_t kHopsPerIteration = 4096;

__attribute__((target("clflushopt"))) void DirtyAndFlushOpt(uint8_t* buf, uint64_t v) {
  for (size_t i = 0; i < kFlushBatchLines; ++i) {
    *reinterpret_cast<volatile uint64_t*>(buf + i * kCacheLine) = v;
    _mm_clflushopt(buf + i * kCacheLine);
  }
  _mm_sfence();
}

__attribute__((target("clwb"))) void DirtyAndClwb(uint8_t* buf, uint64_t v) {
  for (size_t i = 0; i < kFlushBatchLines; ++i) {
    *reinterpret_cast<volatile uint64_t*>(buf + i * kCacheLine) = v;
    _mm_clwb(buf + i * kCacheLine);
  }
  _mm_sfence();
}

void DirtyAndClflush(uint8_t* buf, uint64_t v) {
  for (size_t i = 0; i < kFlushBatchLines; ++i) {
    *reinterpret_cast<volatile uint64_t*>(buf + i * kCacheLine) = v;
    _mm_clflush(buf + i * kCacheLine);
  }
  _mm_mfence();
}

// A random cyclic permutation of lines: each line holds the offset of the next, so every load
// depends on the one before and the prefetchers cannot guess it.
void BuildChase(uint8_t* buf, size_t bytes, uint64_t seed) {
  size_t lines = bytes / kCacheLine;
  std::vector<uint32_t> order(lines);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin() + 1, order.end(), std::mt19937_64(seed));
  for (size_t i = 0; i < lines; ++i) {
    uint64_t next = uint64_t{order[(i + 1) % lines]} * kCacheLine;
    *reinterpret_cast<uint64_t*>(buf + uint64_t{order[i]} * kCacheLine) = next;
  }
}

std::string SizeName(size_t bytes) {
  if (bytes >= (size_t{1} << 20)) return std::to_string(bytes >> 20) + "MiB";
  return std::to_string(bytes >> 10) + "KiB";
}

}  // namespace

Result<nlohmann::json> RunRegionBench(const BenchOptions& options) {
  const auto& cpu = region::Cpu();
  const int reps = options.quick ? 2 : options.repetitions;
  const double min_time = options.quick ? 0.01 : 0.1;
  const size_t chase_bytes = options.quick ? (size_t{32} << 20) : (size_t{256} << 20);
  const std::vector<size_t> copy_sizes =
      options.quick ? std::vector<size_t>{4096, 65536, size_t{2} << 20, size_t{16} << 20}
                    : std::vector<size_t>{4096, 65536, size_t{2} << 20, size_t{256} << 20};
  const size_t copy_max = copy_sizes.back();

  Buffer flush_buf(kFlushBatchBytes);
  Buffer chase_buf(chase_bytes);
  Buffer src(copy_max), dst(copy_max);
  if (!flush_buf.ok() || !chase_buf.ok() || !src.ok() || !dst.ok()) {
    return NoSpace("cannot allocate " + util::FormatBytes(chase_bytes + 2 * copy_max) +
                   " of benchmark buffers; free memory or use --quick");
  }
  BuildChase(chase_buf.data(), chase_bytes, 42);

  std::vector<GbCase> cases;
  cases.push_back({"dram_load_latency", [&](benchmark::State& state) {
                     uint64_t off = 0;
                     const uint8_t* base = chase_buf.data();
                     for (auto _ : state) {
                       for (size_t i = 0; i < kHopsPerIteration; ++i) {
                         off = *reinterpret_cast<const volatile uint64_t*>(base + off);
                       }
                     }
                     benchmark::DoNotOptimize(off);
                   }, min_time});
  uint64_t stamp = 0;
  cases.push_back({"flush/clflush", [&](benchmark::State& state) {
                     for (auto _ : state) DirtyAndClflush(flush_buf.data(), ++stamp);
                   }, min_time});
  if (cpu.clflushopt) {
    cases.push_back({"flush/clflushopt", [&](benchmark::State& state) {
                       for (auto _ : state) DirtyAndFlushOpt(flush_buf.data(), ++stamp);
                     }, min_time});
  }
  if (cpu.clwb) {
    cases.push_back({"flush/clwb", [&](benchmark::State& state) {
                       for (auto _ : state) DirtyAndClwb(flush_buf.data(), ++stamp);
                     }, min_time});
  }
  cases.push_back({"flush/publish_one_line", [&](benchmark::State& state) {
                     // The protocol's commit point: one word stored, its line clflushed, fenced.
                     uint8_t* buf = flush_buf.data();
                     for (auto _ : state) {
                       for (size_t i = 0; i < kFlushBatchLines; ++i) {
                         *reinterpret_cast<volatile uint64_t*>(buf + i * kCacheLine) = ++stamp;
                         region::FlushLines(buf + i * kCacheLine, 8);
                       }
                     }
                   }, min_time});
  for (size_t n : copy_sizes) {
    // Sizes up to 2 MiB copy the same hot buffer (their real use: a block just produced, still
    // in cache); the largest walks buffers far bigger than the caches.
    size_t slots = n > (size_t{2} << 20) ? copy_max / n : 1;
    cases.push_back({"copy/memcpy/" + SizeName(n), [&, n, slots](benchmark::State& state) {
                       size_t i = 0;
                       for (auto _ : state) {
                         size_t at = (i++ % slots) * n;
                         std::memcpy(dst.data() + at, src.data() + at, n);
                         benchmark::ClobberMemory();
                       }
                     }, min_time});
    cases.push_back({"copy/memcpy+clflush/" + SizeName(n), [&, n, slots](benchmark::State& state) {
                       // The cached alternative to P3: copy, then write every line back.
                       size_t i = 0;
                       for (auto _ : state) {
                         size_t at = (i++ % slots) * n;
                         std::memcpy(dst.data() + at, src.data() + at, n);
                         region::FlushLines(dst.data() + at, n);
                       }
                     }, min_time});
    cases.push_back({"copy/nt/" + SizeName(n), [&, n, slots](benchmark::State& state) {
                       size_t i = 0;
                       for (auto _ : state) {
                         size_t at = (i++ % slots) * n;
                         region::NtCopy(dst.data() + at, src.data() + at, n);
                         benchmark::ClobberMemory();
                       }
                     }, min_time});
  }

  CXLKV_ASSIGN_OR_RETURN(auto seconds, RunCases(cases, reps));

  auto scaled = [](const std::vector<double>& v, double k) {
    std::vector<double> out;
    for (double x : v) out.push_back(x * k);
    return out;
  };
  const auto latency_ns = scaled(seconds["dram_load_latency"], 1e9 / kHopsPerIteration);
  nlohmann::json results = nlohmann::json::array();
  results.push_back(FigureJson({"dram_load_latency", "ns", false, latency_ns, "", {},
                                "dependent loads over " + util::FormatBytes(chase_bytes)}));
  for (const char* name : {"flush/clflush", "flush/clflushopt", "flush/clwb"}) {
    if (!seconds.count(name)) continue;
    results.push_back(FigureJson({std::string(name) + " (store+flush)", "ns/line", false,
                                  scaled(seconds[name], 1e9 / kFlushBatchLines),
                                  "dram_load_latency", latency_ns,
                                  "per line in a 64 KiB batch, one fence per batch; ratio in "
                                  "DRAM round trips"}));
  }
  results.push_back(FigureJson({"flush/publish_one_line", "ns/line", false,
                                scaled(seconds["flush/publish_one_line"], 1e9 / kFlushBatchLines),
                                "dram_load_latency", latency_ns,
                                "store + clflush + mfence per line (the protocol's commit)"}));
  for (size_t n : copy_sizes) {
    auto gbps = [&](const std::string& key) {
      std::vector<double> out;
      for (double s : seconds[key]) out.push_back(static_cast<double>(n) / s / 1e9);
      return out;
    };
    std::string size = SizeName(n);
    auto memcpy_gbps = gbps("copy/memcpy/" + size);
    results.push_back(FigureJson({"copy/memcpy/" + size, "GB/s", true, memcpy_gbps, "", {},
                                  "plain memcpy, the reference"}));
    results.push_back(FigureJson({"copy/nt/" + size, "GB/s", true, gbps("copy/nt/" + size),
                                  "copy/memcpy/" + size, memcpy_gbps,
                                  std::string("non-temporal copy (") + region::NtCopyVariant() +
                                      ") / memcpy"}));
    results.push_back(FigureJson({"copy/nt_vs_flushed_memcpy/" + size, "GB/s", true,
                                  gbps("copy/nt/" + size), "copy/memcpy+clflush/" + size,
                                  gbps("copy/memcpy+clflush/" + size),
                                  "nt copy / (memcpy then clflush every line): both leave the "
                                  "bytes in memory, where another host can read them"}));
  }

  nlohmann::json report;
  report["suite"] = "region";
  report["machine"] = MachineJson();
  report["repetitions"] = reps;
  report["quick"] = options.quick;
  report["results"] = results;
  return report;
}

}  // namespace cxlkv::bench
