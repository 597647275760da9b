// cxlkv demo: the main job on the embedded default (a region in /dev/shm). It grows with each
// capability; today: the prefix KV cache between separate processes, as TraCT's prefill and
// decode workers use it — a prefill node publishes a prompt's KV blocks, a second prompt that
// shares the document hits its prefix, and a decode node reads every block back.
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>

#include "commands.h"
#include "pool/pool_internal.h"
#include "util/units.h"

namespace cxlkv::cli {
namespace {

// A small model's KV layout: 8 layers x K/V x 16 tokens x 4 heads x 64 x fp16 = 128 KiB/block.
KeyNamespace DemoNamespace() {
  KeyNamespace ns;
  ns.model_id = "demo-llama-tiny";
  ns.layout.num_layers = 8;
  ns.layout.num_kv_heads = 4;
  ns.layout.head_size = 64;
  return ns;
}

// A prompt: a shared 768-token document, then a 256-token question of its own.
std::vector<int32_t> Prompt(int question) {
  std::vector<int32_t> t;
  for (int i = 0; i < 768; ++i) t.push_back((i * 7919) % 32000);
  for (int i = 0; i < 256; ++i) t.push_back((question * 104729 + i * 31) % 32000);
  return t;
}

// Stand-in KV bytes: a pure function of the block key, so the decode side can verify them.
void FakeKv(const BlockKey& k, std::vector<uint8_t>& out) {
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<uint8_t>((k.lo >> (i % 56)) ^ (k.hi * (i + 1)) >> 7);
}

// One worker process: joins as `node`, runs `body`, exits with 0 on success.
int Worker(const std::string& path, uint32_t node, const std::function<Status(KvCache&, NamespaceHandle&)>& body) {
  PoolOpenOptions o;
  o.node_id = node;
  auto pool = Pool::Open({path}, o);
  if (!pool.ok()) {
    std::fprintf(stderr, "node %u: %s\n", node, pool.status().ToString().c_str());
    return 1;
  }
  auto cache = (*pool)->Cache();
  auto ns = cache.ok() ? (*cache)->Namespace(DemoNamespace()) : Result<NamespaceHandle>(cache.status());
  Status s = ns.ok() ? body(**cache, *ns) : ns.status();
  if (!s.ok()) std::fprintf(stderr, "node %u: %s\n", node, s.ToString().c_str());
  std::fflush(stdout);  // the child leaves by _exit
  return s.ok() ? 0 : 1;
}

Status RunInChild(const std::string& path, uint32_t node,
                  const std::function<Status(KvCache&, NamespaceHandle&)>& body) {
  std::fflush(stdout);
  pid_t pid = ::fork();
  if (pid < 0) return IoError("fork failed");
  if (pid == 0) ::_exit(Worker(path, node, body));
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return Internal("demo worker node " + std::to_string(node) + " failed");
  return Status::Ok();
}

// Prefill: look up the prompt's chain, "compute" and publish the blocks that missed.
Status Prefill(KvCache& cache, NamespaceHandle& ns, int question) {
  auto keys = KvCache::ChainKeys(ns, Prompt(question));
  CXLKV_ASSIGN_OR_RETURN(auto hit, cache.Lookup(ns, keys));
  std::vector<uint8_t> kv(ns.block_bytes);
  size_t written = 0;
  for (size_t i = hit.hit_blocks; i < keys.size(); ++i) {
    FakeKv(keys[i], kv);
    Status s = cache.Put(ns, keys[i], kv.data(), kv.size());
    if (!s.ok() && s.code() != StatusCode::kAlreadyExists) return s;
    ++written;
  }
  cache.Release(hit.pins);
  std::printf("  prefill  node %u  prompt %d: %zu of %zu blocks hit (%zu tokens reused), %zu computed and "
              "published\n", 1u, question, hit.hit_blocks, keys.size(), hit.hit_blocks * ns.block_size, written);
  return Status::Ok();
}

// Decode: read every block of the prompt from the pool and check each byte.
Status Decode(KvCache& cache, NamespaceHandle& ns, int question) {
  auto keys = KvCache::ChainKeys(ns, Prompt(question));
  CXLKV_ASSIGN_OR_RETURN(auto hit, cache.Lookup(ns, keys));
  if (hit.hit_blocks != keys.size()) return Internal("decode found only " + std::to_string(hit.hit_blocks) + " blocks");
  std::vector<uint8_t> got(ns.block_bytes), want(ns.block_bytes);
  for (size_t i = 0; i < keys.size(); ++i) {
    CXLKV_RETURN_IF_ERROR(cache.Read(hit.pins[i], 0, got.data(), got.size()));
    FakeKv(keys[i], want);
    if (got != want) return Internal("decode read wrong bytes in block " + std::to_string(i));
  }
  cache.Release(hit.pins);
  std::printf("  decode   node %u  prompt %d: read all %zu blocks (%s), byte-identical\n", 2u, question,
              keys.size(), util::FormatBytes(keys.size() * ns.block_bytes).c_str());
  return Status::Ok();
}

Status RunCacheDemo(const std::string& path) {
  std::printf("== prefix KV cache across processes (prefill node 1, decode node 2) ==\n");
  for (int q = 0; q < 2; ++q) {
    CXLKV_RETURN_IF_ERROR(RunInChild(path, 1, [q](KvCache& c, NamespaceHandle& ns) { return Prefill(c, ns, q); }));
    CXLKV_RETURN_IF_ERROR(RunInChild(path, 2, [q](KvCache& c, NamespaceHandle& ns) { return Decode(c, ns, q); }));
  }
  auto regions = pool::AttachAll({path});
  if (!regions.ok()) return regions.status();
  auto stat = pool::Stat(*regions, 0);
  const auto& t = stat["cache"]["totals"];
  std::printf("== pool: %llu lookups, %llu of %llu blocks hit (%.1f%%), %llu blocks cached (%s) ==\n",
              t["lookups"].get<unsigned long long>(), t["hit_blocks"].get<unsigned long long>(),
              t["lookup_blocks"].get<unsigned long long>(), 100.0 * stat["cache"]["hit_rate"]["blocks"].get<double>(),
              stat["cache"]["states"]["ready"].get<unsigned long long>(),
              util::FormatBytes(stat["cache"]["used_bytes"].get<uint64_t>()).c_str());
  auto problems = pool::Check(*regions, 0);
  for (const auto& p : problems) std::printf("problem: %s\n", p.c_str());
  if (!problems.empty()) return Corrupted("the pool failed its check after the demo");
  std::printf("== cxlkv check: ok. Inspect it yourself: cxlkv stat --path %s ==\n", path.c_str());
  return Status::Ok();
}

}  // namespace

void AddDemoCommands(CLI::App& app, CommandResult& result) {
  struct Args {
    std::string path;
    std::string size = "256M";
  };
  auto args = std::make_shared<Args>();
  args->path = "/dev/shm/cxlkv-demo-" + std::to_string(::getuid());
  CLI::App* cmd = app.add_subcommand("demo", "Run the end-to-end demo on a region in /dev/shm");
  cmd->add_option("--path", args->path, "Region path (re-created)")->capture_default_str();
  cmd->add_option("--size", args->size, "Region size")->capture_default_str();
  cmd->callback([args, &result] {
    auto size = util::ParseByteSize(args->size);
    if (!size.ok()) {
      result.status = size.status();
      return;
    }
    PoolCreateOptions opts;
    opts.size = *size;
    opts.overwrite = true;
    result.status = Pool::Create({args->path}, opts);
    if (!result.status.ok()) return;
    auto attached = Region::Attach(args->path);
    if (!attached.ok()) {
      result.status = attached.status();
      return;
    }
    std::printf("== demo: created a pool region at %s ==\n", args->path.c_str());
    PrintRegionInfo((*attached)->info(), stdout);
    result.status = RunCacheDemo(args->path);
  });
}

}  // namespace cxlkv::cli
