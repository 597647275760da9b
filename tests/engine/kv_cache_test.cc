// PagedKvCache: the layout it describes to connectors, and its block free list.
#include "engine/kv_cache.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "engine_test_util.h"

namespace cxlkv::engine {
namespace {

using test_util::Allocate;
using test_util::TinyConfig;
using ::testing::AllOf;
using ::testing::HasSubstr;

// ---------------------------------------------------------------------------------------------
// (6) PagedKvCache.

TEST(EngineKvCache, LayoutDescribesTheTensors) {
  const ModelConfig c = TinyConfig();
  PagedKvCache cache(c, 10, 16);
  const EngineKvLayout l = cache.Layout();
  EXPECT_TRUE(l.Validate().ok()) << l.Validate().ToString();
  EXPECT_EQ(l.kind, EngineLayoutKind::kFlashAttn);
  EXPECT_EQ(l.dtype, KvDtype::kFp32);
  EXPECT_EQ(l.num_blocks, 10u);
  EXPECT_EQ(l.block_size, 16u);
  EXPECT_EQ(l.num_kv_heads, c.num_kv_heads);
  EXPECT_EQ(l.head_size, c.head_dim);
  ASSERT_EQ(l.num_layers(), c.num_layers);
  EXPECT_EQ(l.LayerTensorBytes(), 2ull * 10 * 16 * c.num_kv_heads * c.head_dim * 4);
  const uint64_t row_bytes = uint64_t{c.num_kv_heads} * c.head_dim * 4;
  for (uint32_t layer = 0; layer < c.num_layers; ++layer) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(l.layers[layer]) % 64, 0u);
    for (uint32_t b : {0u, 3u, 9u}) {
      for (uint32_t r : {0u, 15u}) {
        EXPECT_EQ(reinterpret_cast<uint8_t*>(cache.Key(layer, b, r)),
                  l.EnginePiece(layer, 0, b) + r * row_bytes);
        EXPECT_EQ(reinterpret_cast<uint8_t*>(cache.Value(layer, b, r)),
                  l.EnginePiece(layer, 1, b) + r * row_bytes);
      }
    }
    EXPECT_EQ(reinterpret_cast<uint8_t*>(cache.Value(layer, 9, 15)) + row_bytes,
              l.layers[layer] + l.LayerTensorBytes());
  }
  EXPECT_EQ(cache.Key(0, 9, 15)[0], 0.0f);  // zero-initialised
}

TEST(EngineKvCache, ExhaustionTakesNothingAndFreedBlocksAreReused) {
  PagedKvCache cache(TinyConfig(), 10, 16);
  std::vector<uint32_t> a = Allocate(cache, 6);
  EXPECT_EQ(std::set<uint32_t>(a.begin(), a.end()).size(), 6u);
  EXPECT_EQ(cache.free_blocks(), 4u);
  Result<std::vector<uint32_t>> r = cache.AllocateBlocks(5);
  EXPECT_EQ(r.status().code(), StatusCode::kNoSpace);
  EXPECT_THAT(r.status().message(), AllOf(HasSubstr("4 free"), HasSubstr("5 requested")));
  EXPECT_EQ(cache.free_blocks(), 4u);
  std::vector<uint32_t> b = Allocate(cache, 4);
  EXPECT_EQ(cache.free_blocks(), 0u);
  std::set<uint32_t> all(a.begin(), a.end());
  all.insert(b.begin(), b.end());
  EXPECT_EQ(all.size(), 10u);

  const std::vector<uint32_t> give_back = {a[1], a[4], b[0]};
  cache.FreeBlocks(give_back);
  cache.FreeBlocks(give_back);  // a double free is ignored
  EXPECT_EQ(cache.free_blocks(), 3u);
  std::vector<uint32_t> c = Allocate(cache, 3);
  EXPECT_EQ(std::set<uint32_t>(c.begin(), c.end()),
            std::set<uint32_t>(give_back.begin(), give_back.end()));
  EXPECT_EQ(cache.AllocateBlocks(1).status().code(), StatusCode::kNoSpace);
}
}  // namespace
}  // namespace cxlkv::engine
