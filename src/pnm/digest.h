// Page digests (PNM §3.1, Quest): per page and KV head, the per-dimension minimum and maximum of
// the page's keys. Score(q, page) = Σ_d max(q_d·lo_d, q_d·hi_d) is then an upper bound on
// q·k for every key k of the page, so a page whose score is low cannot hold a high logit.
//
// Storage: [pages][num_kv_heads][2][head_dim] bf16 — lo then hi — whatever the KV dtype: an
// eighth of the keys' bytes for fp16 KV, and bf16 widens to fp32 with a shift, so scoring reads
// few bytes and converts for free. Bounds are rounded outward (lo down, hi up) so the score
// stays an upper bound after rounding; because rounding is monotonic, widening a digest row by
// row gives exactly the digest computed over the rows at once (decode appends equal a rebuild).
// Keys that are NaN are left out of the bounds (their logits are NaN whatever is selected).
//
// Thread-safety: none needed; a digest is written by the page's one writer.
#ifndef CXLKV_SRC_PNM_DIGEST_H_
#define CXLKV_SRC_PNM_DIGEST_H_

#include <cstdint>
#include <span>

#include "cxlkv/status.h"
#include "pnm/geometry.h"

namespace cxlkv::pnm {

// bf16 elements of one page's digest, and its bytes.
inline uint64_t DigestElemsPerPage(const Geometry& g) { return uint64_t{g.num_kv_heads} * 2 * g.head_dim; }
inline uint64_t DigestBytesPerPage(const Geometry& g) { return DigestElemsPerPage(g) * sizeof(uint16_t); }

// The digest of an empty page: lo = +inf, hi = -inf (it scores -inf or NaN, never selected by score).
// REQUIRES: out holds DigestElemsPerPage(g) elements.
void ClearPageDigest(const Geometry& g, uint16_t* out);

// Widens a page's digest by its K rows [from, to). REQUIRES: g valid, from <= to <= page_tokens,
// page.k names a whole slab.
void ExtendPageDigest(const Geometry& g, const PageKv& page, uint32_t from, uint32_t to, uint16_t* digest);

// The digests of every page of a context into `out` (pages × DigestElemsPerPage). Errors:
// kInvalidArgument for a bad geometry or context, or an `out` of the wrong size.
Status BuildDigests(const Geometry& g, const ContextView& ctx, std::span<uint16_t> out);

// Head h's lo (hi = lo + head_dim) within page p's digest.
inline const uint16_t* DigestLo(const Geometry& g, const uint16_t* digests, uint64_t p, uint32_t h) {
  return digests + p * DigestElemsPerPage(g) + uint64_t{h} * 2 * g.head_dim;
}

}  // namespace cxlkv::pnm

#endif  // CXLKV_SRC_PNM_DIGEST_H_
