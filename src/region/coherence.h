// Cache-coherence primitives for memory shared by hosts that do not snoop each other's caches
// (multi-host CXL 2.0). See docs/protocol.md, rules P1–P3, and TraCT §3.4.
//
//   FlushLines       clflush each 64-byte line, then mfence. clflush evicts the line from the
//                    whole local cache hierarchy and writes it back before it completes: the
//                    only flush that PUBLISHES a store to another host. (Rule P1.)
//   FlushOptLines    clflushopt each line, then sfence.  } Cheaper, but they only QUEUE the
//   WritebackLines   clwb each line, then sfence.        } write-back; the fence orders them
//                    and does not wait for the line to reach the device, and clwb keeps the
//                    line cached (a reader's stale copy is never dropped). NOT sufficient to
//                    publish across hosts (TraCT §3.4's refcount example); kept for measuring.
//   InvalidateLines  drops the local copy of each line before reading what another host wrote
//                    (x86 has no user-mode invalidate-only instruction: clflush, then mfence
//                    so later loads cannot pass it). (Rule P2.)
//   NtCopy           copies with non-temporal (streaming) stores so bulk payload never sits
//                    dirty in this host's cache, then sfence. (Rule P3.)
//
// All functions are thread-safe and may be called on any mapped memory.
#ifndef CXLKV_SRC_REGION_COHERENCE_H_
#define CXLKV_SRC_REGION_COHERENCE_H_

#include <cstddef>
#include <cstdint>

namespace cxlkv::region {

inline constexpr size_t kCacheLine = 64;

void FlushLines(const void* p, size_t n);
void FlushOptLines(const void* p, size_t n);
void WritebackLines(const void* p, size_t n);
void InvalidateLines(const void* p, size_t n);

// Invalidation for reading: clflushopt each line, then mfence. Later loads miss and read
// memory (a dirty line is written back first, and same-address ordering makes the load see
// it). It is not a PUBLISH: whether a written-back line has reached the device by the fence
// is exactly what TraCT §3.4 doubts, so publishing stays on FlushLines. Several times cheaper
// per line than clflush; the metadata accessor and payload reads use it.
void InvalidateLinesOpt(const void* p, size_t n);
// The same without the closing fence, for batches: flush or invalidate many lines, then one
// FullFence() before anything that depends on them.
void FlushLinesUnfenced(const void* p, size_t n);
void InvalidateLinesOptUnfenced(const void* p, size_t n);
// Reads payload another host wrote: invalidate + memcpy, slice by slice.
void CopyFromShared(void* dst, const void* src, size_t n);

// Non-temporal copy. Lines of `dst` that the copy only partly covers (an unaligned head or tail)
// are written with ordinary stores and then clflushed, so after return every byte of
// [dst, dst+n) is in memory, not in this host's cache. A partial line is written back whole:
// callers keep payload objects line-aligned (the allocator does) so no neighbour shares it.
void NtCopy(void* dst, const void* src, size_t n);
// The same without the closing sfence, for batches of pieces: one FullFence() after the last
// piece orders them all before what depends on them (a commit, a readiness flag).
void NtCopyUnfenced(void* dst, const void* src, size_t n);

// Which NtCopy body runs on this CPU: "avx512", "avx2" or "scalar" (movnti).
const char* NtCopyVariant();

// Exposed so tests and benchmarks can compare the variants on this CPU.
void NtCopyScalar(void* dst, const void* src, size_t n);
void NtCopyAvx2(void* dst, const void* src, size_t n);    // REQUIRES: Cpu().avx2
void NtCopyAvx512(void* dst, const void* src, size_t n);  // REQUIRES: Cpu().avx512f

inline void StoreFence() { __builtin_ia32_sfence(); }
inline void FullFence() { __builtin_ia32_mfence(); }
inline void CompilerFence() { __asm__ volatile("" ::: "memory"); }
inline void CpuRelax() { __builtin_ia32_pause(); }

}  // namespace cxlkv::region

#endif  // CXLKV_SRC_REGION_COHERENCE_H_
