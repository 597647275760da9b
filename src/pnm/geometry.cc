#include "pnm/geometry.h"

#include <string>

namespace cxlkv::pnm {

Status Geometry::Validate() const {
  if (num_heads == 0 || num_kv_heads == 0 || head_dim == 0 || page_tokens == 0) {
    return InvalidArgument("attention geometry: num_heads, num_kv_heads, head_dim and page_tokens must be > 0");
  }
  if (num_heads % num_kv_heads != 0) {
    return InvalidArgument("attention geometry: num_heads " + std::to_string(num_heads) +
                                   " is not a multiple of num_kv_heads " + std::to_string(num_kv_heads));
  }
  // The kernels step 16 lanes at a time; every model head size in use is a multiple of 16.
  if (head_dim % 16 != 0 || head_dim > 1024) {
    return InvalidArgument("attention geometry: head_dim " + std::to_string(head_dim) +
                                   " must be a multiple of 16 and at most 1024");
  }
  if (page_tokens > 4096) {
    return InvalidArgument("attention geometry: page_tokens " + std::to_string(page_tokens) +
                                   " is above 4096");
  }
  if (dtype != KvDtype::kFp16 && dtype != KvDtype::kBf16 && dtype != KvDtype::kFp32) {
    return InvalidArgument("attention geometry: KV dtype must be fp16, bf16 or fp32 (fp8 is not supported)");
  }
  return Status::Ok();
}

Status ContextView::Validate(const Geometry& g) const {
  if (g.PagesFor(tokens) != pages.size()) {
    return InvalidArgument("context of " + std::to_string(tokens) + " tokens needs " +
                                   std::to_string(g.PagesFor(tokens)) + " pages of " +
                                   std::to_string(g.page_tokens) + ", got " + std::to_string(pages.size()));
  }
  for (const PageKv& p : pages) {
    if (p.k == nullptr || p.v == nullptr) return InvalidArgument("context page with a null K or V pointer");
  }
  return Status::Ok();
}

}  // namespace cxlkv::pnm
