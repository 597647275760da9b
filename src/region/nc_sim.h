// The non-coherent memory simulator (DESIGN.md, "The non-coherent simulator").
//
// On one host the hardware is coherent, so a protocol that forgets a flush still works here and
// breaks only on multi-host CXL. NcSimCache makes the hazards of non-coherent memory happen on
// one host: it is one simulated host's private cache of the region's *metadata* lines.
//   - a load fills the line from memory (the real shared mapping) and later loads hit the copy,
//     so a reader that does not invalidate keeps seeing old data;
//   - a store dirties only the cached copy, so other hosts see nothing until it is written back;
//   - Flush writes a dirty line back whole (64 bytes) and drops it; Invalidate does the same
//     (x86's clflush is the only user-mode invalidate, and it writes back dirty data);
//   - a write-back is 8 word stores: at seeded random moments it pauses between two of them,
//     so a fill by another host may see the line half new (only 8-byte words are atomic);
//   - at seeded random moments a dirty line is written back whole, and lines are evicted, as a
//     real cache does under pressure: a line holding one host's unflushed store can overwrite a
//     newer value another host published in the same line.
// One NcSimCache per simulated host: give each process (or each thread playing a host) its own.
// Payload (bulk KV bytes) is not simulated: it is written with non-temporal stores that bypass
// the cache on real hardware too.
//
// Thread-safety: all methods lock an internal mutex (threads of one simulated host share its
// cache, as cores of one host share theirs).
#ifndef CXLKV_SRC_REGION_NC_SIM_H_
#define CXLKV_SRC_REGION_NC_SIM_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <random>
#include <unordered_map>
#include <vector>

namespace cxlkv::region {

struct SimOptions {
  uint64_t seed = 1;                    // the schedule of random write-backs and evictions
  double writeback_probability = 0.05;  // per access: write back one random dirty line
  double evict_probability = 0.02;      // per access: evict one random line (writing it back)
  size_t capacity_lines = 512;          // more than this many cached lines: evict at random
  // Per write-back: pause (20 µs) after a random number of its 8 words, so that another host's
  // fill of the line meanwhile sees part of it new and part old. Memory is written atomically
  // 8 bytes at a time, not a line at a time; a protocol that trusts the rest of a line because
  // it sees one word of it new fails under this.
  double torn_writeback_probability = 0.01;
};

struct SimStats {
  uint64_t loads = 0, stores = 0, hits = 0, misses = 0;
  uint64_t flushed_dirty = 0;     // lines written back by Flush/Invalidate
  uint64_t random_writebacks = 0; // lines written back at a random moment
  uint64_t evictions = 0;
};

class NcSimCache {
 public:
  // `memory` is the shared mapping of `size` bytes that stands for the CXL device.
  NcSimCache(uint8_t* memory, uint64_t size, const SimOptions& options);

  uint64_t Load64(uint64_t off);  // REQUIRES: off % 8 == 0
  void Store64(uint64_t off, uint64_t value);
  void Read(uint64_t off, void* dst, size_t n);
  void Write(uint64_t off, const void* src, size_t n);
  void Flush(uint64_t off, size_t n);
  void Invalidate(uint64_t off, size_t n);

  // Models a host that loses power: dirty lines vanish without being written back.
  void DropEverything();
  // Models a host whose cache drains: every dirty line is written back, all are dropped.
  void WriteBackEverything();

  SimStats stats() const;
  size_t dirty_lines() const;
  // Turns the random write-backs and evictions off (or back on): a test that must show a
  // missing flush deterministically removes the luck that would sometimes hide it.
  void SetChaos(bool on);

 private:
  struct Line {
    std::array<uint64_t, 8> words;
    bool dirty = false;
  };

  Line& Fill(uint64_t line_index);
  void WriteBack(uint64_t line_index, Line& line);
  void Evict(uint64_t line_index);
  void FlushLine(uint64_t line_index);
  void Chaos();

  uint8_t* memory_;
  uint64_t size_;
  SimOptions options_;
  bool chaos_ = true;
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Line> lines_;
  std::vector<uint64_t> resident_;  // the keys of lines_, for picking one at random
  std::mt19937_64 rng_;
  SimStats stats_;
};

}  // namespace cxlkv::region

#endif  // CXLKV_SRC_REGION_NC_SIM_H_
