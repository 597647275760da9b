// The references `cxlkv bench pnm` measures near-memory attention against, in the same run on
// the same machine: one thread streaming the KV arena (memory read), and one thread reading the
// sparse step's own access pattern with nothing to compute. Plus the suite's seeded random
// numbers and the cache size its arena is sized from.
#ifndef CXLKV_BENCH_PNM_REFS_H_
#define CXLKV_BENCH_PNM_REFS_H_

#include <cstdint>
#include <span>
#include <vector>

#include "pnm/geometry.h"

namespace cxlkv::bench {

// SplitMix64: the suite's seeded random numbers (the arena's fp16 values, the pages a reference
// reads).
inline uint64_t SplitMix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The last-level cache's size: sysfs for cpu0 (what the VM exposes), else sysconf, else 32 MiB.
uint64_t LlcBytes();

// The memory-bandwidth reference: a streaming read-sum of [p, p + bytes) with wide loads and
// independent accumulators, one thread (Attend runs on one). Returns the sum (keep it, or the
// reads go). REQUIRES: p 32-byte aligned.
uint64_t ReadSum(const uint8_t* p, uint64_t bytes);

// The reference for attention over per-head selections of format-2 pages: one thread reading
// the same access pattern with no arithmetic to overlap. Per step a layer (rotating over
// `layers`, as the steps do), and for each KV head a random 1/32 of its pages in ascending
// order, each page's K and V runs of that head, the next page's runs asked for line by line as
// these are read (the page kernel's own prefetch distance). GB/s per repetition.
// REQUIRES: g.head_major, whole cache lines per run (head_dim · elem_bytes · page_tokens % 64 == 0).
std::vector<double> PageReadBw(const pnm::Geometry& g, std::span<const std::vector<pnm::PageKv>> layers, int reps);

}  // namespace cxlkv::bench

#endif  // CXLKV_BENCH_PNM_REFS_H_
