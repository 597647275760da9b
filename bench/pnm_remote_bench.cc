// The near-memory service's figures for `cxlkv bench pnm` (daemon/pnm_service.h): the same
// decode step through the RPC to the service's engines and computed in-process over the same
// pool bytes, the bytes that cross per step, and opening a context with and without digests
// stored in the pool.
//
//   remote_step_ms/32K/B    one step (selection + attention, one layer, one sequence) at the
//                           service, round trip included, vs in_process_step_ms/32K/B (the same
//                           selection and attention on an AttendPool of as many threads as the
//                           service's, called directly): the RPC's cost per step.
//   remote_link_KiB/32K     request + answer payload bytes per step vs the KV bytes the step read
//                           next to the memory.
//   open_ms/32K/stored      opening a context whose digests an earlier opener stored in the pool
//                           vs open_ms/32K/built (pins and builds them from the keys).
// Geometry: fp16, 32 query heads, 8 KV heads, head_dim 128, one layer of 32K tokens in the pool
// (128 MiB of KV, several times the last-level cache).
#include <unistd.h>

#include <chrono>
#include <random>

#include "bench_clock.h"
#include "cxlkv/pool.h"
#include "daemon/pnm_service.h"
#include "pnm/attend.h"
#include "pnm/attend_pool.h"
#include "pnm/digest.h"
#include "pnm/remote.h"
#include "pnm/select.h"
#include "suites.h"

namespace cxlkv::bench {
namespace {

double MsSince(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

constexpr uint64_t kTokens = 32 << 10;

KeyNamespace PnmRemoteNamespace() {
  KeyNamespace ns;
  ns.model_id = "bench-pnm-remote";
  ns.layout.dtype = KvDtype::kFp16;
  ns.layout.num_layers = 1;
  ns.layout.num_kv_heads = 8;
  ns.layout.head_size = 128;
  ns.layout.block_size = 16;
  return ns;
}

}  // namespace

Result<std::vector<nlohmann::json>> PnmRemoteFigures(const BenchOptions& options, int reps) {
  const std::string path = options.workdir + "/cxlkv-bench-pnm-" + std::to_string(::getpid());
  PoolCreateOptions co;
  co.size = 320ull << 20;
  co.max_nodes = 2;
  co.overwrite = true;
  CXLKV_RETURN_IF_ERROR(Pool::Create({path}, co));
  struct Unlink {
    std::string p;
    ~Unlink() { ::unlink(p.c_str()); }
  } unlink_at_end{path};
  PoolOpenOptions oo;
  oo.node_id = 0;
  CXLKV_ASSIGN_OR_RETURN(auto pool, Pool::Open({path}, oo));
  CXLKV_ASSIGN_OR_RETURN(KvCache * cache, pool->Cache());
  const KeyNamespace kns = PnmRemoteNamespace();
  CXLKV_ASSIGN_OR_RETURN(NamespaceHandle ns, cache->Namespace(kns));
  const pnm::Geometry g{32, 8, 128, 16, KvDtype::kFp16};

  // The context: random fp16 in [-1, 1) (exponents 14..15), one block per page.
  std::vector<int32_t> tokens(kTokens);
  for (uint64_t i = 0; i < kTokens; ++i) tokens[i] = static_cast<int32_t>(i);
  const auto keys = KvCache::ChainKeys(ns, tokens);
  std::mt19937_64 rng(0x9e11);
  std::vector<uint16_t> block(ns.block_bytes / 2);
  for (const BlockKey& k : keys) {
    for (uint16_t& h : block) h = static_cast<uint16_t>((rng() & 0x83ff) | 0x3800);
    Status s = cache->Put(ns, k, block.data(), ns.block_bytes);
    if (!s.ok()) return Status(s.code(), "bench pnm remote: storing the context: " + s.message());
  }
  std::vector<std::vector<float>> qs(16, std::vector<float>(uint64_t{g.num_heads} * g.head_dim));
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (auto& q : qs) {
    for (float& x : q) x = u(rng);
  }

  daemon::NearMemoryServiceOptions so;
  so.threads = 1;
  CXLKV_ASSIGN_OR_RETURN(auto service, daemon::NearMemoryService::Start(*pool, so));
  if (!service->server().WaitServing(std::chrono::seconds(10))) return Unavailable("bench pnm remote: the service did not start");
  CXLKV_ASSIGN_OR_RETURN(auto client, pnm::NearMemoryClient::Open(*pool, 0));

  // Opening: the first builds the digests and stores them, the next ones read them back.
  std::vector<double> built_ms, stored_ms;
  uint64_t context = 0;
  {
    auto t0 = Clock::now();
    CXLKV_ASSIGN_OR_RETURN(auto opened, client->OpenContext(kns, g.num_heads, keys));
    built_ms.push_back(MsSince(t0));
    if (opened.totals.digests_stored != keys.size()) {
      return Internal("bench pnm remote: " + std::to_string(opened.totals.digests_stored) + " of " +
                      std::to_string(keys.size()) + " digests stored");
    }
    context = opened.context;
  }
  for (int r = 0; r < std::max(reps, 3); ++r) {
    auto t0 = Clock::now();
    CXLKV_ASSIGN_OR_RETURN(auto again, client->OpenContext(kns, g.num_heads, keys));
    stored_ms.push_back(MsSince(t0));
    CXLKV_RETURN_IF_ERROR(client->Close({&again.context, 1}));
  }

  // The in-process reference over the same pool bytes: pinned views and local digests.
  CXLKV_ASSIGN_OR_RETURN(LookupResult hit, cache->Lookup(ns, keys));
  if (hit.hit_blocks != keys.size()) return Internal("bench pnm remote: the context left the pool");
  std::vector<pnm::PageKv> views;
  for (const BlockPin& p : hit.pins) {
    const uint8_t* base = cache->PayloadPtr(p);
    views.push_back({base, base + g.SlabBytes()});
  }
  const pnm::ContextView ctx{views, kTokens};
  std::vector<uint8_t> digests(keys.size() * pnm::DigestBytesPerPage(g));
  CXLKV_RETURN_IF_ERROR(pnm::BuildDigests(g, ctx, digests));

  // As many threads as the service's engines: they share a lone request's selection and
  // attention out among them, and the figure is the RPC's cost, not a thread count's.
  pnm::AttendPool local_pool(so.threads);
  std::vector<nlohmann::json> out;
  const std::pair<uint32_t, const char*> budgets[] = {{kTokens / 32, "1_32"}, {0, "dense"}};
  const int steps = 16;
  for (const auto& [budget, name] : budgets) {
    std::vector<double> remote_ms, local_ms;
    pnm::Partial part;
    pnm::Selection sel;
    for (int r = 0; r < std::max(reps, 3); ++r) {
      auto t0 = Clock::now();
      for (int s = 0; s < steps; ++s) {
        pnm::NearMemoryClient::Job j;
        j.context = context;
        j.q = qs[s % qs.size()].data();
        j.budget_tokens = budget;
        j.out = &part;
        CXLKV_RETURN_IF_ERROR(client->Attend({&j, 1}));
      }
      remote_ms.push_back(MsSince(t0) / steps);
      t0 = Clock::now();
      for (int s = 0; s < steps; ++s) {
        const float* q = qs[s % qs.size()].data();
        pnm::AttendJob attend{&g, q, ctx, nullptr, 0, &part, {}};
        if (budget != 0) {
          pnm::SelectJob select{&g, q, digests.data(), kTokens, {budget, 1, 1}, &sel, {}};
          CXLKV_RETURN_IF_ERROR(local_pool.Select({&select, 1}));
          attend.selection = &sel;
        }
        CXLKV_RETURN_IF_ERROR(local_pool.Run({&attend, 1}));
      }
      local_ms.push_back(MsSince(t0) / steps);
    }
    out.push_back(FigureJson({std::string("remote_step_ms/32K/") + name, "ms", false, remote_ms,
                              std::string("in_process_step_ms/32K/") + name, local_ms,
                              "one step at the cxlkvd service (RPC round trip included) vs the same step in-process"}));
  }
  cache->Release(hit.pins);
  // Bytes per step: what crossed the link against what the service read next to the memory.
  const auto st = service->stats();
  const double jobs = static_cast<double>(std::max<uint64_t>(st.attend_jobs, 1));
  out.push_back(FigureJson({"remote_link_KiB/32K", "KiB", false, {client->link_bytes() / jobs / 1024.0},
                            "remote_kv_read_KiB/32K", {st.kv_bytes_read / jobs / 1024.0},
                            "request + answer bytes per step vs KV bytes the service read for it"}));
  out.push_back(FigureJson({"open_ms/32K/stored", "ms", false, stored_ms, "open_ms/32K/built", built_ms,
                            "opening a 32K context with its digests read from the pool vs built from the keys"}));
  CXLKV_RETURN_IF_ERROR(client->Close({&context, 1}));
  return out;
}

}  // namespace cxlkv::bench
