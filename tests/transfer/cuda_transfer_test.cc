// The CUDA path: where no GPU (or no CUDA build) is there, Create says so and what to use
// instead; with a GPU, a round trip through device tensors is byte-identical.
#include <numeric>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "transfer/cuda_transfer.h"
#include "transfer_test_util.h"

namespace cxlkv {
namespace {

using ::testing::HasSubstr;
using testing::EngineCache;
using testing::Fixture;
using testing::Shape;

TEST(CudaTransfer, RoundTripThroughDeviceTensorsOrACleanSkip) {
  Fixture f("cuda-xfer");
  auto t = transfer::CudaTransfer::Create(*f.cache, f.pool->MappedRanges());
  if (!t.ok()) {
    EXPECT_EQ(t.status().code(), StatusCode::kNotSupported) << t.status().ToString();
    EXPECT_THAT(t.status().message(), HasSubstr("CpuTransfer"));
    GTEST_SKIP() << "no GPU path here: " << t.status().message();
  }
#if CXLKV_HAVE_CUDA
  auto shape = Shape(EngineLayoutKind::kFlashAttn, KvDtype::kFp16, 8, 8, 4, 128);
  EngineCache src(shape, 21), back(shape, 22);
  EngineKvLayout dsrc = testing::ToDevice(src), dback = testing::ToDevice(back);
  auto ns = f.Ns(shape, "cuda");
  std::vector<uint32_t> ids = {5, 1, 7, 2};
  auto keys = KvCache::ChainKeys(ns, testing::Tokens(31, 16 * ids.size(), 0, 0));
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  auto g = (*t)->GatherWrite(ns, dsrc, ids, keys, stream);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->written, ids.size());
  auto hit = f.cache->Lookup(ns, keys);
  ASSERT_TRUE(hit.ok());
  ASSERT_EQ(hit->hit_blocks, ids.size());
  const std::vector<uint32_t> out_ids = {0, 3, 6, 4};
  ASSERT_TRUE((*t)->ScatterRead(dback, out_ids, hit->pins, stream).ok());
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  f.cache->Release(hit->pins);
  for (uint32_t l = 0; l < shape.num_layers(); ++l) {
    ASSERT_EQ(cudaMemcpy(back.layout.layers[l], dback.layers[l], shape.LayerTensorBytes(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    cudaFree(dsrc.layers[l]);
    cudaFree(dback.layers[l]);
  }
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(back.Block(out_ids[i]), src.Block(ids[i])) << i;
  // Invalid requests fail before anything is enqueued.
  const std::vector<uint32_t> twice = {0, 0};
  EXPECT_EQ((*t)->ScatterRead(dback, twice, hit->pins, stream).code(), StatusCode::kInvalidArgument);
  cudaStreamDestroy(stream);
#endif
}

TEST(CudaTransfer, BuiltMatchesTheBuild) {
#if CXLKV_HAVE_CUDA
  EXPECT_TRUE(transfer::CudaTransfer::Built());
#else
  EXPECT_FALSE(transfer::CudaTransfer::Built());
#endif
}

}  // namespace
}  // namespace cxlkv
