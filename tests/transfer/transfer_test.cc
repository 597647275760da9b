// Gather-write and scatter-read between engine layouts and pool blocks: byte-identical round
// trips for every layout x dtype x TP slice, random shapes and block-id permutations, and
// requests that must fail whole with the destination untouched.
#include <algorithm>
#include <numeric>
#include <random>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "transfer_test_util.h"

namespace cxlkv {
namespace {

using testing::EngineCache;
using testing::Fixture;
using testing::Shape;

using ::testing::HasSubstr;

// Writes blocks `ids` of `src` under fresh keys, reads them into `ids_out` of a fresh cache.
void RoundTrip(Fixture& f, const EngineKvLayout& shape, uint32_t threads, uint64_t seed,
               const std::string& model) {
  EngineCache src(shape, seed), dst(shape, seed + 1);
  auto ns = f.Ns(src.layout, model);
  std::vector<uint32_t> ids(shape.num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(std::max<size_t>(1, ids.size() / 2));
  std::vector<int32_t> tokens(ids.size() * shape.block_size);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % 32000);
  auto keys = KvCache::ChainKeys(ns, tokens);
  ASSERT_EQ(keys.size(), ids.size());
  transfer::CpuTransfer t(*f.cache, {.threads = threads, .small_piece_bytes = 4096});
  auto g = t.GatherWrite(ns, src.layout, ids, keys);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->written, ids.size());
  auto hit = f.cache->Lookup(ns, keys);
  ASSERT_TRUE(hit.ok());
  ASSERT_EQ(hit->hit_blocks, ids.size());
  std::vector<uint32_t> out_ids = ids;
  std::shuffle(out_ids.begin(), out_ids.end(), rng);  // into other slots of the fresh cache
  ASSERT_TRUE(t.ScatterRead(dst.layout, out_ids, hit->pins).ok());
  for (size_t i = 0; i < ids.size(); ++i) {
    ASSERT_EQ(dst.Block(out_ids[i]), src.Block(ids[i])) << "block " << i;
  }
  f.cache->Release(hit->pins);
}

TEST(Transfer, RoundTripsEveryLayoutDtypeAndTpSlice) {
  Fixture f("xfer-all");
  int n = 0;
  for (auto kind : {EngineLayoutKind::kFlashAttn, EngineLayoutKind::kFlashInfer, EngineLayoutKind::kMla,
                    EngineLayoutKind::kFlashInferHnd}) {
    for (auto dtype : {KvDtype::kFp16, KvDtype::kBf16, KvDtype::kFp8, KvDtype::kFp32}) {
      for (uint32_t tp : {1u, 2u}) {
        SCOPED_TRACE(std::to_string(static_cast<int>(kind)) + "/" + std::to_string(static_cast<int>(dtype)) + "/tp" +
                     std::to_string(tp));
        auto shape = Shape(kind, dtype, 4, 8, 8 / tp, 64, tp - 1, tp);
        RoundTrip(f, shape, 2, 100 + n, "model-" + std::to_string(n));
        ++n;
      }
    }
  }
}

TEST(Transfer, PropertyRandomShapesAndPermutations) {
  Fixture f("xfer-prop");
  std::mt19937_64 rng(7);
  for (int i = 0; i < 12; ++i) {
    auto kind = static_cast<EngineLayoutKind>(rng() % 4);
    auto dtype = static_cast<KvDtype>(rng() % 4);
    auto shape = Shape(kind, dtype, 1 + rng() % 6, 2 + rng() % 10, 1 + rng() % 4, 16 << (rng() % 3));
    shape.block_size = 1 + rng() % 32;
    RoundTrip(f, shape, 1 + rng() % 3, 1000 + i, "prop-" + std::to_string(i));
  }
}

TEST(Transfer, MlaSignatureIsTheSameOnEveryRank) {
  auto r0 = Shape(EngineLayoutKind::kMla, KvDtype::kBf16, 2, 4, 0, 64, 0, 4);
  auto r3 = Shape(EngineLayoutKind::kMla, KvDtype::kBf16, 2, 4, 0, 64, 3, 4);
  KvLayoutSignature a = r0.Signature(), b = r3.Signature();
  EXPECT_EQ(std::memcmp(&a, &b, sizeof a), 0) << "MLA keys must not multiply the data by the rank count";
  auto fa = Shape(EngineLayoutKind::kFlashAttn, KvDtype::kBf16, 2, 4, 2, 64, 0, 4);
  auto fb = Shape(EngineLayoutKind::kFlashAttn, KvDtype::kBf16, 2, 4, 2, 64, 3, 4);
  KvLayoutSignature c = fa.Signature(), d = fb.Signature();
  EXPECT_NE(std::memcmp(&c, &d, sizeof c), 0) << "head slices of different ranks must not share keys";
}

// An HND engine's blocks are pool block format 2, which is part of the namespace: in a pool where
// a model is registered with format 1, the same model in format 2 is a layout mismatch (said
// plainly), and under another extra key its keys are its own, so neither engine reads the
// other's blocks in the wrong order. A format the build does not know, or format 2 for an MLA
// latent, is refused where the namespace registers.
TEST(Transfer, HeadMajorBlocksHaveANamespaceOfTheirOwn) {
  Fixture f("xfer-hnd");
  auto nhd = Shape(EngineLayoutKind::kFlashInfer, KvDtype::kFp16, 2, 4, 2, 64);
  auto hnd = Shape(EngineLayoutKind::kFlashInferHnd, KvDtype::kFp16, 2, 4, 2, 64);
  EXPECT_EQ(nhd.Signature().block_format, kPoolBlockFormat);
  EXPECT_EQ(hnd.Signature().block_format, kPoolBlockFormatHeadMajor);
  EXPECT_EQ(nhd.PoolBlockBytes(), hnd.PoolBlockBytes());
  const NamespaceHandle a = f.Ns(nhd, "model");
  KeyNamespace same;
  same.model_id = "model";
  same.layout = hnd.Signature();
  auto mismatch = f.cache->Namespace(same);
  ASSERT_FALSE(mismatch.ok());
  EXPECT_THAT(mismatch.status().message(), HasSubstr("format=2"));
  same.extra_key = "hnd";
  auto b = f.cache->Namespace(same);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_NE(std::memcmp(&a.seed, &b->seed, sizeof a.seed), 0) << "the formats must not share keys";
  // Blocks written by the HND engine are not found under the NHD engine's keys.
  EngineCache src(hnd, 41);
  auto tokens = testing::Tokens(41, 16 * 2, 0, 0);
  transfer::CpuTransfer t(*f.cache, {.threads = 1});
  std::vector<uint32_t> ids{1, 3};
  ASSERT_TRUE(t.GatherWrite(*b, src.layout, ids, KvCache::ChainKeys(*b, tokens)).ok());
  auto miss = f.cache->Lookup(a, KvCache::ChainKeys(a, tokens));
  ASSERT_TRUE(miss.ok());
  EXPECT_EQ(miss->hit_blocks, 0u);
  KeyNamespace bad;
  bad.model_id = "other";
  bad.layout = hnd.Signature();
  bad.layout.block_format = 3;
  EXPECT_THAT(f.cache->Namespace(bad).status().message(), HasSubstr("pool block format 3"));
  bad.layout = Shape(EngineLayoutKind::kMla, KvDtype::kFp16, 2, 4, 0, 64).Signature();
  bad.layout.block_format = kPoolBlockFormatHeadMajor;
  EXPECT_THAT(f.cache->Namespace(bad).status().message(), HasSubstr("MLA"));
}

TEST(Transfer, InvalidRequestsFailWholeAndTouchNothing) {
  Fixture f("xfer-bad");
  auto shape = Shape(EngineLayoutKind::kFlashAttn, KvDtype::kFp16, 3, 6, 2, 64);
  EngineCache src(shape, 1), dst(shape, 2);
  auto ns = f.Ns(src.layout);
  auto keys = KvCache::ChainKeys(ns, testing::Tokens(1, 16 * 3, 0, 0));
  transfer::CpuTransfer t(*f.cache, {.threads = 2});
  // Gather: a block id out of range publishes nothing.
  std::vector<uint32_t> bad_ids{0, 1, 6};
  auto g = t.GatherWrite(ns, src.layout, bad_ids, keys);
  EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(g.status().message(), HasSubstr("out of range"));
  EXPECT_EQ(*f.cache->Exists(ns, keys), 0u);
  // Gather: a namespace registered for another layout.
  auto other = Shape(EngineLayoutKind::kFlashAttn, KvDtype::kFp16, 2, 6, 2, 64);
  auto other_ns = f.Ns(EngineCache(other, 3).layout, "other");
  std::vector<uint32_t> ids{0, 1, 2};
  auto mismatch = t.GatherWrite(other_ns, src.layout, ids, keys);
  EXPECT_EQ(mismatch.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(mismatch.status().message(), HasSubstr("Signature()"));
  // Gather: a null layer pointer.
  EngineKvLayout null_layer = src.layout;
  null_layer.layers[1] = nullptr;
  EXPECT_THAT(t.GatherWrite(ns, null_layer, ids, keys).status().message(), HasSubstr("null base pointer"));
  EXPECT_EQ(*f.cache->Exists(ns, keys), 0u);
  // A good gather, then bad scatters leave the destination untouched.
  ASSERT_TRUE(t.GatherWrite(ns, src.layout, ids, keys).ok());
  auto hit = f.cache->Lookup(ns, keys);
  ASSERT_EQ(hit->hit_blocks, 3u);
  auto before = dst.tensors;
  std::vector<uint32_t> twice{4, 5, 4};
  Status overlap = t.ScatterRead(dst.layout, twice, hit->pins);
  EXPECT_EQ(overlap.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(overlap.message(), HasSubstr("appears twice"));
  std::vector<uint32_t> out_of_range{0, 1, 9};
  EXPECT_THAT(t.ScatterRead(dst.layout, out_of_range, hit->pins).message(), HasSubstr("out of range"));
  EngineCache small(other, 4);
  EXPECT_THAT(t.ScatterRead(small.layout, ids, hit->pins).message(), HasSubstr("signature mismatch"));
  EngineKvLayout null_dst = dst.layout;
  null_dst.layers[0] = nullptr;
  EXPECT_EQ(t.ScatterRead(null_dst, ids, hit->pins).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(dst.tensors == before) << "a refused scatter wrote into the engine's cache";
  ASSERT_TRUE(t.ScatterRead(dst.layout, ids, hit->pins).ok());
  for (uint32_t id : ids) EXPECT_EQ(dst.Block(id), src.Block(id));
  f.cache->Release(hit->pins);
  // Blocks already cached are skipped, not rewritten.
  auto again = t.GatherWrite(ns, src.layout, ids, keys);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->written, 0u);
  EXPECT_EQ(again->already_cached, 3u);
}

TEST(Transfer, SparseReadMatchesAReferenceGather) {
  Fixture f("xfer-sparse");
  for (auto kind : {EngineLayoutKind::kFlashAttn, EngineLayoutKind::kFlashInfer, EngineLayoutKind::kFlashInferHnd}) {
    // Qwen-like pieces: head size 80 fp16 = 160-byte pieces.
    auto shape = Shape(kind, KvDtype::kFp16, 3, 8, 4, 80);
    EngineCache src(shape, 5 + static_cast<int>(kind));
    auto ns = f.Ns(src.layout, "sparse-" + std::to_string(static_cast<int>(kind)));
    std::vector<uint32_t> ids{3, 0, 7, 5};  // the request's blocks, in order
    auto keys = KvCache::ChainKeys(ns, testing::Tokens(9 + static_cast<int>(kind), 16 * ids.size(), 0, 0));
    transfer::CpuTransfer t(*f.cache, {.threads = 2});
    ASSERT_TRUE(t.GatherWrite(ns, src.layout, ids, keys).ok());
    auto hit = f.cache->Lookup(ns, keys);
    ASSERT_EQ(hit->hit_blocks, ids.size());
    // 16 tokens per (layer, head), different for each, in no particular order.
    transfer::SparseSelection sel{3, 4, {}};
    std::mt19937_64 rng(3);
    for (int s = 0; s < 12; ++s) {
      std::vector<uint32_t> tok(64);
      std::iota(tok.begin(), tok.end(), 0);
      std::shuffle(tok.begin(), tok.end(), rng);
      tok.resize(16);
      sel.tokens.push_back(tok);
    }
    const uint32_t cap = 20;
    const uint64_t hb = 80 * 2;
    std::vector<std::vector<uint8_t>> kbuf(3, std::vector<uint8_t>(4 * cap * hb, 0xEE)), vbuf = kbuf;
    transfer::SparseDestination dst;
    for (int l = 0; l < 3; ++l) {
      dst.k.push_back(kbuf[l].data());
      dst.v.push_back(vbuf[l].data());
    }
    dst.capacity = cap;
    ASSERT_TRUE(t.SparseRead(src.layout, hit->pins, sel, dst).ok());
    // Reference: the same token straight from the engine tensor it was gathered from.
    for (uint32_t l = 0; l < 3; ++l) {
      for (uint32_t h = 0; h < 4; ++h) {
        const auto& tok = sel.tokens[l * 4 + h];
        for (size_t i = 0; i < tok.size(); ++i) {
          uint32_t block = ids[tok[i] / 16], row = tok[i] % 16;
          for (uint32_t part = 0; part < 2; ++part) {
            // The engine's own order within a piece: HND keeps a head's rows together.
            const uint64_t at = kind == EngineLayoutKind::kFlashInferHnd ? uint64_t{h} * 16 + row : uint64_t{row} * 4 + h;
            const uint8_t* want = src.layout.EnginePiece(l, part, block) + at * hb;
            const uint8_t* got = (part ? vbuf : kbuf)[l].data() + (uint64_t{h} * cap + i) * hb;
            ASSERT_EQ(std::memcmp(want, got, hb), 0) << "layer " << l << " head " << h << " token " << tok[i];
          }
        }
        // Rows past the selection are untouched.
        EXPECT_EQ(kbuf[l][(uint64_t{h} * cap + 16) * hb], 0xEE);
      }
    }
    // Invalid: a token beyond the request, too many tokens, a null buffer — nothing written.
    auto before = kbuf;
    auto bad = sel;
    bad.tokens[5][3] = 64;
    EXPECT_THAT(t.SparseRead(src.layout, hit->pins, bad, dst).message(), HasSubstr("beyond the request"));
    bad = sel;
    bad.tokens[0].resize(cap + 1, 1);
    EXPECT_THAT(t.SparseRead(src.layout, hit->pins, bad, dst).message(), HasSubstr("holds"));
    auto null_dst = dst;
    null_dst.v[2] = nullptr;
    EXPECT_THAT(t.SparseRead(src.layout, hit->pins, sel, null_dst).message(), HasSubstr("null buffer"));
    EXPECT_TRUE(kbuf == before);
    f.cache->Release(hit->pins);
  }
}

}  // namespace
}  // namespace cxlkv
