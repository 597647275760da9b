// `cxlkv bench racks`: fetching 2 MiB blocks from another rack's pool over the rack link
// (rack/block_fetch.h), batches of 1 and 16, next to ucx_perftest's active-message bandwidth for
// the same message size over the same transport on the same machine (the limit); and a lookup
// in a home rack's directory over the link next to one etcd range request on a local member.
// Measured in the same run, repetitions interleaved so both see the same load.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <thread>

#include "bench_clock.h"
#include "cxlkv/pool.h"
#include "etcd_server.h"  // tests/rack: the one-member etcd the rack tests start
#include "rack/block_fetch.h"
#include "rack/link_service.h"
#include "suites.h"

namespace cxlkv::bench {
namespace {

constexpr uint64_t kRackBlock = uint64_t{2} << 20;

// The transport both sides use: UCX_TLS from the environment, else TCP (what a rack link without
// RDMA NICs uses, and what loopback can measure honestly: UCX would otherwise pick shared memory).
std::string RacksTransports() {
  const char* env = std::getenv("UCX_TLS");
  return env != nullptr && *env != '\0' ? env : "tcp";
}

// ucx_perftest's ucp_am_bw for `bytes` messages between two processes over loopback: GB/s (the
// "Final:" line's average bandwidth, in MiB/s).
Result<double> UcxPerftestGbps(uint64_t bytes, int iterations, const std::string& tls) {
  if (std::system("command -v ucx_perftest >/dev/null 2>&1") != 0) {
    return NotFound("ucx_perftest is not installed (Debian's ucx-utils; scripts/setup installs it)");
  }
  const int port = testing::EtcdServer::FreePort();
  if (port == 0) return Unavailable("no free loopback port for ucx_perftest");
  const std::string env = "UCX_TLS='" + tls + "' ";
  const std::string server = env + "timeout 60 ucx_perftest -p " + std::to_string(port) + " >/dev/null 2>&1 &";
  if (std::system(server.c_str()) != 0) return Unavailable("could not start the ucx_perftest server");
  const std::string client = env + "timeout 60 ucx_perftest 127.0.0.1 -p " + std::to_string(port) +
                             " -t ucp_am_bw -s " + std::to_string(bytes) + " -n " + std::to_string(iterations) +
                             " -w " + std::to_string(iterations / 10 + 1) + " 2>&1";
  std::string last;
  for (int attempt = 0; attempt < 50; ++attempt) {  // the server may not be listening yet
    FILE* p = ::popen(client.c_str(), "r");
    if (p == nullptr) return Unavailable("cannot run ucx_perftest");
    std::string out;
    char buf[512];
    while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
    const int rc = ::pclose(p);
    const size_t at = out.find("Final:");
    if (rc == 0 && at != std::string::npos) {
      std::istringstream line(out.substr(at));
      std::string word;
      double v[8] = {};
      line >> word;  // "Final:"
      for (double& x : v) line >> x;  // iterations, 3 latencies, 2 bandwidths, 2 rates
      if (!line.fail() && v[4] > 0) return v[4] * 1048576.0 / 1e9;
    }
    last = out.substr(0, 300);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return Unavailable("ucx_perftest gave no bandwidth: " + last);
}

struct RackSide {
  std::string path;
  std::unique_ptr<Pool> pool;
  KvCache* cache = nullptr;
  ~RackSide() {
    pool.reset();
    if (!path.empty()) ::unlink(path.c_str());
  }
};

Status OpenRackSide(RackSide& side, const std::string& path, uint64_t size) {
  PoolCreateOptions co;
  co.size = size;
  co.max_nodes = 2;
  co.overwrite = true;
  CXLKV_RETURN_IF_ERROR(Pool::Create({path}, co));
  side.path = path;
  PoolOpenOptions oo;
  CXLKV_ASSIGN_OR_RETURN(side.pool, Pool::Open({path}, oo));
  CXLKV_ASSIGN_OR_RETURN(side.cache, side.pool->Cache());
  return Status::Ok();
}

KeyNamespace RacksNamespace() {
  KeyNamespace ns;
  ns.model_id = "bench-racks";
  ns.layout = KvLayoutSignature{KvDtype::kFp16, 32, 8, 128, 16, 0, 1, 0, 2, kPoolBlockFormat};  // Llama-3-8B: 2 MiB
  return ns;
}

}  // namespace

Result<nlohmann::json> RunRacksBench(const BenchOptions& options) {
  const int reps = options.quick ? 2 : options.repetitions;
  const size_t blocks = 16;
  const int fetch_rounds = options.quick ? 1 : 4;  // 16-block fetches per sample
  const std::string tls = RacksTransports();
  const std::string tag = std::to_string(::getpid());
  nlohmann::json machine = MachineJson();
  // etcd first: it forks, before this process starts a thread.
  std::string etcd_missing;
  std::unique_ptr<testing::EtcdServer> etcd = testing::EtcdServer::Start(&etcd_missing);

  RackSide holder, asker;
  CXLKV_RETURN_IF_ERROR(OpenRackSide(holder, options.workdir + "/cxlkv-bench-racks-h-" + tag, 96ull << 20));
  CXLKV_RETURN_IF_ERROR(OpenRackSide(asker, options.workdir + "/cxlkv-bench-racks-a-" + tag, 96ull << 20));
  const KeyNamespace kns = RacksNamespace();
  CXLKV_ASSIGN_OR_RETURN(const NamespaceHandle hns, holder.cache->Namespace(kns));
  CXLKV_ASSIGN_OR_RETURN(const NamespaceHandle ans, asker.cache->Namespace(kns));
  std::vector<BlockKey> keys;
  std::vector<uint8_t> payload(kRackBlock);
  for (uint64_t i = 0; i < blocks; ++i) {
    keys.push_back({0xbe0c0000 + i, 42});
    for (size_t b = 0; b < payload.size(); b += 64) payload[b] = static_cast<uint8_t>(i + b);
    CXLKV_RETURN_IF_ERROR(holder.cache->Put(hns, keys.back(), payload.data(), payload.size()));
  }

  auto secret = rack::PoolSecret::FromBytes(std::vector<uint8_t>(32, 0x5a));
  if (!secret.ok()) return secret.status();
  rack::BlockFetchServer server(*holder.cache);
  // The holder is also the home of a 16-block chain some rack announced.
  rack::ChainDirectory directory;
  rack::LinkAnnounce announced{1, {}};
  for (uint32_t i = 0; i < blocks; ++i) announced.blocks.push_back({rack::AnnounceOp::kPublished, keys[0], i, keys[i]});
  directory.Apply("bench-other", announced);
  rack::LinkService service(directory, &server);
  rack::UcxLinkOptions ho;
  ho.rack = "bench-holder";
  ho.listen = "127.0.0.1:0";
  ho.transports = tls;
  CXLKV_ASSIGN_OR_RETURN(auto holder_link, rack::UcxLink::Start(ho, *secret, service.Handler()));
  rack::UcxLinkOptions ao;
  ao.rack = "bench-asker";
  ao.transports = tls;
  CXLKV_ASSIGN_OR_RETURN(auto asker_link, rack::UcxLink::Start(ao, *secret, nullptr));
  rack::BlockFetcher fetcher(*asker_link, *asker.cache);

  // One fetch of `batch` keys starting at `first`, timed; the asker's copies are evicted after,
  // untimed, so every fetch moves its bytes.
  auto timed_fetch = [&](size_t first, size_t batch, double& seconds) -> Status {
    const auto t0 = Clock::now();
    CXLKV_ASSIGN_OR_RETURN(rack::FetchOutcome out,
                           fetcher.Fetch(holder_link->address(), kns, std::span(keys).subspan(first, batch), std::chrono::seconds(30)));
    seconds += SecondsSince(t0);
    CXLKV_RETURN_IF_ERROR(out.link);
    if (out.fetched != batch) return Internal("bench racks: a fetch moved " + std::to_string(out.fetched) + " of " + std::to_string(batch) + " blocks");
    CXLKV_ASSIGN_OR_RETURN(uint64_t evicted, asker.cache->Evict(ans, std::span(keys).subspan(first, batch)));
    if (evicted != batch) return Internal("bench racks: fetched blocks were not all READY");
    return Status::Ok();
  };
  double warm = 0;
  CXLKV_RETURN_IF_ERROR(timed_fetch(0, blocks, warm));  // connect, authenticate, fault the pages in

  std::vector<double> batch16, batch1, perftest;
  std::string perftest_missing;
  for (int rep = 0; rep < reps; ++rep) {
    double s16 = 0, s1 = 0;
    for (int r = 0; r < fetch_rounds; ++r) CXLKV_RETURN_IF_ERROR(timed_fetch(0, blocks, s16));
    for (int r = 0; r < fetch_rounds; ++r) {
      for (size_t i = 0; i < blocks; ++i) CXLKV_RETURN_IF_ERROR(timed_fetch(i, 1, s1));
    }
    const double moved = static_cast<double>(fetch_rounds * blocks * kRackBlock) / 1e9;
    batch16.push_back(moved / s16);
    batch1.push_back(moved / s1);
    auto ref = UcxPerftestGbps(kRackBlock, options.quick ? 64 : 256, tls);
    if (ref.ok()) {
      perftest.push_back(*ref);
    } else {
      perftest_missing = ref.status().ToString();
    }
  }

  // Directory lookups over the link vs etcd range requests, interleaved per repetition.
  const int lookups = options.quick ? 50 : 400;
  std::vector<double> lookup_us, etcd_us;
  std::unique_ptr<rack::EtcdClient> etcd_client;
  if (etcd) {
    auto c = rack::EtcdClient::Create({{etcd->url()}, std::chrono::milliseconds(2000)});
    if (!c.ok()) return c.status();
    etcd_client = std::move(*c);
    CXLKV_RETURN_IF_ERROR(etcd_client->Put("/cxlkv/bench/racks/member", std::string(200, 'm')).status());
  }
  const rack::LinkLookup chain{keys};
  for (int rep = 0; rep < reps; ++rep) {
    auto t0 = Clock::now();
    for (int i = 0; i < lookups; ++i) {
      CXLKV_ASSIGN_OR_RETURN(rack::LinkMessage answer, asker_link->Call(holder_link->address(), chain, std::chrono::seconds(5)));
      const auto* a = std::get_if<rack::LinkLookupAnswer>(&answer.body);
      if (a == nullptr || a->holders.size() != 1 || a->holders[0].blocks != blocks) return Internal("bench racks: the lookup missed");
    }
    lookup_us.push_back(NsSince(t0) / 1000.0 / lookups);
    if (!etcd_client) continue;
    t0 = Clock::now();
    for (int i = 0; i < lookups; ++i) CXLKV_RETURN_IF_ERROR(etcd_client->Get("/cxlkv/bench/racks/member").status());
    etcd_us.push_back(NsSince(t0) / 1000.0 / lookups);
  }

  nlohmann::json results = nlohmann::json::array();
  results.push_back(FigureJson({"etcd_range", "us", false, etcd_us, "", {},
                                "one range request of one key on a one-member etcd over loopback (v3 JSON gateway)"}));
  results.push_back(FigureJson({"directory_lookup/16", "us", false, lookup_us, "etcd_range", etcd_us,
                                "a home rack's answer for a 16-block chain over the rack link, one round trip",
                                Goal::RatioAtMost(1.0)}));
  results.push_back(FigureJson({"ucx_perftest_am_bw/2MiB", "GB/s", true, perftest, "", {},
                                "ucx_perftest -t ucp_am_bw, 2 MiB, two processes over 127.0.0.1, UCX_TLS=" + tls}));
  results.push_back(FigureJson({"fetch/2MiB/batch16", "GB/s", true, batch16, "ucx_perftest_am_bw/2MiB", perftest,
                                "16 blocks per fetch: reserve, pin, send, verify XXH3, flush, commit",
                                Goal::RatioAtLeast(0.8)}));
  results.push_back(FigureJson({"fetch/2MiB/batch1", "GB/s", true, batch1, "ucx_perftest_am_bw/2MiB", perftest,
                                "one block per fetch: a round trip per block", Goal::RatioAtLeast(0.8)}));
  // The holder counts a block once UCX has ended its send, which can be just after the asker
  // has it: wait (bounded) for the last ones.
  for (int i = 0; i < 500 && server.counters().pins_held != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const auto c = server.counters();
  nlohmann::json report;
  report["suite"] = "racks";
  report["machine"] = std::move(machine);
  report["repetitions"] = reps;
  report["transports"] = tls;
  report["holder"] = {{"fetches", c.fetches}, {"blocks_sent", c.blocks_sent}, {"bytes_sent", c.bytes_sent},
                      {"send_failures", c.send_failures}};
  if (!perftest_missing.empty()) report["reference_skipped"] = perftest_missing;
  if (!etcd) report["etcd_skipped"] = etcd_missing;
  report["results"] = results;
  return report;
}

}  // namespace cxlkv::bench
