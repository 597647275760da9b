// Shared set-up for the RPC tests: a test service whose handlers echo, count in the pool
// (exactly-once checks survive a server's death) and stall, served from a child process.
#ifndef CXLKV_TESTS_RPC_RPC_TEST_UTIL_H_
#define CXLKV_TESTS_RPC_RPC_TEST_UTIL_H_

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "../pool/pool_test_util.h"
#include "child.h"
#include "rpc/client.h"
#include "rpc/server.h"

namespace cxlkv::testing {

inline constexpr uint32_t kEcho = 1;
inline constexpr uint32_t kAdd = 2;   // not idempotent: counter += 1 in the pool, returns the new value
inline constexpr uint32_t kSlow = 3;  // echoes after 300 ms
inline constexpr uint32_t kAddThenStall = 4;  // as kAdd, then stalls 300 ms before answering
inline constexpr char kService[] = "test";
inline constexpr char kCounterRoot[] = "test.counter";

// The counter every server of the test service adds to: a word in the pool, by root name.
inline Result<uint64_t> CounterOffset(Pool& pool) {
  auto root = pool.Get(kCounterRoot);
  if (root.ok()) return root->offset;
  CXLKV_ASSIGN_OR_RETURN(uint64_t off, pool.Alloc(64));
  auto& meta = Meta(pool);
  meta.Publish(region::Offset<void>(off).byte_offset(), 0);
  Status put = pool.Put(kCounterRoot, off, 64);
  if (put.ok()) return off;
  (void)pool.Free(off);
  CXLKV_ASSIGN_OR_RETURN(auto again, pool.Get(kCounterRoot));
  return again.offset;
}

inline uint64_t ReadCounter(Pool& pool) {
  auto off = CounterOffset(pool);
  if (!off.ok()) return ~0ull;
  return Meta(pool).Fetch(region::Offset<void>(*off).byte_offset());
}

inline std::map<uint32_t, rpc::Handler> TestOps(Pool& pool, uint64_t counter_off) {
  std::map<uint32_t, rpc::Handler> ops;
  auto echo = [](const rpc::Request& r, std::span<uint8_t> out) -> Result<size_t> {
    if (r.payload.size() > out.size()) return InvalidArgument("echo too long");
    std::memcpy(out.data(), r.payload.data(), r.payload.size());
    return r.payload.size();
  };
  ops[kEcho] = {echo, true};
  region::MetaAccess* meta = &Meta(pool);
  const uint64_t at = region::Offset<void>(counter_off).byte_offset();
  ops[kAdd] = {[meta, at](const rpc::Request& r, std::span<uint8_t> out) -> Result<size_t> {
                 const uint64_t v = meta->Fetch(at) + 1;
                 CXLKV_RETURN_IF_ERROR(r.server->Fence());  // right before the write
                 meta->Publish(at, v);
                 std::memcpy(out.data(), &v, 8);
                 return 8;
               },
               false};
  ops[kAddThenStall] = {[add = ops[kAdd].run](const rpc::Request& r, std::span<uint8_t> out) -> Result<size_t> {
                         auto n = add(r, out);
                         std::this_thread::sleep_for(std::chrono::milliseconds(300));
                         return n;
                       },
                       false};
  ops[kSlow] = {[echo](const rpc::Request& r, std::span<uint8_t> out) -> Result<size_t> {
                  std::this_thread::sleep_for(std::chrono::milliseconds(300));
                  return echo(r, out);
                },
                true};
  return ops;
}

// A child serving (or standing by for) the test service as `node`: replies 1 once started
// (2 once serving, when `wait_serving`), exits cleanly on any command. ForkServer returns once
// it replied; its pid is -1 when it did not.
// With `sim_seed`, behind the non-coherent simulator; `chaos` false turns its random write-backs
// and evictions off, so a missing flush or invalidate hangs instead of being rescued by luck.
inline Child ForkServerNoWait(const std::string& path, uint32_t node, bool wait_serving, uint64_t sim_seed = 0,
                              bool chaos = true) {
  return Child::Fork([path, node, wait_serving, sim_seed, chaos](int in, int out) {
    auto pool = OpenOrNull({path}, node, sim_seed);
    if (!pool) return 1;
    if (sim_seed != 0 && !chaos) Meta(*pool).simulator()->SetChaos(false);
    auto counter = CounterOffset(*pool);
    if (!counter.ok()) return 2;
    auto server = rpc::RpcServer::Start(*pool, kService, TestOps(*pool, *counter));
    if (!server.ok()) {
      std::fprintf(stderr, "server start: %s\n", server.status().ToString().c_str());
      return 3;
    }
    if (wait_serving && !(*server)->WaitServing(std::chrono::seconds(20))) return 4;
    Put(out, wait_serving ? 2 : 1);
    uint64_t cmd;
    Get(in, &cmd);
    return 0;
  });
}

inline Child ForkServer(const std::string& path, uint32_t node, bool wait_serving, uint64_t sim_seed = 0,
                        bool chaos = true) {
  Child c = ForkServerNoWait(path, node, wait_serving, sim_seed, chaos);
  uint64_t ready = 0;
  if (!c.Receive(&ready) || ready != (wait_serving ? 2u : 1u)) {
    c.Wait();
    c.pid = -1;
  }
  return c;
}

// Tells a child waiting for a command to finish; its exit code (0: clean).
inline int StopChild(Child& c) {
  c.Send(0);
  return c.Wait();
}

inline std::vector<uint8_t> Bytes(uint64_t seed, size_t n) {
  std::vector<uint8_t> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(seed * 131 + i * 7);
  return b;
}

}  // namespace cxlkv::testing

#endif  // CXLKV_TESTS_RPC_RPC_TEST_UTIL_H_
