// Attention over selected pages, read in place (PNM §3.1–§3.3): one decode query per head,
// online softmax over the pages a Selection names, fp32 accumulation whatever the KV dtype. It
// returns the output and, per head, the log-sum-exp of the logits it saw, so partial results
// over disjoint token sets — two memory devices, or the engine's resident pages and the
// near-memory rest (the hybrid) — merge exactly (MergeInto), in any order.
//
// Thread-safety: Attend is reentrant (its scratch is per thread); a Partial is one caller's.
// AttendPool (attend_pool.h) runs many across threads.
#ifndef CXLKV_SRC_PNM_ATTEND_H_
#define CXLKV_SRC_PNM_ATTEND_H_

#include <cstdint>
#include <vector>

#include "cxlkv/status.h"
#include "pnm/geometry.h"
#include "pnm/select.h"

namespace cxlkv::pnm {

// Attention over some set of tokens, per query head: out = Σ softmax(logit)·v over the set and
// lse = log Σ exp(logit). The empty set is out = 0, lse = -inf (merging it changes nothing).
struct Partial {
  uint32_t num_heads = 0;
  uint32_t head_dim = 0;
  std::vector<float> out;  // [num_heads][head_dim]
  std::vector<float> lse;  // [num_heads]

  // Makes it the empty set's partial for this shape.
  void Reset(uint32_t heads, uint32_t dim);
};

// logit = scale · (q_h · k) for query head h against its group's KV head; scale 0 means
// 1/sqrt(head_dim). q is [num_heads][head_dim] fp32. `selection` names pages per KV head (every
// page when null). Errors: kInvalidArgument for a bad geometry or context, a selection of another
// head count, or a page index past the context.
Status Attend(const Geometry& g, const float* q, const ContextView& ctx, const Selection* selection, float scale,
              Partial* out);

// Pages × KV heads that Attend reads over a context of `pages` pages: every one when
// `selection` is null, else each head's list (heads may share one list: counted per head).
uint64_t PageHeadsAttended(const Geometry& g, uint64_t pages, const Selection* selection);

// What Attend checks before it reads anything: the geometry, the context, the selection.
Status CheckAttend(const Geometry& g, const ContextView& ctx, const Selection* selection);

namespace internal {
// Attend's work is done in parts: of every page list walked (the context's pages, or each KV
// head's selected pages), part p of `parts` is the positions [n·p/parts, n·(p+1)/parts), over
// every head. Each part is its own online softmax, and the parts' partials merge (MergeInto)
// in part order. The count depends on the context's length only (1 below 128 pages, up to 8),
// never on threads, so a request attended part by part on one thread or split across an
// AttendPool's threads gives the same bits.
uint32_t AttendParts(const ContextView& ctx);
// One part. REQUIRES: CheckAttend(g, ctx, selection) ok; out->Reset(g.num_heads, g.head_dim)
// done; part < parts.
void AttendPart(const Geometry& g, const float* q, const ContextView& ctx, const Selection* selection, float scale,
                uint32_t part, uint32_t parts, Partial* out);
// Every part, merged in order into out: Attend's result. REQUIRES as AttendPart's.
void AttendAllParts(const Geometry& g, const float* q, const ContextView& ctx, const Selection* selection,
                    float scale, Partial* out);
}  // namespace internal

// acc ← the attention over acc's tokens ∪ part's tokens (the sets must be disjoint):
// m = max(s_a, s_b); v = (e^{s_a−m}·v_a + e^{s_b−m}·v_b) / (e^{s_a−m} + e^{s_b−m}); s = m + log(e^{s_a−m} + e^{s_b−m}).
// An empty acc (num_heads 0) takes part's shape. Errors: kInvalidArgument for shapes that differ.
Status MergeInto(const Partial& part, Partial* acc);

}  // namespace cxlkv::pnm

#endif  // CXLKV_SRC_PNM_ATTEND_H_
