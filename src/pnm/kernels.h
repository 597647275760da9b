// Internal to pnm: the vector kernels the near-memory attention is built from, one table per
// instruction set (AVX-512, AVX2 + F16C + FMA, scalar), chosen once at run time from the CPU's
// features (region::Cpu()). CXLKV_PNM_ISA=scalar|avx2|avx512|avx512vnni forces a lower one (tests compare
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

// kAvx512Vnni is kAvx512's table with the digests' integer dot product on AVX512_VNNI's fused
// multiply-add-accumulate (vpdpbusd): one instruction where AVX-512BW needs three.
enum class Isa : uint8_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3 };

// One page of one KV head, as attend_page reads it: the head's K and V rows of `tokens` tokens,
// `row_bytes` apart (a token's row across all KV heads), and the rows of the page that will be
// attended next for the same head (null: none), asked for ahead of use.
struct PageHead {
  const void* k = nullptr;
  const void* v = nullptr;
  uint64_t row_bytes = 0;
  uint32_t tokens = 0;
  const void* next_k = nullptr;
  const void* next_v = nullptr;
};

// The largest query magnitude digest_dot takes: one byte. A query's 2n values pair up as
// (q⁺_d, q⁻_d), one of them 0, so a pair's products sum to at most 255·127 — inside int16, which
// AVX2's and AVX-512BW's u8×s8 pair multiply (vpmaddubsw) saturates to — and 1024 dimensions
// stay far below 2^31. Finer than the digests' own int8 bounds; the needle and attention-mass
// tests select as they did with a 14-bit query.
inline constexpr int32_t kDigestQueryMax = 255;

struct Kernels {
  Isa isa;
  const char* name;
  // dst[i] = float(src[i]) for n elements of dtype (fp16, bf16 or fp32). REQUIRES: n % 16 == 0.
  void (*to_float)(KvDtype dtype, const void* src, float* dst, uint32_t n);
  // Folds one row of keys into a digest's running bounds, per element: lo = row < lo ? row : lo,
  // hi = row > hi ? row : hi (a NaN row element leaves both), probe += row·0 (NaN exactly when
  // the element is NaN or ±inf). Every table gives the same bits. REQUIRES: n % 16 == 0.
  void (*fold_bounds)(const float* row, uint32_t n, float* lo, float* hi, float* probe);
  // The folded bounds of one KV head: returns whether every probe is 0 (no NaN or ±inf key),
  // and sets *max_abs to the largest |lo[d]| or |hi[d]| (exact). REQUIRES: n % 16 == 0.
  bool (*bounds_extent)(const float* lo, const float* hi, const float* probe, uint32_t n, float* max_abs);
  // A digest head's values (digest.h) from its bounds: values[2d] = ceil(hi[d]·inv_scale) and
  // values[2d + 1] = ceil(−lo[d]·inv_scale), products in double (exact for a power-of-two scale);
  // with `merge`, each the larger of it and the value already stored. Every table gives the
  // same bits. REQUIRES: n % 16 == 0, every |bound·inv_scale| <= 127.
  void (*quantize_bounds)(const float* lo, const float* hi, uint32_t n, double inv_scale, bool merge, int8_t* values);
  // Σ a[i] * b[i]. REQUIRES: n % 16 == 0.
  float (*dot)(const float* a, const float* b, uint32_t n);
  // y[i] += a * x[i]. REQUIRES: n % 16 == 0.
  void (*axpy)(float a, const float* x, float* y, uint32_t n);
  // A digest's integer score (digest.h): out[i] = Σ_{j < 2n} q[i·2n + j]·rows[j], for `heads`
  // consecutive query vectors of 2n uint8 (q[2d]·q[2d + 1] == 0: a dimension is positive or
  // negative) against one KV head's 2n int8 digest values (|v| <= 127). Exact in int32 for
  // n <= 1024, so every table gives the same result. REQUIRES: n % 16 == 0.
  void (*digest_dot)(const uint8_t* q, uint32_t heads, const int8_t* rows, uint32_t n, int32_t* out);
  // digest_dot over `pages` digests at rows + p·stride: out[p·heads + i], the same sums, with
  // the query held in registers across the pages (two heads at a time): loading it again for
  // every page held digest_dot to the load ports. Returns false, having written nothing, for a
  // head size it does not hold (it holds 32, 64 and 128). Null where the table has none. Either
  // way SelectPages then calls digest_dot page by page.
  bool (*digest_dot_block)(const uint8_t* q, uint32_t heads, const int8_t* rows, uint64_t stride, uint32_t pages,
                           uint32_t n, int32_t* out);

  // The group kernels: one row of KV (dtype) read and widened once for the `heads` query heads
  // of a GQA group, whose vectors are consecutive (q[i·n .. i·n + n)). REQUIRES: n % 16 == 0.
  // out[i·out_stride] = Σ_d q[i·n + d]·row[d].
  void (*group_dot)(KvDtype dtype, const void* row, const float* q, uint32_t heads, uint32_t n, float* out,
                    uint32_t out_stride);
  // acc[i·n + d] += w[i·w_stride]·row[d].
  void (*group_axpy)(KvDtype dtype, const void* row, const float* w, uint32_t w_stride, uint32_t heads, uint32_t n,
                     float* acc);
  // x[i] = e^(x[i] − shift) for any n; returns Σ of the results. For −87 <= x − shift <= 0
  // (what the online softmax passes) the relative error is below 4e-7; below −87 the result is
  // below 2e-38, negligible next to the e^0 that every such sum holds. NaN in, NaN out.
  float (*exp_sum)(float* x, uint32_t n, float shift);
  // The online softmax over one page for the `heads` query heads of a KV head (q consecutive as
  // in group_dot): logits (scaled), a new running max[i] per head, sum[i] and acc[i·n ..] rescaled
  // to it, then sum[i] += Σ_t e^(logit − max) and acc += the page's values weighted by them.
  // `logits` is scratch of heads × stride floats (stride >= tokens, a multiple of 16). Null
  // where the table has none: Attend then uses group_dot, exp_sum and group_axpy per token.
  void (*attend_page)(KvDtype dtype, const PageHead& page, const float* q, uint32_t heads, uint32_t n, float scale,
                      float* logits, uint32_t stride, float* max, float* sum, float* acc);
};

// The digest-building kernels of the tables (digest_kernels.cc). The AVX2 and AVX-512 ones
// REQUIRE ForIsa(kAvx2) and ForIsa(kAvx512).
void FoldBoundsScalar(const float* row, uint32_t n, float* lo, float* hi, float* probe);
void FoldBoundsAvx2(const float* row, uint32_t n, float* lo, float* hi, float* probe);
void FoldBoundsAvx512(const float* row, uint32_t n, float* lo, float* hi, float* probe);
bool BoundsExtentScalar(const float* lo, const float* hi, const float* probe, uint32_t n, float* max_abs);
bool BoundsExtentAvx512(const float* lo, const float* hi, const float* probe, uint32_t n, float* max_abs);
void QuantizeBoundsScalar(const float* lo, const float* hi, uint32_t n, double inv_scale, bool merge, int8_t* values);
void QuantizeBoundsAvx512(const float* lo, const float* hi, uint32_t n, double inv_scale, bool merge, int8_t* values);
// The VNNI table's digest_dot_block (digest_kernels.cc). REQUIRES: ForIsa(kAvx512Vnni).
bool DigestDotBlockAvx512Vnni(const uint8_t* q, uint32_t heads, const int8_t* rows, uint64_t stride, uint32_t pages,
                              uint32_t n, int32_t* out);

// The AVX-512 table's exp_sum and attend_page (in attend_kernels.cc). REQUIRES: ForIsa(kAvx512).
float ExpSumAvx512(float* x, uint32_t n, float shift);
void AttendPageAvx512(KvDtype dtype, const PageHead& page, const float* q, uint32_t heads, uint32_t n, float scale,
                      float* logits, uint32_t stride, float* max, float* sum, float* acc);

// e^r on |r| <= ln2/2 by its Taylor polynomial to degree 6 (truncation below 1.3e-7 relative);
// with x = k·ln2 + r, e^x = 2^k·e^r. ln2 is split in two so k·ln2 is exact enough.
inline constexpr float kLog2e = 1.44269504088896341f;
inline constexpr float kLn2Hi = 0.693359375f;
inline constexpr float kLn2Lo = -2.12194440e-4f;
inline constexpr float kExpLow = -87.0f;  // 2^k stays a normal float
inline constexpr float kExpHigh = 88.0f;

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
