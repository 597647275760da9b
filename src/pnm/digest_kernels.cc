// The digest kernels (kernels.h). Building: the fold of key rows into a head's running bounds,
// the head's extent, and its int8 values. BuildDigests runs them once per key row and once per
// page and head; written as plain loops they stayed scalar (-O2 on the baseline ISA does not
// vectorize them) and held BuildDigests near 0.8 M tokens/s of 8 KV heads. Scoring: the AVX-512
// digest_dot_block, which keeps the query in registers across a block of pages.
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "pnm/int_sums.h"
#include "pnm/kernels.h"

namespace cxlkv::pnm::internal {

// ---- scalar --------------------------------------------------------------------------------

void FoldBoundsScalar(const float* row, uint32_t n, float* lo, float* hi, float* probe) {
  for (uint32_t j = 0; j < n; ++j) {
    lo[j] = row[j] < lo[j] ? row[j] : lo[j];
    hi[j] = row[j] > hi[j] ? row[j] : hi[j];
    probe[j] += row[j] * 0.0f;
  }
}

// Four partial sums and maxima, so no single chain of dependent adds runs the whole head.
bool BoundsExtentScalar(const float* lo, const float* hi, const float* probe, uint32_t n, float* max_abs) {
  float sum[4] = {0, 0, 0, 0}, m[4] = {0, 0, 0, 0};
  for (uint32_t d = 0; d < n; d += 4) {
    for (uint32_t j = 0; j < 4; ++j) {
      sum[j] += probe[d + j];
      m[j] = std::max(m[j], std::max(std::fabs(lo[d + j]), std::fabs(hi[d + j])));
    }
  }
  *max_abs = std::max(std::max(m[0], m[1]), std::max(m[2], m[3]));
  return (sum[0] + sum[1]) + (sum[2] + sum[3]) == 0;
}

namespace {
// ceil(x · inv_scale) for |x · inv_scale| <= 127: the product is exact in double, and
// truncation then one step up is ceil without a libm call.
int8_t CeilScaled(double x, double inv_scale) {
  const double y = x * inv_scale;
  auto t = static_cast<int32_t>(y);  // toward zero
  if (static_cast<double>(t) < y) ++t;
  return static_cast<int8_t>(t);
}
}  // namespace

void QuantizeBoundsScalar(const float* lo, const float* hi, uint32_t n, double inv_scale, bool merge, int8_t* values) {
  for (uint32_t d = 0; d < n; ++d) {
    const int8_t up = CeilScaled(hi[d], inv_scale), nlo = CeilScaled(-double{lo[d]}, inv_scale);
    values[2 * d] = merge ? std::max(values[2 * d], up) : up;
    values[2 * d + 1] = merge ? std::max(values[2 * d + 1], nlo) : nlo;
  }
}

// ---- AVX2 ----------------------------------------------------------------------------------

#define CXLKV_AVX2 __attribute__((target("avx2,fma,f16c")))
// minps(a, b) is a < b ? a : b and maxps(a, b) is a > b ? a : b, NaN and signed zeros included:
// the scalar fold's very selections.
CXLKV_AVX2 void FoldBoundsAvx2(const float* row, uint32_t n, float* lo, float* hi, float* probe) {
  const __m256 zero = _mm256_setzero_ps();
  for (uint32_t j = 0; j < n; j += 8) {
    const __m256 r = _mm256_loadu_ps(row + j);
    _mm256_storeu_ps(lo + j, _mm256_min_ps(r, _mm256_loadu_ps(lo + j)));
    _mm256_storeu_ps(hi + j, _mm256_max_ps(r, _mm256_loadu_ps(hi + j)));
    _mm256_storeu_ps(probe + j, _mm256_add_ps(_mm256_loadu_ps(probe + j), _mm256_mul_ps(r, zero)));
  }
}

#undef CXLKV_AVX2

// ---- AVX-512 -------------------------------------------------------------------------------

#define CXLKV_AVX512 __attribute__((target("avx512f")))
// GCC 12's AVX-512 headers trip its own -Wuninitialized (GCC bug 105593): see kernels.cc.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

CXLKV_AVX512 void FoldBoundsAvx512(const float* row, uint32_t n, float* lo, float* hi, float* probe) {
  const __m512 zero = _mm512_setzero_ps();
  for (uint32_t j = 0; j < n; j += 16) {
    const __m512 r = _mm512_loadu_ps(row + j);
    _mm512_storeu_ps(lo + j, _mm512_min_ps(r, _mm512_loadu_ps(lo + j)));
    _mm512_storeu_ps(hi + j, _mm512_max_ps(r, _mm512_loadu_ps(hi + j)));
    _mm512_storeu_ps(probe + j, _mm512_add_ps(_mm512_loadu_ps(probe + j), _mm512_mul_ps(r, zero)));
  }
}

CXLKV_AVX512 bool BoundsExtentAvx512(const float* lo, const float* hi, const float* probe, uint32_t n,
                                     float* max_abs) {
  __m512 sum = _mm512_setzero_ps(), m = _mm512_setzero_ps();
  for (uint32_t d = 0; d < n; d += 16) {
    sum = _mm512_add_ps(sum, _mm512_loadu_ps(probe + d));
    m = _mm512_max_ps(m, _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(lo + d)), _mm512_abs_ps(_mm512_loadu_ps(hi + d))));
  }
  *max_abs = _mm512_reduce_max_ps(m);
  return _mm512_reduce_add_ps(sum) == 0;  // ±0 sum to 0 in any order, and a NaN stays
}

namespace {
// 8 bounds → ceil(bound · scale) as int32, in double as the scalar CeilScaled (the product is
// exact, and ceil of an integral double converts exactly).
CXLKV_AVX512 inline __m256i CeilScaled8(const float* x, __m512d scale) {
  const __m512d y = _mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x)), scale);
  return _mm512_cvtpd_epi32(_mm512_roundscale_pd(y, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC));
}

CXLKV_AVX512 inline __m128i CeilScaled16(const float* x, __m512d scale) {
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(CeilScaled8(x, scale)), CeilScaled8(x + 8, scale), 1);
  return _mm512_cvtepi32_epi8(both);  // every value is within ±127
}
}  // namespace

CXLKV_AVX512 void QuantizeBoundsAvx512(const float* lo, const float* hi, uint32_t n, double inv_scale, bool merge,
                                       int8_t* values) {
  const __m512d up = _mm512_set1_pd(inv_scale), down = _mm512_set1_pd(-inv_scale);
  for (uint32_t d = 0; d < n; d += 16) {
    const __m128i h = CeilScaled16(hi + d, up), l = CeilScaled16(lo + d, down);
    __m128i first = _mm_unpacklo_epi8(h, l), second = _mm_unpackhi_epi8(h, l);  // hi_d, nlo_d pairs
    auto* out = reinterpret_cast<__m128i*>(values + 2 * d);
    if (merge) {
      first = _mm_max_epi8(first, _mm_loadu_si128(out));
      second = _mm_max_epi8(second, _mm_loadu_si128(out + 1));
    }
    _mm_storeu_si128(out, first);
    _mm_storeu_si128(out + 1, second);
  }
}

// ---- digest_dot_block (AVX512_VNNI) --------------------------------------------------------
// Only the VNNI table has it: a target attribute is per function, not per template argument, so
// a multiply-add variant for AVX-512 without VNNI would be compiled for VNNI too. That table
// scores page by page.

namespace {

#define CXLKV_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

// acc += q's u8 by v's s8, four products summed into each int32 lane (vpdpbusd).
CXLKV_VNNI inline __m512i MulAdd(__m512i acc, __m512i q, __m512i v) { return _mm512_dpbusd_epi32(acc, q, v); }

CXLKV_VNNI inline __m512i Load64(const void* p) { return _mm512_loadu_si512(p); }

// Two query heads (qa, qb: kChunks vectors of 64 bytes each) against every page, two pages at a
// time: four accumulators reduced together. out[p·heads] and out[p·heads + 1]. Always inlined:
// called, it took qa and qb from the caller's stack for every multiply-add, and the query was
// loaded per page again.
template <uint32_t kChunks>
CXLKV_VNNI inline __attribute__((always_inline)) void TwoHeadsOverPages(const __m512i* qa, const __m512i* qb,
                                                                             const int8_t* rows, uint64_t stride,
                                                                             uint32_t pages, uint32_t heads,
                                                                             int32_t* out) {
  uint32_t p = 0;
  for (; p + 2 <= pages; p += 2) {
    const int8_t* r0 = rows + p * stride;
    const int8_t* r1 = r0 + stride;
    __m512i a0 = _mm512_setzero_si512(), b0 = a0, a1 = a0, b1 = a0;
#pragma GCC unroll 4
    for (uint32_t c = 0; c < kChunks; ++c) {
      const __m512i v0 = Load64(r0 + 64 * c), v1 = Load64(r1 + 64 * c);
      a0 = MulAdd(a0, qa[c], v0);
      b0 = MulAdd(b0, qb[c], v0);
      a1 = MulAdd(a1, qa[c], v1);
      b1 = MulAdd(b1, qb[c], v1);
    }
    alignas(16) int32_t sums[4];
    StoreSums4(a0, b0, a1, b1, sums);
    out[uint64_t{p} * heads] = sums[0];
    out[uint64_t{p} * heads + 1] = sums[1];
    out[uint64_t{p + 1} * heads] = sums[2];
    out[uint64_t{p + 1} * heads + 1] = sums[3];
  }
  if (p < pages) {
    const int8_t* r0 = rows + p * stride;
    __m512i a0 = _mm512_setzero_si512(), b0 = a0;
#pragma GCC unroll 4
    for (uint32_t c = 0; c < kChunks; ++c) {
      const __m512i v0 = Load64(r0 + 64 * c);
      a0 = MulAdd(a0, qa[c], v0);
      b0 = MulAdd(b0, qb[c], v0);
    }
    alignas(16) int32_t sums[4];
    StoreSums4(a0, b0, a0, b0, sums);
    out[uint64_t{p} * heads] = sums[0];
    out[uint64_t{p} * heads + 1] = sums[1];
  }
}

template <uint32_t kChunks>
CXLKV_VNNI void DigestDotBlockT(const uint8_t* q, uint32_t heads, const int8_t* rows, uint64_t stride, uint32_t pages,
                                int32_t* out) {
  constexpr uint32_t kLen = 64 * kChunks;  // query bytes per head
  __m512i qa[kChunks], qb[kChunks];
  for (uint32_t i = 0; i < heads; i += 2) {
    // An odd head count pairs the last head with itself; its twin's sums go to a scratch row.
    const uint8_t* a = q + uint64_t{i} * kLen;
    const uint8_t* b = i + 1 < heads ? a + kLen : a;
#pragma GCC unroll 4
    for (uint32_t c = 0; c < kChunks; ++c) {
      qa[c] = Load64(a + 64 * c);
      qb[c] = Load64(b + 64 * c);
    }
    if (i + 1 < heads) {
      TwoHeadsOverPages<kChunks>(qa, qb, rows, stride, pages, heads, out + i);
    } else {
      for (uint32_t p = 0; p < pages; ++p) {  // the last, odd head: one page at a time
        int32_t pair[2];
        TwoHeadsOverPages<kChunks>(qa, qb, rows + p * stride, stride, 1, 2, pair);
        out[uint64_t{p} * heads + i] = pair[0];
      }
    }
  }
}

}  // namespace

// Head sizes whose two heads' query fits in registers (2n/64 vectors each); others are left to
// digest_dot, page by page.
CXLKV_VNNI bool DigestDotBlockAvx512Vnni(const uint8_t* q, uint32_t heads, const int8_t* rows, uint64_t stride,
                                         uint32_t pages, uint32_t n, int32_t* out) {
  switch (n) {
    case 128:
      DigestDotBlockT<4>(q, heads, rows, stride, pages, out);
      return true;
    case 64:
      DigestDotBlockT<2>(q, heads, rows, stride, pages, out);
      return true;
    case 32:
      DigestDotBlockT<1>(q, heads, rows, stride, pages, out);
      return true;
    default:
      return false;
  }
}
#undef CXLKV_VNNI

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#undef CXLKV_AVX512

}  // namespace cxlkv::pnm::internal
