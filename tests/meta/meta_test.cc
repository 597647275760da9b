// Central metadata (Beluga §6.2; docs/metadata.md): the prefix index written by one metadata
// service over the shared-memory RPC. Real processes on one real region; the service hosted by
// whichever process may host (serving processes stand in for cxlkvd here), moved by kill -9
// and by a pause past the lease; the same protocol under the non-coherent simulator.
#include <signal.h>

#include <atomic>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "../cache/cache_test_util.h"
#include "alloc/chunk_table.h"
#include "cache/inspect.h"
#include "child.h"
#include "meta/client.h"
#include "meta/protocol.h"
#include "meta/service.h"
#include "rpc/area.h"
#include "rpc/client.h"

namespace cxlkv::testing {
namespace {

constexpr uint64_t kBlock = 4096;

// A command to a child that died early fails the test (its Receive or Wait says so) instead of
// killing the test process with SIGPIPE.
[[maybe_unused]] const bool kIgnoreSigpipe = [] {
  ::signal(SIGPIPE, SIG_IGN);
  return true;
}();

Status CreateCentralPool(const std::string& path, uint64_t size = 64ull << 20) {
  PoolCreateOptions co;
  co.size = size;
  co.max_nodes = 8;
  co.overwrite = true;
  co.metadata = MetadataMode::kCentral;
  return Pool::Create({path}, co);
}

// A pool opened as `node` that hosts no service (a client only, like a CLI command).
std::unique_ptr<Pool> OpenClientOnly(const std::string& path, uint32_t node, uint64_t sim_seed = 0) {
  PoolOpenOptions o;
  o.node_id = node;
  o.lease_ms = kTestLeaseMs;
  o.may_host_manager = false;
  o.attach.sim_seed = sim_seed;
  auto p = Pool::Open({path}, o);
  if (!p.ok()) {
    std::fprintf(stderr, "open as node %u: %s\n", node, p.status().ToString().c_str());
    return nullptr;
  }
  return std::move(p).value();
}

// The node whose process serves the metadata service now (-1: none).
int ServingNode(Pool& pool) {
  auto area = rpc::RpcArea::Open(pool, meta::kMetaService);
  if (!area.ok()) return -1;
  const uint64_t w = (*area)->meta().Fetch((*area)->server_word());
  return w == 0 ? -1 : static_cast<int>(rpc::ServerNode(w));
}

bool WaitServingNode(Pool& pool, int node, std::chrono::milliseconds timeout) {
  for (auto end = std::chrono::steady_clock::now() + timeout; std::chrono::steady_clock::now() < end;) {
    if (ServingNode(pool) == node) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// A child that opens the pool as `node` (so it stands by for the service), waits until it
// serves, replies 1, and stays until any command (then exits 0).
Child ForkServingHost(const std::string& path, uint32_t node, uint64_t sim_seed = 0) {
  return Child::Fork([path, node, sim_seed](int in, int out) {
    auto pool = OpenOrNull({path}, node, sim_seed);
    if (!pool || !WaitServingNode(*pool, static_cast<int>(node), std::chrono::seconds(20))) return 1;
    Put(out, 1);
    uint64_t cmd;
    Get(in, &cmd);
    return 0;
  });
}

BlockKey KeyOf(uint64_t i) { return BlockKey{Mix(i + 1), Mix(i + 1000003)}; }

// Reserve + write + commit of one block whose bytes are a function of its key. Ok, or the
// status that stopped it (kAlreadyExists / kBusy when another writer has it).
Status PutBlock(KvCache& cache, const NamespaceHandle& ns, const BlockKey& key) {
  std::vector<uint8_t> data(kBlock);
  FillForKey(key, data.data(), kBlock);
  return cache.Put(ns, key, data.data(), kBlock);
}

// The bytes of every READY block among `keys` equal what its key says; returns how many hit.
size_t VerifyBlocks(KvCache& cache, const NamespaceHandle& ns, std::span<const BlockKey> keys, bool* all_match) {
  size_t hits = 0;
  *all_match = true;
  std::vector<uint8_t> got(kBlock);
  for (const BlockKey& k : keys) {
    auto hit = cache.Lookup(ns, {&k, 1});
    if (!hit.ok() || hit->hit_blocks == 0) continue;
    ++hits;
    if (!cache.Read(hit->pins[0], 0, got.data(), kBlock).ok() || !MatchesKey(k, got.data(), kBlock)) *all_match = false;
    cache.Release(hit->pins);
  }
  return hits;
}

TEST(Meta, InitRecordsTheModeAndTheCacheWorksThroughTheService) {
  TempRegionPath path("meta-basic");
  ASSERT_TRUE(CreateCentralPool(path.path()).ok());
  auto pool = OpenOrNull({path.path()}, 0);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->metadata(), MetadataMode::kCentral);
  ASSERT_TRUE(WaitServingNode(*pool, 0, std::chrono::seconds(10)));
  KvCache& cache = **pool->Cache();
  auto ns = cache.Namespace(TestNamespace());
  ASSERT_TRUE(ns.ok()) << ns.status().ToString();

  // 300 keys: more than one request's worth, so batches are cut and the prefix rule spans them.
  std::vector<BlockKey> keys;
  for (uint64_t i = 0; i < 300; ++i) keys.push_back(KeyOf(i));
  auto many = cache.ReserveMany(*ns, keys, kBlock);
  ASSERT_TRUE(many.ok()) << many.status().ToString();
  ASSERT_EQ(many->size(), keys.size());
  std::vector<Reservation> rs;
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_EQ((*many)[i].outcome, ReserveOutcome::kReserved) << i << ": " << (*many)[i].status.ToString();
    std::vector<uint8_t> data(kBlock);
    FillForKey(keys[i], data.data(), kBlock);
    ASSERT_TRUE(cache.Write((*many)[i].reservation, 0, data.data(), kBlock).ok());
    rs.push_back((*many)[i].reservation);
  }
  // Only the first 250 are committed: lookups stop at the first block that is not READY.
  ASSERT_TRUE(cache.CommitMany(std::span(rs).first(250)).ok());
  ASSERT_TRUE(cache.AbortMany(std::span(rs).subspan(250)).ok());
  auto hit = cache.Lookup(*ns, keys);
  ASSERT_TRUE(hit.ok()) << hit.status().ToString();
  EXPECT_EQ(hit->hit_blocks, 250u);
  {  // One lookup, counted once however many requests it took (300 keys: three).
    auto stat = cache::Stat(*pool->impl().regions[0], {cache::NodeStatus::kLive});
    EXPECT_EQ(stat["totals"]["lookups"].get<uint64_t>(), 1u);
    EXPECT_EQ(stat["totals"]["lookup_blocks"].get<uint64_t>(), 300u);
    EXPECT_EQ(stat["totals"]["hit_blocks"].get<uint64_t>(), 250u);
  }
  std::vector<uint8_t> got(kBlock);
  for (size_t i = 0; i < hit->pins.size(); ++i) {
    ASSERT_TRUE(cache.Read(hit->pins[i], 0, got.data(), kBlock).ok());
    ASSERT_TRUE(MatchesKey(keys[i], got.data(), kBlock)) << i;
  }
  // Pinned blocks are not evicted; released ones are.
  EXPECT_EQ(*cache.Evict(*ns, std::span(keys).first(10)), 0u);
  cache.Release(hit->pins);
  EXPECT_EQ(*cache.Evict(*ns, std::span(keys).first(10)), 10u);
  EXPECT_EQ(*cache.Exists(*ns, keys), 0u);
  EXPECT_EQ(*cache.Exists(*ns, std::span(keys).subspan(10)), 240u);

  // Single-key semantics survive the wire: duplicates, busy writers, bad sizes.
  EXPECT_EQ(PutBlock(cache, *ns, keys[20]).code(), StatusCode::kAlreadyExists);
  auto r = cache.Reserve(*ns, keys[5], kBlock);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(cache.Reserve(*ns, keys[5], kBlock).status().code(), StatusCode::kBusy);
  auto peek = cache.Peek(*ns, std::span(keys).subspan(5, 1));
  ASSERT_TRUE(peek.ok());
  EXPECT_EQ((*peek)[0].state, PeekState::kWriting);
  EXPECT_TRUE((*peek)[0].writer_live);
  ASSERT_TRUE(cache.Abort(*r).ok());
  EXPECT_EQ(cache.Reserve(*ns, KeyOf(999), 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(cache.Reserve(*ns, KeyOf(999), 0).status().message().empty());

  // One engine's "clear" through the service: its namespace goes, another's stays.
  auto other = cache.Namespace(TestNamespace("other-model"));
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE(PutBlock(cache, *other, KeyOf(5000)).ok());
  EXPECT_EQ(*cache.EvictNamespace(*ns), 240u);
  EXPECT_EQ(*cache.Exists(*ns, std::span(keys).subspan(10)), 0u);
  EXPECT_EQ(*cache.Exists(*other, std::vector<BlockKey>{KeyOf(5000)}), 1u);

  // No stripe lock was taken by anyone: the service is the index's one writer.
  EXPECT_EQ(pool->impl().index->stripe_locks_taken(), 0u);
  // The region's state is one a decentralized reader would accept.
  auto regions = pool::AttachAll({path.path()});
  ASSERT_TRUE(regions.ok());
  auto problems = pool::Check(*regions, 300);
  EXPECT_TRUE(problems.empty()) << problems.front();
}

TEST(Meta, FourWriterProcessesCommitEachKeyExactlyOnce) {
  TempRegionPath path("meta-writers");
  ASSERT_TRUE(CreateCentralPool(path.path()).ok());
  constexpr int kWriters = 4;
  constexpr uint64_t kKeys = 200;  // every writer tries every key: one wins each
  std::vector<Child> writers;
  for (int w = 0; w < kWriters; ++w) {
    writers.push_back(Child::Fork([&path, w](int in, int out) {
      auto pool = OpenClientOnly(path.path(), static_cast<uint32_t>(w + 1));
      if (!pool) return 1;
      auto cache = pool->Cache();
      if (!cache.ok()) return 2;
      uint64_t go;
      Put(out, 1);
      Get(in, &go);  // the service serves now
      auto ns = (*cache)->Namespace(TestNamespace());
      if (!ns.ok()) return 3;
      uint64_t won = 0, lost = 0;
      for (uint64_t i = 0; i < kKeys; ++i) {
        const uint64_t k = (i * 7 + static_cast<uint64_t>(w) * 53) % kKeys;  // different orders
        Status s = PutBlock(**cache, *ns, KeyOf(k));
        if (s.ok()) {
          ++won;
        } else if (s.code() == StatusCode::kAlreadyExists || s.code() == StatusCode::kBusy) {
          ++lost;
        } else {
          std::fprintf(stderr, "writer %d key %llu: %s\n", w, static_cast<unsigned long long>(k), s.ToString().c_str());
          return 4;
        }
      }
      // w + 1 lookups: each counts on this writer's node row (hit rates per node), once each.
      const std::vector<BlockKey> three = {KeyOf(0), KeyOf(1), KeyOf(2)};
      for (int l = 0; l <= w; ++l) {
        auto hit = (*cache)->Lookup(*ns, three);
        if (!hit.ok()) return 5;
        (*cache)->Release(hit->pins);
      }
      Put(out, won);
      Get(in, &go);
      return 0;
    }));
  }
  // The service runs here (this process may host); the writers only ask.
  auto pool = OpenOrNull({path.path()}, 0);
  ASSERT_NE(pool, nullptr);
  ASSERT_TRUE(WaitServingNode(*pool, 0, std::chrono::seconds(10)));
  for (Child& c : writers) {
    uint64_t ready = 0;
    ASSERT_TRUE(c.Receive(&ready));
    ASSERT_EQ(ready, 1u);
  }
  for (Child& c : writers) c.Send(1);
  uint64_t total_won = 0;
  for (Child& c : writers) {
    uint64_t won = 0;
    ASSERT_TRUE(c.Receive(&won));
    total_won += won;
    c.Send(1);
  }
  for (Child& c : writers) EXPECT_EQ(c.Wait(), 0);
  {  // The service (node 0) counted no lookup; each writer's node its own.
    auto stat = cache::Stat(*pool->impl().regions[0], std::vector<cache::NodeStatus>(8, cache::NodeStatus::kLive));
    EXPECT_EQ(stat["per_node"]["0"]["lookups"].get<uint64_t>(), 0u) << stat["per_node"].dump();
    for (int w = 0; w < kWriters; ++w) {
      EXPECT_EQ(stat["per_node"][std::to_string(w + 1)]["lookups"].get<uint64_t>(), static_cast<uint64_t>(w + 1))
          << "writer " << w << ": " << stat["per_node"].dump();
    }
  }
  // A key that was busy (its writer between reserve and commit) may still be absent: put it now.
  KvCache& cache = **pool->Cache();
  auto ns = cache.Namespace(TestNamespace());
  ASSERT_TRUE(ns.ok());
  std::vector<BlockKey> keys;
  for (uint64_t i = 0; i < kKeys; ++i) keys.push_back(KeyOf(i));
  uint64_t late = 0;
  for (const BlockKey& k : keys) late += PutBlock(cache, *ns, k).ok();
  EXPECT_EQ(total_won + late, kKeys) << "each key committed exactly once";
  bool match = false;
  EXPECT_EQ(VerifyBlocks(cache, *ns, keys, &match), kKeys);
  EXPECT_TRUE(match);
  EXPECT_EQ(LiveEntries(*pool).size(), kKeys);
}

// A serving process killed -9: a standby takes over, the index is intact, a client that kept
// writing through the takeover finds every block it was told committed, with its bytes.
TEST(Meta, ServiceKilledIsTakenOverAndNothingPublishedIsLost) {
  TempRegionPath path("meta-kill");
  ASSERT_TRUE(CreateCentralPool(path.path()).ok());
  Child server = ForkServingHost(path.path(), 1);
  Child client = Child::Fork([&path](int in, int out) {
    auto pool = OpenClientOnly(path.path(), 3);
    if (!pool) return 1;
    KvCache& cache = **pool->Cache();
    uint64_t go;
    Get(in, &go);
    NamespaceHandle ns;
    for (int tries = 0;; ++tries) {  // the service may be moving
      auto h = cache.Namespace(TestNamespace());
      if (h.ok()) {
        ns = *h;
        break;
      }
      if (tries > 200) return 2;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    uint64_t committed = 0, unknown = 0, unavailable = 0;
    for (uint64_t i = 0; i < 400; ++i) {
      Status s = PutBlock(cache, ns, KeyOf(i));
      if (s.ok()) {
        ++committed;
        Put(out, i);  // the parent checks every key reported here
      } else if (s.code() == StatusCode::kUnavailable) {
        ++unavailable;  // no service for a moment, or the outcome was lost in the takeover
      } else if (s.code() == StatusCode::kAlreadyExists || s.code() == StatusCode::kBusy) {
        ++unknown;
      } else {
        std::fprintf(stderr, "client put %llu: %s\n", static_cast<unsigned long long>(i), s.ToString().c_str());
        return 3;
      }
      if (i == 100) {  // the parent kills the server now; the rest goes through the takeover
        Put(out, ~0ull);
        Get(in, &go);
      }
    }
    Put(out, ~1ull);
    std::fprintf(stderr, "client: committed %llu, unavailable %llu, busy/exists %llu\n",
                 static_cast<unsigned long long>(committed), static_cast<unsigned long long>(unavailable),
                 static_cast<unsigned long long>(unknown));
    Get(in, &go);
    return committed > 0 ? 0 : 4;
  });
  uint64_t ready = 0;
  ASSERT_TRUE(server.Receive(&ready));
  // The standby: this process (node 2).
  auto pool = OpenOrNull({path.path()}, 2);
  ASSERT_NE(pool, nullptr);
  ASSERT_EQ(ServingNode(*pool), 1);
  client.Send(1);
  std::set<uint64_t> acknowledged;
  for (;;) {
    uint64_t v = 0;
    ASSERT_TRUE(client.Receive(&v));
    if (v == ~0ull) {
      ::kill(server.pid, SIGKILL);
      EXPECT_EQ(server.Wait(), 128 + SIGKILL);
      client.Send(1);
      continue;
    }
    if (v == ~1ull) break;
    acknowledged.insert(v);
  }
  EXPECT_TRUE(WaitServingNode(*pool, 2, std::chrono::seconds(10)));
  client.Send(1);
  EXPECT_EQ(client.Wait(), 0);
  KvCache& cache = **pool->Cache();
  auto ns = cache.Namespace(TestNamespace());
  ASSERT_TRUE(ns.ok());
  std::vector<BlockKey> keys;
  for (uint64_t i : acknowledged) keys.push_back(KeyOf(i));
  bool match = false;
  EXPECT_EQ(VerifyBlocks(cache, *ns, keys, &match), acknowledged.size()) << "a block acknowledged committed is gone";
  EXPECT_TRUE(match);
  EXPECT_GT(acknowledged.size(), 100u);
}

// The serving process paused past its lease: a standby serves; when the paused one resumes, it
// is fenced (its lock lapsed) and publishes nothing, and the pool stays consistent.
TEST(Meta, ServicePausedPastItsLeaseIsFencedAndReplaced) {
  TempRegionPath path("meta-pause");
  ASSERT_TRUE(CreateCentralPool(path.path()).ok());
  Child server = ForkServingHost(path.path(), 1);
  uint64_t ready = 0;
  ASSERT_TRUE(server.Receive(&ready));
  auto pool = OpenOrNull({path.path()}, 2);
  ASSERT_NE(pool, nullptr);
  KvCache& cache = **pool->Cache();
  auto ns = cache.Namespace(TestNamespace());
  ASSERT_TRUE(ns.ok()) << ns.status().ToString();
  for (uint64_t i = 0; i < 20; ++i) ASSERT_TRUE(PutBlock(cache, *ns, KeyOf(i)).ok());
  ASSERT_EQ(::kill(server.pid, SIGSTOP), 0);
  ASSERT_TRUE(WaitServingNode(*pool, 2, std::chrono::milliseconds(kTestLeaseMs * 20))) << "no takeover";
  for (uint64_t i = 20; i < 40; ++i) {
    Status s = PutBlock(cache, *ns, KeyOf(i));
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  ASSERT_EQ(::kill(server.pid, SIGCONT), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(kTestLeaseMs * 3));
  EXPECT_EQ(ServingNode(*pool), 2) << "the resumed process must not serve again while the standby holds the lock";
  for (uint64_t i = 40; i < 60; ++i) ASSERT_TRUE(PutBlock(cache, *ns, KeyOf(i)).ok());
  std::vector<BlockKey> keys;
  for (uint64_t i = 0; i < 60; ++i) keys.push_back(KeyOf(i));
  bool match = false;
  EXPECT_EQ(VerifyBlocks(cache, *ns, keys, &match), 60u);
  EXPECT_TRUE(match);
  server.Send(0);
  EXPECT_EQ(server.Wait(), 0);
  auto regions = pool::AttachAll({path.path()});
  ASSERT_TRUE(regions.ok());
  auto problems = pool::Check(*regions, 300);
  EXPECT_TRUE(problems.empty()) << problems.front();
}

// A client killed between reserve and commit: the service's sweep reclaims its WRITING entry
// once its life is over, and the key can be written again.
TEST(Meta, AClientKilledMidReservationIsReclaimedByTheService) {
  TempRegionPath path("meta-client");
  ASSERT_TRUE(CreateCentralPool(path.path()).ok());
  // Forked before this process opens the pool (threads do not cross a fork).
  Child client = Child::Fork([&path](int in, int out) {
    uint64_t go;
    Get(in, &go);
    auto p = OpenClientOnly(path.path(), 4);
    if (!p) return 1;
    KvCache& c = **p->Cache();
    auto h = c.Namespace(TestNamespace());
    if (!h.ok()) return 2;
    auto r = c.Reserve(*h, KeyOf(7), kBlock);
    if (!r.ok()) return 3;
    Put(out, 1);
    ::pause();  // killed here, reservation open
    return 0;
  });
  auto pool = OpenOrNull({path.path()}, 0);
  ASSERT_NE(pool, nullptr);
  ASSERT_TRUE(WaitServingNode(*pool, 0, std::chrono::seconds(10)));
  KvCache& cache = **pool->Cache();
  auto ns = cache.Namespace(TestNamespace());
  ASSERT_TRUE(ns.ok());
  client.Send(1);
  uint64_t ready = 0;
  ASSERT_TRUE(client.Receive(&ready));
  EXPECT_EQ(cache.Reserve(*ns, KeyOf(7), kBlock).status().code(), StatusCode::kBusy);
  ::kill(client.pid, SIGKILL);
  EXPECT_EQ(client.Wait(), 128 + SIGKILL);
  bool reclaimed = false;
  for (auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(kTestLeaseMs * 20);
       std::chrono::steady_clock::now() < end && !reclaimed;) {
    reclaimed = PutBlock(cache, *ns, KeyOf(7)).ok();
    if (!reclaimed) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(reclaimed) << "the dead client's reservation was never reclaimed";
  EXPECT_EQ(LiveEntries(*pool).size(), 1u);
}

// A process of a node that lives on is killed with a reservation open: the node's surviving
// process finds the dead slot and reports it; the service drops the reservation (the node's
// life, and so the sweep, would never end it).
TEST(Meta, ADeadProcessOfALiveNodeIsReportedAndItsReservationDropped) {
  TempRegionPath path("meta-process");
  ASSERT_TRUE(CreateCentralPool(path.path()).ok());
  Child keeper = Child::Fork([&path](int in, int out) {  // node 2's long-lived process
    auto p = OpenClientOnly(path.path(), 2);
    if (!p || !Put(out, p->impl().node->incarnation())) return 1;
    uint64_t cmd;
    Get(in, &cmd);
    return 0;
  });
  Child victim = Child::Fork([&path](int in, int out) {  // a second process of node 2
    uint64_t go;
    Get(in, &go);
    auto p = OpenClientOnly(path.path(), 2);
    if (!p) return 1;
    KvCache& c = **p->Cache();
    auto h = c.Namespace(TestNamespace());
    if (!h.ok()) return 2;
    auto r = c.Reserve(*h, KeyOf(11), kBlock);
    if (!r.ok()) return 3;
    Put(out, 1);
    ::pause();
    return 0;
  });
  auto pool = OpenOrNull({path.path()}, 0);
  ASSERT_NE(pool, nullptr);
  ASSERT_TRUE(WaitServingNode(*pool, 0, std::chrono::seconds(10)));
  uint64_t life = 0, ready = 0;
  ASSERT_TRUE(keeper.Receive(&life));
  victim.Send(1);
  ASSERT_TRUE(victim.Receive(&ready));
  KvCache& cache = **pool->Cache();
  auto ns = cache.Namespace(TestNamespace());
  ASSERT_TRUE(ns.ok());
  EXPECT_EQ(cache.Reserve(*ns, KeyOf(11), kBlock).status().code(), StatusCode::kBusy);
  ::kill(victim.pid, SIGKILL);
  EXPECT_EQ(victim.Wait(), 128 + SIGKILL);
  bool dropped = false;
  for (auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(kTestLeaseMs * 20);
       std::chrono::steady_clock::now() < end && !dropped;) {
    dropped = PutBlock(cache, *ns, KeyOf(11)).ok();
    if (!dropped) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(dropped) << "the dead process's reservation outlived it";
  // Node 2 never died: the same life throughout (the report, not the sweep, dropped it).
  // (Its life, not its liveness: a sanitizer-slowed observer may see a late heartbeat.)
  auto views = pool->impl().node->Nodes();
  EXPECT_EQ(cache::WriterInc(views[2].incarnation), cache::WriterInc(life));
  keeper.Send(0);
  EXPECT_EQ(keeper.Wait(), 0);
}

// Chaos: two client processes storm overlapping keys (put, lookup and verify, evict) while the
// serving process is killed -9 twice; standbys take over each time. Afterwards every READY
// block has its key's bytes, nothing is WRITING, and the allocated space is exactly the blocks'
// plus the RPC areas': no payload leaked or freed twice across the service's deaths.
TEST(Meta, StormThroughTwoServiceKillsKeepsBytesAndSpaceExact) {
  TempRegionPath path("meta-chaos");
  ASSERT_TRUE(CreateCentralPool(path.path()).ok());
  auto host = [&path](uint32_t node) {
    return Child::Fork([&path, node](int in, int out) {
      auto pool = OpenOrNull({path.path()}, node);
      if (!pool) return 1;
      Put(out, 1);
      uint64_t cmd;
      Get(in, &cmd);
      return 0;
    });
  };
  auto client = [&path](uint32_t node, uint64_t seed) {
    return Child::Fork([&path, node, seed](int in, int out) {
      uint64_t go;
      Get(in, &go);
      auto pool = OpenClientOnly(path.path(), node);
      if (!pool) return 1;
      KvCache& cache = **pool->Cache();
      NamespaceHandle ns;
      for (int tries = 0;; ++tries) {
        auto h = cache.Namespace(TestNamespace());
        if (h.ok()) {
          ns = *h;
          break;
        }
        if (tries > 300) return 2;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      std::vector<uint8_t> got(kBlock);
      for (uint64_t op = 0; op < 600; ++op) {
        const BlockKey key = KeyOf(Mix(seed * 1000 + op) % 96);  // 96 keys shared by both clients
        auto hit = cache.Lookup(ns, {&key, 1});
        if (hit.ok() && hit->hit_blocks == 1) {
          if (!cache.Read(hit->pins[0], 0, got.data(), kBlock).ok() || !MatchesKey(key, got.data(), kBlock)) {
            std::fprintf(stderr, "client %u: wrong bytes under a READY key\n", node);
            return 3;
          }
          cache.Release(hit->pins);
          if (op % 5 == 0) (void)cache.Evict(ns, {&key, 1});
        } else {
          Status st = PutBlock(cache, ns, key);  // any failure is a retry later: the service may be moving
          (void)st;
        }
        if (op == 200) Put(out, 1);  // the parent kills a server around here
        if (op == 400) Put(out, 2);
      }
      Put(out, 3);
      Get(in, &go);
      return 0;
    });
  };
  std::vector<Child> hosts;
  for (uint32_t n = 1; n <= 3; ++n) hosts.push_back(host(n));
  Child c1 = client(5, 1);
  Child c2 = client(6, 2);
  for (Child& h : hosts) {
    uint64_t ready = 0;
    ASSERT_TRUE(h.Receive(&ready));
  }
  auto pool = OpenClientOnly(path.path(), 7);  // watches; hosts nothing
  ASSERT_NE(pool, nullptr);
  c1.Send(1);
  c2.Send(1);
  std::vector<bool> alive(hosts.size(), true);
  int kills = 0;
  for (uint64_t step : {1u, 2u}) {
    uint64_t v = 0;
    ASSERT_TRUE(c1.Receive(&v));
    ASSERT_EQ(v, step);
    // The server now: a host not killed yet (after the first kill, once a standby took over).
    int serving = -1;
    for (auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
         std::chrono::steady_clock::now() < end; std::this_thread::sleep_for(std::chrono::milliseconds(10))) {
      serving = ServingNode(*pool);
      if (serving >= 1 && serving <= 3 && alive[serving - 1]) break;
    }
    ASSERT_TRUE(serving >= 1 && serving <= 3 && alive[serving - 1]) << "no live host serves (" << serving << ")";
    ::kill(hosts[serving - 1].pid, SIGKILL);
    EXPECT_EQ(hosts[serving - 1].Wait(), 128 + SIGKILL);
    alive[serving - 1] = false;
    ++kills;
  }
  uint64_t done = 0;
  ASSERT_TRUE(c1.Receive(&done));
  for (uint64_t v = 0; v != 3;) ASSERT_TRUE(c2.Receive(&v));
  c1.Send(1);
  c2.Send(1);
  EXPECT_EQ(c1.Wait(), 0);
  EXPECT_EQ(c2.Wait(), 0);
  EXPECT_EQ(kills, 2);
  // Quiescent: let the survivor's sweeps and the allocator's recoveries of the dead run.
  std::this_thread::sleep_for(std::chrono::milliseconds(6 * kTestLeaseMs));
  KvCache& cache = **pool->Cache();
  auto ns = cache.Namespace(TestNamespace());
  ASSERT_TRUE(ns.ok()) << ns.status().ToString();
  uint64_t bytes = 0;
  std::vector<uint8_t> got(kBlock);
  for (const cache::Entry& e : LiveEntries(*pool)) {
    ASSERT_EQ(cache::StateOf(e.state), cache::kReady) << "an entry stayed in flight";
    const BlockKey k{e.key_lo, e.key_hi};
    auto hit = cache.Lookup(*ns, {&k, 1});
    ASSERT_TRUE(hit.ok() && hit->hit_blocks == 1);
    ASSERT_TRUE(cache.Read(hit->pins[0], 0, got.data(), kBlock).ok());
    EXPECT_TRUE(MatchesKey(k, got.data(), kBlock));
    cache.Release(hit->pins);
    bytes += e.bytes;
  }
  // The dead service lives' allocator recoveries (by the manager, a surviving host) may still
  // be finishing under this load: poll for a while, the space must come out exact.
  uint64_t allocated = 0;
  const uint64_t want = bytes + RootedBytes(path.path());
  for (int i = 0; i < 100; ++i) {
    auto regions = pool::AttachAll({path.path()});
    ASSERT_TRUE(regions.ok());
    allocated = alloc::InspectChunks(*(*regions)[0], 8).allocated_bytes;
    if (allocated == want) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(kTestLeaseMs / 2));
  }
  EXPECT_EQ(allocated, want) << "allocated space does not account for the cached blocks and the RPC areas";
  if (allocated != want) {
    std::set<uint64_t> referenced;
    for (const cache::Entry& e : LiveEntries(*pool)) referenced.insert(region::Offset<void>(e.payload).byte_offset());
    for (const auto& r : pool->impl().roots->List()) referenced.insert(region::Offset<void>(r.offset).byte_offset());
    auto regions = pool::AttachAll({path.path()});
    ASSERT_TRUE(regions.ok());
    for (auto [off, owner] : AllocatedObjects(*(*regions)[0])) {
      if (referenced.count(off)) continue;
      auto w = alloc::OwnerWord::Decode(owner);
      ADD_FAILURE() << "unreferenced object at " << off << " in a chunk of kind " << static_cast<int>(w.kind)
                    << " owned by node " << w.node << " life " << w.incarnation;
    }
    // Diagnostics: frees still waiting in remote-free rings.
    alloc::ChunkTableLayout t((*regions)[0]->impl(), 8);
    auto& m = (*regions)[0]->impl().meta();
    for (uint32_t o = 0; o < 8 && t.has_inboxes(); ++o) {
      for (uint32_t f = 0; f < 8; ++f) {
        const uint64_t ring = t.inbox(o, f);
        const uint64_t tail = m.Fetch(ring), head = m.Fetch(ring + alloc::kInboxHeadOffset);
        for (uint64_t i = head; i < tail && i < head + 256; ++i) {
          const uint64_t raw = m.Fetch(ring + alloc::kInboxEntriesOffset + (i % alloc::kInboxEntries) * 8);
          ADD_FAILURE() << "pending free of " << region::Offset<void>(raw).byte_offset() << " in ring (owner " << o
                        << ", freer " << f << "), closed word " << m.Fetch(ring + alloc::kInboxClosedOffset);
        }
      }
    }
  }
  for (size_t i = 0; i < hosts.size(); ++i) {
    if (!alive[i]) continue;
    hosts[i].Send(0);
    EXPECT_EQ(hosts[i].Wait(), 0);
  }
}

// Requests that are not what a client of this build would send are refused, and the service
// keeps serving.
TEST(Meta, MalformedAndForgedRequestsAreRefused) {
  TempRegionPath path("meta-bad");
  ASSERT_TRUE(CreateCentralPool(path.path()).ok());
  auto pool = OpenOrNull({path.path()}, 0);
  ASSERT_NE(pool, nullptr);
  ASSERT_TRUE(WaitServingNode(*pool, 0, std::chrono::seconds(10)));
  // A raw client on this process's channel (the cache's own client opens it later, once this
  // one is gone: a channel has one client at a time).
  auto client = rpc::RpcClient::Open(*pool, meta::kMetaService);
  ASSERT_TRUE(client.ok());
  auto call = [&](uint32_t op, std::vector<uint8_t> body) { return (*client)->Call(op, body).status(); };
  sync::Node& node = *pool->impl().node;
  const uint64_t me = cache::WriterWord(node.id(), node.incarnation(), node.process_slot());
  auto word = [](uint64_t v) {
    std::vector<uint8_t> b(8);
    std::memcpy(b.data(), &v, 8);
    return b;
  };
  EXPECT_EQ(call(meta::kLookupPin, {}).code(), StatusCode::kInvalidArgument);  // empty
  EXPECT_EQ(call(meta::kReserve, {1, 2, 3}).code(), StatusCode::kInvalidArgument);  // short
  auto body = word(me);
  body.resize(8 + meta::kHandleBytes + 4, 0);
  body[8 + meta::kHandleBytes] = 200;  // claims 200 keys, carries none
  EXPECT_EQ(call(meta::kLookupPin, body).code(), StatusCode::kInvalidArgument);
  // Another node's writer word on this node's channel: forged.
  const uint64_t other = cache::WriterWord(node.id() + 1, node.incarnation(), node.process_slot());
  EXPECT_EQ(call(meta::kEvictAll, word(other)).code(), StatusCode::kInvalidArgument);
  // A life that is over (an earlier incarnation of this node).
  const uint64_t old_life = cache::WriterWord(node.id(), node.incarnation() + 7, node.process_slot());
  EXPECT_EQ(call(meta::kEvictAll, word(old_life)).code(), StatusCode::kLeaseExpired);
  // Evicting a namespace: a forged writer, and a body cut before its handle.
  EXPECT_EQ(call(meta::kEvictNamespace, word(other)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(call(meta::kEvictNamespace, word(me)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(call(999, word(me)).code(), StatusCode::kInvalidArgument);  // unknown opcode
  // Commit of a reservation that does not exist.
  auto commit = word(me);
  commit.resize(8 + 4 + meta::kReservationBytes, 0);
  commit[8] = 1;
  EXPECT_FALSE(call(meta::kCommit, commit).ok());
  client->reset();
  // Still serving, and the index is untouched.
  KvCache& cache = **pool->Cache();
  auto ns = cache.Namespace(TestNamespace());
  ASSERT_TRUE(ns.ok());
  EXPECT_TRUE(PutBlock(cache, *ns, KeyOf(1)).ok());
  EXPECT_EQ(LiveEntries(*pool).size(), 1u);
}

// With no process that hosts the service (a lock manager runs, in a process that recovers
// nothing and so hosts no service), calls fail kUnavailable within the deadline, naming cxlkvd.
TEST(Meta, WithNoServiceCallsFailCleanlyAndDoNotHang) {
  TempRegionPath path("meta-none");
  ASSERT_TRUE(CreateCentralPool(path.path()).ok());
  PoolOpenOptions mo;
  mo.node_id = 1;
  mo.lease_ms = kTestLeaseMs;
  mo.recovers = false;
  auto manager = Pool::Open({path.path()}, mo);
  ASSERT_TRUE(manager.ok()) << manager.status().ToString();
  auto pool = OpenClientOnly(path.path(), 0);
  ASSERT_NE(pool, nullptr);
  const auto start = std::chrono::steady_clock::now();
  auto ns = (*pool->Cache())->Namespace(TestNamespace());
  EXPECT_EQ(ns.status().code(), StatusCode::kUnavailable) << ns.status().ToString();
  EXPECT_NE(ns.status().message().find("cxlkvd"), std::string::npos) << ns.status().message();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

// The whole protocol under the non-coherent simulator: a client and the service in different
// processes, each with its own simulated cache of the metadata, several seeds.
TEST(Meta, RoundTripsUnderTheSimulatorWithManySeeds) {
  for (uint64_t seed : cxlkv::testing::SimSeeds({11, 23, 37, 41})) {
    TempRegionPath path("meta-sim");
    ASSERT_TRUE(CreateCentralPool(path.path()).ok());
    Child server = ForkServingHost(path.path(), 1, seed * 3 + 1);
    uint64_t ready = 0;
    ASSERT_TRUE(server.Receive(&ready)) << "seed " << seed;
    auto pool = OpenClientOnly(path.path(), 2, seed);
    ASSERT_NE(pool, nullptr);
    KvCache& cache = **pool->Cache();
    auto ns = cache.Namespace(TestNamespace());
    ASSERT_TRUE(ns.ok()) << ns.status().ToString();
    std::vector<BlockKey> keys;
    for (uint64_t i = 0; i < 64; ++i) keys.push_back(KeyOf(i + seed * 1000));
    for (const BlockKey& k : keys) ASSERT_TRUE(PutBlock(cache, *ns, k).ok()) << "seed " << seed;
    bool match = false;
    EXPECT_EQ(VerifyBlocks(cache, *ns, keys, &match), keys.size()) << "seed " << seed;
    EXPECT_TRUE(match) << "seed " << seed;
    // Half by key, half by namespace: both through the service's stripe-locked eviction.
    EXPECT_EQ(*cache.Evict(*ns, std::span(keys).first(32)), 32u) << "seed " << seed;
    EXPECT_EQ(*cache.EvictNamespace(*ns), keys.size() - 32) << "seed " << seed;
    EXPECT_EQ(*cache.Exists(*ns, std::span(keys).subspan(32)), 0u);
    server.Send(0);
    EXPECT_EQ(server.Wait(), 0) << "seed " << seed;
  }
}

}  // namespace
}  // namespace cxlkv::testing
