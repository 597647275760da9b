#include "pnm/digest.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "pnm/kernels.h"

namespace cxlkv::pnm {

namespace {

// ceil(v / 2^k) for a stored value: an arithmetic shift floors, so negate around it.
int8_t ShiftUp(int8_t v, int k) { return static_cast<int8_t>(-((-int{v}) >> std::min(k, 31))); }

// The smallest e >= kDigestMinExponent with m <= 127·2^e.
int ExponentFor(double m) {
  if (!(m > 0)) return kDigestMinExponent;
  int ex = 0;
  (void)std::frexp(m / kDigestValueMax, &ex);  // m/127 in [2^(ex-1), 2^ex)
  int e = ex - 1;
  if (std::ldexp(double{kDigestValueMax}, e) < m) ++e;
  return std::max(e, int{kDigestMinExponent});
}

}  // namespace

void ClearPageDigest(const Geometry& g, uint8_t* out) {
  std::memset(out, 0, DigestBytesPerPage(g));
  for (uint32_t h = 0; h < g.num_kv_heads; ++h) out[h] = static_cast<uint8_t>(kDigestEmpty);
}

void ExtendPageDigest(const Geometry& g, const PageKv& page, uint32_t from, uint32_t to, uint8_t* digest) {
  if (from >= to) return;
  const internal::Kernels& k = internal::Active();
  const uint32_t dim = g.head_dim;
  const uint32_t width = g.num_kv_heads * dim;  // one token's keys across the heads
  thread_local std::vector<float> row, lo, hi, probe;
  row.resize(width);
  lo.assign(width, std::numeric_limits<float>::infinity());
  hi.assign(width, -std::numeric_limits<float>::infinity());
  probe.assign(width, 0.0f);
  // The rows' min and max in fp32 first (the kernel table's fold), quantized once after.
  // x·0 is NaN exactly when x is NaN or ±inf, and NaN stays in a sum: `probe` finds them.
  const auto* slab = static_cast<const uint8_t*>(page.k);
  for (uint32_t t = from; t < to; ++t) {
    if (g.head_major) {  // the token's row of each head, from the head's own run
      for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
        k.to_float(g.dtype, slab + g.HeadOffset(h) + t * g.TokenStride(), row.data() + uint64_t{h} * dim, dim);
      }
    } else {
      k.to_float(g.dtype, slab + t * g.RowBytes(), row.data(), width);
    }
    k.fold_bounds(row.data(), width, lo.data(), hi.data(), probe.data());
  }
  for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
    const float* flo = lo.data() + uint64_t{h} * dim;
    const float* fhi = hi.data() + uint64_t{h} * dim;
    float max_abs = 0;
    const bool finite = k.bounds_extent(flo, fhi, probe.data() + uint64_t{h} * dim, dim, &max_abs);
    auto* values = reinterpret_cast<int8_t*>(digest + DigestHeaderBytes(g) + uint64_t{h} * 2 * dim);
    const int old_e = static_cast<int8_t>(digest[h]);
    if (old_e == kDigestUnbounded) continue;
    if (!finite) {
      std::memset(values, 0, 2 * dim);
      digest[h] = static_cast<uint8_t>(kDigestUnbounded);
      continue;
    }
    int e = ExponentFor(max_abs);
    if (old_e != kDigestEmpty && e <= old_e) {
      e = old_e;
    } else if (old_e != kDigestEmpty) {
      for (uint32_t j = 0; j < 2 * dim; ++j) values[j] = ShiftUp(values[j], e - old_e);
    }
    k.quantize_bounds(flo, fhi, dim, std::ldexp(1.0, -e), old_e != kDigestEmpty, values);
    digest[h] = static_cast<uint8_t>(static_cast<int8_t>(e));
  }
}

Status BuildDigests(const Geometry& g, const ContextView& ctx, std::span<uint8_t> out) {
  if (Status s = g.Validate(); !s.ok()) return s;
  if (Status s = ctx.Validate(g); !s.ok()) return s;
  if (out.size() != ctx.pages.size() * DigestBytesPerPage(g)) {
    return InvalidArgument("digest buffer holds " + std::to_string(out.size()) + " bytes; " +
                           std::to_string(ctx.pages.size()) + " pages need " +
                           std::to_string(ctx.pages.size() * DigestBytesPerPage(g)));
  }
  for (uint64_t p = 0; p < ctx.pages.size(); ++p) {
    uint8_t* d = out.data() + p * DigestBytesPerPage(g);
    ClearPageDigest(g, d);
    ExtendPageDigest(g, ctx.pages[p], 0, ctx.TokensOf(p, g.page_tokens), d);
  }
  return Status::Ok();
}

bool DigestPageWellFormed(const Geometry& g, const uint8_t* page_digest) {
  for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
    const int e = DigestExponent(page_digest, h);
    const bool sentinel = e == kDigestEmpty || e == kDigestUnbounded;
    const int8_t* v = DigestValues(g, page_digest, h);
    for (uint32_t j = 0; j < 2 * g.head_dim; ++j) {
      if (v[j] < -kDigestValueMax || (sentinel && v[j] != 0)) return false;
    }
  }
  return true;
}

DigestBounds DigestBoundsOf(const Geometry& g, const uint8_t* page_digest, uint32_t h, uint32_t d) {
  const int e = DigestExponent(page_digest, h);
  constexpr double kInf = std::numeric_limits<double>::infinity();
  if (e == kDigestEmpty) return {kInf, -kInf};
  if (e == kDigestUnbounded) return {-kInf, kInf};
  const int8_t* v = DigestValues(g, page_digest, h);
  return {-std::ldexp(static_cast<double>(v[2 * d + 1]), e), std::ldexp(static_cast<double>(v[2 * d]), e)};
}

}  // namespace cxlkv::pnm
