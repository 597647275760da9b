// Fetching KV blocks from another rack's pool (rack/block_fetch.h), two real pools on one
// machine joined by the rack link over loopback TCP: fetched blocks are READY and read back
// equal, so the next lookup is a local hit; a holder that lies about lengths, keys or checksums
// gets none of its wrong blocks published; a holder paused past the deadline, or killed -9 in
// the middle of a fetch, leaves the asker's reservations aborted and nothing WRITING.
#include <signal.h>
#include <sys/wait.h>

#include <gtest/gtest.h>
#include <xxhash.h>

#include <atomic>
#include <thread>

#include "../cache/cache_test_util.h"
#include "child.h"
#include "rack/block_fetch.h"

namespace cxlkv::rack {
namespace {

using namespace std::chrono_literals;
using cxlkv::testing::Child;

PoolSecret FetchSecret() { return *PoolSecret::FromBytes(std::vector<uint8_t>(32, 3)); }

// Llama-3-8B's KV of one 16-token block: 2 MiB, sent by rendezvous.
KeyNamespace FetchNamespace() {
  KeyNamespace ns;
  ns.model_id = "llama-3-8b";
  ns.layout = KvLayoutSignature{KvDtype::kFp16, 32, 8, 128, 16, 0, 1, 0, 2, kPoolBlockFormat};
  return ns;
}
constexpr uint64_t kBlockBytes = 2u << 20;
constexpr uint64_t kDyingBase = 600;

std::vector<BlockKey> FetchKeys(size_t n, uint64_t base = 500) {
  std::vector<BlockKey> keys;
  for (uint64_t i = 0; i < n; ++i) keys.push_back({base + i, 77});
  return keys;
}

std::vector<uint8_t> BlockFor(const BlockKey& k) {
  std::vector<uint8_t> b(kBlockBytes);
  testing::FillForKey(k, b.data(), b.size());
  return b;
}

UcxLinkOptions FetchLinkOptions(const std::string& rack, bool listen) {
  UcxLinkOptions o;
  o.rack = rack;
  o.listen = listen ? "127.0.0.1:0" : "";
  o.transports = "tcp";
  return o;
}

// One rack's pool: a region of its own, with a cache.
struct RackPool {
  explicit RackPool(const std::string& path) {
    Status s = testing::CreateCachePool(path, 64 << 20);
    EXPECT_TRUE(s.ok()) << s.ToString();
    pool = testing::OpenOrNull({path}, 0);
    if (!pool) return;
    cache = *pool->Cache();
    ns = *cache->Namespace(FetchNamespace());
  }
  void PutAll(std::span<const BlockKey> keys) {
    for (const BlockKey& k : keys) {
      const auto b = BlockFor(k);
      EXPECT_TRUE(cache->Put(ns, k, b.data(), b.size()).ok());
    }
  }
  // Every key READY reads back as its pattern; returns how many keys are READY in a row.
  size_t VerifiedPrefix(std::span<const BlockKey> keys) {
    auto hit = cache->Lookup(ns, keys);
    EXPECT_TRUE(hit.ok());
    std::vector<uint8_t> out(kBlockBytes);
    for (size_t i = 0; i < hit->hit_blocks; ++i) {
      EXPECT_TRUE(cache->Read(hit->pins[i], 0, out.data(), out.size()).ok());
      EXPECT_TRUE(testing::MatchesKey(keys[i], out.data(), out.size())) << "block " << i << " holds wrong bytes";
    }
    cache->Release(hit->pins);
    return hit->hit_blocks;
  }
  // No key is left WRITING: each is READY or absent.
  void ExpectNothingWriting(std::span<const BlockKey> keys) {
    auto peek = cache->Peek(ns, keys);
    ASSERT_TRUE(peek.ok());
    for (size_t i = 0; i < keys.size(); ++i) EXPECT_NE((*peek)[i].state, PeekState::kWriting) << "key " << i;
  }
  std::unique_ptr<Pool> pool;
  KvCache* cache = nullptr;
  NamespaceHandle ns;
};

bool WaitFor(const std::function<bool()>& done, std::chrono::milliseconds limit = 10s) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

// The holder in a child process: its own pool with `held` blocks, a link that serves fetches.
// Reports its port; a fetch of the keys from kDyingBase on kills the child once two of its
// payloads are out, mid-transfer.
class DyingAfterTwo final : public LinkReply {
 public:
  explicit DyingAfterTwo(LinkReply& inner) : inner_(inner) {}
  void Send(const LinkMessage& m, std::span<const uint8_t> payload, std::function<void(Status)> done) override {
    if (payload.empty()) return inner_.Send(m, payload, std::move(done));
    inner_.Send(m, payload, [done = std::move(done)](Status s) {
      static int sent = 0;
      if (done) done(s);
      if (++sent == 2) raise(SIGKILL);
    });
  }
  void Later(std::function<void(LinkReply&)> next) override {
    inner_.Later([next = std::move(next)](LinkReply& r) {
      DyingAfterTwo dying(r);
      next(dying);
    });
  }
  const std::string& peer_rack() const override { return inner_.peer_rack(); }
  int64_t peer_life() const override { return inner_.peer_life(); }

 private:
  LinkReply& inner_;
};

int HolderChild(const std::string& path, size_t held, int in, int out) {
  RackPool holder(path);
  if (!holder.pool) return 2;
  holder.PutAll(FetchKeys(held));
  holder.PutAll(FetchKeys(held, kDyingBase));
  BlockFetchServer server(*holder.cache);
  auto link = UcxLink::Start(FetchLinkOptions("rack-h", true), FetchSecret(), [&](const LinkMessage& m, LinkReply& reply) {
    const auto* f = std::get_if<LinkFetch>(&m.body);
    if (f && f->keys[0].lo >= kDyingBase) {
      DyingAfterTwo dying(reply);
      server.Serve(m, dying);
      return;
    }
    server.Serve(m, reply);
  });
  if (!link.ok()) return 3;
  const std::string& a = (*link)->address();
  if (!cxlkv::testing::Put(out, std::stoull(a.substr(a.rfind(':') + 1)))) return 4;
  uint64_t cmd;
  while (cxlkv::testing::Get(in, &cmd)) {
  }
  return 0;
}

// First in this file: it forks before this process opens a pool or starts UCX.
TEST(BlockFetch, HolderPausedOrKilledMidFetchLeavesNothingWriting) {
  testing::TempRegionPath holder_path("fetch-holder"), asker_path("fetch-asker");
  const std::string hp = holder_path.path();
  Child child = Child::Fork([hp](int in, int out) { return HolderChild(hp, 8, in, out); });
  ASSERT_GT(child.pid, 0);
  uint64_t port = 0;
  ASSERT_TRUE(child.Receive(&port));
  const std::string holder = "127.0.0.1:" + std::to_string(port);
  RackPool asker(asker_path.path());
  ASSERT_NE(asker.pool, nullptr);
  auto link = UcxLink::Start(FetchLinkOptions("rack-a", false), FetchSecret(), nullptr);
  ASSERT_TRUE(link.ok()) << link.status().ToString();
  BlockFetcher fetcher(**link, *asker.cache);

  // Paused past the deadline: the fetch times out, nothing is published or left WRITING.
  const auto first = FetchKeys(2);
  ASSERT_EQ(kill(child.pid, SIGSTOP), 0);
  int stopped = 0;  // a stop is delivered asynchronously: wait until the child is stopped
  ASSERT_EQ(waitpid(child.pid, &stopped, WUNTRACED), child.pid);
  ASSERT_TRUE(WIFSTOPPED(stopped));
  auto paused = fetcher.Fetch(holder, FetchNamespace(), first, 500ms);
  ASSERT_TRUE(paused.ok()) << paused.status().ToString();
  EXPECT_EQ(paused->link.code(), StatusCode::kTimeout) << paused->link.ToString();
  EXPECT_EQ(paused->fetched, 0u);
  EXPECT_EQ(asker.VerifiedPrefix(first), 0u);
  asker.ExpectNothingWriting(first);
  // Resumed, it serves: the blocks become local hits.
  ASSERT_EQ(kill(child.pid, SIGCONT), 0);
  auto resumed = fetcher.Fetch(holder, FetchNamespace(), first, 10000ms);
  ASSERT_TRUE(resumed.ok()) << resumed.status().ToString();
  EXPECT_TRUE(resumed->link.ok()) << resumed->link.ToString();
  EXPECT_EQ(resumed->fetched, 2u);
  EXPECT_EQ(asker.VerifiedPrefix(first), 2u);

  // Killed after two payloads of an eight-block fetch: the call ends kUnavailable; what
  // arrived whole and verified is READY and correct, every other key absent, none WRITING.
  const auto all = FetchKeys(8, kDyingBase);
  auto killed = fetcher.Fetch(holder, FetchNamespace(), all, 30000ms);
  ASSERT_TRUE(killed.ok()) << killed.status().ToString();
  EXPECT_EQ(killed->link.code(), StatusCode::kUnavailable) << killed->link.ToString();
  EXPECT_LT(killed->fetched, 8u);
  EXPECT_EQ(child.Wait(), 128 + SIGKILL);
  auto hit = asker.cache->Lookup(asker.ns, all);
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(hit->hit_blocks, killed->ready);
  std::vector<uint8_t> out(kBlockBytes);
  for (size_t i = 0; i < hit->hit_blocks; ++i) {
    ASSERT_TRUE(asker.cache->Read(hit->pins[i], 0, out.data(), out.size()).ok());
    EXPECT_TRUE(testing::MatchesKey(all[i], out.data(), out.size())) << "block " << i;
  }
  asker.cache->Release(hit->pins);
  auto peek = asker.cache->Peek(asker.ns, all);
  ASSERT_TRUE(peek.ok());
  size_t ready = 0;
  for (const KeyPeek& p : *peek) {
    EXPECT_NE(p.state, PeekState::kWriting);
    ready += p.state == PeekState::kReady;
  }
  EXPECT_EQ(ready, killed->fetched);
}

TEST(BlockFetch, FetchedBlocksAreLocalHitsAndMissesAreAborted) {
  testing::TempRegionPath hp("fetch-h"), ap("fetch-a");
  RackPool holder(hp.path()), asker(ap.path());
  ASSERT_NE(holder.pool, nullptr);
  ASSERT_NE(asker.pool, nullptr);
  const auto keys = FetchKeys(8);
  holder.PutAll(std::span(keys).first(6));
  BlockFetchServer server(*holder.cache);
  auto h = UcxLink::Start(FetchLinkOptions("rack-h", true), FetchSecret(),
                          [&](const LinkMessage& m, LinkReply& reply) { server.Serve(m, reply); });
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  auto a = UcxLink::Start(FetchLinkOptions("rack-a", false), FetchSecret(), nullptr);
  ASSERT_TRUE(a.ok());
  BlockFetcher fetcher(**a, *asker.cache);

  // The asker holds the first block already: it asks for the other seven, gets five.
  asker.PutAll(std::span(keys).first(1));
  auto r = fetcher.Fetch((*h)->address(), FetchNamespace(), keys, 20000ms);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->link.ok()) << r->link.ToString();
  EXPECT_EQ(r->already_cached, 1u);
  EXPECT_EQ(r->fetched, 5u);
  EXPECT_EQ(r->ready, 6u);
  EXPECT_EQ(r->bytes, 5 * kBlockBytes);
  EXPECT_EQ(r->rejected, 0u);
  EXPECT_EQ(asker.VerifiedPrefix(keys), 6u) << "the next lookup is a local hit";
  asker.ExpectNothingWriting(keys);
  EXPECT_TRUE(WaitFor([&] { return server.counters().pins_held == 0; })) << "the holder kept pins after the fetch";
  EXPECT_EQ(server.counters().blocks_sent, 5u);
  EXPECT_EQ(holder.VerifiedPrefix(keys), 6u);  // the holder's blocks are still there, unpinned
  EXPECT_EQ(holder.cache->EvictAll().value(), 6u) << "a pin the fetch took was never released";

  // Everything here already: nothing is asked for.
  auto again = fetcher.Fetch((*h)->address(), FetchNamespace(), std::span(keys).first(6), 5000ms);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->already_cached, 6u);
  EXPECT_EQ(again->fetched, 0u);
  EXPECT_EQ(server.counters().fetches, 1u);

  // A namespace without a layout cannot be fetched: the block size is unknown.
  KeyNamespace no_layout = testing::TestNamespace();
  EXPECT_EQ(fetcher.Fetch((*h)->address(), no_layout, keys, 1000ms).status().code(), StatusCode::kInvalidArgument);
  // A holder that is not there: an error, nothing left WRITING.
  auto gone = fetcher.Fetch("127.0.0.1:1", FetchNamespace(), FetchKeys(2, 900), 2000ms);
  ASSERT_TRUE(gone.ok());
  EXPECT_FALSE(gone->link.ok());
  asker.ExpectNothingWriting(FetchKeys(2, 900));
}

TEST(BlockFetch, ALyingHolderGetsNoWrongBlockPublished) {
  testing::TempRegionPath ap("fetch-lie");
  RackPool asker(ap.path());
  ASSERT_NE(asker.pool, nullptr);
  const auto keys = FetchKeys(5, 700);
  auto good = std::make_shared<std::vector<uint8_t>>(BlockFor(keys[0]));
  auto short_block = std::make_shared<std::vector<uint8_t>>(kBlockBytes / 2);
  std::atomic<int> done{0};
  // Block 0 is right; 1 has a wrong checksum; 2 the wrong length; 3 names a key not asked for;
  // 4 is sent twice (the second copy refused). The end claims all five.
  auto lying = UcxLink::Start(FetchLinkOptions("rack-l", true), FetchSecret(), [&](const LinkMessage& m, LinkReply& reply) {
    const auto& f = std::get<LinkFetch>(m.body);
    auto count = [&done, good, short_block](Status) { done.fetch_add(1); };
    const uint64_t sum = XXH3_64bits(good->data(), good->size());
    reply.Send({m.id, LinkFetchBlock{0, f.keys[0], kBlockBytes, sum}}, *good, count);
    reply.Send({m.id, LinkFetchBlock{1, f.keys[1], kBlockBytes, sum ^ 1}}, *good, count);
    reply.Send({m.id, LinkFetchBlock{2, f.keys[2], kBlockBytes / 2, 0}}, *short_block, count);
    reply.Send({m.id, LinkFetchBlock{3, BlockKey{1, 1}, kBlockBytes, sum}}, *good, count);
    reply.Send({m.id, LinkFetchBlock{0, f.keys[0], kBlockBytes, sum}}, *good, count);
    reply.Send({m.id, LinkFetchEnd{5}});
  });
  ASSERT_TRUE(lying.ok()) << lying.status().ToString();
  auto a = UcxLink::Start(FetchLinkOptions("rack-a", false), FetchSecret(), nullptr);
  ASSERT_TRUE(a.ok());
  BlockFetcher fetcher(**a, *asker.cache);
  auto r = fetcher.Fetch((*lying)->address(), FetchNamespace(), keys, 20000ms);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->fetched, 1u);
  EXPECT_EQ(r->ready, 1u);
  EXPECT_EQ(r->rejected, 4u);
  EXPECT_EQ(asker.VerifiedPrefix(keys), 1u);
  asker.ExpectNothingWriting(keys);
  auto peek = asker.cache->Peek(asker.ns, keys);
  ASSERT_TRUE(peek.ok());
  for (size_t i = 1; i < keys.size(); ++i) EXPECT_EQ((*peek)[i].state, PeekState::kAbsent) << "key " << i;
  // UCX ends every send, the refused ones included: a holder's pins would not leak.
  EXPECT_TRUE(WaitFor([&] { return done.load() == 5; })) << done.load() << " of 5 sends ended";
}

}  // namespace
}  // namespace cxlkv::rack
