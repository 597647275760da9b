// Page digests (PNM §3.1, Quest): per page and KV head, the per-dimension minimum and maximum of
// the page's keys. Score(q, page) = Σ_d max(q_d·lo_d, q_d·hi_d) is then an upper bound on
// q·k for every key k of the page, so a page whose score is low cannot hold a high logit.
//
// Storage, per page: an int8 exponent e_h per KV head (the header, padded to 16 bytes), then per
// KV head 2·head_dim int8 values, dimension by dimension: hi_d then nlo_d (= −lo_d), in units of
// 2^e_h and rounded up (so hi is rounded up and lo down: outward). A quarter of the keys' bytes
// for fp16 KV (1/32 of the KV) — half of a bf16 digest — and scored with integer
// multiply-adds (select.h). e_h is the smallest exponent (>= kDigestMinExponent) at which every
// bound of the head fits in ±127. Decode appends that need a larger exponent shift the stored
// values (ceil(ceil(x/a)/b) = ceil(x/ab)), so widening a digest row by row gives exactly the
// digest computed over the rows at once — tested bit for bit.
//
// A head with no row yet has e = kDigestEmpty (scores −inf). A non-finite key (NaN or ±inf)
// makes its head's digest unbounded, e = kDigestUnbounded: the page then scores +inf and is
// always selected, so sparsity never hides a poisoned page's NaN.
//
// Thread-safety: none needed; a digest is written by the page's one writer.
#ifndef CXLKV_SRC_PNM_DIGEST_H_
#define CXLKV_SRC_PNM_DIGEST_H_

#include <cstdint>
#include <span>

#include "cxlkv/status.h"
#include "pnm/geometry.h"

namespace cxlkv::pnm {

inline constexpr int8_t kDigestEmpty = -128;
inline constexpr int8_t kDigestUnbounded = 127;
inline constexpr int8_t kDigestMinExponent = -127;  // smaller keys round outward to 0 or ±1
inline constexpr int kDigestValueMax = 127;

// The header's bytes (the exponents, padded so each head's values start 16-byte aligned).
inline uint64_t DigestHeaderBytes(const Geometry& g) { return (uint64_t{g.num_kv_heads} + 15) / 16 * 16; }
// One page's digest bytes.
inline uint64_t DigestBytesPerPage(const Geometry& g) {
  return DigestHeaderBytes(g) + uint64_t{g.num_kv_heads} * 2 * g.head_dim;
}

// KV head h's exponent and values within one page's digest.
inline int8_t DigestExponent(const uint8_t* page_digest, uint32_t h) { return static_cast<int8_t>(page_digest[h]); }
inline const int8_t* DigestValues(const Geometry& g, const uint8_t* page_digest, uint32_t h) {
  return reinterpret_cast<const int8_t*>(page_digest + DigestHeaderBytes(g) + uint64_t{h} * 2 * g.head_dim);
}
// Page p's digest within a context's digests.
inline const uint8_t* PageDigest(const Geometry& g, const uint8_t* digests, uint64_t p) {
  return digests + p * DigestBytesPerPage(g);
}

// The digest of an empty page (every head kDigestEmpty). REQUIRES: out holds DigestBytesPerPage(g).
void ClearPageDigest(const Geometry& g, uint8_t* out);

// Widens a page's digest by its K rows [from, to). REQUIRES: g valid, from <= to <= page_tokens,
// page.k names a whole slab.
void ExtendPageDigest(const Geometry& g, const PageKv& page, uint32_t from, uint32_t to, uint8_t* digest);

// The digests of every page of a context into `out` (pages × DigestBytesPerPage). Errors:
// kInvalidArgument for a bad geometry or context, or an `out` of the wrong size.
Status BuildDigests(const Geometry& g, const ContextView& ctx, std::span<uint8_t> out);

// Whether bytes read from elsewhere (the pool) can be a page's digest: every value within ±127,
// and an empty or unbounded head's values 0. A digest that is not can hide a page from selection
// (never worse: scoring stays in bounds either way); callers rebuild it from the keys.
bool DigestPageWellFormed(const Geometry& g, const uint8_t* page_digest);

// What a digest says of head h's dimension d: lo_d <= every key's value <= hi_d (empty: lo = +inf,
// hi = −inf; unbounded: −inf and +inf). For tests and tools; scoring reads the values directly.
struct DigestBounds {
  double lo = 0;
  double hi = 0;
};
DigestBounds DigestBoundsOf(const Geometry& g, const uint8_t* page_digest, uint32_t h, uint32_t d);

}  // namespace cxlkv::pnm

#endif  // CXLKV_SRC_PNM_DIGEST_H_
