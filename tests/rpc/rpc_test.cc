// The shared-memory RPC across real processes on one real region, and under the non-coherent
// simulator: bytes echoed back equal, exact counts with many clients and requests in flight,
// malformed requests, a client killed mid-request, a server killed (kill -9) or paused
// (SIGSTOP past its lease) while a standby takes over, a corrupted area.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>

#include "rpc_test_util.h"

namespace cxlkv::testing {
namespace {

using namespace std::chrono_literals;

std::string MakePool(const TempRegionPath& path) {
  PoolCreateOptions o;
  o.size = 64 << 20;
  o.max_nodes = 8;
  o.overwrite = true;
  EXPECT_TRUE(Pool::Create({path.path()}, o).ok());
  return path.path();
}

std::unique_ptr<rpc::RpcClient> OpenClient(Pool& pool, std::chrono::milliseconds timeout = 10s) {
  rpc::RpcClientOptions o;
  o.timeout = timeout;
  auto c = rpc::RpcClient::Open(pool, kService, o);
  if (!c.ok()) {
    std::fprintf(stderr, "client: %s\n", c.status().ToString().c_str());
    return nullptr;
  }
  return std::move(c).value();
}

// Echoes of many sizes (one line and several), bursts of posted echoes behind one doorbell, then
// adds one at a time and a full ring at once.
// `chaos` as in ForkServer; `timeout` bounds every wait.
int EchoAndAdd(const std::string& path, uint32_t node, int echoes, int adds, uint64_t sim_seed = 0,
               bool chaos = true, std::chrono::milliseconds timeout = 10s) {
  auto pool = OpenOrNull({path}, node, sim_seed);
  CHILD_CHECK(pool != nullptr, "open");
  if (sim_seed != 0 && !chaos) Meta(*pool).simulator()->SetChaos(false);
  auto client = OpenClient(*pool, timeout);
  CHILD_CHECK(client != nullptr, "client");
  std::vector<uint8_t> out(client->response_capacity());
  for (int k = 0; k < echoes; ++k) {
    auto in = Bytes(node * 100000 + k, 1 + (k * 37) % client->request_capacity());
    auto n = client->Call(kEcho, in, out);
    CHILD_CHECK(n.ok(), "echo %d: %s", k, n.status().ToString().c_str());
    CHILD_CHECK(*n == in.size() && std::memcmp(out.data(), in.data(), in.size()) == 0, "echo %d differs", k);
  }
  // Posted in a burst behind one doorbell (one-line and longer requests mixed), answered out
  // of ring order: the oldest last.
  for (int round = 0; round < 3; ++round) {
    std::vector<std::vector<uint8_t>> sent;
    std::vector<rpc::RpcClient::Ticket> tickets;
    for (int q = 0; q < 6; ++q) {
      const size_t size = (q % 2 == 0) ? 1 + (q * 13 + round) % 48 : 49 + (q * 71 + round * 29) % (client->request_capacity() - 48);
      sent.push_back(Bytes(node * 7000 + round * 10 + q, size));
      auto t = client->Post(kEcho, sent.back());
      CHILD_CHECK(t.ok(), "post: %s", t.status().ToString().c_str());
      tickets.push_back(*t);
    }
    if (round != 1) client->Ring();  // round 1: Wait rings
    for (int q = 5; q >= 0; --q) {
      auto n = client->Wait(tickets[q], out, rpc::RpcClient::Clock::now() + timeout);
      CHILD_CHECK(n.ok(), "posted echo %d: %s", q, n.status().ToString().c_str());
      CHILD_CHECK(*n == sent[q].size() && std::memcmp(out.data(), sent[q].data(), *n) == 0, "posted echo %d differs", q);
    }
  }
  uint64_t last = 0;
  int done = 0;
  while (done < adds) {
    // As many requests in flight as the ring holds, then their answers in order.
    std::vector<rpc::RpcClient::Ticket> tickets;
    for (int q = 0; q < 8 && done + static_cast<int>(tickets.size()) < adds; ++q) {
      auto t = client->Submit(kAdd, {});
      CHILD_CHECK(t.ok(), "submit: %s", t.status().ToString().c_str());
      tickets.push_back(*t);
    }
    for (auto t : tickets) {
      auto n = client->Wait(t, out, rpc::RpcClient::Clock::now() + timeout);
      CHILD_CHECK(n.ok() && *n == 8, "add: %s", n.status().ToString().c_str());
      uint64_t v;
      std::memcpy(&v, out.data(), 8);
      CHILD_CHECK(v > last, "counter went from %llu to %llu", (unsigned long long)last, (unsigned long long)v);
      last = v;
      ++done;
    }
  }
  return 0;
}

TEST(Rpc, EchoesAndExactCountsWithThreeClientProcesses) {
  TempRegionPath path("rpc");
  MakePool(path);
  Child server = ForkServer(path.path(), 0, true);
  ASSERT_GT(server.pid, 0);
  auto codes = RunForked(3, [&](int i) { return EchoAndAdd(path.path(), 1 + i, 200, 300); });
  for (int c : codes) EXPECT_EQ(c, 0);
  EXPECT_EQ(StopChild(server), 0);
  auto pool = OpenOrNull({path.path()}, 7);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(ReadCounter(*pool), 900u);
}

TEST(Rpc, RoundTripsUnderTheNonCoherentSimulatorWithManySeeds) {
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    TempRegionPath path("rpcsim");
    MakePool(path);
    Child server = ForkServer(path.path(), 0, true, seed * 100);
    ASSERT_GT(server.pid, 0);
    auto codes = RunForked(2, [&](int i) { return EchoAndAdd(path.path(), 1 + i, 60, 60, seed * 100 + 1 + i); });
    for (int c : codes) EXPECT_EQ(c, 0);
    EXPECT_EQ(StopChild(server), 0);
    auto pool = OpenOrNull({path.path()}, 7);
    ASSERT_NE(pool, nullptr);
    EXPECT_EQ(ReadCounter(*pool), 120u);
  }
}

// The same with the simulator's random write-backs and evictions off: nothing but the protocol's
// own flushes and invalidates carries a request or an answer between processes, so one left out
// hangs its wait (and fails it) instead of being rescued by a lucky eviction (the flush audit).
TEST(Rpc, RoundTripsUnderTheSimulatorWithoutChaos) {
  for (uint64_t seed : SimSeeds({1, 2})) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    TempRegionPath path("rpcquiet");
    MakePool(path);
    Child server = ForkServer(path.path(), 0, true, seed * 100, false);
    ASSERT_GT(server.pid, 0);
    auto codes = RunForked(2, [&](int i) { return EchoAndAdd(path.path(), 1 + i, 30, 30, seed * 100 + 1 + i, false, 3s); });
    for (int c : codes) EXPECT_EQ(c, 0);
    EXPECT_EQ(StopChild(server), 0);
    auto pool = OpenOrNull({path.path()}, 7);
    ASSERT_NE(pool, nullptr);
    EXPECT_EQ(ReadCounter(*pool), 60u);
  }
}

TEST(Rpc, MalformedRequestsGetAnErrorAndTheServerKeepsServing) {
  TempRegionPath path("rpcbad");
  MakePool(path);
  Child server = ForkServer(path.path(), 0, true);
  ASSERT_GT(server.pid, 0);
  auto codes = RunForked(1, [&](int) {
    auto pool = OpenOrNull({path.path()}, 1);
    CHILD_CHECK(pool != nullptr, "open");
    auto client = OpenClient(*pool);
    CHILD_CHECK(client != nullptr, "client");
    auto unknown = client->Call(99, Bytes(1, 10));
    CHILD_CHECK(!unknown.ok() && unknown.status().code() == StatusCode::kInvalidArgument &&
                    unknown.status().message().find("no opcode 99") != std::string::npos,
                "unknown opcode: %s", unknown.status().ToString().c_str());
    auto big = client->Submit(kEcho, Bytes(2, client->request_capacity() + 1));
    CHILD_CHECK(!big.ok() && big.status().code() == StatusCode::kInvalidArgument, "oversized accepted");
    // A forged request whose length overruns its slot, as a broken or hostile client writes it.
    const auto& area = client->area();
    const uint32_t channel = client->channel();
    const uint64_t seq = 2;  // the unknown-opcode call above was request 1
    const uint64_t req = area.request(1, channel, 1);
    auto& meta = Meta(*pool);
    meta.Store(req + 8, (uint64_t{kEcho} << 32) | 0x7fffffffu);
    meta.Flush(req, 16);
    meta.Publish(req, seq);
    const uint64_t resp = area.response(1, channel, 1);
    auto deadline = std::chrono::steady_clock::now() + 10s;
    while (meta.Fetch(resp) != rpc::ResponseWord(seq, rpc::SlotState::kDone)) {
      CHILD_CHECK(std::chrono::steady_clock::now() < deadline, "forged request not answered");
      std::this_thread::sleep_for(1ms);
    }
    const uint64_t word1 = meta.Load(resp + 8);
    CHILD_CHECK((word1 >> 32) == static_cast<uint64_t>(StatusCode::kInvalidArgument), "forged request: status %llu",
                (unsigned long long)(word1 >> 32));
    client.reset();
    // A fresh client on the channel resumes after the forged request, and is served.
    auto again = OpenClient(*pool);
    CHILD_CHECK(again != nullptr, "client again");
    auto echo = again->Call(kEcho, Bytes(3, 100));
    CHILD_CHECK(echo.ok() && *echo == Bytes(3, 100), "echo after malformed: %s", echo.status().ToString().c_str());
    return 0;
  });
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(StopChild(server), 0);
}

TEST(Rpc, AClientKilledMidRequestLeavesItsNodesChannelsUsable) {
  TempRegionPath path("rpckill");
  MakePool(path);
  Child server = ForkServer(path.path(), 0, true);
  ASSERT_GT(server.pid, 0);
  Child victim = Child::Fork([&](int, int out) {
    auto pool = OpenOrNull({path.path()}, 1);
    if (!pool) return 1;
    auto client = OpenClient(*pool);
    if (!client) return 2;
    if (!client->Submit(kSlow, Bytes(4, 64)).ok()) return 3;
    Put(out, 1);
    for (;;) std::this_thread::sleep_for(1s);
  });
  uint64_t submitted = 0;
  ASSERT_TRUE(victim.Receive(&submitted));
  ::kill(victim.pid, SIGKILL);
  EXPECT_EQ(victim.Wait(), 128 + SIGKILL);
  auto codes = RunForked(2, [&](int) {
    auto pool = OpenOrNull({path.path()}, 1);  // the victim's node, perhaps its process slot
    CHILD_CHECK(pool != nullptr, "open");
    auto client = OpenClient(*pool);
    CHILD_CHECK(client != nullptr, "client");
    for (int k = 0; k < 50; ++k) {
      auto echo = client->Call(kEcho, Bytes(k, 200));
      CHILD_CHECK(echo.ok() && *echo == Bytes(k, 200), "echo %d: %s", k, echo.status().ToString().c_str());
    }
    return 0;
  });
  for (int c : codes) EXPECT_EQ(c, 0);
  EXPECT_EQ(StopChild(server), 0);
}

// A client adding one call after another (200 µs apart, so a phase lasts tens of ms), counting
// answers and calls whose outcome it cannot know. At each milestone (answered adds) it reports
// its count and waits for a command to go on; after the last it reports the unknown count.
Child ForkAdder(const std::string& path, uint32_t node, std::vector<uint64_t> milestones) {
  return Child::Fork([path, node, milestones](int in, int out) {
    auto pool = OpenOrNull({path}, node);
    if (!pool) return 1;
    auto client = OpenClient(*pool, 20s);
    if (!client) return 2;
    uint64_t ok = 0, unknown = 0;
    for (uint64_t milestone : milestones) {
      while (ok < milestone) {
        auto n = client->Call(kAdd, {});
        if (n.ok()) {
          ++ok;
        } else if (n.status().code() == StatusCode::kUnavailable) {
          ++unknown;
          std::this_thread::sleep_for(20ms);
        } else if (n.status().code() == StatusCode::kBusy) {
          std::this_thread::sleep_for(20ms);  // abandoned slots wait for a successor's answers
        } else {
          std::fprintf(stderr, "add: %s\n", n.status().ToString().c_str());
          return 3;
        }
        std::this_thread::sleep_for(200us);
      }
      Put(out, ok);
      uint64_t go;
      if (!Get(in, &go)) return 4;
    }
    Put(out, unknown);
    uint64_t cmd;
    Get(in, &cmd);
    return 0;
  });
}

void CheckExactlyOnce(const std::string& path, uint64_t ok, uint64_t unknown) {
  auto pool = OpenOrNull({path}, 7);
  ASSERT_NE(pool, nullptr);
  const uint64_t counter = ReadCounter(*pool);
  EXPECT_GE(counter, ok) << "an answered add was lost";
  EXPECT_LE(counter, ok + unknown) << "an add ran twice";
}

TEST(Rpc, AServerKilledNineIsReplacedByAStandbyAndNoAddRunsTwice) {
  TempRegionPath path("rpcfail");
  MakePool(path);
  Child first = ForkServer(path.path(), 0, true);
  ASSERT_GT(first.pid, 0);
  Child standby = ForkServer(path.path(), 2, false);
  ASSERT_GT(standby.pid, 0);
  Child adder = ForkAdder(path.path(), 1, {100, 300});
  uint64_t ok = 0;
  ASSERT_TRUE(adder.Receive(&ok));
  adder.Send(1);
  std::this_thread::sleep_for(5ms);
  ::kill(first.pid, SIGKILL);  // while the adder calls: requests in flight
  EXPECT_EQ(first.Wait(), 128 + SIGKILL);
  ASSERT_TRUE(adder.Receive(&ok));  // two hundred more answered adds, served by the standby
  adder.Send(1);
  uint64_t unknown = 0;
  ASSERT_TRUE(adder.Receive(&unknown));
  EXPECT_EQ(StopChild(adder), 0);
  EXPECT_EQ(StopChild(standby), 0);
  EXPECT_GE(ok, 200u);
  CheckExactlyOnce(path.path(), ok, unknown);
}

// A server behind the simulator (no random write-backs) killed after running a non-idempotent
// request but before answering it: what it did not flush died with it, so only its published
// "accepted" word tells the standby not to run the request again.
TEST(Rpc, AServerKilledAfterAcceptingUnderTheSimulatorLeavesItsOutcomeUnknown) {
  TempRegionPath path("rpcaccept");
  MakePool(path);
  Child first = ForkServer(path.path(), 0, true, 4242, false);
  ASSERT_GT(first.pid, 0);
  Child standby = ForkServer(path.path(), 2, false);
  ASSERT_GT(standby.pid, 0);
  Child caller = Child::Fork([&](int, int out) {
    auto pool = OpenOrNull({path.path()}, 1);
    if (!pool) return 1;
    auto client = OpenClient(*pool, 20s);
    if (!client) return 2;
    auto n = client->Call(kAddThenStall, {});
    Put(out, n.ok() ? 0 : static_cast<uint64_t>(n.status().code()));
    return 0;
  });
  {
    auto pool = OpenOrNull({path.path()}, 7);
    ASSERT_NE(pool, nullptr);
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (ReadCounter(*pool) != 1 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
    ASSERT_EQ(ReadCounter(*pool), 1u) << "the first server never ran the add";
  }
  ::kill(first.pid, SIGKILL);  // the add ran; its answer is 300 ms away
  EXPECT_EQ(first.Wait(), 128 + SIGKILL);
  uint64_t code = 0;
  ASSERT_TRUE(caller.Receive(&code));
  EXPECT_EQ(code, static_cast<uint64_t>(StatusCode::kUnavailable)) << "the add's outcome should be unknown";
  EXPECT_EQ(caller.Wait(), 0);
  EXPECT_EQ(StopChild(standby), 0);
  auto pool = OpenOrNull({path.path()}, 7);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(ReadCounter(*pool), 1u) << "the standby ran the accepted add again";
}

TEST(Rpc, AServerPausedPastItsLeaseIsFencedAndItsStandbyServes) {
  TempRegionPath path("rpcpause");
  MakePool(path);
  Child first = ForkServer(path.path(), 0, true);
  ASSERT_GT(first.pid, 0);
  Child standby = ForkServer(path.path(), 2, false);
  ASSERT_GT(standby.pid, 0);
  Child adder = ForkAdder(path.path(), 1, {50, 150, 250});
  uint64_t ok = 0;
  ASSERT_TRUE(adder.Receive(&ok));
  adder.Send(1);
  std::this_thread::sleep_for(5ms);
  ::kill(first.pid, SIGSTOP);
  ASSERT_TRUE(adder.Receive(&ok));  // answered while the first server is stopped: the standby serves
  ::kill(first.pid, SIGCONT);       // resumes into a refused fence: it publishes nothing
  adder.Send(1);
  ASSERT_TRUE(adder.Receive(&ok));
  adder.Send(1);
  {
    auto pool = OpenOrNull({path.path()}, 6);
    ASSERT_NE(pool, nullptr);
    auto area = rpc::RpcArea::Open(*pool, kService);
    ASSERT_TRUE(area.ok());
    const uint64_t word = (*area)->meta().Fetch((*area)->server_word());
    EXPECT_EQ(rpc::ServerNode(word), 2u) << "the resumed server took the service back";
  }
  uint64_t unknown = 0;
  ASSERT_TRUE(adder.Receive(&unknown));
  EXPECT_EQ(StopChild(adder), 0);
  EXPECT_EQ(StopChild(first), 0);
  EXPECT_EQ(StopChild(standby), 0);
  CheckExactlyOnce(path.path(), ok, unknown);
}

TEST(Rpc, NoServerFailsCleanlyInsteadOfHanging) {
  TempRegionPath path("rpcnone");
  MakePool(path);
  auto pool = OpenOrNull({path.path()}, 1);
  ASSERT_NE(pool, nullptr);
  auto missing = rpc::RpcClient::Open(*pool, kService);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(rpc::RpcArea::OpenOrCreate(*pool, kService).ok());  // an area nobody serves
  auto client = OpenClient(*pool, 30s);
  ASSERT_NE(client, nullptr);
  auto t0 = std::chrono::steady_clock::now();
  auto r = client->Call(kEcho, Bytes(1, 8));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 25s);
}

TEST(Rpc, ACorruptedOrForeignAreaIsRefusedByName) {
  TempRegionPath path("rpccorrupt");
  MakePool(path);
  auto pool = OpenOrNull({path.path()}, 1);
  ASSERT_NE(pool, nullptr);
  auto area = rpc::RpcArea::OpenOrCreate(*pool, kService);
  ASSERT_TRUE(area.ok());
  auto& meta = (*area)->meta();
  const uint64_t header = (*area)->server_word() - rpc::kLine;
  const uint64_t magic = meta.Load(header);
  meta.Publish(header + 16, 0xffffffffull);  // clients per node and depth, checksum now stale
  auto bad = rpc::RpcArea::Open(*pool, kService);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kCorrupted);
  EXPECT_NE(bad.status().message().find("checksum"), std::string::npos) << bad.status().message();
  meta.Publish(header, 0x1234);
  bad = rpc::RpcArea::Open(*pool, kService);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("magic"), std::string::npos) << bad.status().message();
  meta.Publish(header, magic);
  auto big = rpc::RpcArea::OpenOrCreate(*pool, "other", {.clients_per_node = 65});
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), StatusCode::kInvalidArgument);
  auto name = rpc::RpcArea::OpenOrCreate(*pool, "Bad Name");
  EXPECT_EQ(name.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cxlkv::testing
