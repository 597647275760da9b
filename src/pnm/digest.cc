#include "pnm/digest.h"

#include <limits>
#include <vector>

#include "pnm/kernels.h"

namespace cxlkv::pnm {

using internal::Bf16RoundDown;
using internal::Bf16RoundUp;
using internal::Bf16ToFloat;

void ClearPageDigest(const Geometry& g, uint16_t* out) {
  constexpr uint16_t kPlusInf = 0x7f80, kMinusInf = 0xff80;
  for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
    uint16_t* lo = out + uint64_t{h} * 2 * g.head_dim;
    for (uint32_t d = 0; d < g.head_dim; ++d) {
      lo[d] = kPlusInf;
      lo[g.head_dim + d] = kMinusInf;
    }
  }
}

void ExtendPageDigest(const Geometry& g, const PageKv& page, uint32_t from, uint32_t to, uint16_t* digest) {
  if (from >= to) return;
  const internal::Kernels& k = internal::Active();
  const uint32_t width = g.num_kv_heads * g.head_dim;  // one token's keys across the heads
  thread_local std::vector<float> row, lo, hi;
  row.resize(width);
  lo.assign(width, std::numeric_limits<float>::infinity());
  hi.assign(width, -std::numeric_limits<float>::infinity());
  // The rows' min and max in fp32 first (loops the compiler vectorizes), rounded once after:
  // rounding is monotonic, so round(min) = min(round) and the result is the same either way.
  const auto* slab = static_cast<const uint8_t*>(page.k);
  for (uint32_t t = from; t < to; ++t) {
    k.to_float(g.dtype, slab + t * g.RowBytes(), row.data(), width);
    for (uint32_t j = 0; j < width; ++j) {
      lo[j] = row[j] < lo[j] ? row[j] : lo[j];  // NaN compares false: it widens nothing
      hi[j] = row[j] > hi[j] ? row[j] : hi[j];
    }
  }
  for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
    uint16_t* dlo = digest + uint64_t{h} * 2 * g.head_dim;
    uint16_t* dhi = dlo + g.head_dim;
    const float* flo = lo.data() + uint64_t{h} * g.head_dim;
    const float* fhi = hi.data() + uint64_t{h} * g.head_dim;
    for (uint32_t d = 0; d < g.head_dim; ++d) {
      if (flo[d] < Bf16ToFloat(dlo[d])) dlo[d] = Bf16RoundDown(flo[d]);
      if (fhi[d] > Bf16ToFloat(dhi[d])) dhi[d] = Bf16RoundUp(fhi[d]);
    }
  }
}

Status BuildDigests(const Geometry& g, const ContextView& ctx, std::span<uint16_t> out) {
  if (Status s = g.Validate(); !s.ok()) return s;
  if (Status s = ctx.Validate(g); !s.ok()) return s;
  if (out.size() != ctx.pages.size() * DigestElemsPerPage(g)) {
    return InvalidArgument("digest buffer holds " + std::to_string(out.size()) + " elements; " +
                           std::to_string(ctx.pages.size()) + " pages need " +
                           std::to_string(ctx.pages.size() * DigestElemsPerPage(g)));
  }
  for (uint64_t p = 0; p < ctx.pages.size(); ++p) {
    uint16_t* d = out.data() + p * DigestElemsPerPage(g);
    ClearPageDigest(g, d);
    ExtendPageDigest(g, ctx.pages[p], 0, ctx.TokensOf(p, g.page_tokens), d);
  }
  return Status::Ok();
}

}  // namespace cxlkv::pnm
