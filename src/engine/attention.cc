#include "engine/attention.h"

#include <algorithm>
#include <bit>
#include <cstddef>
#include <limits>

namespace cxlkv::engine::internal {
namespace {

// Keys per tile: scores are computed 16 keys at a time, vectorized across keys.
constexpr uint32_t kTile = 16;
// Query heads (of one row, sharing a KV head) scored together against one key tile, and
// combined together with one V row: register blocking that halves the loads per FMA.
constexpr uint32_t kScoreHeads = 2;
constexpr uint32_t kValueHeads = 4;
// Dims of V accumulated per pass, in registers.
constexpr uint32_t kValueDims = 8;

// exp(x) for x <= 0; x below -87 counts as -87. Branch-free, so a loop over it vectorizes:
// x = n ln2 + r with |r| <= ln2/2, exp(r) by its degree-6 Taylor polynomial, 2^n by building
// the exponent bits. Relative error below 3e-7.
inline float ExpNonPositive(float x) {
  // The clamp as an unsigned min on the bits (a float compare would leave a branch under
  // -ftrapping-math): for x <= 0 a larger magnitude has larger bits.
  constexpr uint32_t kMinusLimit = std::bit_cast<uint32_t>(-87.0f);
  const uint32_t xb = std::bit_cast<uint32_t>(x);
  x = std::bit_cast<float>(xb > kMinusLimit ? kMinusLimit : xb);
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds
  const float n = (x * kLog2e + kRound) - kRound;
  constexpr float kLn2Hi = 0.693359375f;  // 9 significant bits: n * kLn2Hi is exact
  constexpr float kLn2Lo = -2.12194440e-4f;
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const uint32_t e = static_cast<uint32_t>(static_cast<int32_t>(n) + 127);  // in [1, 127]
  return p * std::bit_cast<float>(e << 23);
}

// For Q query heads: out[q][j] = q[q] . kt[:, j] over the kTile keys of a transposed tile
// kt[head_dim][kTile]. Each sum runs over d in order.
template <uint32_t Q>
inline void ScoreTile(const float* const* q, const float* __restrict kt, uint32_t hd,
                      float* const* out) {
  float acc[Q][kTile] = {};
  for (uint32_t d = 0; d < hd; ++d) {
    const float* __restrict k = kt + d * kTile;
#pragma GCC unroll 4
    for (uint32_t i = 0; i < Q; ++i) {
      const float qd = q[i][d];
#pragma GCC unroll 16
      for (uint32_t j = 0; j < kTile; ++j) acc[i][j] += qd * k[j];
    }
  }
  for (uint32_t i = 0; i < Q; ++i) std::copy(acc[i], acc[i] + kTile, out[i]);
}

// Replaces s[0, n) by exp(s - max s) and returns their sum. The order of every reduction is
// fixed by the absolute key index (lanes of kTile, then the tail).
inline float ExpRow(float* __restrict s, uint32_t n) {
  const uint32_t full = n / kTile * kTile;
  float mx[kTile];
  std::fill(mx, mx + kTile, -std::numeric_limits<float>::max());
  for (uint32_t b = 0; b < full; b += kTile) {
    const float* __restrict t = s + b;
    for (uint32_t j = 0; j < kTile; ++j) mx[j] = t[j] > mx[j] ? t[j] : mx[j];
  }
  float m = -std::numeric_limits<float>::max();
  for (uint32_t j = 0; j < kTile; ++j) m = mx[j] > m ? mx[j] : m;
  for (uint32_t p = full; p < n; ++p) m = s[p] > m ? s[p] : m;

  float lane[kTile] = {};
  for (uint32_t b = 0; b < full; b += kTile) {
    float* __restrict t = s + b;
    for (uint32_t j = 0; j < kTile; ++j) {
      const float e = ExpNonPositive(t[j] - m);
      t[j] = e;
      lane[j] += e;
    }
  }
  float sum = 0.0f;
  for (uint32_t j = 0; j < kTile; ++j) sum += lane[j];
  for (uint32_t p = full; p < n; ++p) {
    s[p] = ExpNonPositive(s[p] - m);
    sum += s[p];
  }
  return sum;
}

// For Q query heads with softmax numerators w[i][0, n) and inverse sums inv[i]:
// out[i * hd + d] = inv[i] * sum_p w[i][p] * v_p[d] for d in [0, kValueDims), where
// v_p = v + voff[p]. Each sum runs over p in order.
template <uint32_t Q>
inline void ValueBlock(const float* const* w, const float* inv, uint32_t n, const float* v,
                       const uint64_t* voff, uint32_t hd, float* out) {
  float acc[Q][kValueDims] = {};
  for (uint32_t p = 0; p < n; ++p) {
    const float* __restrict vp = v + voff[p];
#pragma GCC unroll 4
    for (uint32_t i = 0; i < Q; ++i) {
      const float wp = w[i][p];
#pragma GCC unroll 8
      for (uint32_t d = 0; d < kValueDims; ++d) acc[i][d] += wp * vp[d];
    }
  }
  for (uint32_t i = 0; i < Q; ++i) {
    for (uint32_t d = 0; d < kValueDims; ++d) out[uint64_t{i} * hd + d] = acc[i][d] * inv[i];
  }
}

// ValueBlock over all head_dim dims of Q heads: blocks of kValueDims, then the tail one dim
// at a time (same order of summation).
template <uint32_t Q>
inline void ValueHeads(const float* const* w, const float* inv, uint32_t n, const float* v,
                       const uint64_t* voff, uint32_t hd, float* out) {
  const uint32_t blocked = hd / kValueDims * kValueDims;
  for (uint32_t d = 0; d < blocked; d += kValueDims) {
    ValueBlock<Q>(w, inv, n, v + d, voff, hd, out + d);
  }
  for (uint32_t i = 0; i < Q; ++i) {
    for (uint32_t d = blocked; d < hd; ++d) {
      float acc = 0.0f;
      for (uint32_t p = 0; p < n; ++p) acc += w[i][p] * v[voff[p] + d];
      out[uint64_t{i} * hd + d] = acc * inv[i];
    }
  }
}

}  // namespace

float ExpNonPositiveForTest(float x) { return ExpNonPositive(x); }

void Attend(const AttentionShape& s, const float* q, uint64_t q_stride, uint32_t pos0,
            uint32_t row_begin, uint32_t row_end, const KvView& kv, float* out,
            AttentionScratch& scratch) {
  if (row_begin >= row_end) return;
  const uint32_t hd = s.head_dim;
  const uint32_t group = s.num_heads / s.num_kv_heads;
  const uint64_t out_stride = uint64_t{s.num_heads} * hd;
  const uint32_t nkeys = pos0 + row_end;
  const uint32_t ntiles = (nkeys + kTile - 1) / kTile;
  const uint64_t sstride = uint64_t{ntiles} * kTile;
  const uint32_t nq = (row_end - row_begin) * group;  // queries sharing one KV head
  scratch.scores.resize(nq * sstride);
  scratch.key_tile.resize(uint64_t{hd} * kTile);
  scratch.inv_sum.resize(nq);
  scratch.offsets.resize(nkeys);
  for (uint32_t p = 0; p < nkeys; ++p) scratch.offsets[p] = kv.RowOffset(p);
  float* kt = scratch.key_tile.data();

  // Query i of row r (head g * group + i).
  auto query = [&](uint32_t r, uint32_t g, uint32_t i) {
    return q + r * q_stride + uint64_t{g * group + i} * hd;
  };
  auto scores = [&](uint32_t r, uint32_t i) {
    return scratch.scores.data() + (uint64_t{r - row_begin} * group + i) * sstride;
  };

  for (uint32_t g = 0; g < s.num_kv_heads; ++g) {
    // 1. Scores, one tile of keys at a time, the tile transposed so the dot products of kTile
    // keys vectorize across keys. A row scores the tiles up to its own position.
    for (uint32_t t = 0; t < ntiles; ++t) {
      const uint32_t p0 = t * kTile;
      const uint32_t valid = std::min(kTile, nkeys - p0);
      for (uint32_t j = 0; j < valid; ++j) {
        const float* k = kv.k_base + scratch.offsets[p0 + j] + g * hd;
        for (uint32_t d = 0; d < hd; ++d) kt[d * kTile + j] = k[d];
      }
      for (uint32_t j = valid; j < kTile; ++j) {
        for (uint32_t d = 0; d < hd; ++d) kt[d * kTile + j] = 0.0f;
      }
      for (uint32_t r = std::max(row_begin, p0 > pos0 ? p0 - pos0 : 0); r < row_end; ++r) {
        uint32_t i = 0;
        for (; i + kScoreHeads <= group; i += kScoreHeads) {
          const float* qs[kScoreHeads];
          float* os[kScoreHeads];
          for (uint32_t k = 0; k < kScoreHeads; ++k) {
            qs[k] = query(r, g, i + k);
            os[k] = scores(r, i + k) + p0;
          }
          ScoreTile<kScoreHeads>(qs, kt, hd, os);
        }
        for (; i < group; ++i) {
          const float* qs[1] = {query(r, g, i)};
          float* os[1] = {scores(r, i) + p0};
          ScoreTile<1>(qs, kt, hd, os);
        }
      }
    }
    // 2. Softmax numerators and their sums.
    for (uint32_t r = row_begin; r < row_end; ++r) {
      for (uint32_t i = 0; i < group; ++i) {
        scratch.inv_sum[uint64_t{r - row_begin} * group + i] =
            1.0f / ExpRow(scores(r, i), pos0 + r + 1);
      }
    }
    // 3. Weighted sums of V, keys in ascending position order.
    const float* v = kv.v_base + g * hd;
    for (uint32_t r = row_begin; r < row_end; ++r) {
      const uint32_t n = pos0 + r + 1;
      const float* inv = &scratch.inv_sum[uint64_t{r - row_begin} * group];
      float* o = out + r * out_stride + uint64_t{g * group} * hd;
      uint32_t i = 0;
      for (; i + kValueHeads <= group; i += kValueHeads) {
        const float* ws[kValueHeads];
        for (uint32_t k = 0; k < kValueHeads; ++k) ws[k] = scores(r, i + k);
        ValueHeads<kValueHeads>(ws, inv + i, n, v, scratch.offsets.data(), hd,
                                o + uint64_t{i} * hd);
      }
      for (; i < group; ++i) {
        const float* ws[1] = {scores(r, i)};
        ValueHeads<1>(ws, inv + i, n, v, scratch.offsets.data(), hd, o + uint64_t{i} * hd);
      }
    }
  }
}

}  // namespace cxlkv::engine::internal
