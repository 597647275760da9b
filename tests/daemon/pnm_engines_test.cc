// Engines per memory node (PNM §3.2; daemon/node_engines.h): a pool whose regions lie
// on two NUMA nodes gets an engine on each, and each attends the pages its node holds. The
// nodes are faked (a Platform that answers by address and records bindings), so this runs on a
// one-node machine: the answers still equal local attention over the same bytes — split by
// residence and merged by log-sum-exp within fp32 rounding, bit for bit when a context lies on
// one node — and each engine's page count is exactly what its node holds of the selections.
#include <atomic>
#include <chrono>
#include <thread>
#include <cerrno>
#include <cmath>

#include "daemon/node_engines.h"
#include "daemon/pnm_service.h"
#include "../pool/pool_test_util.h"
#include "pnm_daemon_util.h"
#include "region/offset.h"
#include "test_region.h"

namespace cxlkv {
namespace {

using namespace cxlkv::testing;

// Region i's memory is on node nodes[i] (negative: unknown, that errno); RunThreadOnNode
// records each binding and fails for `refuse`.
class FakeNodes : public region::Platform {
 public:
  std::vector<std::span<uint8_t>> ranges;
  std::vector<int> nodes;
  int refuse = -1;
  std::atomic<int> bound[4] = {};

  int NumaNodeOf(const void* addr) override {
    const auto* a = static_cast<const uint8_t*>(addr);
    for (size_t i = 0; i < ranges.size(); ++i) {
      if (a >= ranges[i].data() && a < ranges[i].data() + ranges[i].size()) return nodes[i];
    }
    return -EFAULT;
  }
  int RunThreadOnNode(int node) override {
    if (node == refuse) return -EPERM;
    if (node >= 0 && node < 4) bound[node].fetch_add(1);
    return 0;
  }
};

TEST(NodeEngines, OneEnginePerMemoryNodeOfTheRegionsTheFirstRegionsFirst) {
  std::vector<uint8_t> memory(4 << 10);
  std::vector<std::span<uint8_t>> regions;
  for (int i = 0; i < 4; ++i) regions.emplace_back(memory.data() + i * 1024, 1024);
  FakeNodes fake;
  fake.ranges = regions;

  fake.nodes = {1, 0, 1, 2};  // three nodes; region 0's first
  auto e = daemon::NodeEngines::Create(regions, {.threads = 1, .bind_numa = true, .platform = &fake});
  ASSERT_EQ(e->size(), 3u);
  EXPECT_EQ(e->EngineOfRegion(0), 0u);
  EXPECT_EQ(e->EngineOfRegion(1), 1u);
  EXPECT_EQ(e->EngineOfRegion(2), 0u);
  EXPECT_EQ(e->EngineOfRegion(3), 2u);
  auto s = e->stats();
  EXPECT_EQ(s[0].numa_node, 1);
  EXPECT_EQ(s[0].regions, 2u);
  EXPECT_EQ(s[1].numa_node, 0);
  EXPECT_EQ(s[2].numa_node, 2);
  EXPECT_EQ(s[2].threads, 2u);  // a worker and its lead
  e.reset();  // every thread joined: each bound itself once; the first engine's lead (the
              // serving thread) was never asked to
  EXPECT_EQ(fake.bound[1].load(), 1);
  EXPECT_EQ(fake.bound[0].load(), 2);
  EXPECT_EQ(fake.bound[2].load(), 2);

  fake.nodes = {0, 0, 0, 0};  // one node, four devices: one engine
  e = daemon::NodeEngines::Create(regions, {.threads = 0, .bind_numa = true, .platform = &fake});
  EXPECT_EQ(e->size(), 1u);
  EXPECT_EQ(e->stats()[0].regions, 4u);

  fake.nodes = {-ENOSYS, 1, -ENOSYS, 1};  // region 0's node unknown: its engine unbound, says why
  e = daemon::NodeEngines::Create(regions, {.threads = 0, .bind_numa = true, .platform = &fake});
  ASSERT_EQ(e->size(), 2u);
  EXPECT_EQ(e->EngineOfRegion(2), 0u);
  s = e->stats();
  EXPECT_EQ(s[0].numa_node, -1);
  EXPECT_NE(s[0].note.find("unknown"), std::string::npos) << s[0].note;
  EXPECT_EQ(s[1].numa_node, 1);

  fake.nodes = {0, 1, 0, 1};  // not asked to bind: one engine, whatever the nodes
  e = daemon::NodeEngines::Create(regions, {.threads = 0, .bind_numa = false, .platform = &fake});
  EXPECT_EQ(e->size(), 1u);
  EXPECT_NE(e->stats()[0].note.find("not bound"), std::string::npos);

  fake.refuse = 1;  // a binding that fails is reported, not hidden
  e = daemon::NodeEngines::Create(regions, {.threads = 1, .bind_numa = true, .platform = &fake});
  e->BindServingThread();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  do {  // the second engine's threads bind as they start
    s = e->stats();
  } while (s[1].numa_node != -1 && std::chrono::steady_clock::now() < deadline &&
           (std::this_thread::sleep_for(std::chrono::milliseconds(1)), true));
  EXPECT_EQ(s[0].numa_node, 0);
  EXPECT_EQ(s[1].numa_node, -1);
  EXPECT_NE(s[1].note.find("binding to NUMA node 1 failed"), std::string::npos) << s[1].note;
}

// Which engine holds each page of `keys`: its block's region (both regions are their own node).
std::vector<uint32_t> RegionsOf(KvCache& cache, const NamespaceHandle& ns, std::span<const BlockKey> keys) {
  auto hit = cache.Lookup(ns, keys);
  EXPECT_TRUE(hit.ok() && hit->hit_blocks == keys.size());
  std::vector<uint32_t> out;
  if (!hit.ok()) return out;
  for (const BlockPin& p : hit->pins) out.push_back(region::Offset<void>(p.offset).region_index());
  cache.Release(hit->pins);
  return out;
}

TEST(NearMemoryService, EachMemoryNodesEngineAttendsThePagesItsNodeHolds) {
  TempRegionPath a{"pnmnode0"}, b{"pnmnode1"};
  PoolCreateOptions co;
  co.size = 64 << 20;
  co.max_nodes = 8;
  co.overwrite = true;
  co.chunk_bytes = 256 << 10;  // 16 blocks a chunk: a context's chunks alternate between the regions
  ASSERT_TRUE(Pool::Create({a.path(), b.path()}, co).ok());
  auto pool = OpenOrNull({a.path(), b.path()}, 0, 0, kQuietLeaseMs);
  ASSERT_NE(pool, nullptr);
  KvCache* cache = *pool->Cache();
  const NamespaceHandle ns = *cache->Namespace(TestNamespace());
  FakeNodes fake;
  fake.ranges = pool->MappedRanges();
  fake.nodes = {0, 1};
  daemon::NearMemoryServiceOptions so;
  so.threads = 1;
  so.platform = &fake;
  auto started = daemon::NearMemoryService::Start(*pool, so);
  ASSERT_TRUE(started.ok()) << started.status().ToString();
  std::unique_ptr<daemon::NearMemoryService> service = std::move(*started);
  ASSERT_TRUE(service->server().WaitServing(std::chrono::seconds(10)));
  ASSERT_EQ(service->stats().engines.size(), 2u);

  constexpr uint32_t kPages = 192;
  const auto keys = PutContext(*cache, ns, kPages, 11);
  const auto region = RegionsOf(*cache, ns, keys);
  const uint64_t on_second = std::count(region.begin(), region.end(), 1u);
  ASSERT_GT(on_second, 0u);  // the test's premise: the context spans both nodes
  ASSERT_LT(on_second, kPages);

  auto client = Client::Open(*pool, 0);
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  auto ctx = (*client)->OpenContext(TestNamespace(), kHeads, keys);
  ASSERT_TRUE(ctx.ok()) << ctx.status().ToString();

  // Dense and two budgets, every layer: within fp32 rounding of attention over the whole, and
  // each engine attended exactly its node's share of every job's pages.
  std::vector<std::vector<float>> qs;
  std::vector<Client::Job> jobs;
  std::vector<pnm::Partial> outs(kLayers * 3);
  for (uint32_t i = 0; i < kLayers * 3; ++i) qs.push_back(Query(60 + i));
  for (uint32_t i = 0; i < kLayers * 3; ++i) {
    jobs.push_back(MakeJob(ctx->context, i / 3, qs[i].data(), std::array<uint32_t, 3>{0, 512, 128}[i % 3], &outs[i]));
  }
  const Status attended = (*client)->Attend(jobs);
  ASSERT_TRUE(attended.ok()) << attended.ToString();
  uint64_t want_pages[2] = {0, 0};
  for (size_t i = 0; i < jobs.size(); ++i) {
    ASSERT_TRUE(jobs[i].status.ok()) << jobs[i].status.ToString();
    LocalLayer local(*cache, ns, keys, jobs[i].layer);
    pnm::Selection sel = pnm::Selection::All(kKvHeads, kPages);
    if (jobs[i].budget_tokens != 0) {
      ASSERT_TRUE(pnm::SelectPages(local.g, qs[i].data(), local.digests.data(), local.Ctx().tokens,
                                   {jobs[i].budget_tokens, 1, 1}, &sel).ok());
    }
    for (uint32_t h = 0; h < kKvHeads; ++h) {
      for (uint32_t p : sel.Of(h)) ++want_pages[region[p]];
    }
    pnm::Partial whole;
    ASSERT_TRUE(pnm::Attend(local.g, qs[i].data(), local.Ctx(), &sel, 0, &whole).ok());
    for (size_t d = 0; d < whole.out.size(); ++d) {
      ASSERT_NEAR(outs[i].out[d], whole.out[d], 1e-5 * (1 + std::fabs(whole.out[d]))) << "job " << i << ", output " << d;
    }
    for (size_t h = 0; h < whole.lse.size(); ++h) ASSERT_NEAR(outs[i].lse[h], whole.lse[h], 1e-4) << "job " << i;
  }
  auto engines = service->stats().engines;
  EXPECT_EQ(engines[0].pages_attended, want_pages[0]);
  EXPECT_EQ(engines[1].pages_attended, want_pages[1]);
  EXPECT_EQ(engines[0].jobs, jobs.size());  // every job has pages on both nodes: a part on each
  EXPECT_EQ(engines[1].jobs, jobs.size());
  EXPECT_EQ(service->stats().pages_attended, want_pages[0] + want_pages[1]);

  // A context whose pages all lie on the second node is that engine's alone: the same bits as
  // attention on one engine.
  std::vector<BlockKey> second;
  for (uint32_t p = 0; p < kPages; ++p) {
    if (region[p] == 1) second.push_back(keys[p]);
  }
  auto only = (*client)->OpenContext(TestNamespace(), kHeads, second);
  ASSERT_TRUE(only.ok()) << only.status().ToString();
  pnm::Partial out;
  Client::Job j = MakeJob(only->context, 1, qs[0].data(), 0, &out);
  ASSERT_TRUE((*client)->Attend({&j, 1}).ok()) << j.status.ToString();
  EXPECT_TRUE(SameBits(out, LocalAttention(*cache, ns, second, 1, qs[0], 0)));
  const auto after = service->stats().engines;
  EXPECT_EQ(after[0].jobs, engines[0].jobs);
  EXPECT_EQ(after[1].jobs, engines[1].jobs + 1);
  EXPECT_EQ(after[1].pages_attended, engines[1].pages_attended + second.size() * kKvHeads);

  ASSERT_TRUE((*client)->Close(std::vector<uint64_t>{ctx->context, only->context}).ok());
  client->reset();
  service.reset();  // threads joined: each engine's worker and lead bound to its own node
  EXPECT_EQ(fake.bound[1].load(), 2);
  EXPECT_GE(fake.bound[0].load(), 2);  // its worker and the serving thread
}

}  // namespace
}  // namespace cxlkv
