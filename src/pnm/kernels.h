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
