// The AVX-512 block kernel (kernels.h): attend_page — one page of one
// KV head for its whole GQA group, FlashAttention-style — all the page's logits
// first, one max and one rescale per page and head, the exponentials as vectors, then the
// values accumulated in registers across the page's tokens.
//
// Why blocks: the per-token group kernels (group_dot / group_axpy) reduce every dot product
// horizontally on its own and keep the output accumulators in memory — per 256-byte row ~4
// horizontal reductions, and a load and a store of the accumulator per 16 outputs and head —
// and were called through a pointer per token: 7 GB/s, 0.22 of one thread's read bandwidth.
// Here 4 tokens × 4 heads of dot products are reduced together (16 sums in one transposed
// reduction, ~3 operations per sum instead of ~8), and the values' accumulators (4 heads × 64
// dimensions) stay in registers over the page's tokens: one load and one store per page
// instead of per token. That doubled the speed; what is left is arithmetic (the same speed over
// a context in L2 as cold): 4 fp32 FMAs per KV element for a group of 4, one 512-bit FMA a cycle.
//
// Sums keep a fixed order that depends only on n and the token count, never on the position of
// the head or token in its block (tails repeat the last row and store nothing), so per-head and
// whole calls give identical bits. The value accumulation is the same fma, token after token,
// as group_axpy.
#include <immintrin.h>

#include <cmath>
#include <limits>

#include "pnm/kernels.h"

namespace cxlkv::pnm::internal {
namespace {

#define CXLKV_AVX512 __attribute__((target("avx512f")))
// GCC 12's AVX-512 headers trip its own -Wuninitialized (GCC bug 105593): see kernels.cc.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

template <KvDtype D>
CXLKV_AVX512 inline __m512 Load16(const uint8_t* row, uint32_t d) {
  if constexpr (D == KvDtype::kFp32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + d);
  } else if constexpr (D == KvDtype::kBf16) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row) + d / 16));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row) + d / 16));
  }
}

template <KvDtype D>
constexpr uint32_t kElemBytes = D == KvDtype::kFp32 ? 4 : 2;

// Asks for [p, p + bytes) ahead of use, into L2 (a page is larger than L1). A head's rows are
// strided, which the hardware prefetchers do not follow: measured dense, 7 GB/s without this,
// 8.7 with the hint to L1 (it evicts the page being read), 14 with this one.
inline void Prefetch(const uint8_t* p, uint32_t bytes) {
  for (uint32_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
}

// e^x for 16 lanes (constants and method in kernels.h).
CXLKV_AVX512 inline __m512 Exp16(__m512 x) {
  // max/min with x second keep a NaN (they return the second operand when one is NaN).
  x = _mm512_min_ps(_mm512_set1_ps(kExpHigh), _mm512_max_ps(_mm512_set1_ps(kExpLow), x));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}

// x[i] = e^(x[i] − shift); returns their sum (the table's exp_sum; inlined into attend_page).
CXLKV_AVX512 inline float ExpSum(float* x, uint32_t n, float shift) {
  const __m512 s = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  for (uint32_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 e = Exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), s));
    _mm512_mask_storeu_ps(x + i, m, e);
    sum = _mm512_mask_add_ps(sum, m, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// Two steps of the transposed reduction. Within each 128-bit lane, Pair1 leaves
// [a0+a2, b0+b2, a1+a3, b1+b3] and Pair2 (of two Pair1 results) [A, B, C, D], the lane's partial
// sums of four series. Pair3 then adds 128-bit lanes pairwise: [a.L0+a.L1, a.L2+a.L3, b.L0+b.L1,
// b.L2+b.L3].
CXLKV_AVX512 inline __m512 Pair1(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
CXLKV_AVX512 inline __m512 Pair2(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
CXLKV_AVX512 inline __m512 Pair3(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xdd));
}
// Lane c of the result = Σ of the lanes of v_c.
CXLKV_AVX512 inline __m512 Sum16(__m512 v0, __m512 v1, __m512 v2, __m512 v3, __m512 v4, __m512 v5, __m512 v6,
                                 __m512 v7, __m512 v8, __m512 v9, __m512 v10, __m512 v11, __m512 v12, __m512 v13,
                                 __m512 v14, __m512 v15) {
  const __m512 x0 = Pair2(Pair1(v0, v1), Pair1(v2, v3)), x1 = Pair2(Pair1(v4, v5), Pair1(v6, v7));
  const __m512 x2 = Pair2(Pair1(v8, v9), Pair1(v10, v11)), x3 = Pair2(Pair1(v12, v13), Pair1(v14, v15));
  return Pair3(Pair3(x0, x1), Pair3(x2, x3));
}

// logits[i·stride + t] = scale·(q_i · k_t) for the page's tokens and the group's heads.
template <KvDtype D>
CXLKV_AVX512 void Logits(const PageHead& page, const float* q, uint32_t heads, uint32_t n, float scale, float* logits,
                         uint32_t stride) {
  const uint8_t* k = static_cast<const uint8_t*>(page.k);
  const uint8_t* next = static_cast<const uint8_t*>(page.next_k);
  const uint32_t row_bytes = n * kElemBytes<D>;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (uint32_t t = 0; t < page.tokens; t += 4) {
    const uint8_t* r[4];
    for (uint32_t j = 0; j < 4; ++j) r[j] = k + uint64_t{t + j < page.tokens ? t + j : page.tokens - 1} * page.row_bytes;
    if (next != nullptr) {
      for (uint32_t j = 0; j < 4 && t + j < page.tokens; ++j) Prefetch(next + uint64_t{t + j} * page.row_bytes, row_bytes);
    }
    for (uint32_t i = 0; i < heads; i += 4) {
      // Heads past the group repeat its last one; their sums are not stored.
      const float* q0 = q + uint64_t{i} * n;
      const float* q1 = q + uint64_t{i + 1 < heads ? i + 1 : heads - 1} * n;
      const float* q2 = q + uint64_t{i + 2 < heads ? i + 2 : heads - 1} * n;
      const float* q3 = q + uint64_t{i + 3 < heads ? i + 3 : heads - 1} * n;
      __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
             a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
      for (uint32_t d = 0; d < n; d += 16) {
        const __m512 k0 = Load16<D>(r[0], d), k1 = Load16<D>(r[1], d), k2 = Load16<D>(r[2], d),
                     k3 = Load16<D>(r[3], d);
        __m512 x = _mm512_loadu_ps(q0 + d);
        a00 = _mm512_fmadd_ps(x, k0, a00);
        a01 = _mm512_fmadd_ps(x, k1, a01);
        a02 = _mm512_fmadd_ps(x, k2, a02);
        a03 = _mm512_fmadd_ps(x, k3, a03);
        x = _mm512_loadu_ps(q1 + d);
        a10 = _mm512_fmadd_ps(x, k0, a10);
        a11 = _mm512_fmadd_ps(x, k1, a11);
        a12 = _mm512_fmadd_ps(x, k2, a12);
        a13 = _mm512_fmadd_ps(x, k3, a13);
        x = _mm512_loadu_ps(q2 + d);
        a20 = _mm512_fmadd_ps(x, k0, a20);
        a21 = _mm512_fmadd_ps(x, k1, a21);
        a22 = _mm512_fmadd_ps(x, k2, a22);
        a23 = _mm512_fmadd_ps(x, k3, a23);
        x = _mm512_loadu_ps(q3 + d);
        a30 = _mm512_fmadd_ps(x, k0, a30);
        a31 = _mm512_fmadd_ps(x, k1, a31);
        a32 = _mm512_fmadd_ps(x, k2, a32);
        a33 = _mm512_fmadd_ps(x, k3, a33);
      }
      // Lane 4i' + j: head i + i', token t + j.
      alignas(64) float sums[16];
      _mm512_store_ps(sums, _mm512_mul_ps(vscale, Sum16(a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23,
                                                         a30, a31, a32, a33)));
      for (uint32_t ii = 0; ii < 4 && i + ii < heads; ++ii) {
        for (uint32_t j = 0; j < 4 && t + j < page.tokens; ++j) logits[uint64_t{i + ii} * stride + t + j] = sums[ii * 4 + j];
      }
    }
  }
}

// acc_i[d0, d0 + 16·C) += Σ_t w_i[t]·v_t[d0, d0 + 16·C) for four heads (w and acc rows given;
// `valid` of them stored), token after token; C is 4 or 1.
template <KvDtype D, int C>
CXLKV_AVX512 void ValuesBlock(const PageHead& page, uint32_t n, uint32_t d0, const float* const w[4], float* const acc[4],
                              uint32_t valid) {
  static_assert(C == 4 || C == 1);
  const uint8_t* v = static_cast<const uint8_t*>(page.v);
  const uint8_t* next = static_cast<const uint8_t*>(page.next_v);
  (void)n;
  __m512 a00 = _mm512_loadu_ps(acc[0] + d0), a10 = _mm512_loadu_ps(acc[1] + d0), a20 = _mm512_loadu_ps(acc[2] + d0),
         a30 = _mm512_loadu_ps(acc[3] + d0);
  __m512 a01 = a00, a02 = a00, a03 = a00, a11 = a00, a12 = a00, a13 = a00, a21 = a00, a22 = a00, a23 = a00, a31 = a00,
         a32 = a00, a33 = a00;
  if constexpr (C == 4) {
    a01 = _mm512_loadu_ps(acc[0] + d0 + 16), a02 = _mm512_loadu_ps(acc[0] + d0 + 32), a03 = _mm512_loadu_ps(acc[0] + d0 + 48);
    a11 = _mm512_loadu_ps(acc[1] + d0 + 16), a12 = _mm512_loadu_ps(acc[1] + d0 + 32), a13 = _mm512_loadu_ps(acc[1] + d0 + 48);
    a21 = _mm512_loadu_ps(acc[2] + d0 + 16), a22 = _mm512_loadu_ps(acc[2] + d0 + 32), a23 = _mm512_loadu_ps(acc[2] + d0 + 48);
    a31 = _mm512_loadu_ps(acc[3] + d0 + 16), a32 = _mm512_loadu_ps(acc[3] + d0 + 32), a33 = _mm512_loadu_ps(acc[3] + d0 + 48);
  }
  for (uint32_t t = 0; t < page.tokens; ++t) {
    const uint8_t* row = v + uint64_t{t} * page.row_bytes;
    if (next != nullptr) Prefetch(next + uint64_t{t} * page.row_bytes + d0 * kElemBytes<D>, 16 * C * kElemBytes<D>);
    const __m512 w0 = _mm512_set1_ps(w[0][t]), w1 = _mm512_set1_ps(w[1][t]), w2 = _mm512_set1_ps(w[2][t]),
                 w3 = _mm512_set1_ps(w[3][t]);
    __m512 x = Load16<D>(row, d0);
    a00 = _mm512_fmadd_ps(w0, x, a00);
    a10 = _mm512_fmadd_ps(w1, x, a10);
    a20 = _mm512_fmadd_ps(w2, x, a20);
    a30 = _mm512_fmadd_ps(w3, x, a30);
    if constexpr (C == 4) {
      x = Load16<D>(row, d0 + 16);
      a01 = _mm512_fmadd_ps(w0, x, a01);
      a11 = _mm512_fmadd_ps(w1, x, a11);
      a21 = _mm512_fmadd_ps(w2, x, a21);
      a31 = _mm512_fmadd_ps(w3, x, a31);
      x = Load16<D>(row, d0 + 32);
      a02 = _mm512_fmadd_ps(w0, x, a02);
      a12 = _mm512_fmadd_ps(w1, x, a12);
      a22 = _mm512_fmadd_ps(w2, x, a22);
      a32 = _mm512_fmadd_ps(w3, x, a32);
      x = Load16<D>(row, d0 + 48);
      a03 = _mm512_fmadd_ps(w0, x, a03);
      a13 = _mm512_fmadd_ps(w1, x, a13);
      a23 = _mm512_fmadd_ps(w2, x, a23);
      a33 = _mm512_fmadd_ps(w3, x, a33);
    }
  }
  auto store = [&](float* a, __m512 c0, __m512 c1, __m512 c2, __m512 c3) CXLKV_AVX512 {
    _mm512_storeu_ps(a + d0, c0);
    if constexpr (C == 4) {
      _mm512_storeu_ps(a + d0 + 16, c1);
      _mm512_storeu_ps(a + d0 + 32, c2);
      _mm512_storeu_ps(a + d0 + 48, c3);
    }
  };
  store(acc[0], a00, a01, a02, a03);
  if (valid > 1) store(acc[1], a10, a11, a12, a13);
  if (valid > 2) store(acc[2], a20, a21, a22, a23);
  if (valid > 3) store(acc[3], a30, a31, a32, a33);
}

template <KvDtype D>
CXLKV_AVX512 void AttendPageAvx512T(const PageHead& page, const float* q, uint32_t heads, uint32_t n, float scale,
                                    float* logits, uint32_t stride, float* max, float* sum, float* acc) {
  Logits<D>(page, q, heads, n, scale, logits, stride);
  const uint32_t tokens = page.tokens;
  // Online softmax, once per head for the whole page: logits become weights e^(logit − max).
  for (uint32_t i = 0; i < heads; ++i) {
    float* li = logits + uint64_t{i} * stride;
    __m512 vmax = _mm512_set1_ps(kMinusInf);
    for (uint32_t t = 0; t < tokens; t += 16) {
      const __mmask16 m = tokens - t >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (tokens - t)) - 1);
      vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(_mm512_set1_ps(kMinusInf), m, li + t));
    }
    const float new_max = std::max(max[i], _mm512_reduce_max_ps(vmax));
    if (new_max == kMinusInf) {  // every logit so far is -inf: nothing to weigh yet
      for (uint32_t t = 0; t < tokens; ++t) li[t] = 0.0f;
      continue;
    }
    const float rescale = std::exp(max[i] - new_max);  // exp(-inf) = 0 on the first page
    if (rescale != 1.0f) {
      sum[i] *= rescale;
      float* ai = acc + uint64_t{i} * n;
      const __m512 r = _mm512_set1_ps(rescale);
      for (uint32_t d = 0; d < n; d += 16) _mm512_storeu_ps(ai + d, _mm512_mul_ps(_mm512_loadu_ps(ai + d), r));
    }
    max[i] = new_max;
    sum[i] += ExpSum(li, tokens, new_max);
  }
  for (uint32_t i = 0; i < heads; i += 4) {
    const float* w[4];
    float* a[4];
    for (uint32_t j = 0; j < 4; ++j) {
      const uint32_t head = i + j < heads ? i + j : heads - 1;
      w[j] = logits + uint64_t{head} * stride;
      a[j] = acc + uint64_t{head} * n;
    }
    const uint32_t valid = heads - i < 4 ? heads - i : 4;
    uint32_t d = 0;
    for (; d + 64 <= n; d += 64) ValuesBlock<D, 4>(page, n, d, w, a, valid);
    for (; d < n; d += 16) ValuesBlock<D, 1>(page, n, d, w, a, valid);
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace

__attribute__((target("avx512f"))) float ExpSumAvx512(float* x, uint32_t n, float shift) { return ExpSum(x, n, shift); }

void AttendPageAvx512(KvDtype dtype, const PageHead& page, const float* q, uint32_t heads, uint32_t n, float scale,
                      float* logits, uint32_t stride, float* max, float* sum, float* acc) {
  switch (dtype) {
    case KvDtype::kFp32:
      return AttendPageAvx512T<KvDtype::kFp32>(page, q, heads, n, scale, logits, stride, max, sum, acc);
    case KvDtype::kBf16:
      return AttendPageAvx512T<KvDtype::kBf16>(page, q, heads, n, scale, logits, stride, max, sum, acc);
    default:
      return AttendPageAvx512T<KvDtype::kFp16>(page, q, heads, n, scale, logits, stride, max, sum, acc);
  }
}

}  // namespace cxlkv::pnm::internal
