#include "pnm/kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "pnm/int_sums.h"
#include "region/cpu.h"

namespace cxlkv::pnm::internal {

float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: mant * 2^-24, exact in fp32
      float f = std::ldexp(static_cast<float>(mant), -24);
      std::memcpy(&bits, &f, sizeof bits);
      bits |= sign;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

namespace {

uint32_t BitsOf(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

// Truncation drops the low 16 bits: toward zero. Toward zero is down for positive values and
// up for negative ones; the other direction is one bf16 step further from zero.
uint16_t Bf16Directed(float x, bool up) {
  const uint32_t b = BitsOf(x);
  if (std::isnan(x)) return 0x7fc0;
  const uint16_t truncated = static_cast<uint16_t>(b >> 16);
  if ((b & 0xffffu) == 0) return truncated;
  const bool negative = (b >> 31) != 0;
  return negative == up ? truncated : static_cast<uint16_t>(truncated + 1);
}

// ---- scalar --------------------------------------------------------------------------------

void ToFloatScalar(KvDtype dtype, const void* src, float* dst, uint32_t n) {
  if (dtype == KvDtype::kFp32) {
    std::memcpy(dst, src, size_t{n} * sizeof(float));
    return;
  }
  const auto* s = static_cast<const uint16_t*>(src);
  if (dtype == KvDtype::kBf16) {
    for (uint32_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(s[i]);
  } else {
    for (uint32_t i = 0; i < n; ++i) dst[i] = HalfToFloat(s[i]);
  }
}

float DotScalar(const float* a, const float* b, uint32_t n) {
  float acc[4] = {0, 0, 0, 0};
  for (uint32_t i = 0; i < n; i += 4) {
    for (uint32_t j = 0; j < 4; ++j) acc[j] += a[i + j] * b[i + j];
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

void AxpyScalar(float a, const float* x, float* y, uint32_t n) {
  for (uint32_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// Exact in int32: |q·v| <= 255·127 and at most 2·1024 terms of which half are 0 (a query
// dimension is positive or negative, not both): below 2^31 (kernels.h).
void DigestDotScalar(const uint8_t* q, uint32_t heads, const int8_t* rows, uint32_t n, int32_t* out) {
  for (uint32_t i = 0; i < heads; ++i) {
    const uint8_t* qi = q + uint64_t{i} * 2 * n;
    int32_t sum = 0;
    for (uint32_t j = 0; j < 2 * n; ++j) sum += int32_t{qi[j]} * int32_t{rows[j]};
    out[i] = sum;
  }
}

float LoadScalar(KvDtype dtype, const void* row, uint32_t d) {
  if (dtype == KvDtype::kFp32) return static_cast<const float*>(row)[d];
  const uint16_t v = static_cast<const uint16_t*>(row)[d];
  return dtype == KvDtype::kBf16 ? Bf16ToFloat(v) : HalfToFloat(v);
}

void GroupDotScalar(KvDtype dtype, const void* row, const float* q, uint32_t heads, uint32_t n, float* out,
                    uint32_t out_stride) {
  float widened[1024];  // n <= 1024 (Geometry::Validate)
  for (uint32_t d = 0; d < n; ++d) widened[d] = LoadScalar(dtype, row, d);
  for (uint32_t i = 0; i < heads; ++i) out[i * out_stride] = DotScalar(q + uint64_t{i} * n, widened, n);
}

void GroupAxpyScalar(KvDtype dtype, const void* row, const float* w, uint32_t w_stride, uint32_t heads, uint32_t n,
                     float* acc) {
  float widened[1024];
  for (uint32_t d = 0; d < n; ++d) widened[d] = LoadScalar(dtype, row, d);
  for (uint32_t i = 0; i < heads; ++i) AxpyScalar(w[i * w_stride], widened, acc + uint64_t{i} * n, n);
}

float ExpSumScalar(float* x, uint32_t n, float shift) {
  float sum = 0;
  for (uint32_t i = 0; i < n; ++i) sum += (x[i] = std::exp(x[i] - shift));
  return sum;
}

// The vector exponentials' constants are in kernels.h (attend_kernels.cc has the AVX-512 one).

// ---- AVX2 + F16C + FMA ---------------------------------------------------------------------

#define CXLKV_AVX2 __attribute__((target("avx2,fma,f16c")))

CXLKV_AVX2 float HorizontalSum256(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

CXLKV_AVX2 __m256 LoadBf16x8(const uint16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

CXLKV_AVX2 void ToFloatAvx2(KvDtype dtype, const void* src, float* dst, uint32_t n) {
  if (dtype == KvDtype::kFp32) {
    std::memcpy(dst, src, size_t{n} * sizeof(float));
    return;
  }
  const auto* s = static_cast<const uint16_t*>(src);
  if (dtype == KvDtype::kBf16) {
    for (uint32_t i = 0; i < n; i += 8) _mm256_storeu_ps(dst + i, LoadBf16x8(s + i));
  } else {
    for (uint32_t i = 0; i < n; i += 8) {
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
    }
  }
}

CXLKV_AVX2 float DotAvx2(const float* a, const float* b, uint32_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (uint32_t i = 0; i < n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  return HorizontalSum256(_mm256_add_ps(acc0, acc1));
}

CXLKV_AVX2 void AxpyAvx2(float a, const float* x, float* y, uint32_t n) {
  const __m256 va = _mm256_set1_ps(a);
  for (uint32_t i = 0; i < n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
}

CXLKV_AVX2 int32_t HorizontalSum256i(__m256i v) {
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(x);
}

// 32 query bytes against 32 digest values: vpmaddubsw multiplies u8 by s8 and sums each pair
// (q⁺_d·hi_d + q⁻_d·nlo_d, one term 0: exact in int16, kernels.h), vpmaddwd by ones widens the
// pairs into int32 lanes.
CXLKV_AVX2 inline __m256i DigestMulAdd(__m256i acc, __m256i q, __m256i v) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(q, v), _mm256_set1_epi16(1)));
}

CXLKV_AVX2 inline __m256i At(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

CXLKV_AVX2 void DigestDotAvx2(const uint8_t* q, uint32_t heads, const int8_t* rows, uint32_t n, int32_t* out) {
  const uint32_t len = 2 * n;  // a multiple of 32
  uint32_t i = 0;
  for (; i + 4 <= heads; i += 4) {
    const uint8_t* q0 = q + uint64_t{i} * len;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (uint32_t j = 0; j < len; j += 32) {
      const __m256i v = At(rows + j);
      a0 = DigestMulAdd(a0, At(q0 + j), v);
      a1 = DigestMulAdd(a1, At(q0 + len + j), v);
      a2 = DigestMulAdd(a2, At(q0 + 2 * len + j), v);
      a3 = DigestMulAdd(a3, At(q0 + 3 * len + j), v);
    }
    out[i] = HorizontalSum256i(a0);
    out[i + 1] = HorizontalSum256i(a1);
    out[i + 2] = HorizontalSum256i(a2);
    out[i + 3] = HorizontalSum256i(a3);
  }
  for (; i < heads; ++i) {
    const uint8_t* qi = q + uint64_t{i} * len;
    __m256i a = _mm256_setzero_si256();
    for (uint32_t j = 0; j < len; j += 32) a = DigestMulAdd(a, At(qi + j), At(rows + j));
    out[i] = HorizontalSum256i(a);
  }
}

CXLKV_AVX2 __m256 Load8(KvDtype dtype, const void* row, uint32_t d) {
  switch (dtype) {
    case KvDtype::kFp32:
      return _mm256_loadu_ps(static_cast<const float*>(row) + d);
    case KvDtype::kBf16:
      return LoadBf16x8(static_cast<const uint16_t*>(row) + d);
    default:
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + d)));
  }
}

CXLKV_AVX2 void GroupDotAvx2(KvDtype dtype, const void* row, const float* q, uint32_t heads, uint32_t n, float* out,
                             uint32_t out_stride) {
  uint32_t i = 0;
  for (; i + 4 <= heads; i += 4) {  // four heads share each widened chunk of the row
    const float* q0 = q + uint64_t{i} * n;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (uint32_t d = 0; d < n; d += 8) {
      const __m256 k = Load8(dtype, row, d);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d), k, a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + n + d), k, a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 2 * n + d), k, a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 3 * n + d), k, a3);
    }
    out[i * out_stride] = HorizontalSum256(a0);
    out[(i + 1) * out_stride] = HorizontalSum256(a1);
    out[(i + 2) * out_stride] = HorizontalSum256(a2);
    out[(i + 3) * out_stride] = HorizontalSum256(a3);
  }
  for (; i < heads; ++i) {
    const float* qi = q + uint64_t{i} * n;
    __m256 a = _mm256_setzero_ps();
    for (uint32_t d = 0; d < n; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qi + d), Load8(dtype, row, d), a);
    out[i * out_stride] = HorizontalSum256(a);
  }
}

CXLKV_AVX2 void GroupAxpyAvx2(KvDtype dtype, const void* row, const float* w, uint32_t w_stride, uint32_t heads,
                              uint32_t n, float* acc) {
  for (uint32_t d = 0; d < n; d += 8) {
    const __m256 v = Load8(dtype, row, d);
    for (uint32_t i = 0; i < heads; ++i) {
      float* a = acc + uint64_t{i} * n + d;
      _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(w[i * w_stride]), v, _mm256_loadu_ps(a)));
    }
  }
}

CXLKV_AVX2 __m256 Exp8(__m256 x) {
  // max/min with x second keep a NaN (they return the second operand when one is NaN).
  x = _mm256_min_ps(_mm256_set1_ps(kExpHigh), _mm256_max_ps(_mm256_set1_ps(kExpLow), x));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
}

CXLKV_AVX2 float ExpSumAvx2(float* x, uint32_t n, float shift) {
  const __m256 s = _mm256_set1_ps(shift);
  __m256 sum = _mm256_setzero_ps();
  uint32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), s));
    _mm256_storeu_ps(x + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = HorizontalSum256(sum);
  if (i < n) {  // the tail through the same polynomial, so every element is computed alike
    float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (uint32_t j = i; j < n; ++j) tail[j - i] = x[j] - shift;
    _mm256_storeu_ps(tail, Exp8(_mm256_loadu_ps(tail)));
    for (uint32_t j = i; j < n; ++j) total += (x[j] = tail[j - i]);
  }
  return total;
}

#undef CXLKV_AVX2

// ---- AVX-512 -------------------------------------------------------------------------------

#define CXLKV_AVX512 __attribute__((target("avx512f")))
// GCC 12's AVX-512 headers build their "undefined" vectors by self-initialization, which its
// own -Wuninitialized then reports at every inlined use (GCC bug 105593): a false positive.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

CXLKV_AVX512 __m512 LoadBf16x16(const uint16_t* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

CXLKV_AVX512 void ToFloatAvx512(KvDtype dtype, const void* src, float* dst, uint32_t n) {
  if (dtype == KvDtype::kFp32) {
    std::memcpy(dst, src, size_t{n} * sizeof(float));
    return;
  }
  const auto* s = static_cast<const uint16_t*>(src);
  if (dtype == KvDtype::kBf16) {
    for (uint32_t i = 0; i < n; i += 16) _mm512_storeu_ps(dst + i, LoadBf16x16(s + i));
  } else {
    for (uint32_t i = 0; i < n; i += 16) {
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i))));
    }
  }
}

CXLKV_AVX512 float DotAvx512(const float* a, const float* b, uint32_t n) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  uint32_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
  }
  if (i < n) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

CXLKV_AVX512 void AxpyAvx512(float a, const float* x, float* y, uint32_t n) {
  const __m512 va = _mm512_set1_ps(a);
  for (uint32_t i = 0; i < n; i += 16) {
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  }
}

CXLKV_AVX512 __m512 Load16(KvDtype dtype, const void* row, uint32_t d) {
  switch (dtype) {
    case KvDtype::kFp32:
      return _mm512_loadu_ps(static_cast<const float*>(row) + d);
    case KvDtype::kBf16:
      return LoadBf16x16(static_cast<const uint16_t*>(row) + d);
    default:
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + d)));
  }
}

CXLKV_AVX512 void GroupDotAvx512(KvDtype dtype, const void* row, const float* q, uint32_t heads, uint32_t n, float* out,
                                 uint32_t out_stride) {
  uint32_t i = 0;
  for (; i + 4 <= heads; i += 4) {  // four heads share each widened chunk of the row
    const float* q0 = q + uint64_t{i} * n;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (uint32_t d = 0; d < n; d += 16) {
      const __m512 k = Load16(dtype, row, d);
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + d), k, a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + n + d), k, a1);
      a2 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + 2 * n + d), k, a2);
      a3 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + 3 * n + d), k, a3);
    }
    out[i * out_stride] = _mm512_reduce_add_ps(a0);
    out[(i + 1) * out_stride] = _mm512_reduce_add_ps(a1);
    out[(i + 2) * out_stride] = _mm512_reduce_add_ps(a2);
    out[(i + 3) * out_stride] = _mm512_reduce_add_ps(a3);
  }
  for (; i < heads; ++i) {
    const float* qi = q + uint64_t{i} * n;
    __m512 a = _mm512_setzero_ps();
    for (uint32_t d = 0; d < n; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(qi + d), Load16(dtype, row, d), a);
    out[i * out_stride] = _mm512_reduce_add_ps(a);
  }
}

CXLKV_AVX512 void GroupAxpyAvx512(KvDtype dtype, const void* row, const float* w, uint32_t w_stride, uint32_t heads,
                                  uint32_t n, float* acc) {
  for (uint32_t d = 0; d < n; d += 16) {
    const __m512 v = Load16(dtype, row, d);
    for (uint32_t i = 0; i < heads; ++i) {
      float* a = acc + uint64_t{i} * n + d;
      _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(w[i * w_stride]), v, _mm512_loadu_ps(a)));
    }
  }
}

// StoreSums4 (int_sums.h) reduces four heads' accumulators at once. 2n bytes are a multiple of
// 32: whole 64-byte steps, and the last half step masked (DigestChunk, int_sums.h).
// 64 query bytes against 64 digest values: u8×s8 pairs summed exactly in int16 (kernels.h), then
// widened into int32 lanes (AVX-512BW).
__attribute__((target("avx512f,avx512bw"))) inline __m512i DigestMulAdd512(__m512i acc, __m512i q, __m512i v) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(q, v), _mm512_set1_epi16(1)));
}

__attribute__((target("avx512f,avx512bw"))) void DigestDotAvx512(const uint8_t* q, uint32_t heads,
                                                                  const int8_t* rows, uint32_t n, int32_t* out) {
  const uint32_t len = 2 * n;
  uint32_t i = 0;
  for (; i + 4 <= heads; i += 4) {
    const uint8_t* q0 = q + uint64_t{i} * len;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (uint32_t j = 0; j < len; j += 64) {
      const __mmask64 m = DigestChunkMask(len - j);
      const __m512i v = _mm512_maskz_loadu_epi8(m, rows + j);
      a0 = DigestMulAdd512(a0, _mm512_maskz_loadu_epi8(m, q0 + j), v);
      a1 = DigestMulAdd512(a1, _mm512_maskz_loadu_epi8(m, q0 + len + j), v);
      a2 = DigestMulAdd512(a2, _mm512_maskz_loadu_epi8(m, q0 + 2 * len + j), v);
      a3 = DigestMulAdd512(a3, _mm512_maskz_loadu_epi8(m, q0 + 3 * len + j), v);
    }
    StoreSums4(a0, a1, a2, a3, out + i);
  }
  for (; i < heads; ++i) {
    const uint8_t* qi = q + uint64_t{i} * len;
    __m512i a = _mm512_setzero_si512();
    for (uint32_t j = 0; j < len; j += 64) {
      const __mmask64 m = DigestChunkMask(len - j);
      a = DigestMulAdd512(a, _mm512_maskz_loadu_epi8(m, qi + j), _mm512_maskz_loadu_epi8(m, rows + j));
    }
    out[i] = _mm512_reduce_add_epi32(a);
  }
}

// The same sums with vpdpbusd, which multiplies u8 by s8 in groups of four and adds them into
// the int32 accumulator in one instruction (AVX512_VNNI). Integer sums: the same result as above.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void DigestDotAvx512Vnni(const uint8_t* q, uint32_t heads,
                                                                              const int8_t* rows, uint32_t n,
                                                                              int32_t* out) {
  const uint32_t len = 2 * n;
  uint32_t i = 0;
  for (; i + 4 <= heads; i += 4) {
    const uint8_t* q0 = q + uint64_t{i} * len;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (uint32_t j = 0; j < len; j += 64) {
      const __mmask64 m = DigestChunkMask(len - j);
      const __m512i v = _mm512_maskz_loadu_epi8(m, rows + j);
      a0 = _mm512_dpbusd_epi32(a0, _mm512_maskz_loadu_epi8(m, q0 + j), v);
      a1 = _mm512_dpbusd_epi32(a1, _mm512_maskz_loadu_epi8(m, q0 + len + j), v);
      a2 = _mm512_dpbusd_epi32(a2, _mm512_maskz_loadu_epi8(m, q0 + 2 * len + j), v);
      a3 = _mm512_dpbusd_epi32(a3, _mm512_maskz_loadu_epi8(m, q0 + 3 * len + j), v);
    }
    StoreSums4(a0, a1, a2, a3, out + i);
  }
  for (; i < heads; ++i) {
    const uint8_t* qi = q + uint64_t{i} * len;
    __m512i a = _mm512_setzero_si512();
    for (uint32_t j = 0; j < len; j += 64) {
      const __mmask64 m = DigestChunkMask(len - j);
      a = _mm512_dpbusd_epi32(a, _mm512_maskz_loadu_epi8(m, qi + j), _mm512_maskz_loadu_epi8(m, rows + j));
    }
    out[i] = _mm512_reduce_add_epi32(a);
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#undef CXLKV_AVX512

constexpr Kernels kScalar{Isa::kScalar,   "scalar",        ToFloatScalar,   FoldBoundsScalar, BoundsExtentScalar,
                          QuantizeBoundsScalar, DotScalar,
                          AxpyScalar,     DigestDotScalar, nullptr, GroupDotScalar, GroupAxpyScalar,  ExpSumScalar,
                          nullptr};
// The AVX2 table finishes digests with the scalar kernels (a head's 128 dimensions once per
// page, against the fold's once per key row).
constexpr Kernels kAvx2{Isa::kAvx2,   "avx2",        ToFloatAvx2,   FoldBoundsAvx2, BoundsExtentScalar,
                        QuantizeBoundsScalar, DotAvx2,
                        AxpyAvx2,     DigestDotAvx2, nullptr, GroupDotAvx2, GroupAxpyAvx2,  ExpSumAvx2,
                        nullptr};
constexpr Kernels kAvx512{Isa::kAvx512,   "avx512",        ToFloatAvx512,   FoldBoundsAvx512, BoundsExtentAvx512,
                          QuantizeBoundsAvx512, DotAvx512,
                          AxpyAvx512,     DigestDotAvx512, nullptr, GroupDotAvx512, GroupAxpyAvx512,  ExpSumAvx512,
                          AttendPageAvx512};
constexpr Kernels kAvx512Vnni{Isa::kAvx512Vnni, "avx512vnni",        ToFloatAvx512,   FoldBoundsAvx512, BoundsExtentAvx512,
                              QuantizeBoundsAvx512, DotAvx512,
                              AxpyAvx512,       DigestDotAvx512Vnni, DigestDotBlockAvx512Vnni, GroupDotAvx512, GroupAxpyAvx512,  ExpSumAvx512,
                              AttendPageAvx512};

const Kernels& Choose() {
  const Kernels* best = ForIsa(Isa::kAvx512Vnni);
  if (best == nullptr) best = ForIsa(Isa::kAvx512);
  if (best == nullptr) best = ForIsa(Isa::kAvx2);
  if (best == nullptr) best = &kScalar;
  const char* want = std::getenv("CXLKV_PNM_ISA");
  if (want == nullptr || *want == '\0') return *best;
  for (const Kernels* k : {&kScalar, &kAvx2, &kAvx512, &kAvx512Vnni}) {
    if (std::string_view(want) != k->name) continue;
    if (ForIsa(k->isa) != nullptr) return *k;
    std::fprintf(stderr, "cxlkv: CXLKV_PNM_ISA=%s: this CPU lacks it; using %s\n", want, best->name);
    return *best;
  }
  std::fprintf(stderr, "cxlkv: CXLKV_PNM_ISA=%s is not one of scalar, avx2, avx512, avx512vnni; using %s\n", want, best->name);
  return *best;
}

}  // namespace

uint16_t Bf16RoundDown(float x) { return Bf16Directed(x, /*up=*/false); }
uint16_t Bf16RoundUp(float x) { return Bf16Directed(x, /*up=*/true); }

const Kernels* ForIsa(Isa isa) {
  const region::CpuFeatures& cpu = region::Cpu();
  switch (isa) {
    case Isa::kScalar:
      return &kScalar;
    case Isa::kAvx2:
      return cpu.avx2 && cpu.fma && cpu.f16c ? &kAvx2 : nullptr;
    case Isa::kAvx512:
      return cpu.avx512f && cpu.avx512bw && cpu.f16c ? &kAvx512 : nullptr;
    case Isa::kAvx512Vnni:
      return cpu.avx512f && cpu.avx512bw && cpu.avx512vnni && cpu.f16c ? &kAvx512Vnni : nullptr;
  }
  return nullptr;
}

const Kernels& Active() {
  static const Kernels& chosen = Choose();
  return chosen;
}

}  // namespace cxlkv::pnm::internal
