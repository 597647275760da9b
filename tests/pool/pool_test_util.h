// Shared set-up for pool tests: a pool in /dev/shm, a counter published as a root, children
// that open the pool as a given node.
#ifndef CXLKV_TESTS_POOL_POOL_TEST_UTIL_H_
#define CXLKV_TESTS_POOL_POOL_TEST_UTIL_H_

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "pool/pool_internal.h"
#include "region/region_internal.h"
#include "test_region.h"

namespace cxlkv::testing {

#if defined(CXLKV_ASAN) || defined(CXLKV_TSAN)
// Sanitizers slow every thread 3-10x and the tests run two at a time on two cores: a beat thread
// starved that long must not look like a pause past the lease (which the fence then acts on).
inline constexpr uint32_t kTestLeaseMs = 1000;
#else
inline constexpr uint32_t kTestLeaseMs = 400;
#endif
// For in-process tests that are not about the node's lease: long enough that a beat thread
// starved on a loaded two-core sanitizer run never ends the node's life midway (a service then
// forgets what it held for the old life, and the test fails for a reason it does not test).
inline constexpr uint32_t kQuietLeaseMs = 5000;

// `sim_quiet_cache`: with a seed, the simulated cache writes back only what is flushed
// (RegionAttachOptions::sim_quiet_cache).
inline std::unique_ptr<Pool> OpenOrNull(const std::vector<std::string>& paths, uint32_t node,
                                        uint64_t sim_seed = 0, uint32_t lease_ms = kTestLeaseMs,
                                        bool sim_quiet_cache = false) {
  PoolOpenOptions o;
  o.node_id = node;
  o.lease_ms = lease_ms;
  o.attach.sim_seed = sim_seed;
  o.attach.sim_quiet_cache = sim_quiet_cache;
  auto p = Pool::Open(paths, o);
  if (!p.ok()) {
    std::fprintf(stderr, "open as node %u: %s\n", node, p.status().ToString().c_str());
    return nullptr;
  }
  return std::move(p).value();
}

inline region::MetaAccess& Meta(Pool& p) { return p.impl().regions[0]->impl().meta(); }

}  // namespace cxlkv::testing

#endif  // CXLKV_TESTS_POOL_POOL_TEST_UTIL_H_
