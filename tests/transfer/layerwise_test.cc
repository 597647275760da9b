// Layer-wise pipelining: a load reports layers in order, each complete when reported and the
// next not yet started while the engine holds the first; a store publishes nothing until every
// layer is in and Finish commits; prefetches queue behind each other.
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <numeric>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "transfer_test_util.h"

namespace cxlkv {
namespace {

using ::testing::HasSubstr;
using testing::EngineCache;
using testing::Fixture;
using testing::Shape;

// True iff layer `l` of engine block `id` in `a` equals layer `l` of block `src_id` in `b`.
bool LayerEquals(const EngineCache& a, uint32_t id, const EngineCache& b, uint32_t src_id, uint32_t l) {
  for (uint32_t p = 0; p < a.layout.parts(); ++p) {
    if (std::memcmp(a.layout.EnginePiece(l, p, id), b.layout.EnginePiece(l, p, src_id), a.layout.PieceBytes()) != 0) {
      return false;
    }
  }
  return true;
}

struct Written {
  NamespaceHandle ns;
  std::vector<uint32_t> ids;
  std::vector<BlockKey> keys;
};

Written WriteBlocks(Fixture& f, const EngineCache& src, uint32_t blocks, int seed) {
  Written w;
  w.ns = f.Ns(src.layout, "layerwise-" + std::to_string(seed));
  w.ids.resize(blocks);
  std::iota(w.ids.begin(), w.ids.end(), 0);
  w.keys = KvCache::ChainKeys(w.ns, testing::Tokens(seed, 16 * blocks, 0, 0));
  transfer::CpuTransfer t(*f.cache, {.threads = 2});
  auto g = t.GatherWrite(w.ns, src.layout, w.ids, w.keys);
  EXPECT_TRUE(g.ok()) << g.status().ToString();
  return w;
}

TEST(Layerwise, LoadReportsLayersInOrderEachCompleteWhenReady) {
  Fixture f("layerwise-load");
  const uint32_t layers = 12, blocks = 6;
  auto shape = Shape(EngineLayoutKind::kFlashAttn, KvDtype::kFp16, layers, 8, 4, 64);
  EngineCache src(shape, 1), dst(shape, 2);
  Written w = WriteBlocks(f, src, blocks, 1);
  auto hit = f.cache->Lookup(w.ns, w.keys);
  ASSERT_TRUE(hit.ok());
  ASSERT_EQ(hit->hit_blocks, blocks);
  const std::vector<uint32_t> out_ids = {7, 3, 0, 5, 1, 6};  // other slots, other order

  // The callback of layer 0 holds the background thread until the test has looked: layer 1
  // cannot have started, so its bytes in the engine must still be the old ones.
  std::mutex mu;
  std::condition_variable cv;
  bool looked = false;
  std::vector<uint32_t> order;
  std::vector<bool> complete_when_reported(layers, false);
  transfer::CpuTransfer t(*f.cache, {.threads = 2});
  auto load = t.StartLoad(dst.layout, out_ids, hit->pins, [&](uint32_t l) {
    bool all = true;
    for (uint32_t i = 0; i < blocks; ++i) all = all && LayerEquals(dst, out_ids[i], src, w.ids[i], l);
    std::unique_lock<std::mutex> lock(mu);
    order.push_back(l);
    complete_when_reported[l] = all;
    if (l == 0) cv.wait(lock, [&] { return looked; });
  });
  ASSERT_TRUE(load.ok()) << load.status().ToString();
  (*load)->WaitLayer(0);
  EXPECT_TRUE((*load)->LayerReady(0));
  EXPECT_EQ((*load)->layers_ready(), 1u);
  for (uint32_t i = 0; i < blocks; ++i) {
    EXPECT_TRUE(LayerEquals(dst, out_ids[i], src, w.ids[i], 0)) << "block " << i;
    EXPECT_FALSE(LayerEquals(dst, out_ids[i], src, w.ids[i], 1)) << "layer 1 loaded before layer 0 was consumed";
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    looked = true;
  }
  cv.notify_all();

  uint32_t last_seen = 0;
  for (uint32_t l = 1; l < layers; ++l) {
    (*load)->WaitLayer(l);
    const uint32_t ready = (*load)->layers_ready();
    EXPECT_GE(ready, l + 1);
    EXPECT_GE(ready, last_seen);
    last_seen = ready;
    for (uint32_t i = 0; i < blocks; ++i) ASSERT_TRUE(LayerEquals(dst, out_ids[i], src, w.ids[i], l)) << l;
  }
  load->reset();  // waits for the callbacks too
  std::vector<uint32_t> expected(layers);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(order, expected);
  for (uint32_t l = 0; l < layers; ++l) EXPECT_TRUE(complete_when_reported[l]) << "layer " << l;
  f.cache->Release(hit->pins);
}

TEST(Layerwise, PrefetchesQueueBehindEachOtherAndSyncCallsInterleave) {
  Fixture f("layerwise-prefetch");
  auto shape = Shape(EngineLayoutKind::kFlashInfer, KvDtype::kBf16, 8, 8, 2, 128);
  EngineCache src(shape, 3), a(shape, 4), b(shape, 5), c(shape, 6);
  Written w = WriteBlocks(f, src, 4, 2);
  auto hit = f.cache->Lookup(w.ns, w.keys);
  ASSERT_TRUE(hit.ok());
  transfer::CpuTransfer t(*f.cache, {.threads = 2});
  auto first = t.StartLoad(a.layout, w.ids, hit->pins);
  auto second = t.StartLoad(b.layout, w.ids, hit->pins);
  ASSERT_TRUE(first.ok() && second.ok());
  // A synchronous read while both are queued or running.
  ASSERT_TRUE(t.ScatterRead(c.layout, w.ids, hit->pins).ok());
  (*second)->Wait();
  (*first)->Wait();
  for (uint32_t id : w.ids) {
    EXPECT_EQ(a.Block(id), src.Block(id));
    EXPECT_EQ(b.Block(id), src.Block(id));
    EXPECT_EQ(c.Block(id), src.Block(id));
  }
  f.cache->Release(hit->pins);
}

TEST(Layerwise, StorePublishesOnlyWhenEveryLayerIsInAndFinished) {
  Fixture f("layerwise-store");
  const uint32_t layers = 6;
  auto shape = Shape(EngineLayoutKind::kFlashAttn, KvDtype::kFp32, layers, 8, 2, 32);
  EngineCache computed(shape, 7), engine(shape, 8), readback(shape, 9);
  auto ns = f.Ns(shape, "layerwise-store");
  const std::vector<uint32_t> ids = {2, 5, 6};
  auto keys = KvCache::ChainKeys(ns, testing::Tokens(3, 16 * ids.size(), 0, 0));
  transfer::CpuTransfer t(*f.cache, {.threads = 2});
  auto store = t.StartStore(ns, engine.layout, ids, keys);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  for (uint32_t l = 0; l < layers; ++l) {
    // "Compute" layer l into the engine's cache, then report it.
    for (uint32_t id : ids) {
      for (uint32_t p = 0; p < shape.parts(); ++p) {
        std::memcpy(engine.layout.EnginePiece(l, p, id), computed.layout.EnginePiece(l, p, id), shape.PieceBytes());
      }
    }
    ASSERT_TRUE((*store)->LayerComputed(l).ok());
    EXPECT_EQ(*f.cache->Exists(ns, keys), 0u) << "published before Finish";
  }
  auto twice = (*store)->LayerComputed(1);
  EXPECT_EQ(twice.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(twice.message(), HasSubstr("twice"));
  EXPECT_EQ((*store)->LayerComputed(layers).code(), StatusCode::kInvalidArgument);
  auto done = (*store)->Finish();
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_EQ(done->written, ids.size());
  auto hit = f.cache->Lookup(ns, keys);
  ASSERT_TRUE(hit.ok());
  ASSERT_EQ(hit->hit_blocks, ids.size());
  ASSERT_TRUE(t.ScatterRead(readback.layout, ids, hit->pins).ok());
  for (uint32_t id : ids) EXPECT_EQ(readback.Block(id), computed.Block(id));
  f.cache->Release(hit->pins);

  // A store that misses a layer publishes nothing, and one dropped unfinished frees its blocks.
  auto keys2 = KvCache::ChainKeys(ns, testing::Tokens(4, 16 * ids.size(), 0, 0));
  auto partial = t.StartStore(ns, engine.layout, ids, keys2);
  ASSERT_TRUE(partial.ok());
  ASSERT_TRUE((*partial)->LayerComputed(0).ok());
  auto missing = (*partial)->Finish();
  EXPECT_EQ(missing.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.status().message(), HasSubstr("nothing published"));
  EXPECT_EQ(*f.cache->Exists(ns, keys2), 0u);
  {
    auto dropped = t.StartStore(ns, engine.layout, ids, keys2);
    ASSERT_TRUE(dropped.ok()) << "the aborted reservations must be reusable: " << dropped.status().ToString();
    ASSERT_TRUE((*dropped)->LayerComputed(3).ok());
  }
  EXPECT_EQ(*f.cache->Exists(ns, keys2), 0u);
  auto again = t.StartStore(ns, engine.layout, ids, keys2);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  for (uint32_t l = 0; l < layers; ++l) ASSERT_TRUE((*again)->LayerComputed(l).ok());
  auto ok = (*again)->Finish();
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->written, ids.size());
  EXPECT_EQ(*f.cache->Exists(ns, keys2), ids.size());
}

TEST(Layerwise, InvalidRequestsFailBeforeAnythingMoves) {
  Fixture f("layerwise-invalid");
  auto shape = Shape(EngineLayoutKind::kFlashAttn, KvDtype::kFp16, 4, 4, 2, 64);
  EngineCache src(shape, 10), dst(shape, 11);
  Written w = WriteBlocks(f, src, 2, 5);
  auto hit = f.cache->Lookup(w.ns, w.keys);
  ASSERT_TRUE(hit.ok());
  const auto before = dst.Block(0);
  transfer::CpuTransfer t(*f.cache, {.threads = 2});
  const std::vector<uint32_t> twice = {0, 0};
  auto overlap = t.StartLoad(dst.layout, twice, hit->pins);
  EXPECT_EQ(overlap.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(overlap.status().message(), HasSubstr("overlap"));
  const std::vector<uint32_t> out_of_range = {0, 9};
  EXPECT_EQ(t.StartLoad(dst.layout, out_of_range, hit->pins).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dst.Block(0), before);
  auto other = Shape(EngineLayoutKind::kFlashAttn, KvDtype::kFp16, 4, 4, 4, 64);
  EngineCache wrong(other, 12);
  auto sig = t.StartStore(w.ns, wrong.layout, w.ids, w.keys);
  EXPECT_EQ(sig.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(sig.status().message(), HasSubstr("Signature"));
  f.cache->Release(hit->pins);
}

}  // namespace
}  // namespace cxlkv
