// Helpers of the near-memory service tests (pnm_daemon_test.cc, pnm_engines_test.cc): a test
// namespace and its KV put into the pool, queries, and the same attention computed locally over
// the same pool bytes, to compare the daemon's answers with.
#ifndef CXLKV_TESTS_DAEMON_PNM_DAEMON_UTIL_H_
#define CXLKV_TESTS_DAEMON_PNM_DAEMON_UTIL_H_

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "cxlkv/cache.h"
#include "pnm/attend.h"
#include "pnm/digest.h"
#include "pnm/remote.h"
#include "pnm/select.h"

namespace cxlkv::testing {

using Client = pnm::NearMemoryClient;

constexpr uint32_t kLayers = 2, kKvHeads = 2, kHeads = 8, kDim = 64, kPage = 16;

inline KeyNamespace TestNamespace() {
  KeyNamespace ns;
  ns.model_id = "pnm-daemon-test";
  ns.layout.dtype = KvDtype::kFp16;
  ns.layout.num_layers = kLayers;
  ns.layout.num_kv_heads = kKvHeads;
  ns.layout.head_size = kDim;
  ns.layout.block_size = kPage;
  return ns;
}

inline pnm::Geometry TestGeometry() { return {kHeads, kKvHeads, kDim, kPage, KvDtype::kFp16}; }

inline uint16_t Half(float x) {  // truncating float -> fp16 for test data in [-4, 4]
  uint32_t b;
  std::memcpy(&b, &x, 4);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const int exp = static_cast<int>((b >> 23) & 0xff) - 127 + 15;
  if (exp <= 0) return static_cast<uint16_t>(sign);
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exp) << 10) | ((b >> 13) & 0x3ffu));
}

// `pages` blocks of seeded fp16 KV (a few keys per page made loud, so selection matters) put
// into the pool; returns their keys.
inline std::vector<BlockKey> PutContext(KvCache& cache, const NamespaceHandle& ns, uint32_t pages, uint32_t seed) {
  std::vector<int32_t> tokens(size_t{pages} * kPage);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(seed * 100000 + i);
  auto keys = KvCache::ChainKeys(ns, tokens);
  std::mt19937 rng(seed);
  std::normal_distribution<float> noise(0.f, 0.5f);
  std::vector<uint16_t> block(ns.block_bytes / 2);
  for (uint32_t p = 0; p < pages; ++p) {
    for (auto& h : block) h = Half(noise(rng));
    if (p % 7 == 3) {
      for (uint32_t d = 0; d < kDim; ++d) block[d] = Half(3.5f);  // layer 0, K, token 0, head 0
    }
    Status s = cache.Put(ns, keys[p], block.data(), block.size() * 2);
    EXPECT_TRUE(s.ok() || s.code() == StatusCode::kAlreadyExists) << s.ToString();
  }
  return keys;
}

inline std::vector<float> Query(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> q(size_t{kHeads} * kDim);
  for (auto& x : q) x = d(rng);
  return q;
}

// The same attention computed here, over the same pool bytes.
inline pnm::Partial LocalAttention(KvCache& cache, const NamespaceHandle& ns, std::span<const BlockKey> keys, uint32_t layer,
                            const std::vector<float>& q, uint32_t budget, const pnm::Geometry& g = TestGeometry()) {
  auto hit = cache.Lookup(ns, keys);
  EXPECT_TRUE(hit.ok() && hit->hit_blocks == keys.size());
  std::vector<pnm::PageKv> views;
  for (const BlockPin& p : hit->pins) {
    const uint8_t* base = cache.PayloadPtr(p);
    views.push_back({base + (layer * 2) * g.SlabBytes(), base + (layer * 2 + 1) * g.SlabBytes()});
  }
  const pnm::ContextView ctx{views, keys.size() * kPage};
  pnm::Partial out;
  pnm::Selection sel;
  const pnm::Selection* selection = nullptr;
  if (budget != 0) {
    std::vector<uint8_t> digests(keys.size() * pnm::DigestBytesPerPage(g));
    EXPECT_TRUE(pnm::BuildDigests(g, ctx, digests).ok());
    EXPECT_TRUE(pnm::SelectPages(g, q.data(), digests.data(), ctx.tokens, {budget, 1, 1}, &sel).ok());
    selection = &sel;
  }
  EXPECT_TRUE(pnm::Attend(g, q.data(), ctx, selection, 0, &out).ok());
  cache.Release(hit->pins);
  return out;
}

inline Client::Job MakeJob(uint64_t context, uint32_t layer, const float* q, uint32_t budget, pnm::Partial* out) {
  Client::Job j;
  j.context = context;
  j.layer = layer;
  j.q = q;
  j.budget_tokens = budget;
  j.out = out;
  return j;
}

inline bool SameBits(const pnm::Partial& a, const pnm::Partial& b) {
  return a.out.size() == b.out.size() && a.lse.size() == b.lse.size() &&
         std::memcmp(a.out.data(), b.out.data(), a.out.size() * 4) == 0 &&
         std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * 4) == 0;
}

// One layer of a context read locally, as the daemon reads it: pinned pool blocks and digests
// built from them.
struct LocalLayer {
  KvCache& cache;
  pnm::Geometry g = TestGeometry();
  std::vector<BlockPin> pins;
  std::vector<pnm::PageKv> views;
  std::vector<uint8_t> digests;
  LocalLayer(KvCache& c, const NamespaceHandle& ns, std::span<const BlockKey> keys, uint32_t layer) : cache(c) {
    auto hit = cache.Lookup(ns, keys);
    EXPECT_TRUE(hit.ok() && hit->hit_blocks == keys.size());
    if (!hit.ok()) return;
    pins = hit->pins;
    for (const BlockPin& p : pins) {
      const uint8_t* base = cache.PayloadPtr(p);
      views.push_back({base + (layer * 2) * g.SlabBytes(), base + (layer * 2 + 1) * g.SlabBytes()});
    }
    digests.resize(keys.size() * pnm::DigestBytesPerPage(g));
    EXPECT_TRUE(pnm::BuildDigests(g, Ctx(), digests).ok());
  }
  ~LocalLayer() { cache.Release(pins); }
  pnm::ContextView Ctx() const { return {views, views.size() * kPage}; }
};

}  // namespace cxlkv::testing

#endif  // CXLKV_TESTS_DAEMON_PNM_DAEMON_UTIL_H_
