// The reference engine decoding with its prompt's KV left in the pool and attended by a
// near-memory service (PNM §3.2): the engine's copy of the prompt is poisoned with NaN,
// so every correct logit proves those bytes were read only next to the memory. A whole-context
// answer merged with the engine's own tokens decodes as dense does; a context closed by its lease
// while the engine idled is reopened transparently; bad input is refused.
#include "engine/remote_attention.h"

#include <gtest/gtest.h>

#include <csignal>
#include <cstdio>
#include <cmath>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "cxlkv/pool.h"
#include "daemon/pnm_service.h"
#include "engine/model.h"
#include "decode_test_util.h"
#include "engine_test_util.h"
#include "child.h"
#include "test_region.h"

namespace cxlkv::engine::remote_attention_test {
namespace {

using test_util::Allocate;
using test_util::RandomTokens;
using test_util::TestWeights;

ModelConfig RemoteConfig() { return test_util::GqaConfig("tiny-remote"); }

constexpr uint32_t kBlock = 16;
constexpr uint32_t kPrompt = 700;  // 43 full pages in the pool, a partial one in the engine
constexpr uint32_t kSteps = 8;

// A sequence of kPrompt tokens prefilled in its own cache, and kSteps decode steps.
struct Sequence : test_util::PrefilledSequence {
  explicit Sequence(const Model& m) : PrefilledSequence(m, kPrompt, 64, kBlock, 5) {}
};

std::vector<std::vector<float>> DecodeSteps(const Model& m, Sequence& s, DecodeAttention* a,
                                            const std::vector<int32_t>& forced = {}) {
  return test_util::DecodeSteps(m, s, a, kSteps, forced);
}

using test_util::RelativeError;

// Stores the sequence's full prompt blocks in the pool (pool block format 1) under `ns` (set
// here: the model and the cache's layout), then poisons the engine's copy of them with NaN, so
// a correct logit proves those bytes were read elsewhere; returns their keys.
std::vector<BlockKey> PutPromptInPool(Pool& pool, Sequence& s, KeyNamespace* ns) {
  KvCache* cache = *pool.Cache();
  ns->model_id = "tiny-remote";
  ns->layout = s.cache.Layout().Signature();
  auto h = cache->Namespace(*ns);
  EXPECT_TRUE(h.ok()) << h.status().ToString();
  if (!h.ok()) return {};
  const auto keys = KvCache::ChainKeys(*h, s.tokens);
  const uint64_t slab = uint64_t{kBlock} * s.cache.row_floats();
  std::vector<float> block(2 * slab * s.cache.num_layers());
  for (size_t b = 0; b < keys.size(); ++b) {
    for (uint32_t l = 0; l < s.cache.num_layers(); ++l) {
      std::memcpy(&block[(2 * l) * slab], s.cache.Key(l, s.table[b], 0), slab * sizeof(float));
      std::memcpy(&block[(2 * l + 1) * slab], s.cache.Value(l, s.table[b], 0), slab * sizeof(float));
      std::fill_n(s.cache.Key(l, s.table[b], 0), slab, std::numeric_limits<float>::quiet_NaN());
      std::fill_n(s.cache.Value(l, s.table[b], 0), slab, std::numeric_limits<float>::quiet_NaN());
    }
    Status put = cache->Put(*h, keys[b], block.data(), block.size() * sizeof(float));
    EXPECT_TRUE(put.ok() || put.code() == StatusCode::kAlreadyExists) << put.ToString();
  }
  return keys;
}

class RemoteDecode : public ::testing::Test {
 protected:
  void StartPool(uint32_t lease_ms = 10000) {
    PoolCreateOptions co;
    co.size = 128 << 20;
    co.max_nodes = 4;
    co.overwrite = true;
    ASSERT_TRUE(Pool::Create({path.path()}, co).ok());
    PoolOpenOptions po;
    po.node_id = 0;
    auto p = Pool::Open({path.path()}, po);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    pool = std::move(*p);
    daemon::NearMemoryServiceOptions so;
    so.context_lease_ms = lease_ms;
    auto s = daemon::NearMemoryService::Start(*pool, so);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    service = std::move(*s);
    ASSERT_TRUE(service->server().WaitServing(std::chrono::seconds(10)));
    auto c = pnm::NearMemoryClient::Open(*pool, 0);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    client = std::move(*c);
  }

  std::vector<BlockKey> MovePromptToPool(Sequence& s) { return PutPromptInPool(*pool, s, &ns); }

  std::unique_ptr<RemoteDecodeAttention> Make(const Model& m, uint32_t budget, uint32_t held_pages = 0) {
    RemoteAttentionOptions o;
    o.budget_tokens = budget;
    o.held_pages = held_pages;
    auto a = RemoteDecodeAttention::Create(m.config(), kBlock, *client, ns, o, *pool->Cache());
    EXPECT_TRUE(a.ok()) << a.status().ToString();
    return a.ok() ? std::move(a).value() : nullptr;
  }

  Model model{RemoteConfig(), TestWeights(RemoteConfig())};
  testing::TempRegionPath path{"remotedec"};
  std::unique_ptr<Pool> pool;
  std::unique_ptr<daemon::NearMemoryService> service;
  std::unique_ptr<pnm::NearMemoryClient> client;
  KeyNamespace ns;
};

TEST_F(RemoteDecode, ThePromptAttendedAtTheDaemonDecodesAsDenseDoes) {
  StartPool();
  Sequence dense_seq(model);
  const auto dense = DecodeSteps(model, dense_seq, nullptr);
  std::vector<int32_t> forced;
  for (const auto& l : dense) forced.push_back(Model::Argmax(l));

  for (uint32_t budget : {0u, 4096u}) {  // every page, and a budget that covers them
    Sequence s(model);
    const auto keys = MovePromptToPool(s);
    ASSERT_EQ(keys.size(), kPrompt / kBlock);
    auto a = Make(model, budget);
    ASSERT_NE(a, nullptr);
    ASSERT_TRUE(a->Open(keys).ok());
    EXPECT_EQ(a->context_tokens(), uint64_t{kPrompt / kBlock} * kBlock);
    const auto got = DecodeSteps(model, s, a.get(), forced);
    ASSERT_EQ(got.size(), dense.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_LT(RelativeError(got[i], dense[i]), 1e-4) << "budget " << budget << " step " << i;
      EXPECT_EQ(Model::Argmax(got[i]), forced[i]) << "budget " << budget << " step " << i;
    }
    const SparseAttentionStats& st = a->stats();
    const uint32_t layers = model.config().num_layers;
    EXPECT_EQ(st.layer_steps, uint64_t{kSteps} * layers);
    EXPECT_EQ(st.selected_pages, st.context_pages);
    EXPECT_EQ(st.context_pages, uint64_t{kSteps} * layers * keys.size() * 2);
    // Per layer step only q, out and lse crossed: 2 × 8 heads × 16 + 8 floats, and framing.
    EXPECT_LT(st.link_bytes, uint64_t{kSteps} * layers * 1200);
    EXPECT_GT(st.link_bytes, uint64_t{kSteps} * layers * (2 * 8 * 16 + 8) * 4);
  }
}

TEST_F(RemoteDecode, ASparseBudgetAttendsItsPagesAtTheDaemon) {
  StartPool();
  Sequence s(model);
  const auto keys = MovePromptToPool(s);
  auto a = Make(model, 128);
  ASSERT_NE(a, nullptr);
  ASSERT_TRUE(a->Open(keys).ok());
  const auto got = DecodeSteps(model, s, a.get());
  ASSERT_EQ(got.size(), kSteps);
  for (const auto& l : got) {
    for (float x : l) ASSERT_TRUE(std::isfinite(x)) << "a poisoned engine page was read";
  }
  const SparseAttentionStats& st = a->stats();
  EXPECT_EQ(st.selected_pages, st.layer_steps * (128 / kBlock) * 2);
  EXPECT_EQ(service->stats().attend_jobs, st.layer_steps);
}

// The hybrid against the daemon: the engine holds half the budget's pages per (layer, KV head),
// recalled out of the pool blocks (its own copy of the prompt is NaN), attends the held selected
// ones itself and the daemon the rest. The merged steps equal the plain sparse ones to fp32
// merge rounding, with the same tokens; the engine reads pages the daemon no longer does.
TEST_F(RemoteDecode, TheHybridAttendsItsHeldPagesAndTheDaemonTheRest) {
  StartPool();
  constexpr uint32_t kBudget = 128;  // 8 pages per KV head
  Sequence sparse_seq(model);
  const auto sparse_keys = MovePromptToPool(sparse_seq);  // sets the namespace
  auto sparse = Make(model, kBudget);
  ASSERT_NE(sparse, nullptr);
  ASSERT_TRUE(sparse->Open(sparse_keys).ok());
  const auto want = DecodeSteps(model, sparse_seq, sparse.get());
  std::vector<int32_t> forced;
  for (const auto& l : want) forced.push_back(Model::Argmax(l));

  Sequence s(model);
  const auto keys = MovePromptToPool(s);
  auto hybrid = Make(model, kBudget, kBudget / kBlock / 2);
  ASSERT_NE(hybrid, nullptr);
  ASSERT_TRUE(hybrid->Open(keys).ok());
  const auto got = DecodeSteps(model, s, hybrid.get(), forced);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    for (float x : got[i]) ASSERT_TRUE(std::isfinite(x)) << "a poisoned engine page was read, step " << i;
    EXPECT_LT(RelativeError(got[i], want[i]), 1e-5) << "step " << i;
    EXPECT_EQ(Model::Argmax(got[i]), forced[i]) << "step " << i;
  }
  const SparseAttentionStats& h = hybrid->stats();
  const SparseAttentionStats& sp = sparse->stats();
  EXPECT_EQ(h.selected_pages, sp.selected_pages) << "the same selections";
  // The first step holds nothing and recalls half the budget per (layer, KV head); later steps
  // attend held pages here, so the daemon reads less and the engine more.
  const uint32_t layers = model.config().num_layers;
  EXPECT_GE(h.recalled_pages, uint64_t{layers} * 2 * (kBudget / kBlock / 2));
  EXPECT_EQ(h.recalled_bytes, h.recalled_pages * 2 * kBlock * 16 * sizeof(float));
  EXPECT_LT(h.near_kv_bytes, sp.near_kv_bytes);
  EXPECT_EQ(h.near_kv_bytes + h.engine_kv_bytes, sp.near_kv_bytes + sp.engine_kv_bytes);
  EXPECT_EQ(service->stats().attend_jobs, h.layer_steps + sp.layer_steps);
  hybrid->Close();
  sparse->Close();
  EXPECT_EQ(service->stats().pages_pinned, 0u);
}

TEST_F(RemoteDecode, AContextClosedByItsLeaseIsReopenedOnTheNextStep) {
  // A lease several times a decode step even under ThreadSanitizer on a loaded 2-core machine:
  // at 200 ms a slow step once let the context lapse a second time (two reopens, not one).
  constexpr uint32_t kLeaseMs = 1000;
  StartPool(kLeaseMs);
  Sequence s(model);
  const auto keys = MovePromptToPool(s);
  auto a = Make(model, 0);
  ASSERT_NE(a, nullptr);
  ASSERT_TRUE(a->Open(keys).ok());
  auto first = model.Decode(s.first, kPrompt, s.cache, s.table, a.get());
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(a->reopened(), 0u) << "the context lapsed within one step: the lease is too short for this machine";
  std::this_thread::sleep_for(std::chrono::milliseconds(3 * kLeaseMs));  // the engine idles past the lease
  auto second = model.Decode(Model::Argmax(*first), kPrompt + 1, s.cache, s.table, a.get());
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(a->reopened(), 1u);
  EXPECT_EQ(service->stats().contexts_expired, 1u);
  EXPECT_EQ(service->stats().contexts_open, 1u);
}

TEST_F(RemoteDecode, BadInputIsRefusedWithAReason) {
  StartPool();
  Sequence s(model);
  const auto keys = MovePromptToPool(s);
  auto a = Make(model, 0);
  ASSERT_NE(a, nullptr);
  ASSERT_TRUE(a->Open(keys).ok());
  std::vector<float> q(8 * 16, 0.1f), out(8 * 16);
  // A position inside the pool's context: the engine must not attend it itself.
  Status inside = a->Attend(0, q.data(), 10, s.cache, s.table, out.data());
  EXPECT_EQ(inside.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(inside.message().find("inside the pool context"), std::string::npos) << inside.ToString();
  EXPECT_EQ(a->Attend(99, q.data(), kPrompt, s.cache, s.table, out.data()).code(), StatusCode::kInvalidArgument);
  // Keys that are not in the pool: the open names the page.
  std::vector<BlockKey> missing = keys;
  missing[3].hi ^= 1;
  Status open = a->Open(missing);
  EXPECT_EQ(open.code(), StatusCode::kNotFound);
  EXPECT_NE(open.message().find("page 3"), std::string::npos) << open.ToString();
  // A namespace whose layout is not this model's.
  KeyNamespace other = ns;
  other.layout.head_size = 32;
  RemoteAttentionOptions o;
  EXPECT_EQ(RemoteDecodeAttention::Create(model.config(), kBlock, *client, other, o).status().code(),
            StatusCode::kInvalidArgument);
  // The hybrid without a budget (the daemon selects) or without the cache to recall from.
  o.held_pages = 4;
  EXPECT_EQ(RemoteDecodeAttention::Create(model.config(), kBlock, *client, ns, o, *pool->Cache()).status().code(),
            StatusCode::kInvalidArgument);
  o.budget_tokens = 128;
  EXPECT_EQ(RemoteDecodeAttention::Create(model.config(), kBlock, *client, ns, o).status().code(),
            StatusCode::kInvalidArgument);
}

// A decode engine on node 2 in its own process (forked before the parent opens the pool). It
// decodes kSteps with remote sparse for reference, then with the remote hybrid; after two
// hybrid steps it replies 1 and waits while the parent pauses it past its lease (its node is
// declared dead: its pins and its daemon context are recovered). Resumed by command 1, it
// decodes the rest. Exit 0: every step as the reference (same tokens, 1e-5), the context
// reopened once and the pins taken again once; else the failing check's code.
int HybridEngineProcess(const std::string& path, int in, int out) {
  PoolOpenOptions po;
  po.node_id = 2;
  po.lease_ms = 500;
  auto pool = Pool::Open({path}, po);
  if (!pool.ok()) return 10;
  const Model model{RemoteConfig(), TestWeights(RemoteConfig())};
  rpc::RpcClientOptions ro;
  ro.timeout = std::chrono::milliseconds(10000);
  auto client = pnm::NearMemoryClient::Open(**pool, 0, ro);
  if (!client.ok()) return 11;
  KeyNamespace ns;
  Sequence ref_seq(model);
  const auto keys = PutPromptInPool(**pool, ref_seq, &ns);
  RemoteAttentionOptions o;
  o.budget_tokens = 128;
  auto sparse = RemoteDecodeAttention::Create(model.config(), kBlock, **client, ns, o);
  if (!sparse.ok() || !(*sparse)->Open(keys).ok()) return 12;
  const auto want = DecodeSteps(model, ref_seq, sparse->get());
  (*sparse)->Close();
  if (want.size() != kSteps) return 13;

  Sequence s(model);
  PutPromptInPool(**pool, s, &ns);  // the same blocks (already there): poisons this engine's copy
  o.held_pages = 4;
  auto hybrid = RemoteDecodeAttention::Create(model.config(), kBlock, **client, ns, o, *(*pool)->Cache());
  if (!hybrid.ok() || !(*hybrid)->Open(keys).ok()) return 14;
  int32_t token = s.first;
  for (uint32_t i = 0; i < kSteps; ++i) {
    if (i == 2) {
      uint64_t cmd = 0;
      if (!testing::Put(out, 1) || !testing::Get(in, &cmd) || cmd != 1) return 15;
    }
    auto logits = model.Decode(token, kPrompt + i, s.cache, s.table, hybrid->get());
    if (!logits.ok()) {
      std::fprintf(stderr, "hybrid step %u: %s\n", i, logits.status().ToString().c_str());
      return 16;
    }
    if (RelativeError(*logits, want[i]) > 1e-5 || Model::Argmax(*logits) != Model::Argmax(want[i])) {
      std::fprintf(stderr, "hybrid step %u differs from remote sparse: %g\n", i, RelativeError(*logits, want[i]));
      return 17;
    }
    token = Model::Argmax(want[i]);
  }
  if ((*hybrid)->reopened() != 1) return 18;
  if ((*hybrid)->repinned() != 1) return 19;
  (*hybrid)->Close();
  return 0;
}

// The remote hybrid's engine paused past its lease: its node is declared dead, so its pins on
// the context's blocks and its context at the daemon are recovered. Resumed, it must not read
// through the old pins again: it reopens the context, takes its pins again under its new life,
// and decodes on exactly as remote sparse does. Nothing stays pinned afterwards.
TEST(RemoteDecodeProcesses, AHybridEnginePausedPastItsLeasePinsAgainAndDecodesOn) {
  testing::TempRegionPath path("remotehyb");
  PoolCreateOptions co;
  co.size = 128 << 20;
  co.max_nodes = 4;
  co.overwrite = true;
  ASSERT_TRUE(Pool::Create({path.path()}, co).ok());
  testing::Child engine = testing::Child::Fork([&](int in, int out) {
    uint64_t go = 0;
    if (!testing::Get(in, &go)) return 1;
    return HybridEngineProcess(path.path(), in, out);
  });
  ASSERT_GT(engine.pid, 0);
  PoolOpenOptions po;
  po.node_id = 0;
  auto pool = Pool::Open({path.path()}, po);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  daemon::NearMemoryServiceOptions so;
  so.context_lease_ms = 5000;  // the context ends with the engine's node life, not by idling
  auto service = daemon::NearMemoryService::Start(**pool, so);
  ASSERT_TRUE(service.ok()) << service.status().ToString();
  ASSERT_TRUE((*service)->server().WaitServing(std::chrono::seconds(10)));

  uint64_t reply = 0;
  ASSERT_TRUE(engine.Send(1) && engine.Receive(&reply));
  ASSERT_EQ(reply, 1u) << "the engine did not reach its third step";
  ::kill(engine.pid, SIGSTOP);
  // Its node life ends: the daemon closes its context (the recovery of its pins goes with it).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while ((*service)->stats().contexts_open != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ((*service)->stats().contexts_open, 0u) << "the paused engine's node was never declared dead";
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));  // past its lease once more
  ::kill(engine.pid, SIGCONT);
  ASSERT_TRUE(engine.Send(1));
  EXPECT_EQ(engine.Wait(), 0) << "see the exit codes of HybridEngineProcess";

  // Every pin is gone: the daemon's (contexts closed) and the engine's (released, or recovered).
  EXPECT_EQ((*service)->stats().pages_pinned, 0u);
  const Model model{RemoteConfig(), TestWeights(RemoteConfig())};
  Sequence s(model);
  KeyNamespace ns;
  ns.model_id = "tiny-remote";
  ns.layout = s.cache.Layout().Signature();
  KvCache* cache = *(*pool)->Cache();
  auto h = cache->Namespace(ns);
  ASSERT_TRUE(h.ok());
  const auto keys = KvCache::ChainKeys(*h, s.tokens);
  EXPECT_EQ(*cache->Evict(*h, keys), keys.size());
}

}  // namespace
}  // namespace cxlkv::engine::remote_attention_test
