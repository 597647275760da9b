// A lock under test: a pool, one user lock, and a published counter that children increment
// under the lock — an exact count proves no two holders ever overlapped.
#ifndef CXLKV_TESTS_POOL_LOCK_TEST_UTIL_H_
#define CXLKV_TESTS_POOL_LOCK_TEST_UTIL_H_

#include <gtest/gtest.h>

#include "pool_test_util.h"

namespace cxlkv::testing {

struct LockSetup {
  std::string path;
  uint32_t lock = 0;
  uint64_t counter = 0;  // raw offset of a published 64-byte counter
};

// The parent joins as the last node only to allocate the lock and the counter, and leaves before
// forking (no threads may cross a fork).
inline LockSetup Prepare(const std::string& path, uint32_t nodes) {
  LockSetup s{path};
  PoolCreateOptions co;
  co.size = 32 << 20;
  co.max_nodes = nodes + 1;
  EXPECT_TRUE(Pool::Create({path}, co).ok());
  auto p = OpenOrNull({path}, nodes);
  if (!p) return s;
  auto lock = p->AllocateLock();
  EXPECT_TRUE(lock.ok()) << lock.status().ToString();
  s.lock = lock.ok() ? *lock : 0;
  auto off = p->Alloc(64);
  EXPECT_TRUE(off.ok());
  s.counter = *off;
  Meta(*p).Publish(region::Offset<void>(s.counter).byte_offset(), 0);
  EXPECT_TRUE(p->Put("counter", s.counter, 64).ok());
  return s;
}

inline uint64_t ReadCounter(const LockSetup& s) {
  auto r = Region::Attach(s.path);
  EXPECT_TRUE(r.ok());
  return (*r)->impl().meta().Fetch(region::Offset<void>(s.counter).byte_offset());
}

// Increments the counter `iterations` times under the lock. A hold the fence refuses (this
// node was paused past its lease) writes nothing and is retried as the node's new life.
// `quiet_cache`: the simulated cache writes nothing back on its own (RegionAttachOptions::
// sim_quiet_cache), so every grant depends on the protocol's own flushes; `deadline` per acquire.
inline int Incrementer(const LockSetup& s, uint32_t node, int iterations, uint64_t sim_seed, bool skip_flush,
                       bool quiet_cache = false, std::chrono::seconds deadline = std::chrono::seconds(30)) {
  auto p = OpenOrNull({s.path}, node, sim_seed, kTestLeaseMs, quiet_cache);
  CHILD_CHECK(p != nullptr, "open");
  auto& n = *p->impl().node;
  n.TestSkipReleaseFlush(skip_flush);
  uint64_t off = region::Offset<void>(s.counter).byte_offset();
  for (int i = 0; i < iterations; ++i) {
    auto held = n.AcquireFor(s.lock, deadline);
    if (!held.ok() && held.status().code() == StatusCode::kLeaseExpired) {
      --i;
      continue;
    }
    CHILD_CHECK(held.ok(), "%s", held.status().ToString().c_str());
    uint64_t v = n.meta().Fetch(off);  // P2 before reading what the last holder wrote
    if (!n.CheckHeld(s.lock).ok()) {   // fence: right before the write
      n.Release(s.lock);
      --i;
      continue;
    }
    n.meta().Store(off, v + 1);
    sync::Range r{off, 8};
    n.Release(s.lock, {&r, 1});        // flushes the counter (P1), then releases
  }
  return 0;
}

}  // namespace cxlkv::testing

#endif  // CXLKV_TESTS_POOL_LOCK_TEST_UTIL_H_
