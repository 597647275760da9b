#include "pnm_refs.h"

#include <unistd.h>

#include <immintrin.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>

#include "region/cpu.h"

namespace cxlkv::bench {

namespace {

__attribute__((target("avx2"))) uint64_t ReadSumAvx2(const uint8_t* p, uint64_t bytes) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  const auto* v = reinterpret_cast<const __m256i*>(p);
  for (uint64_t i = 0; i + 4 <= bytes / 32; i += 4) {
    a0 = _mm256_add_epi64(a0, _mm256_load_si256(v + i));
    a1 = _mm256_add_epi64(a1, _mm256_load_si256(v + i + 1));
    a2 = _mm256_add_epi64(a2, _mm256_load_si256(v + i + 2));
    a3 = _mm256_add_epi64(a3, _mm256_load_si256(v + i + 3));
  }
  a0 = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), a0);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

uint64_t ReadSumScalar(const uint8_t* p, uint64_t bytes) {
  const auto* w = reinterpret_cast<const uint64_t*>(p);
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  for (uint64_t i = 0; i + 4 <= bytes / 8; i += 4) {
    a0 += w[i];
    a1 += w[i + 1];
    a2 += w[i + 2];
    a3 += w[i + 3];
  }
  return a0 + a1 + a2 + a3;
}

// One KV head's run of a format-2 page summed, the same run of the next page asked for line by
// line as this one is read. REQUIRES: bytes % 64 == 0.
__attribute__((target("avx2"))) uint64_t ReadRunAvx2(const uint8_t* run, const uint8_t* next, uint64_t bytes) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0;
  for (uint64_t b = 0; b < bytes; b += 64) {
    if (next != nullptr) __builtin_prefetch(next + b, 0, 2);
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + b)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + b + 32)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(a0, a1));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

uint64_t ReadRunScalar(const uint8_t* run, const uint8_t* next, uint64_t bytes) {
  uint64_t a = 0;
  for (uint64_t b = 0; b < bytes; b += 64) {
    if (next != nullptr) __builtin_prefetch(next + b, 0, 2);
    const auto* w = reinterpret_cast<const uint64_t*>(run + b);
    a += w[0] + w[1] + w[2] + w[3] + w[4] + w[5] + w[6] + w[7];
  }
  return a;
}

}  // namespace

uint64_t LlcBytes() {
  for (int idx = 3; idx >= 2; --idx) {
    std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(idx) + "/size");
    std::string s;
    if (f >> s && !s.empty()) {
      uint64_t v = std::strtoull(s.c_str(), nullptr, 10);
      char unit = s.back();
      if (unit == 'K') v <<= 10;
      if (unit == 'M') v <<= 20;
      if (v > 0) return v;
    }
  }
  long v = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return v > 0 ? static_cast<uint64_t>(v) : uint64_t{32} << 20;
}

uint64_t ReadSum(const uint8_t* p, uint64_t bytes) {
  return region::Cpu().avx2 ? ReadSumAvx2(p, bytes) : ReadSumScalar(p, bytes);
}

std::vector<double> PageReadBw(const pnm::Geometry& g, std::span<const std::vector<pnm::PageKv>> layers, int reps) {
  const uint64_t run = g.HeadBytes() * g.page_tokens;
  const bool avx2 = region::Cpu().avx2;
  auto read = [&](const uint8_t* p, const uint8_t* next) { return avx2 ? ReadRunAvx2(p, next, run) : ReadRunScalar(p, next, run); };
  const size_t count = layers.size();
  uint64_t seed = 0x5eed;
  volatile uint64_t sink = 0;  // keeps the reads, as memory_read_bw's
  std::vector<uint64_t> chosen;
  std::vector<double> gbps;
  size_t li = 0;
  for (int rep = 0; rep < reps; ++rep) {
    uint64_t bytes = 0;
    double seconds = 0;
    for (size_t i = 0; i < count; ++i) {
      const auto& pages = layers[li++ % count];
      for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
        chosen.clear();
        for (uint64_t p = 0; p < pages.size(); ++p) {
          if (SplitMix(seed) % 32 == 0) chosen.push_back(p);
        }
        const uint64_t offset = g.HeadOffset(h);
        auto t0 = std::chrono::steady_clock::now();  // the choosing is not timed
        for (size_t j = 0; j < chosen.size(); ++j) {
          const pnm::PageKv& page = pages[chosen[j]];
          const pnm::PageKv* next = j + 1 < chosen.size() ? &pages[chosen[j + 1]] : nullptr;
          for (int slab = 0; slab < 2; ++slab) {
            const void* at = slab == 0 ? page.k : page.v;
            const void* ahead = next == nullptr ? nullptr : slab == 0 ? next->k : next->v;
            sink = sink + read(static_cast<const uint8_t*>(at) + offset,
                               ahead == nullptr ? nullptr : static_cast<const uint8_t*>(ahead) + offset);
          }
        }
        seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        bytes += chosen.size() * 2 * run;
      }
    }
    gbps.push_back(static_cast<double>(bytes) / seconds / 1e9);
  }
  return gbps;
}

}  // namespace cxlkv::bench
