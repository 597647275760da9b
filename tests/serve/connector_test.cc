// The KV connector in one process over a real pool: every mode generates exactly what the
// engine generates alone; the pool mode reuses a shared prefix; a prefetch prepared before the
// request ahead of it published its blocks still finds them (top-up); handoff blocks are used
// once.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "../cache/cache_test_util.h"
#include "../engine/engine_test_util.h"
#include "engine/config.h"
#include "engine/model.h"
#include "engine/weights.h"
#include "daemon/pnm_service.h"
#include "serve/kv_connector.h"

namespace cxlkv::serve {
namespace {

constexpr uint32_t kBlock = 16;
const int32_t kVocab = static_cast<int32_t>(engine::test_util::TinyConfig().vocab_size);

struct Rig {
  explicit Rig(const std::string& tag, const engine::ModelConfig& c = engine::test_util::TinyConfig()) : path(tag) {
    config = c;
    EXPECT_TRUE(testing::CreateCachePool(path.path(), 64 << 20).ok());
    pool = testing::OpenOrNull({path.path()}, 0);
    cache = *pool->Cache();
    model = std::make_unique<engine::Model>(config, *engine::Weights::Random(config));
    engine = std::make_unique<engine::PagedKvCache>(config, 64);
    KeyNamespace ns;
    ns.model_id = config.name;
    ns.layout = engine->Layout().Signature();
    handle = *cache->Namespace(ns);
  }
  KvConnector Connector(KvMode mode) { return KvConnector(mode, *model, *engine, *cache, handle, 42, 1 << 20); }

  // What the engine alone generates for `prompt` (fresh blocks, no connector).
  std::vector<int32_t> Truth(const std::vector<int32_t>& prompt, uint32_t max_new) {
    auto ids = *engine->AllocateBlocks((prompt.size() + max_new + kBlock - 1) / kBlock);
    auto out = *model->Generate(prompt, 0, max_new, *engine, ids);
    engine->FreeBlocks(ids);
    return out;
  }

  testing::TempRegionPath path;
  std::unique_ptr<Pool> pool;
  KvCache* cache = nullptr;
  engine::ModelConfig config = engine::test_util::TinyConfig();
  std::unique_ptr<engine::Model> model;
  std::unique_ptr<engine::PagedKvCache> engine;
  NamespaceHandle handle;
};

// A 5-block document, then a question of its own (not block-aligned: the tail is handed off).
std::vector<int32_t> Prompt(int question) {
  std::vector<int32_t> t;
  for (int i = 0; i < 5 * static_cast<int>(kBlock); ++i) t.push_back((i * 37) % kVocab);
  for (int i = 0; i < 21; ++i) t.push_back((question * 101 + i * 7) % kVocab);
  return t;
}

TEST(KvConnector, EveryModeGeneratesWhatTheEngineGeneratesAlone) {
  Rig rig("conn-modes");
  for (KvMode mode : {KvMode::kRecompute, KvMode::kPrivate, KvMode::kPool}) {
    SCOPED_TRACE(std::string(KvModeName(mode)));
    auto c = rig.Connector(mode);
    for (int q = 0; q < 3; ++q) {
      const auto prompt = Prompt(q);
      const uint64_t id = static_cast<uint64_t>(mode) * 100 + q;
      auto pre = c.Prefill(id, prompt);
      ASSERT_TRUE(pre.ok()) << pre.status().ToString();
      auto dec = c.Decode(id, prompt, pre->first_token, 6, nullptr);
      ASSERT_TRUE(dec.ok()) << dec.status().ToString();
      EXPECT_EQ(dec->tokens, rig.Truth(prompt, 6)) << "question " << q;
      // The decode side loaded the whole prompt from the handoff: nothing recomputed.
      EXPECT_EQ(dec->stats.computed_tokens, 0u);
      EXPECT_EQ(dec->stats.hit_blocks, (prompt.size() + kBlock - 1) / kBlock);
      // Reuse: the pool and the private cache hit the document from the second question on.
      const uint32_t want_hits = (q > 0 && mode != KvMode::kRecompute) ? 5 : 0;
      EXPECT_EQ(pre->stats.hit_blocks, want_hits) << "question " << q;
      EXPECT_EQ(pre->stats.computed_tokens, prompt.size() - want_hits * kBlock);
    }
  }
  EXPECT_EQ(rig.engine->free_blocks(), rig.engine->num_blocks()) << "engine blocks leaked";
}

TEST(KvConnector, APrefetchPreparedBeforeTheWriterFinishesTopsUp) {
  Rig rig("conn-prefetch");
  auto c = rig.Connector(KvMode::kPool);
  const auto first = Prompt(1), second = Prompt(2);
  // The second request is prepared (its lookup and load started) while the first, which
  // writes the shared document, has not run yet: the prefetch finds nothing...
  auto prepared = c.Prepare(2, second, /*await_in_flight=*/false);
  ASSERT_TRUE(prepared.ok());
  EXPECT_EQ((*prepared)->hit_blocks(), 0u);
  auto a = c.Prefill(1, first);
  ASSERT_TRUE(a.ok());
  // ...and its prefill tops up with what the first published meanwhile.
  auto b = c.Prefill(**prepared);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->stats.hit_blocks, 5u);
  prepared->reset();
  auto dec = c.Decode(2, second, b->first_token, 4, nullptr);
  ASSERT_TRUE(dec.ok());
  EXPECT_EQ(dec->tokens, rig.Truth(second, 4));

  // A prefetch prepared after the writer finds the prefix at once and loads it layer-wise.
  auto third = Prompt(3);
  auto ready = c.Prepare(3, third, /*await_in_flight=*/false);
  ASSERT_TRUE(ready.ok());
  EXPECT_EQ((*ready)->hit_blocks(), 5u);
  auto d = c.Prefill(**ready);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->stats.computed_tokens, third.size() - 5 * kBlock);
  ready->reset();
  (void)c.Decode(3, third, d->first_token, 1, nullptr);
  (void)c.Decode(1, first, a->first_token, 1, nullptr);
  EXPECT_EQ(rig.engine->free_blocks(), rig.engine->num_blocks()) << "engine blocks leaked";
}

TEST(KvConnector, HandoffBlocksAreReadOnceAndAMissingOneIsRecomputed) {
  Rig rig("conn-handoff");
  auto c = rig.Connector(KvMode::kRecompute);
  const auto prompt = Prompt(7);
  auto pre = c.Prefill(9, prompt);
  ASSERT_TRUE(pre.ok());
  auto once = c.Decode(9, prompt, pre->first_token, 3, nullptr);
  ASSERT_TRUE(once.ok());
  EXPECT_EQ(once->stats.computed_tokens, 0u);
  // The one-use blocks are gone: a second decode of the same request recomputes the prompt
  // and still generates the same tokens.
  auto again = c.Decode(9, prompt, pre->first_token, 3, nullptr);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->stats.hit_blocks, 0u);
  EXPECT_EQ(again->stats.computed_tokens, prompt.size());
  EXPECT_EQ(again->tokens, once->tokens);
  // A first token the engine would not produce is caught, not generated from.
  auto wrong = c.Decode(9, prompt, (pre->first_token + 1) % kVocab, 3, nullptr);
  EXPECT_EQ(wrong.status().code(), StatusCode::kInternal);
}

// Remote attention (pool mode): the prompt's full blocks stay in the pool, attended by a
// near-memory service, and only the partial block is loaded; a decode whose partial block is
// gone loads the prefix after all to recompute it; with no daemon the decode falls back to
// loading everything. Every path generates what the engine generates alone.
TEST(KvConnector, RemoteAttentionLeavesThePromptInThePoolAndFallsBackWithoutADaemon) {
  engine::ModelConfig config = engine::test_util::TinyConfig();
  config.head_dim = 16;  // the pnm kernels' granule
  config.hidden_size = 64;
  Rig rig("conn-remote", config);
  auto service = daemon::NearMemoryService::Start(*rig.pool);
  ASSERT_TRUE(service.ok()) << service.status().ToString();
  ASSERT_TRUE((*service)->server().WaitServing(std::chrono::seconds(10)));
  rpc::RpcClientOptions ro;
  ro.timeout = std::chrono::milliseconds(1500);
  auto client = pnm::NearMemoryClient::Open(*rig.pool, 0, ro);
  ASSERT_TRUE(client.ok());
  KeyNamespace ns;
  ns.model_id = config.name;
  ns.layout = rig.engine->Layout().Signature();
  auto remote = engine::RemoteDecodeAttention::Create(config, kBlock, **client, ns, {});
  ASSERT_TRUE(remote.ok()) << remote.status().ToString();
  auto c = rig.Connector(KvMode::kPool);
  c.SetRemoteAttention(std::move(*client), std::move(*remote));
  const auto prompt = Prompt(3);  // 6 full blocks and 5 tokens
  const auto truth = rig.Truth(prompt, 6);
  auto pre = c.Prefill(1, prompt);
  ASSERT_TRUE(pre.ok()) << pre.status().ToString();
  auto dec = c.Decode(1, prompt, pre->first_token, 6, nullptr);
  ASSERT_TRUE(dec.ok()) << dec.status().ToString();
  EXPECT_EQ(dec->tokens, truth);
  EXPECT_EQ(dec->stats.attention_remote_tokens, 6u * kBlock);
  EXPECT_EQ(dec->stats.attention_remote_fallbacks, 0u);
  EXPECT_EQ(dec->stats.bytes_loaded, c.BlockBytes()) << "only the partial block";
  EXPECT_EQ(dec->stats.attention_layer_steps, 5u * config.num_layers);
  EXPECT_EQ((*service)->stats().contexts_open, 0u) << "closed after the request";

  // The handoff block was read once: decoding the request again recomputes it over the prefix.
  auto again = c.Decode(1, prompt, pre->first_token, 6, nullptr);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->tokens, truth);
  EXPECT_EQ(again->stats.computed_tokens, 5u);
  EXPECT_EQ(again->stats.bytes_loaded, 6 * c.BlockBytes());

  // No daemon: the decode loads the prompt and attends it in the engine.
  service->reset();
  auto pre2 = c.Prefill(2, prompt);
  ASSERT_TRUE(pre2.ok());
  auto fallback = c.Decode(2, prompt, pre2->first_token, 6, nullptr);
  ASSERT_TRUE(fallback.ok()) << fallback.status().ToString();
  EXPECT_EQ(fallback->tokens, truth);
  EXPECT_EQ(fallback->stats.attention_remote_fallbacks, 1u);
  EXPECT_EQ(fallback->stats.attention_remote_tokens, 0u);
  EXPECT_EQ(fallback->stats.bytes_loaded, 7 * c.BlockBytes());
}

// A pool full of pinned blocks (nothing evictable): a prefill cannot store its blocks nor its
// handoff tail. The request is still served — the blocks are counted as not stored and the
// decode side recomputes what the handoff lacks — and generates what the engine does alone.
TEST(KvConnector, APoolFullOfPinnedBlocksServesTheRequestWithoutStoring) {
  Rig rig("conn-full");
  auto c = rig.Connector(KvMode::kPool);
  std::vector<uint8_t> filler(c.BlockBytes(), 0x5a);
  std::vector<BlockPin> pins;
  Status put;
  for (uint32_t i = 0; put.ok(); ++i) {
    const BlockKey key{0xf111u + i, 0xf111u};
    put = rig.cache->Put(rig.handle, key, filler.data(), filler.size());
    if (!put.ok()) break;
    auto hit = rig.cache->Lookup(rig.handle, {&key, 1});
    ASSERT_TRUE(hit.ok() && hit->hit_blocks == 1) << "filler block " << i << " was evicted already";
    pins.push_back(hit->pins[0]);
  }
  ASSERT_EQ(put.code(), StatusCode::kNoSpace) << put.ToString();
  const auto prompt = Prompt(3);
  auto pre = c.Prefill(77, prompt);
  ASSERT_TRUE(pre.ok()) << pre.status().ToString();
  EXPECT_EQ(pre->stats.blocks_not_stored, prompt.size() / kBlock + 1);  // five full blocks + the tail
  EXPECT_EQ(pre->stats.bytes_stored, 0u);
  auto dec = c.Decode(77, prompt, pre->first_token, 6, nullptr);
  ASSERT_TRUE(dec.ok()) << dec.status().ToString();
  EXPECT_EQ(dec->tokens, rig.Truth(prompt, 6));
  EXPECT_EQ(dec->stats.computed_tokens, prompt.size());  // nothing was handed off: all recomputed
  rig.cache->Release(pins);
  // With room again, the same prompt stores its blocks.
  auto stored = c.Prefill(78, prompt);
  ASSERT_TRUE(stored.ok()) << stored.status().ToString();
  EXPECT_EQ(stored->stats.blocks_not_stored, 0u);
  EXPECT_GT(stored->stats.bytes_stored, 0u);
  EXPECT_EQ(rig.engine->free_blocks(), rig.engine->num_blocks()) << "engine blocks leaked";
}

}  // namespace
}  // namespace cxlkv::serve
