// Part of `cxlkv bench rpc`: the prefix index's operations in both metadata modes (Beluga §6.2
// Exp #11 against TraCT §3.1), measured on the same machine in the same run.
//
//   index_lookup_16/MODE        one lookup + release of a 16-block chain that hits, one client
//   index_reserve_commit/MODE   one single-key reserve + commit (no payload bytes), one client
//   index_put_4writers/MODE     reserve + 4 KiB write + commit, four client processes at once
//
// Each mode on a fresh pool: node 0's process is the lock manager (and, central, the metadata
// service); the clients are nodes 1..4 and host neither. Decentralized is the reference of each
// figure; the goal is central reserve+commit at least as fast as decentralized with 4 writers.
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "bench_clock.h"
#include "cxlkv/pool.h"
#include "suites.h"

namespace cxlkv::bench {
namespace {

constexpr int kWriters = 4;
constexpr uint64_t kPutBytes = 4096;

struct MetaShared {
  std::atomic<int> host_ready;
  std::atomic<int> clients_ready;
  std::atomic<int> go;
  std::atomic<int> done;
  std::atomic<int> failed;
  double lookup_ns;
  double reserve_commit_ns;
  double put_seconds[kWriters];
};


// The clients that wait for the 4-writer phase block in the kernel (a futex on the shared page)
// rather than poll: three processes waking every 100 µs took most of a core from the service
// thread and its client on this 2-core machine, and the central lookup paid for it.
void WaitUntilSet(std::atomic<int>& word) {
  while (word.load() == 0) {
    ::syscall(SYS_futex, reinterpret_cast<int*>(&word), FUTEX_WAIT, 0, nullptr, nullptr, 0);
  }
}
void SetAndWake(std::atomic<int>& word) {
  word.store(1);
  ::syscall(SYS_futex, reinterpret_cast<int*>(&word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

BlockKey BenchKey(uint32_t writer, uint64_t i) {
  return BlockKey{(uint64_t{writer} << 40) ^ (i * 0x9e3779b97f4a7c15ull) ^ 0x1234567, i + (uint64_t{writer} << 32) + 1};
}

KeyNamespace MetaBenchNamespace() {
  KeyNamespace ns;
  ns.model_id = "bench-meta";
  ns.layout.block_size = 16;
  return ns;
}

// Node 0: the manager, and the metadata service of a central pool. Lives until the clients end.
int Host(const std::string& path, MetaShared* s) {
  PoolOpenOptions o;
  o.node_id = 0;
  auto pool = Pool::Open({path}, o);
  if (!pool.ok()) return 1;
  auto cache = (*pool)->Cache();
  if (!cache.ok() || !(*cache)->Namespace(MetaBenchNamespace()).ok()) return 2;  // central: the service answers
  s->host_ready = 1;
  while (!s->done.load() && !s->failed.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  return 0;
}

// Client `w` (node w + 1). Writer 0 also measures the single-client figures before the put.
int Client(const std::string& path, MetaShared* s, int w, uint64_t ops, uint64_t puts) {
  while (!s->host_ready.load()) {
    if (s->failed.load()) return 1;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  PoolOpenOptions o;
  o.node_id = static_cast<uint32_t>(w + 1);
  o.may_host_manager = false;
  auto pool = Pool::Open({path}, o);
  if (!pool.ok()) return 2;
  KvCache& cache = **(*pool)->Cache();
  auto ns = cache.Namespace(MetaBenchNamespace());
  if (!ns.ok()) return 3;
  if (w == 0) {
    // A 16-block chain, READY, then looked up and released `ops` times.
    std::vector<BlockKey> chain;
    std::vector<uint8_t> block(kPutBytes, 0x5a);
    for (uint64_t i = 0; i < 16; ++i) {
      chain.push_back(BenchKey(99, i));
      if (!cache.Put(*ns, chain.back(), block.data(), block.size()).ok()) return 4;
    }
    for (int i = 0; i < 100; ++i) {  // warm-up
      auto hit = cache.Lookup(*ns, chain);
      if (!hit.ok()) return 5;
      cache.Release(hit->pins);
    }
    auto t0 = Clock::now();
    for (uint64_t i = 0; i < ops; ++i) {
      auto hit = cache.Lookup(*ns, chain);
      if (!hit.ok() || hit->hit_blocks != 16) return 6;
      cache.Release(hit->pins);
    }
    s->lookup_ns = SecondsSince(t0) * 1e9 / static_cast<double>(ops);
    t0 = Clock::now();
    for (uint64_t i = 0; i < ops; ++i) {
      auto r = cache.Reserve(*ns, BenchKey(98, i), kPutBytes);
      if (!r.ok() || !cache.Commit(*r).ok()) return 7;
    }
    s->reserve_commit_ns = SecondsSince(t0) * 1e9 / static_cast<double>(ops);
  }
  std::vector<uint8_t> block(kPutBytes, static_cast<uint8_t>(w));
  s->clients_ready.fetch_add(1);
  WaitUntilSet(s->go);  // set when all are ready, or when one failed
  if (s->failed.load()) return 8;
  auto t0 = Clock::now();
  for (uint64_t i = 0; i < puts; ++i) {
    Status st = cache.Put(*ns, BenchKey(static_cast<uint32_t>(w), i), block.data(), block.size());
    if (!st.ok()) {
      std::fprintf(stderr, "cxlkv bench: writer %d, put %llu: %s\n", w, static_cast<unsigned long long>(i),
                   st.ToString().c_str());
      return 9;
    }
  }
  s->put_seconds[w] = SecondsSince(t0);
  return 0;
}

struct ModeFigures {
  double lookup_us = 0, reserve_commit_us = 0, put_kops = 0;
};

Result<ModeFigures> MeasureMode(const std::string& path, MetadataMode mode, uint64_t ops, uint64_t puts) {
  PoolCreateOptions co;
  co.size = 256ull << 20;
  co.max_nodes = 8;
  co.overwrite = true;
  co.metadata = mode;
  CXLKV_RETURN_IF_ERROR(Pool::Create({path}, co));
  auto* s = static_cast<MetaShared*>(mmap(nullptr, sizeof(MetaShared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (s == MAP_FAILED) return IoError("mmap of the bench's shared page failed");
  new (s) MetaShared{};
  std::vector<pid_t> pids;
  pid_t host = ::fork();
  if (host == 0) ::_exit(Host(path, s));
  for (int w = 0; w < kWriters; ++w) {
    pid_t c = ::fork();
    if (c == 0) {
      const int rc = Client(path, s, w, ops, puts);
      if (rc != 0) s->failed = 1;
      ::_exit(rc);
    }
    pids.push_back(c);
  }
  // All clients ready, then all at once: the 4-writer put.
  const auto deadline = Clock::now() + std::chrono::minutes(5);
  while (s->clients_ready.load() < kWriters && !s->failed.load() && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  SetAndWake(s->go);
  bool ok = true;
  std::string codes;
  for (pid_t p : pids) {
    int st = 0;
    ::waitpid(p, &st, 0);
    ok = ok && WIFEXITED(st) && WEXITSTATUS(st) == 0;
    codes += " " + std::to_string(WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
  }
  s->done = 1;
  int hs = 0;
  ::waitpid(host, &hs, 0);
  ok = ok && WIFEXITED(hs) && WEXITSTATUS(hs) == 0;
  ModeFigures f;
  f.lookup_us = s->lookup_ns / 1e3;
  f.reserve_commit_us = s->reserve_commit_ns / 1e3;
  double slowest = 0;
  for (double t : s->put_seconds) slowest = std::max(slowest, t);
  f.put_kops = slowest > 0 ? kWriters * static_cast<double>(puts) / slowest / 1e3 : 0;
  munmap(s, sizeof(MetaShared));
  ::unlink(path.c_str());
  if (!ok) {
    return Internal(std::string("a ") + MetadataModeName(mode) + " metadata benchmark process failed (client exit codes" +
                    codes + ", host " + std::to_string(hs) + ")");
  }
  return f;
}

}  // namespace

Result<std::vector<nlohmann::json>> MetadataModeFigures(const BenchOptions& options) {
  const int reps = options.quick ? 1 : std::max(3, options.repetitions / 2);
  const uint64_t ops = options.quick ? 200 : 2000;
  const uint64_t puts = options.quick ? 200 : 1500;
  const std::string path = options.workdir + "/cxlkv-bench-meta-" + std::to_string(::getpid());
  std::vector<double> lookup[2], rc[2], put[2], rc_ratio;
  for (int rep = 0; rep < reps; ++rep) {
    for (int m = 0; m < 2; ++m) {
      CXLKV_ASSIGN_OR_RETURN(ModeFigures f, MeasureMode(path, m ? MetadataMode::kCentral : MetadataMode::kDecentralized, ops, puts));
      lookup[m].push_back(f.lookup_us);
      rc[m].push_back(f.reserve_commit_us);
      put[m].push_back(f.put_kops);
    }
  }
  std::vector<nlohmann::json> out;
  out.push_back(FigureJson({"index_lookup_16/decentralized", "us/op", false, lookup[0], "", {},
                            "lookup + release of a 16-block chain that hits, one client"}));
  out.push_back(FigureJson({"index_lookup_16/central", "us/op", false, lookup[1], "index_lookup_16/decentralized", lookup[0],
                            "the same over the metadata service; ratio to decentralized", Goal::RatioAtMost(1.5)}));
  out.push_back(FigureJson({"index_reserve_commit/decentralized", "us/op", false, rc[0], "", {},
                            "single-key reserve + commit, one client (two stripe-lock round trips)"}));
  out.push_back(FigureJson({"index_reserve_commit/central", "us/op", false, rc[1], "index_reserve_commit/decentralized", rc[0],
                            "the same as two RPCs to the index's one writer; ratio to decentralized",
                            Goal::RatioAtMost(1)}));  // us/op: at least as fast is a ratio <= 1
  out.push_back(FigureJson({"index_put_4writers/decentralized", "kops/s", true, put[0], "", {},
                            "reserve + 4 KiB write + commit, four client processes at once"}));
  out.push_back(FigureJson({"index_put_4writers/central", "kops/s", true, put[1], "index_put_4writers/decentralized", put[0],
                            "the same through the metadata service; goal ratio >= 1", Goal::RatioAtLeast(1)}));
  return out;
}

}  // namespace cxlkv::bench
