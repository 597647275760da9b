// Shared set-up for transfer tests: engine caches filled from a seed, layout shapes, a pool.
#ifndef CXLKV_TESTS_TRANSFER_TRANSFER_TEST_UTIL_H_
#define CXLKV_TESTS_TRANSFER_TRANSFER_TEST_UTIL_H_

#include <random>
#include <string>
#include <vector>

#include "../cache/cache_test_util.h"
#include "transfer/transfer.h"

#if CXLKV_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace cxlkv::testing {

// An engine cache: one allocation per layer, filled from a seed.
struct EngineCache {
  EngineKvLayout layout;
  std::vector<std::vector<uint8_t>> tensors;

  EngineCache(EngineKvLayout l, uint64_t seed) : layout(std::move(l)) {
    std::mt19937_64 rng(seed);
    const uint32_t layers = static_cast<uint32_t>(layout.layers.size());
    tensors.resize(layers);
    layout.layers.clear();
    for (auto& t : tensors) {
      t.resize(layout.LayerTensorBytes());
      for (auto& b : t) b = static_cast<uint8_t>(rng());
      layout.layers.push_back(t.data());
    }
  }
  std::vector<uint8_t> Block(uint32_t id) const {
    std::vector<uint8_t> out;
    for (uint32_t l = 0; l < layout.num_layers(); ++l) {
      for (uint32_t p = 0; p < layout.parts(); ++p) {
        const uint8_t* piece = layout.EnginePiece(l, p, id);
        out.insert(out.end(), piece, piece + layout.PieceBytes());
      }
    }
    return out;
  }
};

#if CXLKV_HAVE_CUDA
// A device copy of an engine cache's per-layer tensors (the layout's pointers are then device
// pointers); FreeOnDevice releases them.
inline EngineKvLayout ToDevice(const EngineCache& host) {
  EngineKvLayout d = host.layout;
  for (uint32_t l = 0; l < d.num_layers(); ++l) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, d.LayerTensorBytes()), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, host.layout.layers[l], d.LayerTensorBytes(), cudaMemcpyHostToDevice), cudaSuccess);
    d.layers[l] = static_cast<uint8_t*>(p);
  }
  return d;
}
inline void FreeOnDevice(EngineKvLayout& d) {
  for (auto* p : d.layers) cudaFree(p);
}
#endif

inline EngineKvLayout Shape(EngineLayoutKind kind, KvDtype dtype, uint32_t layers, uint32_t blocks, uint32_t heads,
                     uint32_t head_size, uint32_t tp_rank = 0, uint32_t tp_size = 1) {
  EngineKvLayout l;
  l.kind = kind;
  l.dtype = dtype;
  l.num_blocks = blocks;
  l.num_kv_heads = heads;
  l.head_size = head_size;
  l.latent_dim = kind == EngineLayoutKind::kMla ? head_size * 4 : 0;
  l.tp_rank = tp_rank;
  l.tp_size = tp_size;
  l.layers.assign(layers, nullptr);
  return l;
}

struct Fixture {
  explicit Fixture(const std::string& tag) : path(tag) {
    EXPECT_TRUE(CreateCachePool(path.path(), 128 << 20).ok());
    pool = OpenOrNull({path.path()}, 0);
    cache = *pool->Cache();
  }
  NamespaceHandle Ns(const EngineKvLayout& l, const std::string& model = "m") {
    KeyNamespace ns;
    ns.model_id = model;
    ns.layout = l.Signature();
    auto h = cache->Namespace(ns);
    EXPECT_TRUE(h.ok()) << h.status().ToString();
    return *h;
  }
  TempRegionPath path;
  std::unique_ptr<Pool> pool;
  KvCache* cache = nullptr;
};

}  // namespace cxlkv::testing

#endif  // CXLKV_TESTS_TRANSFER_TRANSFER_TEST_UTIL_H_
