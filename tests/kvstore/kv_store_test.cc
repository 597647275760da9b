// The engine-keyed batch API (include/cxlkv/kv_store.h): byte-identical round trips between two
// engines' registered tensors for every layout and dtype, exists-prefix against puts, put-many
// skipping cached keys, engine hashes of two TP ranks kept apart, and bad requests refused whole.
#include "cxlkv/kv_store.h"

#include <cstring>
#include <numeric>
#include <random>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "../transfer/transfer_test_util.h"

namespace cxlkv {
namespace {

using testing::EngineCache;
using testing::Fixture;
using testing::Shape;
using ::testing::HasSubstr;

// n engine hashes as vLLM makes them (32-byte digests), distinct per `salt`.
std::vector<std::vector<uint8_t>> EngineHashes(size_t n, uint64_t salt) {
  std::mt19937_64 rng(salt);
  std::vector<std::vector<uint8_t>> out(n, std::vector<uint8_t>(32));
  for (auto& h : out) {
    for (auto& b : h) b = static_cast<uint8_t>(rng());
  }
  return out;
}

std::vector<BlockKey> Keys(const NamespaceHandle& ns, const std::vector<std::vector<uint8_t>>& hashes) {
  std::vector<BlockKey> keys;
  for (const auto& h : hashes) keys.push_back(KvCache::KeyFromEngineHash(ns, h));
  return keys;
}

std::unique_ptr<EngineKvStore> Register(Fixture& f, const NamespaceHandle& ns, const EngineKvLayout& l,
                                        uint32_t threads = 1) {
  auto s = EngineKvStore::Register(*f.cache, ns, l, threads);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(*s) : nullptr;
}

TEST(EngineKvStore, RoundTripsEveryLayoutAndDtypeBetweenTwoEngines) {
  Fixture f("kvs-all");
  int n = 0;
  for (auto kind : {EngineLayoutKind::kFlashAttn, EngineLayoutKind::kFlashInfer, EngineLayoutKind::kMla,
                    EngineLayoutKind::kFlashInferHnd}) {
    for (auto dtype : {KvDtype::kFp16, KvDtype::kBf16, KvDtype::kFp8, KvDtype::kFp32}) {
      SCOPED_TRACE(std::to_string(static_cast<int>(kind)) + "/" + std::to_string(static_cast<int>(dtype)));
      auto shape = Shape(kind, dtype, 3, 8, 2, 64);
      EngineCache prefill(shape, 10 + n), decode(shape, 50 + n);
      auto ns = f.Ns(prefill.layout, "model-" + std::to_string(n));
      auto src = Register(f, ns, prefill.layout, 2);
      auto dst = Register(f, ns, decode.layout);
      ASSERT_TRUE(src && dst);
      auto keys = Keys(ns, EngineHashes(5, n));
      const std::vector<uint32_t> from = {6, 1, 3, 0, 7}, into = {2, 5, 4, 7, 0};
      auto put = src->PutMany(keys, from);
      ASSERT_TRUE(put.ok()) << put.status().ToString();
      EXPECT_EQ(put->written, 5u);
      EXPECT_EQ(put->skipped, 0u);
      EXPECT_EQ(*dst->ExistsPrefix(keys), 5u);
      auto got = dst->GetManyInto(keys, into);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      ASSERT_EQ(*got, 5u);
      for (size_t i = 0; i < keys.size(); ++i) EXPECT_EQ(decode.Block(into[i]), prefill.Block(from[i])) << i;
      // A second put of the same keys copies nothing.
      auto again = src->PutMany(keys, from);
      ASSERT_TRUE(again.ok());
      EXPECT_EQ(again->written, 0u);
      EXPECT_EQ(again->skipped, 5u);
      ++n;
    }
  }
}

TEST(EngineKvStore, ExistsPrefixAndGetManyStopAtTheFirstMissingBlock) {
  Fixture f("kvs-prefix");
  auto shape = Shape(EngineLayoutKind::kFlashAttn, KvDtype::kBf16, 2, 16, 2, 32);
  EngineCache a(shape, 1), b(shape, 2);
  auto ns = f.Ns(a.layout);
  auto src = Register(f, ns, a.layout);
  auto dst = Register(f, ns, b.layout);
  auto keys = Keys(ns, EngineHashes(8, 3));
  std::vector<uint32_t> ids(8);
  std::iota(ids.begin(), ids.end(), 0);
  EXPECT_EQ(*src->ExistsPrefix(keys), 0u);
  // Blocks 0..4 and 6 cached; 5 missing: the prefix is 5 and nothing past it is loaded.
  ASSERT_TRUE(src->PutMany(std::span(keys).first(5), std::span(ids).first(5)).ok());
  ASSERT_TRUE(src->PutMany(std::span(keys).subspan(6, 1), std::span(ids).subspan(6, 1)).ok());
  EXPECT_EQ(*src->ExistsPrefix(keys), 5u);
  const std::vector<uint8_t> untouched = b.Block(6);
  auto got = dst->GetManyInto(keys, ids);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, 5u);
  for (uint32_t i = 0; i < 5; ++i) EXPECT_EQ(b.Block(i), a.Block(i));
  EXPECT_EQ(b.Block(6), untouched);
  // Every pin was released: the blocks can all be evicted.
  EXPECT_EQ(*f.cache->EvictAll(), 6u);
}

TEST(EngineKvStore, TheSameEngineHashUnderTwoTpRanksNamesTwoBlocks) {
  Fixture f("kvs-tp");
  auto r0 = Shape(EngineLayoutKind::kFlashAttn, KvDtype::kFp16, 2, 4, 2, 64, 0, 2);
  auto r1 = Shape(EngineLayoutKind::kFlashAttn, KvDtype::kFp16, 2, 4, 2, 64, 1, 2);
  EngineCache e0(r0, 1), e1(r1, 2), back(r1, 3);
  auto ns0 = f.Ns(e0.layout, "llama"), ns1 = f.Ns(e1.layout, "llama");
  auto hashes = EngineHashes(3, 9);
  auto k0 = Keys(ns0, hashes), k1 = Keys(ns1, hashes);
  for (size_t i = 0; i < k0.size(); ++i) EXPECT_NE(k0[i], k1[i]) << i;
  auto s0 = Register(f, ns0, e0.layout), s1 = Register(f, ns1, e1.layout), s1b = Register(f, ns1, back.layout);
  const std::vector<uint32_t> ids = {0, 1, 2};
  ASSERT_TRUE(s0->PutMany(k0, ids).ok());
  EXPECT_EQ(*s1->ExistsPrefix(k1), 0u);  // rank 1 sees none of rank 0's blocks
  ASSERT_TRUE(s1->PutMany(k1, ids).ok());
  ASSERT_EQ(*s1b->GetManyInto(k1, ids), 3u);
  for (uint32_t i : ids) EXPECT_EQ(back.Block(i), e1.Block(i));  // rank 1's bytes, not rank 0's
}

TEST(EngineKvStore, BadRequestsAreRefusedWholeWithTheReason) {
  Fixture f("kvs-bad");
  auto shape = Shape(EngineLayoutKind::kFlashInfer, KvDtype::kFp16, 2, 4, 2, 32);
  EngineCache a(shape, 1), b(shape, 2);
  auto ns = f.Ns(a.layout);
  // A namespace of another layout, zero threads.
  auto other = Shape(EngineLayoutKind::kFlashInfer, KvDtype::kFp32, 2, 4, 2, 32);
  EngineCache o(other, 3);
  auto wrong = EngineKvStore::Register(*f.cache, ns, o.layout);
  ASSERT_FALSE(wrong.ok());
  EXPECT_THAT(wrong.status().ToString(), HasSubstr("register the namespace with this layout"));
  EXPECT_EQ(EngineKvStore::Register(*f.cache, ns, a.layout, 0).status().code(), StatusCode::kInvalidArgument);
  auto s = Register(f, ns, a.layout);
  auto d = Register(f, ns, b.layout);
  auto keys = Keys(ns, EngineHashes(3, 4));
  const std::vector<uint32_t> two = {0, 1}, out_of_range = {0, 1, 4}, twice = {0, 1, 0};
  auto put = s->PutMany(keys, two);
  EXPECT_THAT(put.status().ToString(), HasSubstr("3 keys but 2 block ids"));
  put = s->PutMany(keys, out_of_range);
  EXPECT_THAT(put.status().ToString(), HasSubstr("out of range"));
  EXPECT_EQ(*s->ExistsPrefix(keys), 0u);  // nothing published by a refused put
  ASSERT_TRUE(s->PutMany(keys, std::vector<uint32_t>{0, 1, 2}).ok());
  const std::vector<uint8_t> before = b.Block(0);
  auto got = d->GetManyInto(keys, twice);
  EXPECT_THAT(got.status().ToString(), HasSubstr("appears twice"));
  got = d->GetManyInto(keys, out_of_range);
  EXPECT_THAT(got.status().ToString(), HasSubstr("out of range"));
  EXPECT_EQ(b.Block(0), before);  // the engine untouched
  EXPECT_EQ(*f.cache->EvictAll(), 3u);  // and no pin left behind
}

TEST(EngineKvStore, LayerWiseLoadsAndSavesMoveTheSameBytes) {
  Fixture f("kvs-layers");
  auto shape = Shape(EngineLayoutKind::kFlashAttn, KvDtype::kFp16, 4, 8, 2, 64);
  EngineCache a(shape, 1), b(shape, 2);
  auto ns = f.Ns(a.layout);
  auto src = Register(f, ns, a.layout);
  auto dst = Register(f, ns, b.layout);
  auto keys = Keys(ns, EngineHashes(4, 5));
  const std::vector<uint32_t> from = {3, 0, 6, 1}, into = {7, 2, 4, 5};
  // A save publishes nothing until every layer is reported and it is finished.
  auto save = src->StartPutMany(keys, from);
  ASSERT_TRUE(save.ok()) << save.status().ToString();
  for (uint32_t l = 0; l < 4; ++l) ASSERT_TRUE((*save)->LayerComputed(l).ok());
  EXPECT_EQ((*save)->LayerComputed(2).code(), StatusCode::kInvalidArgument);  // twice
  EXPECT_EQ(*src->ExistsPrefix(keys), 0u);
  auto done = (*save)->Finish();
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_EQ(done->written, 4u);
  EXPECT_EQ(*src->ExistsPrefix(keys), 4u);
  // A load pins the prefix, then hands the layers over in order.
  auto load = dst->StartGetManyInto(keys, into);
  ASSERT_TRUE(load.ok()) << load.status().ToString();
  EXPECT_EQ((*load)->blocks(), 4u);
  EXPECT_EQ(*f.cache->EvictAll(), 0u);  // pinned while in flight
  for (uint32_t l = 0; l < 4; ++l) {
    (*load)->WaitLayer(l);
    for (size_t i = 0; i < from.size(); ++i) {
      for (uint32_t p = 0; p < 2; ++p) {
        ASSERT_EQ(0, std::memcmp(b.layout.EnginePiece(l, p, into[i]), a.layout.EnginePiece(l, p, from[i]),
                                 a.layout.PieceBytes()))
            << "layer " << l << " block " << i;
      }
    }
  }
  load->reset();  // releases the pins
  EXPECT_EQ(*f.cache->EvictAll(), 4u);
}

TEST(EngineKvStore, ASaveDroppedBeforeFinishPublishesNothingAndAMissLoadsNothing) {
  Fixture f("kvs-layers-abort");
  auto shape = Shape(EngineLayoutKind::kFlashInfer, KvDtype::kBf16, 2, 4, 1, 32);
  EngineCache a(shape, 1), b(shape, 2);
  auto ns = f.Ns(a.layout);
  auto s = Register(f, ns, a.layout);
  auto keys = Keys(ns, EngineHashes(2, 6));
  {
    auto save = s->StartPutMany(keys, std::vector<uint32_t>{0, 1});
    ASSERT_TRUE(save.ok());
    ASSERT_TRUE((*save)->LayerComputed(0).ok());
  }  // dropped with layer 1 never reported
  EXPECT_EQ(*s->ExistsPrefix(keys), 0u);
  auto save = s->StartPutMany(keys, std::vector<uint32_t>{0, 1});
  ASSERT_TRUE(save.ok());
  ASSERT_TRUE((*save)->LayerComputed(0).ok());
  EXPECT_EQ((*save)->Finish().status().code(), StatusCode::kInvalidArgument);  // layer 1 missing
  EXPECT_EQ(*s->ExistsPrefix(keys), 0u);
  auto d = Register(f, ns, b.layout);
  const std::vector<uint8_t> before = b.Block(0);
  auto load = d->StartGetManyInto(keys, std::vector<uint32_t>{0, 1});
  ASSERT_TRUE(load.ok());
  EXPECT_EQ((*load)->blocks(), 0u);
  (*load)->Wait();
  EXPECT_EQ(b.Block(0), before);
  EXPECT_THAT(d->StartGetManyInto(keys, std::vector<uint32_t>{0, 0}).status().ToString(), HasSubstr("appears twice"));
}

TEST(EngineKvStore, DeviceTensorsRoundTripOrACleanRefusal) {
  Fixture f("kvs-device");
  auto shape = Shape(EngineLayoutKind::kFlashAttn, KvDtype::kFp16, 2, 8, 2, 64);
  EngineCache a(shape, 1), b(shape, 2);
  auto ns = f.Ns(a.layout);
  auto store = EngineKvStore::RegisterDevice(*f.pool, ns, a.layout, 0);
  if (!store.ok()) {
    EXPECT_EQ(store.status().code(), StatusCode::kNotSupported) << store.status().ToString();
    EXPECT_THAT(store.status().message(), HasSubstr(EngineKvStore::DeviceBuilt() ? "CUDA device" : "without CUDA"));
    GTEST_SKIP() << "no GPU path here: " << store.status().message();
  }
#if CXLKV_HAVE_CUDA
  EngineKvLayout da = testing::ToDevice(a), db = testing::ToDevice(b);
  auto src = EngineKvStore::RegisterDevice(*f.pool, ns, da, 0);
  auto dst = EngineKvStore::RegisterDevice(*f.pool, ns, db, 0);
  ASSERT_TRUE(src.ok() && dst.ok());
  auto keys = Keys(ns, EngineHashes(4, 8));
  const std::vector<uint32_t> from = {6, 1, 3, 0}, into = {2, 5, 4, 7};
  auto put = (*src)->PutMany(std::span(keys).first(2), std::span(from).first(2));
  ASSERT_TRUE(put.ok()) << put.status().ToString();
  auto save = (*src)->StartPutMany(std::span(keys).subspan(2), std::span(from).subspan(2));
  ASSERT_TRUE(save.ok());
  for (uint32_t l = 0; l < 2; ++l) ASSERT_TRUE((*save)->LayerComputed(l).ok());
  ASSERT_EQ((*save)->Finish()->written, 2u);
  ASSERT_EQ(*(*dst)->GetManyInto(std::span(keys).first(2), std::span(into).first(2)), 2u);
  auto load = (*dst)->StartGetManyInto(std::span(keys).subspan(2), std::span(into).subspan(2));
  ASSERT_TRUE(load.ok());
  (*load)->Wait();
  load->reset();
  for (uint32_t l = 0; l < 2; ++l) {
    ASSERT_EQ(cudaMemcpy(b.layout.layers[l], db.layers[l], b.layout.LayerTensorBytes(), cudaMemcpyDeviceToHost),
              cudaSuccess);
  }
  for (size_t i = 0; i < from.size(); ++i) EXPECT_EQ(b.Block(into[i]), a.Block(from[i])) << i;
  testing::FreeOnDevice(da);
  testing::FreeOnDevice(db);
#endif
}

// Block ownership: a preempted request's blocks, released while its layer-wise load and save
// are in flight, are neither overwritten after the release (the release waits for the load) nor
// published from (the save is refused at Finish); a request's own blocks move as before.
TEST(EngineKvStore, ReleasedBlocksAreNeitherLoadedIntoAfterwardsNorPublishedFrom) {
  Fixture f("kvs-owner");
  auto shape = Shape(EngineLayoutKind::kFlashAttn, KvDtype::kBf16, 4, 8, 2, 32);
  EngineCache a(shape, 1), b(shape, 2);
  auto ns = f.Ns(a.layout);
  auto src = Register(f, ns, a.layout);
  auto dst = Register(f, ns, b.layout);
  ASSERT_TRUE(src && dst);
  auto keys = Keys(ns, EngineHashes(6, 9));
  const std::vector<uint32_t> first = {0, 1, 2}, rest = {3, 4, 5};
  ASSERT_TRUE(src->PutMany(std::span(keys).first(3), first).ok());  // untracked: no owner needed
  ASSERT_TRUE(dst->AssignBlocks(1, first).ok());
  ASSERT_TRUE(src->AssignBlocks(2, rest).ok());
  EXPECT_EQ(dst->GetManyInto(std::span(keys).first(3), first).status().code(), StatusCode::kInvalidArgument);
  auto load = dst->StartGetManyInto(std::span(keys).first(3), first, 1);
  ASSERT_TRUE(load.ok()) << load.status().ToString();
  auto save = src->StartPutMany(std::span(keys).subspan(3), rest, 2);
  ASSERT_TRUE(save.ok()) << save.status().ToString();
  ASSERT_TRUE((*save)->LayerComputed(0).ok());
  // Preempted: both give their blocks up. The load's copy is complete once the release returns.
  EXPECT_EQ(dst->ReleaseOwner(1), 3u);
  for (uint32_t i : first) EXPECT_EQ(b.Block(i), a.Block(i));
  EXPECT_EQ(src->ReleaseBlocks(2, std::span(rest).first(1)), 1u);
  for (uint32_t l = 1; l < 4; ++l) ASSERT_TRUE((*save)->LayerComputed(l).ok());
  auto done = (*save)->Finish();
  EXPECT_EQ(done.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(done.status().message(), HasSubstr("given up by its request"));
  EXPECT_EQ(*src->ExistsPrefix(keys), 3u);  // nothing of the refused save
  // Blocks 4 and 5 are still request 2's: they move; block 3 is nobody's now.
  EXPECT_EQ(src->PutMany(std::span(keys).subspan(3, 1), std::span(rest).first(1), 2).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(src->AssignBlocks(0, rest).code(), StatusCode::kInvalidArgument);
  load->reset();
  EXPECT_EQ(*f.cache->EvictAll(), 3u);  // the load's pins were released
}

}  // namespace
}  // namespace cxlkv
