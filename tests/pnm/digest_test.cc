// The near-memory attention's kernels and page digests: every ISA's kernels agree (the digests'
// integer scores and bounds exactly), bf16 conversions round outward, a digest grown row by row equals one
// built at once (exponent shifts included), and every page score is an upper bound on the page's
// true largest q·k, for adversarial queries too.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "pnm_test_util.h"

namespace cxlkv::pnm {
namespace {

using internal::Isa;
using internal::Kernels;
using testing::TestContext;

std::vector<const Kernels*> AvailableKernels() {
  std::vector<const Kernels*> out;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Vnni}) {
    if (const Kernels* k = internal::ForIsa(isa)) out.push_back(k);
  }
  return out;
}

TEST(PnmKernels, EveryIsaConvertsEveryFp16AndBf16ValueExactly) {
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> got(all.size());
  for (const Kernels* k : AvailableKernels()) {
    SCOPED_TRACE(k->name);
    k->to_float(KvDtype::kFp16, all.data(), got.data(), static_cast<uint32_t>(all.size()));
    for (uint32_t i = 0; i < all.size(); ++i) {
      const float want = internal::HalfToFloat(all[i]);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(got[i])) << i;
      } else {
        ASSERT_EQ(got[i], want) << "fp16 bits " << i;
      }
    }
    k->to_float(KvDtype::kBf16, all.data(), got.data(), static_cast<uint32_t>(all.size()));
    for (uint32_t i = 0; i < all.size(); ++i) {
      const float want = internal::Bf16ToFloat(all[i]);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(got[i])) << i;
      } else {
        ASSERT_EQ(got[i], want) << "bf16 bits " << i;
      }
    }
  }
  // A few known fp16 values: 1, -2, the smallest subnormal, the largest finite, infinity.
  EXPECT_EQ(internal::HalfToFloat(0x3c00), 1.0f);
  EXPECT_EQ(internal::HalfToFloat(0xc000), -2.0f);
  EXPECT_EQ(internal::HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(internal::HalfToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(internal::HalfToFloat(0x7c00), std::numeric_limits<float>::infinity());
}

TEST(PnmKernels, EveryIsaAgreesOnDotAndAxpy) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> n(0.0f, 3.0f);
  for (uint32_t dim : {16u, 32u, 48u, 64u, 128u, 256u}) {
    std::vector<float> a(dim), b(dim), y0(dim);
    for (uint32_t i = 0; i < dim; ++i) {
      a[i] = n(rng);
      b[i] = n(rng);
      y0[i] = n(rng);
    }
    double dot = 0;
    for (uint32_t i = 0; i < dim; ++i) dot += double{a[i]} * b[i];
    for (const Kernels* k : AvailableKernels()) {
      SCOPED_TRACE(std::string(k->name) + " dim " + std::to_string(dim));
      EXPECT_NEAR(k->dot(a.data(), b.data(), dim), dot, 1e-4 * (1 + std::fabs(dot)) * dim);
      std::vector<float> y = y0;
      k->axpy(0.5f, a.data(), y.data(), dim);
      for (uint32_t i = 0; i < dim; ++i) EXPECT_FLOAT_EQ(y[i], y0[i] + 0.5f * a[i]);
    }
  }
}

// The digests' integer score is exact on every ISA: random values, every head count (4 at a
// time and the rest), and the extremes at the largest head_dim (no int32 overflow).
TEST(PnmKernels, EveryIsaComputesTheDigestDotExactly) {
  std::mt19937_64 rng(17);
  std::uniform_int_distribution<int> value(-127, 127), query(0, internal::kDigestQueryMax);
  auto reference = [](const std::vector<uint8_t>& q, uint32_t head, const std::vector<int8_t>& v) {
    int64_t sum = 0;
    for (size_t j = 0; j < v.size(); ++j) sum += int64_t{q[head * v.size() + j]} * v[j];
    return sum;
  };
  for (uint32_t dim : {16u, 48u, 64u, 128u, 256u, 1024u}) {
    for (uint32_t heads : {1u, 3u, 4u, 6u}) {
      std::vector<int8_t> v(2 * dim);
      std::vector<uint8_t> q(uint64_t{heads} * 2 * dim);
      for (auto& x : v) x = static_cast<int8_t>(value(rng));
      for (uint32_t j = 0; j < q.size(); j += 2) {  // one of each pair is 0, as QuantizeQuery makes them
        const uint8_t m = static_cast<uint8_t>(query(rng));
        q[j] = rng() & 1 ? m : 0;
        q[j + 1] = q[j] == 0 ? m : 0;
      }
      std::vector<int8_t> worst(2 * dim);  // every product at its largest: 1024 × 255 × 127
      std::vector<uint8_t> worst_q(uint64_t{heads} * 2 * dim);
      for (uint32_t j = 0; j < worst.size(); ++j) worst[j] = j % 2 == 0 ? 127 : -127;
      for (uint32_t j = 0; j < worst_q.size(); j += 2) worst_q[j] = internal::kDigestQueryMax;
      for (const Kernels* k : AvailableKernels()) {
        SCOPED_TRACE(std::string(k->name) + " dim " + std::to_string(dim) + " heads " + std::to_string(heads));
        std::vector<int32_t> out(heads, -1);
        k->digest_dot(q.data(), heads, v.data(), dim, out.data());
        for (uint32_t i = 0; i < heads; ++i) ASSERT_EQ(out[i], reference(q, i, v)) << "head " << i;
        k->digest_dot(worst_q.data(), heads, worst.data(), dim, out.data());
        for (uint32_t i = 0; i < heads; ++i) ASSERT_EQ(out[i], int64_t{dim} * internal::kDigestQueryMax * 127);
        // ... and at its most negative (every negative part at 255 against −127): no saturation
        // of the pair sums, no wrap.
        std::vector<uint8_t> low_q(worst_q.size());
        for (uint32_t j = 0; j < low_q.size(); j += 2) low_q[j + 1] = internal::kDigestQueryMax;
        k->digest_dot(low_q.data(), heads, worst.data(), dim, out.data());
        for (uint32_t i = 0; i < heads; ++i) ASSERT_EQ(out[i], -int64_t{dim} * internal::kDigestQueryMax * 127);
      }
    }
  }
}

// digest_dot_block, where a table has it, gives every page's sums exactly as digest_dot for the
// head sizes it holds in registers and declines the others: odd head counts, odd page counts,
// rows at a stride, the largest products.
TEST(PnmKernels, TheBlockDigestDotEqualsThePageByPageOne) {
  std::mt19937_64 rng(23);
  std::uniform_int_distribution<int> value(-127, 127), query(0, internal::kDigestQueryMax);
  for (uint32_t dim : {16u, 32u, 48u, 64u, 128u, 256u}) {
    for (uint32_t heads : {1u, 2u, 3u, 4u, 8u}) {
      for (uint32_t pages : {1u, 2u, 5u, 16u}) {
        const uint64_t stride = 2 * dim + 16 * (rng() % 4);
        std::vector<int8_t> rows(pages * stride);
        for (auto& x : rows) x = static_cast<int8_t>(value(rng));
        std::vector<uint8_t> q(uint64_t{heads} * 2 * dim);
        for (uint32_t j = 0; j < q.size(); j += 2) {
          const uint8_t m = static_cast<uint8_t>(query(rng));
          q[j] = rng() & 1 ? m : 0;
          q[j + 1] = q[j] == 0 ? m : 0;
        }
        if (pages == 16) {  // the largest sums: every product at 255 × 127
          for (uint64_t j = 0; j < rows.size(); ++j) rows[j] = j % 2 == 0 ? 127 : -127;
          for (uint32_t j = 0; j < q.size(); j += 2) q[j] = internal::kDigestQueryMax, q[j + 1] = 0;
        }
        for (const Kernels* k : AvailableKernels()) {
          if (k->digest_dot_block == nullptr) continue;
          SCOPED_TRACE(std::string(k->name) + " dim " + std::to_string(dim) + " heads " + std::to_string(heads) +
                       " pages " + std::to_string(pages));
          std::vector<int32_t> got(uint64_t{pages} * heads, -1), want(uint64_t{pages} * heads, -2);
          const bool held = dim == 32 || dim == 64 || dim == 128;  // the sizes it keeps in registers
          ASSERT_EQ(k->digest_dot_block(q.data(), heads, rows.data(), stride, pages, dim, got.data()), held);
          if (!held) continue;
          for (uint32_t p = 0; p < pages; ++p) k->digest_dot(q.data(), heads, rows.data() + p * stride, dim, want.data() + p * heads);
          ASSERT_EQ(got, want);
        }
      }
    }
  }
}

// Building a digest's bounds: the fold of key rows (signed zeros, subnormals, NaN and ±inf
// included), the head's extent, and the int8 values (fresh and merged into stored ones) are
// the same bits in every ISA, and the values are ceil(bound · 2^-e) exactly.
TEST(PnmKernels, EveryIsaBuildsDigestBoundsAlike) {
  std::mt19937_64 rng(29);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  auto pick = [&](bool with_nonfinite) {
    switch (rng() % 16) {
      case 0: return 0.0f;
      case 1: return -0.0f;
      case 2: return std::numeric_limits<float>::denorm_min() * static_cast<float>(rng() % 1000 + 1);
      case 3: return with_nonfinite ? std::numeric_limits<float>::quiet_NaN() : 1.0f;
      case 4: return with_nonfinite ? -std::numeric_limits<float>::infinity() : -1.0f;
      default: return std::ldexp(unit(rng), static_cast<int>(rng() % 40) - 20);
    }
  };
  for (uint32_t dim : {16u, 64u, 128u, 1024u}) {
    for (bool with_nonfinite : {false, true}) {
      const uint32_t rows = 1 + static_cast<uint32_t>(rng() % 17);
      std::vector<float> keys(uint64_t{rows} * dim);
      for (auto& x : keys) x = pick(with_nonfinite && rng() % 64 == 0);
      std::vector<int8_t> stored(2 * dim);
      for (auto& v : stored) v = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
      // The scalar table is the reference, itself checked against std::ceil below.
      const Kernels* ref = internal::ForIsa(Isa::kScalar);
      std::vector<float> lo0(dim, std::numeric_limits<float>::infinity()), hi0(dim, -lo0[0]), probe0(dim, 0.0f);
      for (uint32_t r = 0; r < rows; ++r) ref->fold_bounds(keys.data() + uint64_t{r} * dim, dim, lo0.data(), hi0.data(), probe0.data());
      float max0 = -1;
      const bool finite0 = ref->bounds_extent(lo0.data(), hi0.data(), probe0.data(), dim, &max0);
      ASSERT_EQ(finite0, !with_nonfinite || std::all_of(keys.begin(), keys.end(), [](float x) { return std::isfinite(x); }));
      int e = -127;
      while (finite0 && std::ldexp(127.0, e) < max0) ++e;
      const double inv_scale = std::ldexp(1.0, -e);
      std::vector<int8_t> fresh0(2 * dim), merged0 = stored;
      if (finite0) {
        ref->quantize_bounds(lo0.data(), hi0.data(), dim, inv_scale, false, fresh0.data());
        ref->quantize_bounds(lo0.data(), hi0.data(), dim, inv_scale, true, merged0.data());
        for (uint32_t d = 0; d < dim; ++d) {
          ASSERT_EQ(fresh0[2 * d], std::ceil(double{hi0[d]} * inv_scale)) << "dim " << d;
          ASSERT_EQ(fresh0[2 * d + 1], std::ceil(-double{lo0[d]} * inv_scale)) << "dim " << d;
          ASSERT_EQ(merged0[2 * d], std::max(stored[2 * d], fresh0[2 * d]));
          ASSERT_EQ(merged0[2 * d + 1], std::max(stored[2 * d + 1], fresh0[2 * d + 1]));
        }
      }
      for (const Kernels* k : AvailableKernels()) {
        SCOPED_TRACE(std::string(k->name) + " dim " + std::to_string(dim));
        std::vector<float> lo(dim, std::numeric_limits<float>::infinity()), hi(dim, -lo[0]), probe(dim, 0.0f);
        for (uint32_t r = 0; r < rows; ++r) k->fold_bounds(keys.data() + uint64_t{r} * dim, dim, lo.data(), hi.data(), probe.data());
        ASSERT_EQ(0, std::memcmp(lo.data(), lo0.data(), dim * sizeof(float)));
        ASSERT_EQ(0, std::memcmp(hi.data(), hi0.data(), dim * sizeof(float)));
        for (uint32_t d = 0; d < dim; ++d) ASSERT_EQ(std::isnan(probe[d]), std::isnan(probe0[d])) << "dim " << d;
        float max_abs = -1;
        ASSERT_EQ(k->bounds_extent(lo.data(), hi.data(), probe.data(), dim, &max_abs), finite0);
        if (!finite0) continue;
        ASSERT_EQ(max_abs, max0);
        std::vector<int8_t> fresh(2 * dim), merged = stored;
        k->quantize_bounds(lo.data(), hi.data(), dim, inv_scale, false, fresh.data());
        k->quantize_bounds(lo.data(), hi.data(), dim, inv_scale, true, merged.data());
        ASSERT_EQ(fresh, fresh0);
        ASSERT_EQ(merged, merged0);
      }
    }
  }
}

// The group kernels equal the single-head ones on the widened row, for every dtype, head count
// (4-at-a-time and the rest) and ISA.
TEST(PnmKernels, GroupDotAndAxpyEqualOneHeadAtATime) {
  std::mt19937_64 rng(21);
  std::normal_distribution<float> n(0.0f, 2.0f);
  for (KvDtype dtype : {KvDtype::kFp16, KvDtype::kBf16, KvDtype::kFp32}) {
    for (uint32_t dim : {16u, 64u, 128u}) {
      std::vector<uint8_t> row(dim * 4);
      for (uint32_t d = 0; d < dim; ++d) {
        const float x = n(rng);
        if (dtype == KvDtype::kFp32) {
          std::memcpy(row.data() + d * 4, &x, 4);
        } else {
          const uint16_t v = dtype == KvDtype::kFp16 ? testing::FloatToHalf(x) : internal::Bf16RoundDown(x);
          std::memcpy(row.data() + d * 2, &v, 2);
        }
      }
      for (uint32_t heads : {1u, 3u, 4u, 7u, 8u}) {
        std::vector<float> q(heads * dim), w(heads * 5), acc0(heads * dim);
        for (float& x : q) x = n(rng);
        for (float& x : w) x = n(rng);
        for (float& x : acc0) x = n(rng);
        for (const Kernels* k : AvailableKernels()) {
          SCOPED_TRACE(std::string(k->name) + " dtype " + std::to_string(static_cast<int>(dtype)) + " dim " +
                       std::to_string(dim) + " heads " + std::to_string(heads));
          std::vector<float> widened(dim);
          k->to_float(dtype, row.data(), widened.data(), dim);
          std::vector<float> out(heads * 3, -1.0f);
          k->group_dot(dtype, row.data(), q.data(), heads, dim, out.data(), 3);
          std::vector<float> acc = acc0;
          k->group_axpy(dtype, row.data(), w.data(), 5, heads, dim, acc.data());
          for (uint32_t i = 0; i < heads; ++i) {
            const float want = k->dot(q.data() + i * dim, widened.data(), dim);
            EXPECT_NEAR(out[i * 3], want, 1e-5f * (1 + std::fabs(want)) * dim);
            EXPECT_EQ(out[i * 3 + 1], -1.0f) << "wrote between strided outputs";
            std::vector<float> one(acc0.begin() + i * dim, acc0.begin() + (i + 1) * dim);
            k->axpy(w[i * 5], widened.data(), one.data(), dim);
            for (uint32_t d = 0; d < dim; ++d) ASSERT_EQ(acc[i * dim + d], one[d]) << "head " << i << " dim " << d;
          }
        }
      }
    }
  }
}

// The vector exponentials against std::exp over the softmax's range, every length (tails
// included), and the edges: -inf, NaN, far below the range.
TEST(PnmKernels, ExpSumIsAccurateOverTheSoftmaxRange) {
  std::mt19937_64 rng(8);
  std::uniform_real_distribution<float> u(-87.0f, 0.0f);
  for (const Kernels* k : AvailableKernels()) {
    SCOPED_TRACE(k->name);
    for (uint32_t n : {1u, 7u, 8u, 15u, 16u, 17u, 33u, 1000u}) {
      std::vector<float> x(n);
      for (float& v : x) v = u(rng) + 3.0f;
      std::vector<float> y = x;
      const float sum = k->exp_sum(y.data(), n, 3.0f);
      double want_sum = 0;
      for (uint32_t i = 0; i < n; ++i) {
        const double want = std::exp(double{x[i]} - 3.0);
        want_sum += want;
        ASSERT_NEAR(y[i], want, 4e-7 * want + 1e-38) << "x " << x[i] - 3.0f;
      }
      ASSERT_NEAR(sum, want_sum, 1e-6 * want_sum);
    }
    float edge[4] = {-INFINITY, std::numeric_limits<float>::quiet_NaN(), -500.0f, 0.0f};
    k->exp_sum(edge, 4, 0.0f);
    EXPECT_LT(edge[0], 2e-38f);
    EXPECT_GE(edge[0], 0.0f);
    EXPECT_TRUE(std::isnan(edge[1]));
    EXPECT_LT(edge[2], 2e-38f);
    EXPECT_EQ(edge[3], 1.0f);
  }
}

TEST(PnmKernels, Bf16BoundsRoundOutwardAndAreExactWhenRepresentable) {
  std::mt19937_64 rng(3);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    uint32_t b = bits(rng);
    float x;
    std::memcpy(&x, &b, 4);
    if (std::isnan(x)) continue;
    const float down = internal::Bf16ToFloat(internal::Bf16RoundDown(x));
    const float up = internal::Bf16ToFloat(internal::Bf16RoundUp(x));
    ASSERT_LE(down, x) << b;
    ASSERT_GE(up, x) << b;
    if ((b & 0xffff) == 0) {
      ASSERT_EQ(down, x);
      ASSERT_EQ(up, x);
    } else {  // one bf16 step apart: nothing representable lies strictly between
      const int step = int{internal::Bf16RoundUp(x)} - int{internal::Bf16RoundDown(x)};
      ASSERT_EQ(std::abs(step), 1) << b;
      ASSERT_LT(down, up);
    }
  }
  EXPECT_EQ(internal::Bf16RoundDown(1.0f), 0x3f80);
  EXPECT_EQ(internal::Bf16RoundUp(1.0f), 0x3f80);
  EXPECT_EQ(internal::Bf16RoundUp(1.0f + 0x1p-20f), 0x3f81);
  EXPECT_EQ(internal::Bf16RoundDown(-1.0f - 0x1p-20f), 0xbf81);
  EXPECT_EQ(internal::Bf16RoundUp(-1.0f - 0x1p-20f), 0xbf80);
}

Geometry SmallGeometry(KvDtype dtype, uint32_t group = 4) { return testing::MakeGeometry(2 * group, 2, 64, 16, dtype); }

TEST(PnmDigest, GrowingAPartialPageRowByRowEqualsBuildingItAtOnce) {
  for (KvDtype dtype : {KvDtype::kFp16, KvDtype::kBf16, KvDtype::kFp32}) {
  for (bool head_major : {false, true}) {
    SCOPED_TRACE(std::to_string(static_cast<int>(dtype)) + (head_major ? " head-major" : " token-major"));
    Geometry g = SmallGeometry(dtype);
    g.head_major = head_major;
    std::mt19937_64 rng(11);
    TestContext c(g, 16 * 5 + 7);
    c.FillNormal(rng, 4.0f);
    // Later rows that need a larger exponent (the stored values shift), and tiny keys.
    c.SetKey(9, 0, 3, 900.0f);
    c.SetKey(16 + 15, 1, 60, -3000.0f);
    c.SetKey(32 + 4, 1, 1, 20000.0f);
    for (uint32_t d = 0; d < g.head_dim; ++d) c.SetKey(48 + 2, 0, d, 1e-3f);
    const std::vector<uint8_t> built = c.Digests();
    ASSERT_FALSE(built.empty());
    const ContextView v = c.View();
    for (uint64_t p = 0; p < v.pages.size(); ++p) {
      std::vector<uint8_t> grown(DigestBytesPerPage(g));
      ClearPageDigest(g, grown.data());
      for (uint32_t t = 0; t < v.TokensOf(p, g.page_tokens); ++t) ExtendPageDigest(g, v.pages[p], t, t + 1, grown.data());
      ASSERT_TRUE(std::equal(grown.begin(), grown.end(), built.begin() + static_cast<std::ptrdiff_t>(p * grown.size())))
          << "page " << p;
      ASSERT_TRUE(DigestPageWellFormed(g, grown.data()));
    }
    // Every stored key lies within its page's bounds, and the bounds are tight to one step of
    // the page head's scale (2^e, with 127·2^e at most twice the page's largest magnitude).
    for (uint64_t t = 0; t < c.tokens(); ++t) {
      for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
        const uint8_t* page = PageDigest(g, built.data(), t / g.page_tokens);
        ASSERT_NE(DigestExponent(page, h), kDigestEmpty);
        const double step = std::ldexp(1.0, DigestExponent(page, h));
        for (uint32_t d = 0; d < g.head_dim; ++d) {
          const DigestBounds b = DigestBoundsOf(g, page, h, d);
          ASSERT_LE(b.lo, c.Key(t, h, d));
          ASSERT_GE(b.hi, c.Key(t, h, d));
          double lo = INFINITY, hi = -INFINITY;
          const uint64_t first = t / g.page_tokens * g.page_tokens;
          for (uint64_t u = first; u < std::min(c.tokens(), first + g.page_tokens); ++u) {
            lo = std::min<double>(lo, c.Key(u, h, d));
            hi = std::max<double>(hi, c.Key(u, h, d));
          }
          ASSERT_LE(b.hi - hi, step);
          ASSERT_LE(lo - b.lo, step);
        }
      }
    }
  }
  }
}

// A head whose keys include NaN or ±inf is unbounded (it always scores +inf, so a poisoned page
// is attended, not hidden); an empty head scores −inf; bytes that no digest holds are caught.
TEST(PnmDigest, NonFiniteKeysMakeAPageUnboundedAndMalformedBytesAreCaught) {
  const Geometry g = SmallGeometry(KvDtype::kFp32, 1);  // (the test's fp16 store saturates)
  std::mt19937_64 rng(13);
  TestContext c(g, 16 * 3);
  c.FillNormal(rng, 1.0f);
  c.SetKey(16 + 5, 1, 9, std::numeric_limits<float>::quiet_NaN());
  c.SetKey(32 + 2, 0, 0, std::numeric_limits<float>::infinity());
  const std::vector<uint8_t> d = c.Digests();
  const auto q = testing::RandomQuery(g, rng, 1.0f);
  const uint8_t* p1 = PageDigest(g, d.data(), 1);
  const uint8_t* p2 = PageDigest(g, d.data(), 2);
  EXPECT_EQ(DigestExponent(p1, 1), kDigestUnbounded);
  EXPECT_NE(DigestExponent(p1, 0), kDigestUnbounded) << "only the poisoned head";
  EXPECT_EQ(DigestExponent(p2, 0), kDigestUnbounded);
  EXPECT_EQ(PageScoreBound(g, q.data() + g.head_dim, p1, 1), INFINITY);
  EXPECT_LT(PageScoreBound(g, q.data(), p1, 0), INFINITY);
  std::vector<uint8_t> empty(DigestBytesPerPage(g));
  ClearPageDigest(g, empty.data());
  EXPECT_EQ(PageScoreBound(g, q.data(), empty.data(), 0), -INFINITY);
  EXPECT_TRUE(DigestPageWellFormed(g, empty.data()));
  // A query that is not finite makes every page the best.
  auto nan_q = q;
  nan_q[3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(PageScoreBound(g, nan_q.data(), PageDigest(g, d.data(), 0), 0), INFINITY);

  std::vector<uint8_t> bad(d.begin(), d.begin() + static_cast<std::ptrdiff_t>(DigestBytesPerPage(g)));
  ASSERT_TRUE(DigestPageWellFormed(g, bad.data()));
  bad[DigestHeaderBytes(g) + 5] = 0x80;  // -128: outside ±127
  EXPECT_FALSE(DigestPageWellFormed(g, bad.data()));
  std::vector<uint8_t> bad_empty = empty;
  bad_empty[DigestHeaderBytes(g)] = 1;  // an empty head with a value
  EXPECT_FALSE(DigestPageWellFormed(g, bad_empty.data()));
}

// For random and adversarial queries — the sign pattern of one key (it maximizes that key's
// logit), a key itself scaled up, one-hot on an outlier channel — every page's bound is at least
// the page's largest q·k computed exactly.
TEST(PnmDigest, EveryPageScoreBoundsThePagesLargestLogit) {
  for (KvDtype dtype : {KvDtype::kFp16, KvDtype::kBf16, KvDtype::kFp32}) {
    SCOPED_TRACE(static_cast<int>(dtype));
    const Geometry g = SmallGeometry(dtype, 1);
    std::mt19937_64 rng(5);
    TestContext c(g, 16 * 12 + 3);
    c.FillNormal(rng, 2.0f);
    for (uint64_t t = 0; t < c.tokens(); ++t) c.SetKey(t, 0, 7, 200.0f + static_cast<float>(t % 5));  // outlier channel
    const std::vector<uint8_t> digests = c.Digests();
    std::vector<std::vector<float>> queries;
    for (int i = 0; i < 8; ++i) queries.push_back(testing::RandomQuery(g, rng, 5.0f));
    for (uint64_t t : {uint64_t{3}, uint64_t{100}, c.tokens() - 1}) {
      std::vector<float> sign(g.num_heads * g.head_dim), scaled(sign.size()), onehot(sign.size(), 0.0f);
      for (uint32_t h = 0; h < g.num_heads; ++h) {
        for (uint32_t d = 0; d < g.head_dim; ++d) {
          sign[h * g.head_dim + d] = c.Key(t, h, d) >= 0 ? 1e3f : -1e3f;
          scaled[h * g.head_dim + d] = c.Key(t, h, d) * 1e4f;
        }
        onehot[h * g.head_dim + 7] = -3e4f;
      }
      queries.push_back(sign);
      queries.push_back(scaled);
      queries.push_back(onehot);
    }
    for (const auto& q : queries) {
      for (uint64_t p = 0; p < g.PagesFor(c.tokens()); ++p) {
        for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
          double best = -INFINITY;
          for (uint64_t t = p * g.page_tokens; t < std::min(c.tokens(), (p + 1) * g.page_tokens); ++t) {
            double s = 0;
            for (uint32_t d = 0; d < g.head_dim; ++d) s += double{q[h * g.head_dim + d]} * c.Key(t, h, d);
            best = std::max(best, s);
          }
          const float bound = PageScoreBound(g, q.data() + uint64_t{h} * g.head_dim, PageDigest(g, digests.data(), p), h);
          ASSERT_GE(double{bound}, best) << "page " << p << " head " << h;
        }
      }
    }
  }
}

TEST(PnmDigest, BadShapesAreRefusedClearly) {
  Geometry g = SmallGeometry(KvDtype::kFp16);
  TestContext c(g, 40);
  std::vector<uint8_t> wrong(3);
  Status s = BuildDigests(g, c.View(), wrong);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("3 bytes"), std::string::npos) << s.message();
  Geometry bad = g;
  bad.num_heads = 3;
  EXPECT_NE(bad.Validate().message().find("not a multiple"), std::string::npos);
  bad = g;
  bad.head_dim = 40;
  EXPECT_EQ(bad.Validate().code(), StatusCode::kInvalidArgument);
  bad = g;
  bad.dtype = KvDtype::kFp8;
  EXPECT_NE(bad.Validate().message().find("fp8"), std::string::npos);
  ContextView v = c.View();
  v.tokens = 100;  // 7 pages' worth on 3 pages
  EXPECT_NE(v.Validate(g).message().find("needs 7 pages"), std::string::npos) << v.Validate(g).message();
}

}  // namespace
}  // namespace cxlkv::pnm
