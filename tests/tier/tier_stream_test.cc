// The capacity tiers' streaming source: blocks read out of node DRAM and SSD through
// their owner's service into region staging, without promoting them; a corrupt slot read out is a
// miss; the service's requests are refused when malformed.
#include <fcntl.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "child.h"
#include "tier/slot_format.h"
#include "tier/tier_service.h"
#include "tier_test_util.h"
#include "tiering_test_util.h"

namespace cxlkv::tier {
namespace {

using cxlkv::testing::Child;
using cxlkv::testing::OpenCache;

// The streaming source: another node's capacity blocks read straight out (no promote). The
// owner's service reads each slot into staging the reader allocated; the reader sees the bytes
// that were written, and the blocks stay where they were (nothing moved, nothing promoted).
TEST(Tiering, AnotherNodesBlocksAreReadStraightOutAndStayWhereTheyAre) {
  cxlkv::testing::TempRegionPath path("tier-stream");
  ASSERT_TRUE(cxlkv::testing::CreateCachePool(path.path(), 64 << 20, 2048).ok());
  testing::ScratchDir dir;
  const std::string file = dir.File("kv.tier");
  Child owner = Child::Fork([&](int in, int out) {
    auto o = OpenCache(path.path(), 1);
    if (!o.cache) return 1;
    auto store = TierStore::Open(*o.pool, Options({Dram(8 << 20), Ssd(file, 32 << 20)}));
    if (!store.ok()) return 2;
    auto service = StartTierService(*o.pool, **store);
    if (!service.ok()) return 3;
    PutChain(*o.cache, o.ns, 7, 80);  // more than one read window (64 blocks)
    uint64_t spilled = 0;  // a spill round moves at most spill_batch (64) blocks
    for (auto n = (*store)->Spill(~0ull); n.ok() && *n > 0; n = (*store)->Spill(~0ull)) spilled += *n;
    if (spilled != 80) return 4;
    (void)cxlkv::testing::Put(out, 1);
    uint64_t done;
    (void)cxlkv::testing::Get(in, &done);
    const nlohmann::json st = (*store)->Stats();
    return st["read_out"] >= 80u && st["promoted"] == 0u ? 0 : 5;  // read (twice), promoted never
  });
  uint64_t ready = 0;
  ASSERT_TRUE(owner.Receive(&ready));
  auto o = OpenCache(path.path(), 0);
  ASSERT_TRUE(o.cache);
  auto keys = o.cache->ChainKeys(o.ns, cxlkv::testing::Tokens(7, 16 * 80, 0, 0));
  const auto before = EntriesByTier(*o.pool);
  auto hit = o.cache->Lookup(o.ns, keys, KvCache::CapacityPolicy::kLeave);
  ASSERT_TRUE(hit.ok()) << hit.status().ToString();
  EXPECT_EQ(hit->hit_blocks, 0u);
  EXPECT_EQ(hit->capacity_run, 80u);
  size_t seen = 0, calls = 0;  // `use` gets consecutive parts of the prefix, in key order
  auto read = o.cache->ReadCapacity(o.ns, keys, kBlock, [&](std::span<const BlockPin> staged) {
    std::vector<uint8_t> back(kBlock);
    ++calls;
    for (const BlockPin& pin : staged) {
      EXPECT_TRUE(o.cache->Read(pin, 0, back.data(), back.size()).ok());
      EXPECT_TRUE(cxlkv::testing::MatchesKey(keys[seen], back.data(), back.size())) << "block " << seen << " differs";
      ++seen;
    }
    return Status::Ok();
  });
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(read->blocks, 80u);
  EXPECT_EQ(seen, 80u);
  EXPECT_EQ(calls, 2u) << "the staging was not read a bounded window at a time";
  EXPECT_EQ(read->from_mem, before.count(cache::kTierMem) ? before.at(cache::kTierMem) : 0u);
  EXPECT_EQ(read->from_ssd, before.count(cache::kTierSsd) ? before.at(cache::kTierSsd) : 0u);
  EXPECT_EQ(EntriesByTier(*o.pool), before) << "a streamed read moved blocks";
  // What `use` returns comes back, after the staging is released.
  auto failed = o.cache->ReadCapacity(o.ns, keys, kBlock, [](std::span<const BlockPin>) { return Corrupted("no"); });
  EXPECT_EQ(failed.status().code(), StatusCode::kCorrupted);
  ASSERT_TRUE(owner.Send(1));
  EXPECT_EQ(owner.Wait(), 0);
  ExpectCheckClean(path.path());
}

// The tier service's requests come over shared memory: every malformed one is refused with what
// is wrong, never read past its end.
TEST(Tiering, MalformedTierRequestsAndAnswersAreRefused) {
  ReadRequest r;
  r.keys = {BlockKey{1, 2}, BlockKey{3, 4}};
  r.capacity = 4096;
  r.staging = {8192, 12288};
  std::vector<uint8_t> good = EncodeReadRequest(r);
  auto back = DecodeReadRequest(good);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->keys, r.keys);
  EXPECT_EQ(back->capacity, 4096u);
  EXPECT_EQ(back->staging, r.staging);
  for (size_t cut = 0; cut < good.size(); ++cut) {  // every truncation
    EXPECT_EQ(DecodeReadRequest(std::span(good).first(cut)).status().code(), StatusCode::kInvalidArgument) << cut;
  }
  std::vector<uint8_t> lying = good;
  lying[0] = 3;  // the count says three keys, the bytes hold two
  EXPECT_EQ(DecodeReadRequest(lying).status().code(), StatusCode::kInvalidArgument);
  ReadRequest many;
  many.keys.assign(kReadKeysPerCall + 1, BlockKey{5, 6});
  many.staging.assign(kReadKeysPerCall + 1, 0);
  EXPECT_EQ(DecodeReadRequest(EncodeReadRequest(many)).status().code(), StatusCode::kInvalidArgument);
  const std::vector<uint32_t> bytes = {100, 0, 7};
  std::vector<uint8_t> answer = EncodeReadResult(bytes);
  EXPECT_EQ(*DecodeReadResult(answer, 3), bytes);
  EXPECT_EQ(DecodeReadResult(answer, 2).status().code(), StatusCode::kCorrupted);
  EXPECT_EQ(DecodeReadResult(std::span(answer).first(11), 3).status().code(), StatusCode::kCorrupted);
  EXPECT_EQ(DecodePromoteRequest(std::span(good).first(10)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodePromoteResult(std::span(answer).first(8)).status().code(), StatusCode::kCorrupted);
}

// A flipped byte in an SSD slot read out: the read stops before it, the block is never served,
// its entry is dropped and counted.
TEST(Tiering, ACorruptSlotReadOutIsAMissAndItsEntryIsDropped) {
  cxlkv::testing::TempRegionPath path("tier-stream-corrupt");
  ASSERT_TRUE(cxlkv::testing::CreateCachePool(path.path(), 64 << 20, 2048).ok());
  testing::ScratchDir dir;
  auto o = OpenCache(path.path(), 0);
  ASSERT_TRUE(o.cache);
  auto store = TierStore::Open(*o.pool, Options({Ssd(dir.File("kv.tier"), 16 * kSlot)}));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto service = StartTierService(*o.pool, **store);
  ASSERT_TRUE(service.ok());
  Blocks b = PutChain(*o.cache, o.ns, 8, 8);
  ASSERT_EQ(*(*store)->Spill(~0ull), 8u);
  uint64_t slot = ~0ull;
  for (const cache::Entry& e : cxlkv::testing::LiveEntries(*o.pool)) {
    if (e.key_lo == b.keys[5].lo && e.key_hi == b.keys[5].hi) slot = cache::LocationSlot(e.payload);
  }
  ASSERT_NE(slot, ~0ull);
  int fd = ::open(dir.File("kv.tier").c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  const off_t at = static_cast<off_t>(slot * 4096 /* its first 4 KiB unit */ + kSlotHeaderBytes + 77);
  uint8_t byte = 0;
  ASSERT_EQ(::pread(fd, &byte, 1, at), 1);
  byte ^= 0x01;
  ASSERT_EQ(::pwrite(fd, &byte, 1, at), 1);
  ::close(fd);
  size_t seen = 0;
  auto read = o.cache->ReadCapacity(o.ns, b.keys, kBlock, [&](std::span<const BlockPin> staged) {
    std::vector<uint8_t> back(kBlock);
    for (const BlockPin& pin : staged) {
      EXPECT_TRUE(o.cache->Read(pin, 0, back.data(), back.size()).ok());
      EXPECT_TRUE(cxlkv::testing::MatchesKey(b.keys[seen], back.data(), back.size())) << "block " << seen << " differs";
      ++seen;
    }
    return Status::Ok();
  });
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(read->blocks, 5u);
  const nlohmann::json st = (*store)->Stats();
  EXPECT_EQ(st["devices"][0]["miss_corrupt"], 1u);
  EXPECT_EQ(st["dropped_lost"], 1u);
  EXPECT_EQ(st["promoted"], 0u);
  EXPECT_EQ(*o.cache->Exists(o.ns, b.keys), 5u);  // block 5 is gone; 6 and 7 stay on the SSD
  EXPECT_EQ(*o.cache->Exists(o.ns, std::span<const BlockKey>(b.keys).subspan(6)), 2u);
  service->reset();
  ExpectCheckClean(path.path());
}

}  // namespace
}  // namespace cxlkv::tier
