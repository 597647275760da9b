// Internal to pnm: the vector kernels the near-memory attention is built from, one table per
// instruction set (AVX-512, AVX2 + F16C + FMA, scalar), chosen once at run time from the CPU's
// features (region::Cpu()). CXLKV_PNM_ISA=scalar|avx2|avx512 forces a lower one (tests compare
// them; a higher one than the CPU has is refused with a warning and the best one is used).
//
// Every kernel sums in a fixed order that depends only on n (never on alignment or the ISA's
// lane count beyond its own table), so one table gives bit-identical results run to run. Tables
// differ from each other only by fp32 rounding.
#ifndef CXLKV_SRC_PNM_KERNELS_H_
#define CXLKV_SRC_PNM_KERNELS_H_

#include <cstdint>

#include "cxlkv/cache.h"

namespace cxlkv::pnm::internal {

enum class Isa : uint8_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

struct Kernels {
  Isa isa;
  const char* name;
  // dst[i] = float(src[i]) for n elements of dtype (fp16, bf16 or fp32). REQUIRES: n % 16 == 0.
  void (*to_float)(KvDtype dtype, const void* src, float* dst, uint32_t n);
  // Σ a[i] * b[i]. REQUIRES: n % 16 == 0.
  float (*dot)(const float* a, const float* b, uint32_t n);
  // y[i] += a * x[i]. REQUIRES: n % 16 == 0.
  void (*axpy)(float a, const float* x, float* y, uint32_t n);
  // The page score Σ_d max(q_d·lo_d, q_d·hi_d) over bf16 digest bounds; *magnitude gets
  // Σ_d |max(q_d·lo_d, q_d·hi_d)|, from which the caller bounds the sum's rounding error.
  // REQUIRES: n % 16 == 0.
  float (*digest_score)(const float* q, const uint16_t* lo, const uint16_t* hi, uint32_t n, float* magnitude);

  // The group kernels: one row of KV (dtype) read and widened once for the `heads` query heads
  // of a GQA group, whose vectors are consecutive (q[i·n .. i·n + n)). REQUIRES: n % 16 == 0.
  // out[i·out_stride] = Σ_d q[i·n + d]·row[d].
  void (*group_dot)(KvDtype dtype, const void* row, const float* q, uint32_t heads, uint32_t n, float* out,
                    uint32_t out_stride);
  // acc[i·n + d] += w[i·w_stride]·row[d].
  void (*group_axpy)(KvDtype dtype, const void* row, const float* w, uint32_t w_stride, uint32_t heads, uint32_t n,
                     float* acc);
  // digest_score for `heads` consecutive query heads against one digest, each bound widened
  // once: score[i], magnitude[i] equal digest_score(q + i·n, ...) bit for bit.
  void (*group_digest_score)(const float* q, uint32_t heads, const uint16_t* lo, const uint16_t* hi, uint32_t n,
                             float* score, float* magnitude);
  // x[i] = e^(x[i] − shift) for any n; returns Σ of the results. For −87 <= x − shift <= 0
  // (what the online softmax passes) the relative error is below 4e-7; below −87 the result is
  // below 2e-38, negligible next to the e^0 that every such sum holds. NaN in, NaN out.
  float (*exp_sum)(float* x, uint32_t n, float shift);
};

// The table in use: the best the CPU supports, or the one CXLKV_PNM_ISA names.
const Kernels& Active();
// The table of one ISA, or nullptr when this CPU cannot run it.
const Kernels* ForIsa(Isa isa);

// Conversions (exact where the target holds the value).
float HalfToFloat(uint16_t h);
inline float Bf16ToFloat(uint16_t b) {
  uint32_t bits = uint32_t{b} << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}
// fp32 -> bf16 rounded toward -inf (down) or +inf (up): the result is <= (>=) x. NaN stays NaN.
uint16_t Bf16RoundDown(float x);
uint16_t Bf16RoundUp(float x);

}  // namespace cxlkv::pnm::internal

#endif  // CXLKV_SRC_PNM_KERNELS_H_
