// Synthetic KV contexts for the near-memory attention tests, and the fp64 reference they are
// checked against.
#ifndef CXLKV_TESTS_PNM_PNM_TEST_UTIL_H_
#define CXLKV_TESTS_PNM_PNM_TEST_UTIL_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "pnm/attend.h"
#include "pnm/digest.h"
#include "pnm/geometry.h"
#include "pnm/kernels.h"
#include "pnm/select.h"

namespace cxlkv::pnm::testing {

// float -> fp16 by truncation; below fp16's normal range it flushes to zero (test data only).
inline uint16_t FloatToHalf(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const int exp = static_cast<int>((b >> 23) & 0xff) - 127 + 15;
  if (exp <= 0) return static_cast<uint16_t>(sign);
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7bffu);  // the largest finite
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exp) << 10) | ((b >> 13) & 0x3ffu));
}

// A geometry in one line: query heads, KV heads, head size, page size, dtype.
inline Geometry MakeGeometry(uint32_t num_heads, uint32_t num_kv_heads, uint32_t head_dim, uint32_t page_tokens = 16,
                             KvDtype dtype = KvDtype::kFp16) {
  Geometry g;
  g.num_heads = num_heads;
  g.num_kv_heads = num_kv_heads;
  g.head_dim = head_dim;
  g.page_tokens = page_tokens;
  g.dtype = dtype;
  return g;
}

// A context's KV in pool block format 1 or 2 (g.head_major): per page a K slab then a V slab.
class TestContext {
 public:
  TestContext(const Geometry& g, uint64_t tokens) : g_(g), tokens_(tokens) {
    const uint64_t pages = g.PagesFor(tokens);
    bytes_.assign(pages * 2 * g.SlabBytes(), 0);
    for (uint64_t p = 0; p < pages; ++p) {
      uint8_t* base = bytes_.data() + p * 2 * g.SlabBytes();
      pages_.push_back({base, base + g.SlabBytes()});
    }
  }
  const Geometry& geometry() const { return g_; }
  uint64_t tokens() const { return tokens_; }
  ContextView View() const { return {pages_, tokens_}; }

  void SetKey(uint64_t t, uint32_t h, uint32_t d, float x) { Store(Slot(t, h, d, 0), x); }
  void SetValue(uint64_t t, uint32_t h, uint32_t d, float x) { Store(Slot(t, h, d, 1), x); }
  // What the kernels read back (the stored value, exactly).
  float Key(uint64_t t, uint32_t h, uint32_t d) const { return Load(Slot(t, h, d, 0)); }
  float Value(uint64_t t, uint32_t h, uint32_t d) const { return Load(Slot(t, h, d, 1)); }

  // Every K and V element from N(0, sigma).
  void FillNormal(std::mt19937_64& rng, float sigma = 1.0f) {
    std::normal_distribution<float> n(0.0f, sigma);
    for (uint64_t t = 0; t < tokens_; ++t) {
      for (uint32_t h = 0; h < g_.num_kv_heads; ++h) {
        for (uint32_t d = 0; d < g_.head_dim; ++d) {
          SetKey(t, h, d, n(rng));
          SetValue(t, h, d, n(rng));
        }
      }
    }
  }

  std::vector<uint8_t> Digests() const {
    std::vector<uint8_t> out(pages_.size() * DigestBytesPerPage(g_));
    if (!BuildDigests(g_, View(), out).ok()) out.clear();
    return out;
  }

 private:
  uint8_t* Slot(uint64_t t, uint32_t h, uint32_t d, int part) const {
    const uint64_t page = t / g_.page_tokens, row = t % g_.page_tokens;
    auto* base = static_cast<const uint8_t*>(part == 0 ? pages_[page].k : pages_[page].v);
    // Written out here, not through Geometry's strides, so the tests check those too.
    const uint64_t element = g_.head_major ? (uint64_t{h} * g_.page_tokens + row) * g_.head_dim + d
                                           : (row * g_.num_kv_heads + h) * g_.head_dim + d;
    return const_cast<uint8_t*>(base) + element * g_.elem_bytes();
  }
  void Store(uint8_t* p, float x) {
    if (g_.dtype == KvDtype::kFp32) {
      std::memcpy(p, &x, 4);
      return;
    }
    uint16_t v;
    if (g_.dtype == KvDtype::kFp16) {
      v = FloatToHalf(x);
    } else {
      uint32_t b;
      std::memcpy(&b, &x, 4);
      v = static_cast<uint16_t>(b >> 16);
    }
    std::memcpy(p, &v, 2);
  }
  float Load(const uint8_t* p) const {
    if (g_.dtype == KvDtype::kFp32) {
      float x;
      std::memcpy(&x, p, 4);
      return x;
    }
    uint16_t v;
    std::memcpy(&v, p, 2);
    return g_.dtype == KvDtype::kFp16 ? internal::HalfToFloat(v) : internal::Bf16ToFloat(v);
  }

  Geometry g_;
  uint64_t tokens_;
  std::vector<uint8_t> bytes_;
  std::vector<PageKv> pages_;
};

// Dense attention in fp64 over the tokens of `token_set` (every token when empty): per query
// head, the output and the log-sum-exp of the logits.
struct DenseResult {
  std::vector<double> out;  // [num_heads][head_dim]
  std::vector<double> lse;  // [num_heads]
  std::vector<std::vector<double>> probs;  // [num_heads][tokens]: the softmax over every token
};

// With `with_outputs` false, out stays empty and the values are not read (recall only).
inline DenseResult DenseFp64(const TestContext& c, const std::vector<float>& q, double scale,
                             bool with_outputs = true) {
  const Geometry& g = c.geometry();
  DenseResult r;
  if (with_outputs) r.out.assign(uint64_t{g.num_heads} * g.head_dim, 0.0);
  r.lse.assign(g.num_heads, 0.0);
  r.probs.resize(g.num_heads);
  for (uint32_t head = 0; head < g.num_heads; ++head) {
    const uint32_t h = head / g.group();
    std::vector<double> logits(c.tokens());
    double m = -INFINITY;
    for (uint64_t t = 0; t < c.tokens(); ++t) {
      double s = 0;
      for (uint32_t d = 0; d < g.head_dim; ++d) s += double{q[uint64_t{head} * g.head_dim + d]} * c.Key(t, h, d);
      logits[t] = s * scale;
      m = std::max(m, logits[t]);
    }
    double sum = 0;
    for (double& l : logits) sum += (l = std::exp(l - m));
    for (uint64_t t = 0; t < c.tokens(); ++t) {
      const double p = logits[t] / sum;
      if (with_outputs) {
        for (uint32_t d = 0; d < g.head_dim; ++d) r.out[uint64_t{head} * g.head_dim + d] += p * c.Value(t, h, d);
      }
      logits[t] = p;
    }
    r.lse[head] = m + std::log(sum);
    r.probs[head] = std::move(logits);
  }
  return r;
}

inline std::vector<float> RandomQuery(const Geometry& g, std::mt19937_64& rng, float sigma = 1.0f) {
  std::normal_distribution<float> n(0.0f, sigma);
  std::vector<float> q(uint64_t{g.num_heads} * g.head_dim);
  for (float& x : q) x = n(rng);
  return q;
}

}  // namespace cxlkv::pnm::testing

#endif  // CXLKV_TESTS_PNM_PNM_TEST_UTIL_H_
