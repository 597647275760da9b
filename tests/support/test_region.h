// Helpers for tests that need a real region or real processes.
#ifndef CXLKV_TESTS_SUPPORT_TEST_REGION_H_
#define CXLKV_TESTS_SUPPORT_TEST_REGION_H_

#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "cxlkv/region.h"

namespace cxlkv::testing {

// A unique path under /dev/shm, removed (with any staging leftovers) when it goes out of scope.
class TempRegionPath {
 public:
  explicit TempRegionPath(const std::string& tag);
  ~TempRegionPath();
  TempRegionPath(const TempRegionPath&) = delete;
  TempRegionPath& operator=(const TempRegionPath&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Creates a region at `path` or fails the test (ASSERT-style: returns nullptr after a failure).
std::unique_ptr<Region> CreateOrDie(const std::string& path, uint64_t size,
                                    uint32_t max_nodes = 16);

// Forks `n` children; child i runs body(i) and exits with its return value (0 = success).
// Returns each child's exit code (a signal shows as 128 + signo). Children must not use gtest
// assertions: report with CHILD_CHECK.
std::vector<int> RunForked(int n, const std::function<int(int)>& body);

// The seeds a simulator test runs. The optimized build runs every one: there the seeds are the
// point, each a different interleaving of the protocol. A sanitizer build runs the first two:
// there the point is memory and race errors on the code paths, which every seed walks, and each
// seed costs 3-10 times as much (the sanitizer suites were most of the test command's time).
inline std::vector<uint64_t> SimSeeds(std::initializer_list<uint64_t> all) {
#if defined(CXLKV_ASAN) || defined(CXLKV_TSAN)
  return {all.begin(), all.begin() + std::min<size_t>(all.size(), 2)};
#else
  return {all.begin(), all.end()};
#endif
}

}  // namespace cxlkv::testing

// In a forked child: on failure print where and why, and return 1 from the body.
#define CHILD_CHECK(cond, ...)                                               \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::fprintf(stderr, "%s:%d: child check failed: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                     \
      std::fprintf(stderr, "\n");                                            \
      return 1;                                                              \
    }                                                                        \
  } while (0)

#endif  // CXLKV_TESTS_SUPPORT_TEST_REGION_H_
