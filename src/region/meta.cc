#include "region/meta.h"

#include <cstdio>
#include <cstdlib>

namespace cxlkv::region {

MetaAccess::MetaAccess(uint8_t* base, uint64_t size, CoherenceMode mode)
    : base_(base), size_(size), mode_(mode) {}

void MetaAccess::AttachSimulator(const SimOptions& options) {
  sim_ = std::make_unique<NcSimCache>(base_, size_, options);
  audit_ = SimSiteAudit::FromEnvironment();
}

void MetaAccess::SimFlush(uint64_t off, size_t n, const CallSite& site) {
  if (audit_ && audit_->Observe(SimSiteKind::kFlush, site)) return;
  sim_->Flush(off, n);
}

void MetaAccess::SimInvalidate(uint64_t off, size_t n, const CallSite& site) {
  if (audit_ && audit_->Observe(SimSiteKind::kInvalidate, site)) return;
  sim_->Invalidate(off, n);
}

void MetaAccess::OutOfBounds(uint64_t off, size_t n) const {
  // A metadata access outside the region (or a misaligned word) is a bug in cxlkv: stop before
  // it corrupts what other hosts published.
  std::fprintf(stderr, "cxlkv: metadata access [%llu, +%zu) outside region of %llu bytes or misaligned\n",
               static_cast<unsigned long long>(off), n, static_cast<unsigned long long>(size_));
  std::abort();
}

}  // namespace cxlkv::region
