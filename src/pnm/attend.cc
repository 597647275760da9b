#include "pnm/attend.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "pnm/kernels.h"

namespace cxlkv::pnm {

namespace {

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// Per-thread buffers: every query head's running max, sum and output, and one page's logits.
struct Scratch {
  std::vector<float> logits;  // [num_heads][page_tokens], or [num_heads][stride] for attend_page
  std::vector<float> acc;     // [num_heads][head_dim]
  std::vector<float> max;     // [num_heads]
  std::vector<float> sum;     // [num_heads]
};

Status CheckSelection(const Geometry& g, const ContextView& ctx, const Selection& s) {
  if (s.num_kv_heads() != g.num_kv_heads) {
    return InvalidArgument("selection for " + std::to_string(s.num_kv_heads()) + " KV heads, attention has " +
                           std::to_string(g.num_kv_heads));
  }
  for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
    for (uint32_t p : s.Of(h)) {
      if (p >= ctx.pages.size()) {
        return InvalidArgument("selected page " + std::to_string(p) + " is past the context's " +
                               std::to_string(ctx.pages.size()) + " pages");
      }
    }
  }
  return Status::Ok();
}

// Asks for KV head h's K and V rows of a page ahead of use. In a token-major page a head's rows
// are a few cache lines out of every token's row across the heads: a strided walk the hardware
// prefetchers do not follow, so without this each row is a full memory latency.
void PrefetchPage(const Geometry& g, const PageKv& page, uint32_t tokens, uint32_t h) {
  const uint64_t head_bytes = g.HeadBytes();
  for (const void* slab : {page.k, page.v}) {
    const auto* base = static_cast<const uint8_t*>(slab) + g.HeadOffset(h);
    for (uint32_t t = 0; t < tokens; ++t) {
      for (uint64_t b = 0; b < head_bytes; b += 64) __builtin_prefetch(base + t * g.TokenStride() + b, 0, 3);
    }
  }
}

// Online softmax over one page for the query heads of KV heads [h_begin, h_end): the logits, a
// new running max per query head, what was accumulated rescaled, then the page's values added
// weighted by e^(logit − max). Rows are walked in the slabs' own order, front to back. Each K and
// V row of a head is widened once for its whole group. State (max, sum, acc, logits) is indexed
// by query head.
void AttendPage(const Geometry& g, const internal::Kernels& k, const float* q, float scale, const PageKv& page,
                uint32_t tokens, uint32_t h_begin, uint32_t h_end, Scratch& s) {
  const uint32_t group = g.group(), dim = g.head_dim, stride = g.page_tokens;
  const uint64_t token_stride = g.TokenStride();
  const auto* kslab = static_cast<const uint8_t*>(page.k);
  const auto* vslab = static_cast<const uint8_t*>(page.v);
  // Front to back through the slab in either order: token by token across the heads
  // (token-major) or head by head along the tokens (head-major). Each logit and each head's
  // accumulation order over tokens is the same both ways.
  auto walk = [&](auto&& visit) {
    if (g.head_major) {
      for (uint32_t h = h_begin; h < h_end; ++h) {
        for (uint32_t t = 0; t < tokens; ++t) visit(t, h);
      }
    } else {
      for (uint32_t t = 0; t < tokens; ++t) {
        for (uint32_t h = h_begin; h < h_end; ++h) visit(t, h);
      }
    }
  };
  walk([&](uint32_t t, uint32_t h) {
    const uint64_t first = uint64_t{h} * group;  // the group's first query head
    k.group_dot(g.dtype, kslab + g.HeadOffset(h) + t * token_stride, q + first * dim, group, dim,
                s.logits.data() + first * stride + t, stride);
  });
  for (uint32_t i = h_begin * group; i < h_end * group; ++i) {
    float* li = s.logits.data() + uint64_t{i} * stride;
    float page_max = kMinusInf;
    for (uint32_t t = 0; t < tokens; ++t) page_max = std::max(page_max, li[t] *= scale);
    const float new_max = std::max(s.max[i], page_max);
    if (new_max == kMinusInf) {  // every logit so far is -inf: nothing to weigh yet
      std::fill(li, li + tokens, 0.0f);
      continue;
    }
    const float rescale = std::exp(s.max[i] - new_max);  // exp(-inf) = 0 on the first page
    if (rescale != 1.0f) {
      s.sum[i] *= rescale;
      float* ai = s.acc.data() + uint64_t{i} * dim;
      for (uint32_t d = 0; d < dim; ++d) ai[d] *= rescale;
    }
    s.max[i] = new_max;
    s.sum[i] += k.exp_sum(li, tokens, new_max);  // the logits become the weights
  }
  walk([&](uint32_t t, uint32_t h) {
    const uint64_t first = uint64_t{h} * group;
    k.group_axpy(g.dtype, vslab + g.HeadOffset(h) + t * token_stride, s.logits.data() + first * stride + t, stride,
                 group, dim, s.acc.data() + first * dim);
  });
}

// The page through the table's attend_page, KV head by KV head. `next` is the page attended
// after this one (null: none); its rows of each head are asked for while this page's are read.
void AttendPageBlocked(const Geometry& g, const internal::Kernels& k, const float* q, float scale, const PageKv& page,
                       uint32_t tokens, const PageKv* next, uint32_t next_tokens, uint32_t h_begin, uint32_t h_end,
                       uint32_t stride, Scratch& s) {
  const uint32_t group = g.group(), dim = g.head_dim;
  internal::PageHead ph;
  ph.row_bytes = g.TokenStride();
  ph.tokens = tokens;
  for (uint32_t h = h_begin; h < h_end; ++h) {
    const uint64_t first = uint64_t{h} * group;
    const uint64_t head_offset = g.HeadOffset(h);
    ph.k = static_cast<const uint8_t*>(page.k) + head_offset;
    ph.v = static_cast<const uint8_t*>(page.v) + head_offset;
    // A shorter next page is asked for only as far as this page's tokens reach it: harmless.
    const bool ahead = next != nullptr && next_tokens >= tokens;
    ph.next_k = ahead ? static_cast<const uint8_t*>(next->k) + head_offset : nullptr;
    ph.next_v = ahead ? static_cast<const uint8_t*>(next->v) + head_offset : nullptr;
    k.attend_page(g.dtype, ph, q + first * dim, group, dim, scale, s.logits.data() + first * stride, stride,
                  s.max.data() + first, s.sum.data() + first, s.acc.data() + first * dim);
  }
}

}  // namespace

void Partial::Reset(uint32_t heads, uint32_t dim) {
  num_heads = heads;
  head_dim = dim;
  out.assign(uint64_t{heads} * dim, 0.0f);
  lse.assign(heads, kMinusInf);
}

Status CheckAttend(const Geometry& g, const ContextView& ctx, const Selection* selection) {
  if (Status s = g.Validate(); !s.ok()) return s;
  if (Status s = ctx.Validate(g); !s.ok()) return s;
  if (selection != nullptr) return CheckSelection(g, ctx, *selection);
  return Status::Ok();
}

namespace internal {

uint32_t AttendParts(const ContextView& ctx) {
  // 64 pages (1024 tokens at the default page) and more per part: a part's own costs (its
  // accumulators zeroed, its output normalized and merged, its first page not asked for ahead)
  // stay below 1% of it.
  constexpr uint64_t kMinPagesPerPart = 64, kMaxParts = 8;
  return static_cast<uint32_t>(std::clamp<uint64_t>(ctx.pages.size() / kMinPagesPerPart, 1, kMaxParts));
}

void AttendAllParts(const Geometry& g, const float* q, const ContextView& ctx, const Selection* selection,
                    float scale, Partial* out) {
  const uint32_t parts = AttendParts(ctx);
  if (parts == 1) return AttendPart(g, q, ctx, selection, scale, 0, 1, out);
  thread_local Partial part_out;
  for (uint32_t part = 0; part < parts; ++part) {
    part_out.Reset(g.num_heads, g.head_dim);
    AttendPart(g, q, ctx, selection, scale, part, parts, &part_out);
    (void)MergeInto(part_out, out);  // the same shape: cannot fail
  }
}

void AttendPart(const Geometry& g, const float* q, const ContextView& ctx, const Selection* selection, float scale,
                uint32_t part, uint32_t parts, Partial* out) {
  // The slice of a list of n pages this part walks.
  auto slice_begin = [&](uint64_t n) { return n * part / parts; };
  auto slice_end = [&](uint64_t n) { return n * (part + 1) / parts; };
  if (scale == 0) scale = 1.0f / std::sqrt(static_cast<float>(g.head_dim));
  const Kernels& k = Active();
  const uint32_t dim = g.head_dim;
  thread_local Scratch s;
  // attend_page's logits: rows of a multiple of 16 floats (whole vectors, masked at the end).
  const uint32_t stride = k.attend_page != nullptr ? (g.page_tokens + 15) / 16 * 16 : g.page_tokens;
  s.logits.resize(uint64_t{g.num_heads} * stride);
  s.acc.assign(uint64_t{g.num_heads} * dim, 0.0f);
  s.max.assign(g.num_heads, kMinusInf);
  s.sum.assign(g.num_heads, 0.0f);

  // Page p for KV heads [from, to); `next` the page those heads attend next, or none.
  auto visit = [&](uint64_t p, const uint64_t* next, uint32_t from, uint32_t to) {
    const uint32_t tokens = ctx.TokensOf(p, g.page_tokens);
    if (k.attend_page != nullptr) {
      const PageKv* next_page = next != nullptr ? &ctx.pages[*next] : nullptr;
      const uint32_t next_tokens = next != nullptr ? ctx.TokensOf(*next, g.page_tokens) : 0;
      AttendPageBlocked(g, k, q, scale, ctx.pages[p], tokens, next_page, next_tokens, from, to, stride, s);
      return;
    }
    // Token by token across the heads reads a page front to back; one head alone strides.
    if (next != nullptr && to == from + 1) PrefetchPage(g, ctx.pages[*next], ctx.TokensOf(*next, g.page_tokens), from);
    AttendPage(g, k, q, scale, ctx.pages[p], tokens, from, to, s);
  };
  if (selection == nullptr || selection->SameForAllHeads()) {
    // One page list for every head: walk the pages once, all the heads per page. attend_page
    // reads a page KV head by KV head (strided rows), so the next page's rows are asked for
    // while this page's are read: without that, dense attention ran at half the speed.
    const uint64_t n = selection == nullptr ? ctx.pages.size() : selection->Of(0).size();
    auto page_at = [&](uint64_t i) -> uint64_t { return selection == nullptr ? i : selection->Of(0)[i]; };
    const uint64_t end = slice_end(n);
    for (uint64_t i = slice_begin(n); i < end; ++i) {
      const uint64_t next = i + 1 < end ? page_at(i + 1) : 0;
      visit(page_at(i), i + 1 < end ? &next : nullptr, 0, g.num_kv_heads);
    }
  } else {
    // Each head its own pages: one head at a time, the next page's rows asked for ahead.
    for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
      auto pages = selection->Of(h);
      const uint64_t end = slice_end(pages.size());
      for (uint64_t i = slice_begin(pages.size()); i < end; ++i) {
        const uint64_t next = i + 1 < end ? pages[i + 1] : 0;
        visit(pages[i], i + 1 < end ? &next : nullptr, h, h + 1);
      }
    }
  }
  for (uint32_t head = 0; head < g.num_heads; ++head) {
    if (!(s.sum[head] > 0)) continue;  // no token (or only -inf logits): the empty partial
    float* o = out->out.data() + uint64_t{head} * dim;
    const float inv = 1.0f / s.sum[head];
    for (uint32_t d = 0; d < dim; ++d) o[d] = s.acc[uint64_t{head} * dim + d] * inv;
    out->lse[head] = s.max[head] + std::log(s.sum[head]);
  }
}

}  // namespace internal

Status Attend(const Geometry& g, const float* q, const ContextView& ctx, const Selection* selection, float scale,
              Partial* out) {
  if (Status s = CheckAttend(g, ctx, selection); !s.ok()) return s;
  out->Reset(g.num_heads, g.head_dim);
  internal::AttendAllParts(g, q, ctx, selection, scale, out);
  return Status::Ok();
}

uint64_t PageHeadsAttended(const Geometry& g, uint64_t pages, const Selection* selection) {
  if (selection == nullptr) return pages * g.num_kv_heads;
  uint64_t n = 0;
  for (uint32_t h = 0; h < selection->num_kv_heads(); ++h) n += selection->Of(h).size();
  return n;
}

Status MergeInto(const Partial& part, Partial* acc) {
  if (acc->num_heads == 0) {
    *acc = part;
    return Status::Ok();
  }
  if (part.num_heads != acc->num_heads || part.head_dim != acc->head_dim ||
      part.out.size() != acc->out.size() || part.lse.size() != acc->lse.size()) {
    return InvalidArgument("merging a partial of " + std::to_string(part.num_heads) + " heads × " +
                           std::to_string(part.head_dim) + " into one of " + std::to_string(acc->num_heads) +
                           " × " + std::to_string(acc->head_dim));
  }
  for (uint32_t h = 0; h < acc->num_heads; ++h) {
    const float sa = acc->lse[h], sb = part.lse[h];
    const float m = std::max(sa, sb);
    if (m == kMinusInf) continue;  // both empty
    const float wa = std::exp(sa - m), wb = std::exp(sb - m);
    const float total = wa + wb;
    float* va = acc->out.data() + uint64_t{h} * acc->head_dim;
    const float* vb = part.out.data() + uint64_t{h} * acc->head_dim;
    for (uint32_t d = 0; d < acc->head_dim; ++d) va[d] = (wa * va[d] + wb * vb[d]) / total;
    acc->lse[h] = m + std::log(total);
  }
  return Status::Ok();
}

}  // namespace cxlkv::pnm
