// Shared checks of the allocator tests: what a fresh attach of the pool reads (not any
// process's own caches) — free chunks, whether an object is allocated, `cxlkv check`'s
// findings — and the end of a test whose other processes are gone.
#ifndef CXLKV_TESTS_POOL_ALLOC_TEST_UTIL_H_
#define CXLKV_TESTS_POOL_ALLOC_TEST_UTIL_H_

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "child.h"
#include "pool_test_util.h"

namespace cxlkv::testing {

// Free chunks over every region of the pool.
inline uint64_t FreeChunks(const std::vector<std::string>& paths) {
  auto regions = pool::AttachAll(paths);
  EXPECT_TRUE(regions.ok());
  if (!regions.ok()) return 0;
  uint64_t free = 0;
  for (auto& r : *regions) free += alloc::InspectChunks(*r, r->info().max_nodes).free;
  return free;
}

// Whether the object at pool offset `off` (in the first region) is allocated.
inline bool Allocated(const std::vector<std::string>& paths, uint64_t off) {
  auto regions = pool::AttachAll(paths);
  EXPECT_TRUE(regions.ok());
  if (!regions.ok()) return false;
  Region& first = *(*regions)[0];
  return alloc::IsAllocated(first, region::Offset<void>(off).byte_offset(), first.info().max_nodes);
}

inline std::vector<std::string> CheckProblems(const std::vector<std::string>& paths) {
  auto regions = pool::AttachAll(paths);
  EXPECT_TRUE(regions.ok());
  if (!regions.ok()) return {"the pool cannot be attached: " + regions.status().ToString()};
  return pool::Check(*regions);
}

inline void ExpectNoProblems(const std::vector<std::string>& paths) {
  for (const auto& p : CheckProblems(paths)) ADD_FAILURE() << p;
}

inline void SleepLeases(double leases) {
  std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(leases * kTestLeaseMs)));
}

// Once the test's other processes have left: two leases for the recoveries of their lives,
// then `survivor` trims and closes; every chunk is free again and `check` is clean.
inline void ExpectEverythingReturned(std::unique_ptr<Pool>& survivor, const std::vector<std::string>& paths,
                                     uint64_t total_free_chunks) {
  SleepLeases(2);
  survivor->impl().allocator->Trim();
  survivor.reset();
  EXPECT_EQ(FreeChunks(paths), total_free_chunks) << "chunks leaked";
  ExpectNoProblems(paths);
}

// A process that opens the pool as `node` and frees each of `count` offsets the parent sends
// (through the owner's ring where another node owns it), then reports 1. Exit 0: all freed.
inline Child ForkFreer(const std::vector<std::string>& paths, uint32_t node, uint64_t sim_seed, uint64_t count) {
  return Child::Fork([&paths, node, sim_seed, count](int in, int out) {
    auto p = OpenOrNull(paths, node, sim_seed);
    if (!p) return 1;
    for (uint64_t i = 0; i < count; ++i) {
      uint64_t off;
      if (!Get(in, &off)) return 2;
      Status s = p->Free(off);
      CHILD_CHECK(s.ok(), "free: %s", s.ToString().c_str());
    }
    return Put(out, 1) ? 0 : 4;
  });
}

}  // namespace cxlkv::testing

#endif  // CXLKV_TESTS_POOL_ALLOC_TEST_UTIL_H_
