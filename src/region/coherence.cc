#include "region/coherence.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "region/cpu.h"

namespace cxlkv::region {

namespace {

inline uintptr_t LineDown(const void* p) {
  return reinterpret_cast<uintptr_t>(p) & ~(uintptr_t{kCacheLine} - 1);
}

// Calls op(line_address) for each cache line overlapping [p, p+n).
template <typename Op>
inline void ForEachLine(const void* p, size_t n, Op op) {
  if (n == 0) return;
  uintptr_t end = reinterpret_cast<uintptr_t>(p) + n;
  for (uintptr_t a = LineDown(p); a < end; a += kCacheLine) op(reinterpret_cast<void*>(a));
}

// Explicit loops: a lambda would not inherit the target attribute the intrinsic needs.
__attribute__((target("clflushopt"))) void FlushOptBody(const void* p, size_t n) {
  if (n == 0) return;
  uintptr_t end = reinterpret_cast<uintptr_t>(p) + n;
  for (uintptr_t a = LineDown(p); a < end; a += kCacheLine) _mm_clflushopt(reinterpret_cast<void*>(a));
}

__attribute__((target("clwb"))) void WritebackBody(const void* p, size_t n) {
  if (n == 0) return;
  uintptr_t end = reinterpret_cast<uintptr_t>(p) + n;
  for (uintptr_t a = LineDown(p); a < end; a += kCacheLine) _mm_clwb(reinterpret_cast<void*>(a));
}

// Copies the unaligned head [dst, first line boundary) and tail with ordinary stores and
// flushes those lines; returns the aligned middle through the out-parameters.
inline void SplitHeadTail(uint8_t*& d, const uint8_t*& s, size_t& n, uint8_t** tail_dst,
                          const uint8_t** tail_src, size_t* tail_n) {
  size_t head = (kCacheLine - (reinterpret_cast<uintptr_t>(d) & (kCacheLine - 1))) & (kCacheLine - 1);
  if (head > n) head = n;
  if (head != 0) {
    std::memcpy(d, s, head);
    _mm_clflush(d);
    d += head;
    s += head;
    n -= head;
  }
  *tail_n = n & (kCacheLine - 1);
  n -= *tail_n;
  *tail_dst = d + n;
  *tail_src = s + n;
}

inline void CopyTail(uint8_t* d, const uint8_t* s, size_t n) {
  if (n == 0) return;
  std::memcpy(d, s, n);
  _mm_clflush(d);
}

using CopyFn = void (*)(void*, const void*, size_t);

CopyFn ChooseCopy() {
  const CpuFeatures& f = Cpu();
  if (f.avx512f) return NtCopyAvx512;
  if (f.avx2) return NtCopyAvx2;
  return NtCopyScalar;
}

}  // namespace

void FlushLines(const void* p, size_t n) {
  ForEachLine(p, n, [](void* a) { _mm_clflush(a); });
  _mm_mfence();
}

void FlushOptLines(const void* p, size_t n) {
  if (Cpu().clflushopt) {
    FlushOptBody(p, n);
    _mm_sfence();
  } else {
    FlushLines(p, n);
  }
}

void WritebackLines(const void* p, size_t n) {
  if (Cpu().clwb) {
    WritebackBody(p, n);
    _mm_sfence();
  } else {
    FlushLines(p, n);
  }
}

void InvalidateLines(const void* p, size_t n) {
  ForEachLine(p, n, [](void* a) { _mm_clflush(a); });
  // Later loads must not be satisfied before the lines are gone.
  _mm_mfence();
}

void InvalidateLinesOpt(const void* p, size_t n) {
  if (!Cpu().clflushopt) return InvalidateLines(p, n);
  FlushOptBody(p, n);
  // mfence orders every clflushopt before later loads: they miss and read memory.
  _mm_mfence();
}

void FlushLinesUnfenced(const void* p, size_t n) {
  ForEachLine(p, n, [](void* a) { _mm_clflush(a); });
}

void InvalidateLinesOptUnfenced(const void* p, size_t n) {
  if (Cpu().clflushopt) {
    FlushOptBody(p, n);
  } else {
    ForEachLine(p, n, [](void* a) { _mm_clflush(a); });
  }
}

void CopyFromShared(void* dst, const void* src, size_t n) {
  // Invalidate a slice, copy it, go on: the slice stays small enough that the copy runs from
  // L1/L2 fills while the next slice's flushes are issued.
  constexpr size_t kSlice = 16 << 10;
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  for (size_t at = 0; at < n; at += kSlice) {
    size_t len = std::min(kSlice, n - at);
    InvalidateLinesOpt(s + at, len);
    std::memcpy(d + at, s + at, len);
  }
}

namespace {

// The line-aligned middle of a copy, one body per instruction set. Plain functions rather than
// lambdas: a lambda would not inherit the target attribute its intrinsics need.
void StreamScalar(uint8_t* d, const uint8_t* s, size_t n) {
  for (size_t i = 0; i < n; i += 8) {
    long long v;
    std::memcpy(&v, s + i, 8);
    _mm_stream_si64(reinterpret_cast<long long*>(d + i), v);
  }
}

__attribute__((target("avx2"))) void StreamAvx2(uint8_t* d, const uint8_t* s, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
  }
}

__attribute__((target("avx512f"))) void StreamAvx512(uint8_t* d, const uint8_t* s, size_t n) {
  size_t i = 0;
  // Four lines per iteration keeps enough stores in flight to fill the write-combining buffers.
  for (; i + 256 <= n; i += 256) {
    __m512i a = _mm512_loadu_si512(s + i);
    __m512i b = _mm512_loadu_si512(s + i + 64);
    __m512i c = _mm512_loadu_si512(s + i + 128);
    __m512i e = _mm512_loadu_si512(s + i + 192);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), a);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 64), b);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 128), c);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 192), e);
  }
  for (; i < n; i += 64) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), _mm512_loadu_si512(s + i));
  }
}

// Every variant: unaligned head and tail with ordinary stores + clflush, the aligned middle
// streamed by `Body`, then (when `Fence`) one sfence so the streaming stores are ordered before
// what follows. A batch of many pieces leaves the fence to its end (one per batch, not one per
// piece).
template <void (*Body)(uint8_t*, const uint8_t*, size_t), bool Fence = true>
void NtCopyFramed(void* dst, const void* src, size_t n) {
  auto* d = static_cast<uint8_t*>(dst);
  auto* s = static_cast<const uint8_t*>(src);
  uint8_t* td;
  const uint8_t* ts;
  size_t tn;
  SplitHeadTail(d, s, n, &td, &ts, &tn);
  Body(d, s, n);
  CopyTail(td, ts, tn);
  if constexpr (Fence) _mm_sfence();
}

}  // namespace

void NtCopyScalar(void* dst, const void* src, size_t n) { NtCopyFramed<StreamScalar>(dst, src, n); }
void NtCopyAvx2(void* dst, const void* src, size_t n) { NtCopyFramed<StreamAvx2>(dst, src, n); }
void NtCopyAvx512(void* dst, const void* src, size_t n) { NtCopyFramed<StreamAvx512>(dst, src, n); }

void NtCopy(void* dst, const void* src, size_t n) {
  static const CopyFn fn = ChooseCopy();
  fn(dst, src, n);
}

void NtCopyUnfenced(void* dst, const void* src, size_t n) {
  static const CopyFn fn = [] {
    const CpuFeatures& f = Cpu();
    if (f.avx512f) return &NtCopyFramed<StreamAvx512, false>;
    if (f.avx2) return &NtCopyFramed<StreamAvx2, false>;
    return &NtCopyFramed<StreamScalar, false>;
  }();
  fn(dst, src, n);
}

const char* NtCopyVariant() {
  const CpuFeatures& f = Cpu();
  return f.avx512f ? "avx512" : f.avx2 ? "avx2" : "scalar";
}

}  // namespace cxlkv::region
