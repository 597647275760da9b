// The flush audit (docs/protocol.md, "Every flush and the test that needs it").
//
// Under the non-coherent simulator, every Flush and Invalidate of the metadata accessor carries
// its call site (file:line). Two environment variables, read when a simulator is attached, let
// scripts/flush-audit check that the tests would notice each one missing:
//   CXLKV_SIM_SITES=PATH   append every distinct site this process exercises to PATH
//                          ("flush src/alloc/allocator.cc:87"), one line each;
//   CXLKV_SIM_DROP=SITE    skip the flushes and invalidates at SITE ("src/alloc/allocator.cc:87";
//                          several separated by commas): the protocol as if that line were gone.
// Hardware mode never reads them: production code has no way to drop a flush.
//
// Thread-safety: Observe may be called concurrently (one mutex; simulator paths only).
#ifndef CXLKV_SRC_REGION_SIM_AUDIT_H_
#define CXLKV_SRC_REGION_SIM_AUDIT_H_

#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>

namespace cxlkv::region {

enum class SimSiteKind { kFlush, kInvalidate };

// Where a flush or invalidate was called: the caller's __builtin_FILE / __builtin_LINE.
struct CallSite {
  const char* file;
  unsigned line;
};

class SimSiteAudit {
 public:
  // Null when neither variable is set (the common case: nothing to record or drop).
  static std::unique_ptr<SimSiteAudit> FromEnvironment();

  // Records the site; returns true when the caller must skip the flush or invalidate.
  bool Observe(SimSiteKind kind, const CallSite& site);

  // "src/alloc/allocator.cc:87" for a site: the path from its last "src/" on (stable across
  // checkouts and build directories).
  static std::string SiteName(const CallSite& site);

 private:
  SimSiteAudit() = default;
  std::unordered_set<std::string> drop_;
  std::string sites_path_;
  std::mutex mu_;
  std::unordered_set<std::string> seen_;
};

}  // namespace cxlkv::region

#endif  // CXLKV_SRC_REGION_SIM_AUDIT_H_
