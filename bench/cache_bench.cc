// `cxlkv bench cache`: the prefix KV cache's hit path and payload path.
//
//   lookup/chainN     Lookup (pin) + Release of a READY chain of N blocks, ns per block; the
//                     reference is the same probe without pinning (Exists): the ratio is what
//                     the only metadata written on the hit path (one pin word per block,
//                     flushed, and its release) costs.
//   lookup_pin_only/chainN  the Lookup alone, timed inside the same loop: the latency before a
//                     reader holds its pinned prefix (the Release comes after its read).
//   put/2MiB          Reserve + Write + Commit of 2 MiB blocks, GB/s, vs the non-temporal copy
//                     of the same bytes into the same pool in the same run.
//   get/2MiB          Lookup + Read + Release, GB/s, vs memcpy of the same bytes out of the pool,
//                     and vs invalidate + copy of them (get_vs_invalidate_copy, goal >= 0.9).
//   redis/*           the same puts and gets against a local redis-server (started here on
//                     127.0.0.1, stopped after) — the peer baseline; ratio cxlkv / redis.
#include <hiredis/hiredis.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <chrono>
#include <cstring>
#include <optional>
#include <thread>

#include "bench_clock.h"
#include "pool/pool_internal.h"
#include "region/coherence.h"
#include "suites.h"

namespace cxlkv::bench {
namespace {


double Gbps(uint64_t bytes, double ns) { return static_cast<double>(bytes) / ns; }

std::vector<int32_t> TokensFor(uint64_t seed, size_t n) {
  std::vector<int32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>((seed * 2654435761u + i * 40503u) % 128000);
  return t;
}

// A redis-server of our own on a free loopback port; stopped by the destructor.
class RedisPeer {
 public:
  ~RedisPeer() {
    if (ctx_) redisFree(ctx_);
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  Status Start() {
    for (int attempt = 0; attempt < 5; ++attempt) {
      port_ = 20000 + static_cast<int>((::getpid() * 7 + attempt * 131) % 30000);
      pid_ = ::fork();
      if (pid_ == 0) {
        std::string port = std::to_string(port_);
        int devnull = ::open("/dev/null", O_WRONLY);
        ::dup2(devnull, 1);
        ::dup2(devnull, 2);
        ::execlp("redis-server", "redis-server", "--port", port.c_str(), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--protected-mode", "yes", static_cast<char*>(nullptr));
        ::_exit(127);
      }
      for (int i = 0; i < 100; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        int status;
        if (::waitpid(pid_, &status, WNOHANG) == pid_) {
          pid_ = -1;
          if (WIFEXITED(status) && WEXITSTATUS(status) == 127) {
            return NotFound("redis-server is not installed (scripts/setup installs it)");
          }
          break;  // port taken, probably: try another
        }
        ctx_ = redisConnect("127.0.0.1", port_);
        if (ctx_ && !ctx_->err) return Status::Ok();
        if (ctx_) redisFree(ctx_);
        ctx_ = nullptr;
      }
    }
    return IoError("could not start a redis-server on 127.0.0.1");
  }
  Status Set(const std::string& key, const void* data, size_t n) {
    auto* r = static_cast<redisReply*>(redisCommand(ctx_, "SET %b %b", key.data(), key.size(), data, n));
    if (!r) return IoError("redis SET failed: " + std::string(ctx_->errstr));
    bool ok = r->type == REDIS_REPLY_STATUS;
    freeReplyObject(r);
    return ok ? Status::Ok() : IoError("redis SET refused");
  }
  Status Get(const std::string& key, void* dst, size_t n) {
    auto* r = static_cast<redisReply*>(redisCommand(ctx_, "GET %b", key.data(), key.size()));
    if (!r) return IoError("redis GET failed: " + std::string(ctx_->errstr));
    bool ok = r->type == REDIS_REPLY_STRING && r->len == n;
    if (ok) std::memcpy(dst, r->str, n);
    freeReplyObject(r);
    return ok ? Status::Ok() : IoError("redis GET returned no value of the right size");
  }

 private:
  pid_t pid_ = -1;
  int port_ = 0;
  redisContext* ctx_ = nullptr;
};

}  // namespace

Result<nlohmann::json> RunCacheBench(const BenchOptions& options) {
  const int reps = options.quick ? 2 : options.repetitions;
  const int blocks = options.quick ? 8 : 48;
  constexpr uint64_t kBlock = uint64_t{2} << 20;
  std::string path = options.workdir + "/cxlkv-bench-cache-" + std::to_string(::getpid());
  nlohmann::json machine = MachineJsonWithLimits(options);
  PoolCreateOptions co;
  co.size = (options.quick ? 128ull : 512ull) << 20;
  co.max_nodes = 2;
  co.overwrite = true;
  CXLKV_RETURN_IF_ERROR(Pool::Create({path}, co));
  PoolOpenOptions oo;
  oo.node_id = 0;
  auto pool = Pool::Open({path}, oo);
  if (!pool.ok()) return pool.status();
  CXLKV_ASSIGN_OR_RETURN(KvCache * cache, (*pool)->Cache());
  const CoherenceMode coherence = (*pool)->impl().regions[0]->impl().meta().mode();
  KeyNamespace kns;
  kns.model_id = "bench";
  CXLKV_ASSIGN_OR_RETURN(auto ns, cache->Namespace(kns));
  nlohmann::json results = nlohmann::json::array();

  // ---- hit path: chains of 1, 16, 256 small blocks ----
  for (size_t chain : {size_t{1}, size_t{16}, size_t{256}}) {
    auto keys = cache->ChainKeys(ns, TokensFor(chain, chain * 16));
    std::vector<uint8_t> tiny(64, 7);
    for (const auto& k : keys) {
      Status s = cache->Put(ns, k, tiny.data(), tiny.size());
      if (!s.ok() && s.code() != StatusCode::kAlreadyExists) return s;
    }
    const int iters = static_cast<int>((options.quick ? 2000 : 20000) / chain + 10);
    std::vector<double> pinned, lookup_only, probe;
    for (int rep = 0; rep < reps; ++rep) {
      double in_lookup = 0;
      auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) {
        auto t1 = Clock::now();
        auto hit = cache->Lookup(ns, keys);
        in_lookup += NsSince(t1);
        if (!hit.ok() || hit->hit_blocks != chain) return Internal("bench chain did not hit in full");
        cache->Release(hit->pins);
      }
      pinned.push_back(NsSince(t0) / (static_cast<double>(iters) * chain));
      lookup_only.push_back(in_lookup / (static_cast<double>(iters) * chain));
      t0 = Clock::now();
      for (int i = 0; i < iters; ++i) {
        auto n = cache->Exists(ns, keys);
        if (!n.ok() || *n != chain) return Internal("bench chain did not hit in full");
      }
      probe.push_back(NsSince(t0) / (static_cast<double>(iters) * chain));
    }
    std::string n = "chain" + std::to_string(chain);
    results.push_back(FigureJson({"probe_only/" + n, "ns/block", false, probe, "", {},
                                  "Exists: invalidate + read one 64-B entry per block, no writes"}));
    results.push_back(FigureJson({"lookup/" + n, "ns/block", false, pinned, "probe_only/" + n, probe,
                                  "Lookup+Release: plus the chain's pin record written and flushed before the probe "
                                  "(one line per 7 keys), and at release the record cleared and flushed and "
                                  "each block's access stamp written back"}));
    results.push_back(FigureJson({"lookup_pin_only/" + n, "ns/block", false, lookup_only, "probe_only/" + n, probe,
                                  "Lookup alone (the pinned hit a reader waits for; Release follows the read); "
                                  "goal <= 2x the probe for 256 blocks",
                                  chain == 256 ? std::optional(Goal::RatioAtMost(2)) : std::nullopt}));
  }

  // ---- payload path: 2 MiB blocks, and the same bytes copied plainly ----
  std::vector<uint8_t> src(kBlock * blocks), dst(kBlock);
  for (size_t i = 0; i < src.size(); i += 8) {
    uint64_t w = i * 0x9e3779b97f4a7c15ull;
    std::memcpy(&src[i], &w, 8);
  }
  auto keys = cache->ChainKeys(ns, TokensFor(99, 16 * blocks));
  std::vector<double> put, get, nt, mc, imc;
  for (int rep = 0; rep < reps; ++rep) {
    CXLKV_RETURN_IF_ERROR(cache->EvictAll().status());
    auto t0 = Clock::now();
    for (int b = 0; b < blocks; ++b) {
      CXLKV_ASSIGN_OR_RETURN(auto r, cache->Reserve(ns, keys[b], kBlock));
      CXLKV_RETURN_IF_ERROR(cache->Write(r, 0, &src[b * kBlock], kBlock));
      CXLKV_RETURN_IF_ERROR(cache->Commit(r));
    }
    put.push_back(Gbps(kBlock * blocks, NsSince(t0)));
    t0 = Clock::now();
    for (int b = 0; b < blocks; ++b) {
      CXLKV_ASSIGN_OR_RETURN(auto hit, cache->Lookup(ns, {&keys[b], 1}));
      if (hit.hit_blocks != 1) return Internal("bench block did not hit");
      CXLKV_RETURN_IF_ERROR(cache->Read(hit.pins[0], 0, dst.data(), kBlock));
      cache->Release(hit.pins);
    }
    get.push_back(Gbps(kBlock * blocks, NsSince(t0)));
    if (std::memcmp(dst.data(), &src[(blocks - 1) * kBlock], kBlock) != 0) return Internal("bench read back wrong bytes");
    // References: the same bytes into / out of the same pool memory, no cache logic.
    auto hit = cache->Lookup(ns, keys);
    if (!hit.ok()) return hit.status();
    t0 = Clock::now();
    for (int b = 0; b < blocks; ++b) {
      region::NtCopy(const_cast<uint8_t*>(cache->PayloadPtr(hit->pins[b])), &src[b * kBlock], kBlock);
    }
    nt.push_back(Gbps(kBlock * blocks, NsSince(t0)));
    t0 = Clock::now();
    for (int b = 0; b < blocks; ++b) std::memcpy(dst.data(), cache->PayloadPtr(hit->pins[b]), kBlock);
    mc.push_back(Gbps(kBlock * blocks, NsSince(t0)));
    // What a read over non-coherent memory must do at least: drop this host's copies of the
    // lines, then copy them out (region::CopyFromShared, the copy a get makes).
    t0 = Clock::now();
    for (int b = 0; b < blocks; ++b) region::CopyFromShared(dst.data(), cache->PayloadPtr(hit->pins[b]), kBlock);
    imc.push_back(Gbps(kBlock * blocks, NsSince(t0)));
    cache->Release(hit->pins);
  }
  results.push_back(FigureJson({"nt_copy/2MiB", "GB/s", true, nt, "", {}, "non-temporal copy into the pool, same bytes"}));
  results.push_back(FigureJson({"memcpy_out/2MiB", "GB/s", true, mc, "", {}, "memcpy out of the pool, same bytes"}));
  results.push_back(FigureJson({"put/2MiB", "GB/s", true, put, "nt_copy/2MiB", nt,
                                "reserve+write+commit per block vs the bare copy", Goal::RatioAtLeast(0.9)}));
  results.push_back(FigureJson({"get/2MiB", "GB/s", true, get, "memcpy_out/2MiB", mc,
                                "lookup+read+release per block vs the bare copy"}));
  results.push_back(FigureJson({"invalidate_copy_out/2MiB", "GB/s", true, imc, "", {},
                                "invalidate + copy out of the pool, same bytes: a non-coherent read's least work"}));
  results.push_back(FigureJson({"get_vs_invalidate_copy/2MiB", "GB/s", true, get, "invalidate_copy_out/2MiB", imc,
                                "lookup+read+release per block vs invalidate + copy of the same bytes",
                                Goal::RatioAtLeast(0.9)}));

  // ---- the peer: redis-server on loopback, the same blocks ----
  RedisPeer redis;
  Status started = redis.Start();
  if (started.ok()) {
    std::vector<double> rput, rget;
    for (int rep = 0; rep < reps; ++rep) {
      auto t0 = Clock::now();
      for (int b = 0; b < blocks; ++b) CXLKV_RETURN_IF_ERROR(redis.Set("blk" + std::to_string(b), &src[b * kBlock], kBlock));
      rput.push_back(Gbps(kBlock * blocks, NsSince(t0)));
      t0 = Clock::now();
      for (int b = 0; b < blocks; ++b) CXLKV_RETURN_IF_ERROR(redis.Get("blk" + std::to_string(b), dst.data(), kBlock));
      rget.push_back(Gbps(kBlock * blocks, NsSince(t0)));
    }
    results.push_back(FigureJson({"redis_set/2MiB", "GB/s", true, rput, "", {}, "redis-server on 127.0.0.1, hiredis SET"}));
    results.push_back(FigureJson({"redis_get/2MiB", "GB/s", true, rget, "", {}, "redis-server on 127.0.0.1, hiredis GET"}));
    results.push_back(FigureJson({"put_vs_redis/2MiB", "GB/s", true, put, "redis_set/2MiB", rput,
                                  "cxlkv put over redis SET: >1 means cxlkv is faster"}));
    results.push_back(FigureJson({"get_vs_redis/2MiB", "GB/s", true, get, "redis_get/2MiB", rget,
                                  "cxlkv get over redis GET: >1 means cxlkv is faster"}));
  }
  pool->reset();
  ::unlink(path.c_str());
  nlohmann::json report;
  report["suite"] = "cache";
  report["machine"] = std::move(machine);
  report["repetitions"] = reps;
  report["blocks"] = blocks;
  report["coherence"] = std::string(CoherenceModeName(coherence));
  if (!started.ok()) report["peer_skipped"] = started.ToString();
  report["results"] = results;
  return report;
}

}  // namespace cxlkv::bench
