// Batched index operations (ReserveMany / CommitMany / AbortMany) and the lock-free Peek: the
// per-key outcomes keep single-key semantics (READY, busy naming the writer, repeats within a
// batch), one stripe lock per stripe touched, exact accounting after an abort, and a key being
// written by another node (a real second process).
#include <unistd.h>
#include <sys/wait.h>

#include <set>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "cache_test_util.h"

namespace cxlkv {
namespace {

using ::testing::HasSubstr;
using testing::FillForKey;
using testing::MatchesKey;
using testing::OpenOrNull;

struct BatchFixture {
  explicit BatchFixture(const std::string& tag, uint64_t size = 128 << 20) : path(tag) {
    Status s = testing::CreateCachePool(path.path(), size);
    EXPECT_TRUE(s.ok()) << s.ToString();
    pool = OpenOrNull({path.path()}, 0);
    auto c = pool->Cache();
    EXPECT_TRUE(c.ok());
    cache = *c;
    auto n = cache->Namespace(testing::TestNamespace());
    EXPECT_TRUE(n.ok()) << n.status().ToString();
    ns = *n;
  }
  cache::Index& index() { return *pool->impl().index; }
  uint64_t StripeOf(const BlockKey& k) { return k.lo % index().layout().h.stripes; }
  uint64_t Allocated() {
    auto regions = pool::AttachAll({path.path()});
    EXPECT_TRUE(regions.ok());
    return alloc::InspectChunks(*(*regions)[0], 8).allocated_bytes - testing::RootedBytes(path.path());
  }
  void WriteFor(Reservation& r, const BlockKey& k) {
    std::vector<uint8_t> data(r.bytes);
    FillForKey(k, data.data(), r.bytes);
    ASSERT_TRUE(cache->Write(r, 0, data.data(), r.bytes).ok());
  }
  testing::TempRegionPath path;
  std::unique_ptr<Pool> pool;
  KvCache* cache = nullptr;
  NamespaceHandle ns;
};

TEST(CacheBatch, ReserveManyKeepsSingleKeySemanticsAcrossStripes) {
  BatchFixture f("batch-sem");
  constexpr uint64_t kBytes = 16 << 10;
  auto keys = f.cache->ChainKeys(f.ns, testing::Tokens(21, 16 * 48, 0, 0));
  ASSERT_EQ(keys.size(), 48u);
  // keys[0] READY, keys[1] WRITING by this node (a single-key Reserve), the rest absent.
  std::vector<uint8_t> data(kBytes);
  FillForKey(keys[0], data.data(), kBytes);
  ASSERT_TRUE(f.cache->Put(f.ns, keys[0], data.data(), kBytes).ok());
  auto r1 = f.cache->Reserve(f.ns, keys[1], kBytes);
  ASSERT_TRUE(r1.ok());

  std::vector<BlockKey> batch(keys.begin(), keys.end());
  batch.push_back(keys[5]);  // repeated within the batch, twice
  batch.push_back(keys[5]);
  std::set<uint64_t> stripes;
  for (size_t i = 2; i < keys.size(); ++i) stripes.insert(f.StripeOf(keys[i]));
  ASSERT_GT(stripes.size(), 8u) << "the batch should span many stripes";

  const uint64_t locks_before = f.index().stripe_locks_taken();
  auto many = f.cache->ReserveMany(f.ns, batch, kBytes);
  ASSERT_TRUE(many.ok()) << many.status().ToString();
  // One stripe lock per stripe the claims touch, not one per key.
  EXPECT_EQ(f.index().stripe_locks_taken() - locks_before, testing::StripeLocksFor(stripes.size()));
  ASSERT_EQ(many->size(), batch.size());

  EXPECT_EQ((*many)[0].outcome, ReserveOutcome::kAlreadyCached);
  EXPECT_EQ((*many)[0].status.code(), StatusCode::kAlreadyExists);
  EXPECT_EQ((*many)[1].outcome, ReserveOutcome::kBusy);
  EXPECT_EQ((*many)[1].status.code(), StatusCode::kBusy);
  EXPECT_EQ((*many)[1].writer_node, 0u);
  EXPECT_EQ((*many)[1].writer_incarnation, f.pool->impl().node->incarnation());
  EXPECT_THAT((*many)[1].status.message(), HasSubstr("being written by node 0"));
  for (size_t i = 2; i < keys.size(); ++i) {
    EXPECT_EQ((*many)[i].outcome, ReserveOutcome::kReserved) << i << " " << (*many)[i].status.ToString();
    EXPECT_TRUE((*many)[i].reservation.open);
    EXPECT_EQ((*many)[i].reservation.bytes, kBytes);
  }
  for (size_t i = 48; i < 50; ++i) {
    EXPECT_EQ((*many)[i].outcome, ReserveOutcome::kBusy) << i;
    EXPECT_EQ((*many)[i].writer_node, 0u);
    EXPECT_FALSE((*many)[i].reservation.open);
  }
  // Distinct slots and payloads for every reservation.
  std::set<uint32_t> slots;
  std::set<uint64_t> payloads;
  std::vector<Reservation> rs;
  for (size_t i = 2; i < keys.size(); ++i) {
    rs.push_back((*many)[i].reservation);
    slots.insert(rs.back().slot);
    payloads.insert(rs.back().offset);
    f.WriteFor(rs.back(), keys[i]);
  }
  EXPECT_EQ(slots.size(), rs.size());
  EXPECT_EQ(payloads.size(), rs.size());

  // WRITING is invisible until the commit.
  EXPECT_EQ(*f.cache->Exists(f.ns, std::span<const BlockKey>(keys).subspan(2)), 0u);
  const uint64_t locks_before_commit = f.index().stripe_locks_taken();
  std::set<uint32_t> commit_stripes;
  for (const auto& r : rs) commit_stripes.insert(r.slot / f.index().layout().h.slots_per_stripe);
  ASSERT_TRUE(f.cache->CommitMany(rs).ok());
  // Commit is fenced under the stripe lock (a reclaim cannot slip between check and READY):
  // one lock per stripe touched, not per key.
  EXPECT_EQ(f.index().stripe_locks_taken() - locks_before_commit, testing::StripeLocksFor(commit_stripes.size()));
  for (const auto& r : rs) EXPECT_FALSE(r.open);
  EXPECT_EQ(f.cache->CommitMany(rs).code(), StatusCode::kInvalidArgument);  // once only
  EXPECT_EQ(*f.cache->Exists(f.ns, keys), 1u);  // keys[1] still WRITING ends the prefix
  f.WriteFor(*r1, keys[1]);
  ASSERT_TRUE(f.cache->Commit(*r1).ok());

  auto hit = f.cache->Lookup(f.ns, keys);
  ASSERT_TRUE(hit.ok());
  ASSERT_EQ(hit->hit_blocks, keys.size());
  std::vector<uint8_t> out(kBytes);
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(f.cache->Read(hit->pins[i], 0, out.data(), kBytes).ok());
    EXPECT_TRUE(MatchesKey(keys[i], out.data(), kBytes)) << i;
  }
  f.cache->Release(hit->pins);
  // Everything READY now: the whole batch again is "already cached", with no lock taken.
  const uint64_t locks_before_dup = f.index().stripe_locks_taken();
  auto again = f.cache->ReserveMany(f.ns, keys, kBytes);
  ASSERT_TRUE(again.ok());
  for (const auto& o : *again) EXPECT_EQ(o.outcome, ReserveOutcome::kAlreadyCached);
  EXPECT_EQ(f.index().stripe_locks_taken(), locks_before_dup);
  EXPECT_EQ(f.Allocated(), keys.size() * kBytes);

  auto stat = cache::Stat(*f.pool->impl().regions[0], {cache::NodeStatus::kLive});
  EXPECT_EQ(stat["totals"]["inserts"].get<uint64_t>(), keys.size());
}

TEST(CacheBatch, BadBatchIsRefusedWhole) {
  BatchFixture f("batch-bad");
  auto keys = f.cache->ChainKeys(f.ns, testing::Tokens(22, 16 * 4, 0, 0));
  EXPECT_EQ(f.cache->ReserveMany(f.ns, keys, 0).status().code(), StatusCode::kInvalidArgument);
  NamespaceHandle stale = f.ns;
  stale.seed.lo ^= 1;
  EXPECT_EQ(f.cache->ReserveMany(stale, keys, 4096).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(f.cache->Peek(stale, keys).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(testing::LiveEntries(*f.pool).empty());
  auto empty = f.cache->ReserveMany(f.ns, {}, 4096);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
}

TEST(CacheBatch, AbortManyReturnsEveryByteAndSlot) {
  BatchFixture f("batch-abort");
  const uint64_t before = f.Allocated();
  auto keys = f.cache->ChainKeys(f.ns, testing::Tokens(23, 16 * 40, 0, 0));
  std::span<const BlockKey> big(keys.data(), 8), small(keys.data() + 8, 32);
  // Whole-chunk payloads and heap payloads.
  auto a = f.cache->ReserveMany(f.ns, big, 2 << 20);
  auto b = f.cache->ReserveMany(f.ns, small, 16 << 10);
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<Reservation> rs;
  for (const auto& o : *a) {
    ASSERT_EQ(o.outcome, ReserveOutcome::kReserved) << o.status.ToString();
    rs.push_back(o.reservation);
  }
  for (const auto& o : *b) {
    ASSERT_EQ(o.outcome, ReserveOutcome::kReserved) << o.status.ToString();
    rs.push_back(o.reservation);
  }
  EXPECT_EQ(f.Allocated(), before + 8 * (2 << 20) + 32 * (16 << 10));
  EXPECT_EQ(f.index().UsedBytes(), 8u * (2 << 20) + 32 * (16 << 10));
  EXPECT_EQ(testing::LiveEntries(*f.pool).size(), 40u);

  std::set<uint64_t> stripes;
  for (const auto& k : keys) stripes.insert(f.StripeOf(k));
  const uint64_t locks_before = f.index().stripe_locks_taken();
  ASSERT_TRUE(f.cache->AbortMany(rs).ok());
  EXPECT_EQ(f.index().stripe_locks_taken() - locks_before, testing::StripeLocksFor(stripes.size()));
  for (const auto& r : rs) EXPECT_FALSE(r.open);
  EXPECT_EQ(f.Allocated(), before);
  EXPECT_EQ(f.index().UsedBytes(), 0u);
  EXPECT_TRUE(testing::LiveEntries(*f.pool).empty());
  EXPECT_EQ(f.cache->AbortMany(rs).code(), StatusCode::kInvalidArgument);  // once only
  auto stat = cache::Stat(*f.pool->impl().regions[0], {cache::NodeStatus::kLive});
  EXPECT_EQ(stat["totals"]["aborts"].get<uint64_t>(), 40u);

  // Every key and byte is usable again.
  auto again = f.cache->ReserveMany(f.ns, keys, 16 << 10);
  ASSERT_TRUE(again.ok());
  rs.clear();
  for (const auto& o : *again) {
    EXPECT_EQ(o.outcome, ReserveOutcome::kReserved);
    rs.push_back(o.reservation);
  }
  EXPECT_EQ(f.Allocated(), before + 40 * (16 << 10));
  ASSERT_TRUE(f.cache->AbortMany(rs).ok());
  EXPECT_EQ(f.Allocated(), before);
}

TEST(CacheBatch, PeekSeesEveryStateAndNeitherPinsNorLocks) {
  BatchFixture f("batch-peek");
  auto keys = f.cache->ChainKeys(f.ns, testing::Tokens(24, 16 * 3, 0, 0));
  std::vector<uint8_t> data(4096);
  FillForKey(keys[0], data.data(), data.size());
  ASSERT_TRUE(f.cache->Put(f.ns, keys[0], data.data(), data.size()).ok());
  auto w = f.cache->Reserve(f.ns, keys[1], 4096);
  ASSERT_TRUE(w.ok());
  const uint64_t locks_before = f.index().stripe_locks_taken();
  auto p = f.cache->Peek(f.ns, keys);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(f.index().stripe_locks_taken(), locks_before);
  EXPECT_EQ((*p)[0].state, PeekState::kReady);
  EXPECT_EQ((*p)[1].state, PeekState::kWriting);
  EXPECT_EQ((*p)[1].writer_node, 0u);
  EXPECT_EQ((*p)[1].writer_incarnation, f.pool->impl().node->incarnation());
  EXPECT_TRUE((*p)[1].writer_live);
  EXPECT_EQ((*p)[2].state, PeekState::kAbsent);
  auto stat = cache::Stat(*f.pool->impl().regions[0], {cache::NodeStatus::kLive});
  EXPECT_EQ(stat["per_node"]["0"]["pins"].get<uint64_t>(), 0u);
  // Not pinned: eviction takes it at once.
  auto ev = f.cache->Evict(f.ns, {&keys[0], 1});
  ASSERT_TRUE(ev.ok());
  EXPECT_EQ(*ev, 1u);
  ASSERT_TRUE(f.cache->Abort(*w).ok());
  p = f.cache->Peek(f.ns, keys);
  ASSERT_TRUE(p.ok());
  for (const auto& k : *p) EXPECT_EQ(k.state, PeekState::kAbsent);
}

// A key WRITING by another node (another process): the batch reports it busy and names the
// writer's node and life; Peek sees the same; the rest of the batch is reserved.
TEST(CacheBatch, KeyWritingOnAnotherNodeIsBusyNamingTheWriter) {
  const auto tokens = testing::Tokens(25, 16 * 3, 0, 0);
  int to_parent[2], to_child[2];
  ASSERT_EQ(::pipe(to_parent), 0);
  ASSERT_EQ(::pipe(to_child), 0);
  // The writer (node 3) is forked before this process opens the pool, so no thread crosses the
  // fork (ThreadSanitizer refuses that); it learns the region's path through the pipe.
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(to_parent[0]);
    ::close(to_child[1]);
    int rc = 0;
    {
      char path[256] = {};
      if (::read(to_child[0], path, sizeof path - 1) <= 0) ::_exit(6);
      auto pool = OpenOrNull({std::string(path)}, 3);
      auto c = pool ? pool->Cache() : Result<KvCache*>(Internal("open"));
      auto ns = c.ok() ? (*c)->Namespace(testing::TestNamespace()) : Result<NamespaceHandle>(Internal("open"));
      auto r = ns.ok() ? (*c)->Reserve(*ns, KvCache::ChainKeys(*ns, tokens)[0], 4096) : Result<Reservation>(ns.status());
      uint64_t inc = r.ok() ? pool->impl().node->incarnation() : 0;
      if (::write(to_parent[1], &inc, sizeof inc) != sizeof inc) rc = 2;
      char go;
      if (::read(to_child[0], &go, 1) != 1) rc = 3;
      if (r.ok() && !(*c)->Abort(*r).ok()) rc = 4;
      if (!r.ok()) rc = 5;
    }
    ::_exit(rc);
  }
  BatchFixture f("batch-other");
  auto keys = f.cache->ChainKeys(f.ns, tokens);
  ASSERT_EQ(::write(to_child[1], f.path.path().c_str(), f.path.path().size()),
            static_cast<ssize_t>(f.path.path().size()));
  ::close(to_parent[1]);
  ::close(to_child[0]);
  uint64_t inc = 0;
  ASSERT_EQ(::read(to_parent[0], &inc, sizeof inc), static_cast<ssize_t>(sizeof inc));
  ASSERT_NE(inc, 0u) << "the writer process could not reserve";

  auto many = f.cache->ReserveMany(f.ns, keys, 4096);
  ASSERT_TRUE(many.ok());
  EXPECT_EQ((*many)[0].outcome, ReserveOutcome::kBusy);
  EXPECT_EQ((*many)[0].writer_node, 3u);
  EXPECT_EQ((*many)[0].writer_incarnation, inc);
  EXPECT_THAT((*many)[0].status.message(), HasSubstr("being written by node 3"));
  EXPECT_EQ((*many)[1].outcome, ReserveOutcome::kReserved);
  EXPECT_EQ((*many)[2].outcome, ReserveOutcome::kReserved);
  auto p = f.cache->Peek(f.ns, keys);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*p)[0].state, PeekState::kWriting);
  EXPECT_EQ((*p)[0].writer_node, 3u);
  EXPECT_EQ((*p)[0].writer_incarnation, inc);
  EXPECT_TRUE((*p)[0].writer_live);
  EXPECT_EQ((*p)[1].state, PeekState::kWriting);
  EXPECT_EQ((*p)[1].writer_node, 0u);
  std::vector<Reservation> rs{(*many)[1].reservation, (*many)[2].reservation};
  f.WriteFor(rs[0], keys[1]);
  f.WriteFor(rs[1], keys[2]);
  ASSERT_TRUE(f.cache->CommitMany(rs).ok());

  ASSERT_EQ(::write(to_child[1], "g", 1), 1);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  ::close(to_parent[0]);
  ::close(to_child[1]);
  p = f.cache->Peek(f.ns, keys);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*p)[0].state, PeekState::kAbsent);
  EXPECT_EQ((*p)[1].state, PeekState::kReady);
  EXPECT_EQ((*p)[2].state, PeekState::kReady);
}

}  // namespace
}  // namespace cxlkv
