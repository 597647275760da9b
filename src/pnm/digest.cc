#include "pnm/digest.h"

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
  const internal::Kernels& k = internal::Active();
  thread_local std::vector<float> row;
  row.resize(uint64_t{g.num_kv_heads} * g.head_dim);
  const auto* slab = static_cast<const uint8_t*>(page.k);
  for (uint32_t t = from; t < to; ++t) {
    k.to_float(g.dtype, slab + t * g.RowBytes(), row.data(), static_cast<uint32_t>(row.size()));
    for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
      uint16_t* lo = digest + uint64_t{h} * 2 * g.head_dim;
      uint16_t* hi = lo + g.head_dim;
      const float* key = row.data() + uint64_t{h} * g.head_dim;
      for (uint32_t d = 0; d < g.head_dim; ++d) {
        // NaN compares false both ways: it widens nothing.
        if (key[d] < Bf16ToFloat(lo[d])) lo[d] = Bf16RoundDown(key[d]);
        if (key[d] > Bf16ToFloat(hi[d])) hi[d] = Bf16RoundUp(key[d]);
      }
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
