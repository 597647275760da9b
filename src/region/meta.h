// The metadata accessor layer (DESIGN.md rule 1): every load and store of shared *metadata* —
// lock slots, node lines, bitmaps, index entries — goes through a MetaAccess. Nothing else
// dereferences a pointer into metadata. That single seam is what lets the non-coherent
// simulator (nc_sim.h) stand between the code and the memory in tests.
//
// Semantics (docs/protocol.md):
//   Load/Store    one aligned 8-byte word: the only unit CXL makes atomic across hosts.
//   Read/Write    a span of metadata through this host's cache (no atomicity across hosts).
//   Flush         publish: write the lines back to the device and drop them (rule P1).
//   Invalidate    drop this host's copies before reading what another host wrote (rule P2).
//   Publish       Store + Flush of one word: the single-word commit point of every protocol.
//   Fetch         Invalidate + Load of one word: how a poller observes another host's store.
//
// In kHardware mode (one coherent host) Flush and Invalidate are CPU fences only. With a
// simulator attached, every call is routed to the simulated cache.
//
// Thread-safety: all methods may be called concurrently; they order nothing beyond what the
// protocol's locks and single-writer rules order.
#ifndef CXLKV_SRC_REGION_META_H_
#define CXLKV_SRC_REGION_META_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>

#include "cxlkv/region.h"
#include "region/coherence.h"
#include "region/nc_sim.h"
#include "region/sim_audit.h"

namespace cxlkv::region {

class MetaAccess {
 public:
  MetaAccess(uint8_t* base, uint64_t size, CoherenceMode mode);

  // Routes every later access through a fresh simulated host cache (tests).
  void AttachSimulator(const SimOptions& options);
  NcSimCache* simulator() { return sim_.get(); }

  uint64_t Load(uint64_t off) {
    CheckWord(off);
    if (sim_) [[unlikely]] return sim_->Load64(off);
    return __atomic_load_n(reinterpret_cast<uint64_t*>(base_ + off), __ATOMIC_ACQUIRE);
  }
  // A hint that this process is about to write the line at `off` (prefetchw): the line's miss
  // then overlaps whatever comes before the store. No effect on what anyone reads.
  void PrefetchForWrite(uint64_t off) {
    CheckWord(off);
    if (sim_) [[unlikely]] return;
    __builtin_prefetch(base_ + off, 1, 3);
  }
  void Store(uint64_t off, uint64_t value) {
    CheckWord(off);
    if (sim_) [[unlikely]] return sim_->Store64(off, value);
    __atomic_store_n(reinterpret_cast<uint64_t*>(base_ + off), value, __ATOMIC_RELEASE);
  }
  void Read(uint64_t off, void* dst, size_t n) {
    CheckSpan(off, n);
    if (n == 0) return;  // an empty span may come with a null pointer: memcpy forbids it
    if (sim_) [[unlikely]] return sim_->Read(off, dst, n);
    std::atomic_thread_fence(std::memory_order_acquire);
    std::memcpy(dst, base_ + off, n);
  }
  void Write(uint64_t off, const void* src, size_t n) {
    CheckSpan(off, n);
    if (n == 0) return;  // as in Read
    if (sim_) [[unlikely]] return sim_->Write(off, src, n);
    std::memcpy(base_ + off, src, n);
    std::atomic_thread_fence(std::memory_order_release);
  }
  // `file`/`line` (the caller's, by default) cost nothing in hardware mode; under the simulator
  // they name the call site for the flush audit (sim_audit.h). __builtin_FILE/__builtin_LINE
  // rather than std::source_location: clang 14 with libstdc++ (the fuzz build) lacks the latter.
  void Flush(uint64_t off, size_t n, const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) {
    CheckSpan(off, n);
    if (sim_) [[unlikely]] return SimFlush(off, n, {file, line});
    if (mode_ == CoherenceMode::kSoftware) {
      FlushLines(base_ + off, n);
    } else {
      std::atomic_thread_fence(std::memory_order_seq_cst);
    }
  }
  void Invalidate(uint64_t off, size_t n, const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) {
    CheckSpan(off, n);
    if (sim_) [[unlikely]] return SimInvalidate(off, n, {file, line});
    if (mode_ == CoherenceMode::kSoftware) {
      InvalidateLinesOpt(base_ + off, n);
    } else {
      std::atomic_thread_fence(std::memory_order_seq_cst);
    }
  }

  // Batched forms: flush / invalidate `n` bytes at each offset, with one fence for all (the
  // misses and write-backs overlap instead of queueing one fence each).
  template <typename Offsets>
  void FlushEach(const Offsets& offs, size_t n, const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) {
    if (sim_) [[unlikely]] {
      for (uint64_t off : offs) {
        CheckSpan(off, n);
        SimFlush(off, n, {file, line});
      }
      return;
    }
    if (mode_ == CoherenceMode::kSoftware) {
      for (uint64_t off : offs) {
        CheckSpan(off, n);
        FlushLinesUnfenced(base_ + off, n);
      }
    }
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (mode_ == CoherenceMode::kSoftware) FullFence();
  }
  template <typename Offsets>
  void InvalidateEach(const Offsets& offs, size_t n, const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) {
    if (sim_) [[unlikely]] {
      for (uint64_t off : offs) {
        CheckSpan(off, n);
        SimInvalidate(off, n, {file, line});
      }
      return;
    }
    if (mode_ == CoherenceMode::kSoftware) {
      for (uint64_t off : offs) {
        CheckSpan(off, n);
        InvalidateLinesOptUnfenced(base_ + off, n);
      }
      FullFence();
    }
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }

  void Publish(uint64_t off, uint64_t value, const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) {
    Store(off, value);
    Flush(off, sizeof(uint64_t), file, line);
  }
  uint64_t Fetch(uint64_t off, const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) {
    Invalidate(off, sizeof(uint64_t), file, line);
    return Load(off);
  }

  // Read-modify-write among the processes of ONE host (rule 4 allows local atomics): for words
  // only one node writes, such as its own pin counts and counters. Other hosts see the result
  // after a Flush. Returns the previous value.
  uint64_t LocalFetchAdd(uint64_t off, uint64_t delta) {
    CheckWord(off);
    if (sim_) [[unlikely]] {
      std::lock_guard<std::mutex> lock(sim_rmw_mu_);
      uint64_t v = sim_->Load64(off);
      sim_->Store64(off, v + delta);
      return v;
    }
    return __atomic_fetch_add(reinterpret_cast<uint64_t*>(base_ + off), delta, __ATOMIC_ACQ_REL);
  }
  // As above: replaces `expected` by `desired`; on failure `expected` gets the current value.
  bool LocalCompareExchange(uint64_t off, uint64_t& expected, uint64_t desired) {
    CheckWord(off);
    if (sim_) [[unlikely]] {
      std::lock_guard<std::mutex> lock(sim_rmw_mu_);
      uint64_t v = sim_->Load64(off);
      if (v != expected) {
        expected = v;
        return false;
      }
      sim_->Store64(off, desired);
      return true;
    }
    return __atomic_compare_exchange_n(reinterpret_cast<uint64_t*>(base_ + off), &expected, desired,
                                       false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  }

  // Typed helpers for one trivially-copyable struct at `off`.
  template <typename T>
  T ReadStruct(uint64_t off) {
    T v;
    Read(off, &v, sizeof(T));
    return v;
  }
  template <typename T>
  void WriteStruct(uint64_t off, const T& v) {
    Write(off, &v, sizeof(T));
  }

  uint8_t* base() const { return base_; }
  uint64_t size() const { return size_; }
  CoherenceMode mode() const { return mode_; }

 private:
  // Bounds checks run in every build: offsets are computed from words read from the region,
  // which another host (or a corrupted device) may have written. Budget: one compare and one
  // predicted branch on the hot path; the report is out of line. Callers validate what they
  // decode first and return kCorrupted; reaching OutOfBounds means a check is missing.
  void CheckWord(uint64_t off) const {
    if (off % 8 != 0 || off > size_ - 8) [[unlikely]] OutOfBounds(off, 8);
  }
  void CheckSpan(uint64_t off, size_t n) const {
    if (off > size_ || n > size_ - off) [[unlikely]] OutOfBounds(off, n);
  }
  [[noreturn, gnu::noinline, gnu::cold]] void OutOfBounds(uint64_t off, size_t n) const;
  void SimFlush(uint64_t off, size_t n, const CallSite& site);
  void SimInvalidate(uint64_t off, size_t n, const CallSite& site);

  uint8_t* base_;
  uint64_t size_;
  CoherenceMode mode_;
  std::unique_ptr<NcSimCache> sim_;
  std::unique_ptr<SimSiteAudit> audit_;  // flush audit (only with a simulator, only when asked)
  std::mutex sim_rmw_mu_;  // local read-modify-writes through the simulator
};

}  // namespace cxlkv::region

#endif  // CXLKV_SRC_REGION_META_H_
