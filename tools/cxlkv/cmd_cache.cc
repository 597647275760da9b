// cxlkv put / get / evict: the prefix KV cache from the shell. A --key STRING is hashed as a
// one-block chain in the "cli" namespace (blocks of any size).
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "daemon/node_lock.h"
#include "pool/pool_internal.h"
#include "region/region_internal.h"
#include "rpc/frame.h"
#include "rpc/kv_frames.h"
#include "rpc/tcp_client.h"
#include "sync/node.h"

namespace cxlkv::cli {

// Joins as `node`, or (node < 0) as one more process of the node whose cxlkvd runs on this
// host (no node life of its own to start and end), or without a daemon as a node id nobody
// uses: never-used or departed ids first (highest first), silent ones (a killed process's) only
// after them — joining a silent id means watching it for a lease to be sure it is not live
// elsewhere. A CLI command is a short-lived client: it recovers nobody (the pool's long-lived
// processes do) and so leaves at once.
Result<std::unique_ptr<Pool>> OpenAsNode(const std::string& paths, int node) {
  PoolOpenOptions o;
  o.recovers = false;
  o.prefault = false;  // one command touches a few blocks: mapping every page would cost more
  if (node >= 0) {
    o.node_id = static_cast<uint32_t>(node);
    return Pool::Open(SplitPaths(paths), o);
  }
  {
    auto region = Region::Attach(SplitPaths(paths)[0]);
    if (!region.ok()) return region.status();
    const RegionInfo info = (*region)->info();
    region->reset();
    if (auto local = daemon::LocalDaemonNode(info.pool_id, info.max_nodes)) {
      o.node_id = *local;
      auto p = Pool::Open(SplitPaths(paths), o);
      if (p.ok()) return p;  // else (the daemon just stopped, say) a node of its own, as without one
    }
  }
  auto region = Region::Attach(SplitPaths(paths)[0]);
  if (!region.ok()) return region.status();
  const auto* table = (*region)->impl().find_area(region::AreaKind::kNodeTable);
  if (table == nullptr) return InvalidArgument("the first path must be the pool's first region");
  std::vector<uint32_t> unused, silent;
  for (int n = static_cast<int>((*region)->info().max_nodes) - 1; n >= 0; --n) {
    auto line = sync::ReadNodeLine((*region)->impl().meta(), table->offset, static_cast<uint32_t>(n));
    (line.state == sync::NodeState::kLive ? silent : unused).push_back(static_cast<uint32_t>(n));
  }
  region->reset();
  unused.insert(unused.end(), silent.begin(), silent.end());
  Status last = InvalidArgument("no node id is free");
  for (uint32_t n : unused) {
    o.node_id = n;
    auto p = Pool::Open(SplitPaths(paths), o);
    if (p.ok() || p.status().code() != StatusCode::kAlreadyExists) return p;
    last = p.status();
  }
  return Status(last.code(), "every node id is in use (" + last.message() + "); pass --node");
}

namespace {

struct CacheArgs {
  std::string path, tcp, key, data, out;
  rpc::TlsOptions tls;  // with --tcp
  int node = -1;
  bool all = false;
};

KeyNamespace CliNamespace() {
  KeyNamespace ns;
  ns.model_id = "cli";
  ns.layout.block_size = 1;  // the key string is the one block; payloads of any size
  return ns;
}

struct Opened {
  std::unique_ptr<Pool> pool;
  KvCache* cache = nullptr;
  NamespaceHandle ns;
};

Result<Opened> OpenCache(const CacheArgs& a) {
  Opened o;
  CXLKV_ASSIGN_OR_RETURN(o.pool, OpenAsNode(a.path, a.node));
  CXLKV_ASSIGN_OR_RETURN(o.cache, o.pool->Cache());
  CXLKV_ASSIGN_OR_RETURN(o.ns, o.cache->Namespace(CliNamespace()));
  return o;
}

BlockKey CliKey(const Opened& o, const std::string& key) {
  return o.cache->KeyFromEngineHash(o.ns, {reinterpret_cast<const uint8_t*>(key.data()), key.size()});
}

// Over the TCP front of a cxlkvd (--tcp): the same key in the same namespace, the bytes in the
// frames (daemon/kv_front.h).
Result<std::vector<uint8_t>> CallKv(const CacheArgs& a, uint32_t op, std::span<const uint8_t> block = {}) {
  CXLKV_ASSIGN_OR_RETURN(auto client, rpc::TcpClient::Connect(a.tcp, std::chrono::seconds(5), a.tls));
  return client->Call(static_cast<uint8_t>(rpc::FrameService::kKv), op,
                      rpc::EncodeKvRequest(CliNamespace().model_id, {a.key}, block));
}

// Exactly one way to the pool.
Status CheckWay(const CacheArgs& a) {
  if (a.path.empty() == a.tcp.empty()) {
    return InvalidArgument("give the pool's --path (a host that maps it) or a cxlkvd's --tcp HOST:PORT, not both");
  }
  return Status::Ok();
}

Status Put(const CacheArgs& a) {
  CXLKV_RETURN_IF_ERROR(CheckWay(a));
  std::ifstream in(a.data, std::ios::binary);
  if (!in) return NotFound("cannot open data file '" + a.data + "'");
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.empty()) return InvalidArgument("data file '" + a.data + "' is empty: a block needs at least one byte");
  if (!a.tcp.empty()) {
    auto r = CallKv(a, rpc::kKvPut, {reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()});
    if (r.status().code() == StatusCode::kAlreadyExists) {
      return AlreadyExists("key '" + a.key + "' is already cached; evict it first to replace it");
    }
    CXLKV_RETURN_IF_ERROR(r.status());
    std::printf("put '%s': %zu bytes through %s\n", a.key.c_str(), bytes.size(), a.tcp.c_str());
    return Status::Ok();
  }
  CXLKV_ASSIGN_OR_RETURN(auto o, OpenCache(a));
  Status s = o.cache->Put(o.ns, CliKey(o, a.key), bytes.data(), bytes.size());
  if (s.code() == StatusCode::kAlreadyExists) {
    return AlreadyExists("key '" + a.key + "' is already cached; evict it first to replace it");
  }
  CXLKV_RETURN_IF_ERROR(s);
  std::printf("put '%s': %zu bytes as node %u\n", a.key.c_str(), bytes.size(), o.pool->impl().node->id());
  return Status::Ok();
}

// The block of `a.key`, through the pool or a daemon's TCP front.
Result<std::vector<uint8_t>> ReadBlock(const CacheArgs& a) {
  if (!a.tcp.empty()) {
    auto r = CallKv(a, rpc::kKvGet);
    if (r.status().code() == StatusCode::kNotFound) return NotFound("key '" + a.key + "' is not cached");
    return r;
  }
  CXLKV_ASSIGN_OR_RETURN(auto o, OpenCache(a));
  BlockKey key = CliKey(o, a.key);
  CXLKV_ASSIGN_OR_RETURN(auto hit, o.cache->Lookup(o.ns, {&key, 1}));
  if (hit.hit_blocks == 0) return NotFound("key '" + a.key + "' is not cached");
  const BlockPin pin = hit.pins[0];
  std::vector<uint8_t> bytes(pin.bytes);
  Status s = o.cache->Read(pin, 0, bytes.data(), pin.bytes);
  o.cache->Release(hit.pins);
  CXLKV_RETURN_IF_ERROR(s);
  return bytes;
}

Status Get(const CacheArgs& a, CommandResult& result) {
  CXLKV_RETURN_IF_ERROR(CheckWay(a));
  auto block = ReadBlock(a);
  if (block.status().code() == StatusCode::kNotFound) result.failure_exit_code = 2;
  CXLKV_RETURN_IF_ERROR(block.status());
  const std::vector<uint8_t>& bytes = *block;
  if (a.out == "-") {
    std::fwrite(bytes.data(), 1, bytes.size(), stdout);
    return Status::Ok();
  }
  std::ofstream out(a.out, std::ios::binary | std::ios::trunc);
  if (!out || !out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()))) {
    return IoError("cannot write '" + a.out + "'");
  }
  return Status::Ok();
}

Status Evict(const CacheArgs& a) {
  CXLKV_RETURN_IF_ERROR(CheckWay(a));
  if (!a.tcp.empty()) {
    if (a.all) return InvalidArgument("evict --all needs --path (a host that maps the pool)");
    CXLKV_ASSIGN_OR_RETURN(auto r, CallKv(a, rpc::kKvEvict));
    uint64_t n = 0;
    if (r.size() != sizeof n) return Corrupted("malformed evict answer from " + a.tcp);
    std::memcpy(&n, r.data(), sizeof n);
    if (n == 0) return NotFound("key '" + a.key + "' is not cached, or is pinned or in flight");
    std::printf("evicted '%s'\n", a.key.c_str());
    return Status::Ok();
  }
  CXLKV_ASSIGN_OR_RETURN(auto o, OpenCache(a));
  if (a.all) {
    CXLKV_ASSIGN_OR_RETURN(auto n, o.cache->EvictAll());
    std::printf("evicted %llu blocks (pinned blocks stay)\n", static_cast<unsigned long long>(n));
    return Status::Ok();
  }
  BlockKey key = CliKey(o, a.key);
  CXLKV_ASSIGN_OR_RETURN(auto n, o.cache->Evict(o.ns, {&key, 1}));
  if (n == 0) return NotFound("key '" + a.key + "' is not cached, or is pinned or in flight");
  std::printf("evicted '%s'\n", a.key.c_str());
  return Status::Ok();
}

}  // namespace

void AddCacheCommands(CLI::App& app, CommandResult& result) {
  auto put_args = std::make_shared<CacheArgs>();
  CLI::App* put = app.add_subcommand("put", "Store a file's bytes in the KV cache under a string key");
  put->add_option("--path", put_args->path, "Region path(s) of the pool, comma-separated");
  put->add_option("--tcp", put_args->tcp, "Instead of --path: HOST:PORT of a cxlkvd's TCP front (hosts outside the CXL domain)");
  put->add_option("--node", put_args->node, "Node id to join as (default: a free one)");
  put->add_option("--key", put_args->key, "Key string (one block in the 'cli' namespace)")->required();
  put->add_option("--data", put_args->data, "File whose bytes are the block")->required();
  AddTlsOptions(put, &put_args->tls);
  put->callback([put_args, &result] { result.status = Put(*put_args); });

  auto get_args = std::make_shared<CacheArgs>();
  CLI::App* get = app.add_subcommand("get", "Read a cached block into a file; exit 2 when absent");
  get->add_option("--path", get_args->path, "Region path(s) of the pool, comma-separated");
  get->add_option("--tcp", get_args->tcp, "Instead of --path: HOST:PORT of a cxlkvd's TCP front (hosts outside the CXL domain)");
  get->add_option("--node", get_args->node, "Node id to join as (default: a free one)");
  get->add_option("--key", get_args->key, "Key string")->required();
  get->add_option("--out", get_args->out, "Output file ('-': stdout)")->required();
  AddTlsOptions(get, &get_args->tls);
  get->callback([get_args, &result] { result.status = Get(*get_args, result); });

  auto evict_args = std::make_shared<CacheArgs>();
  CLI::App* evict = app.add_subcommand("evict", "Evict one key or every unpinned block");
  evict->add_option("--path", evict_args->path, "Region path(s) of the pool, comma-separated");
  evict->add_option("--tcp", evict_args->tcp, "Instead of --path: HOST:PORT of a cxlkvd's TCP front (hosts outside the CXL domain)");
  evict->add_option("--node", evict_args->node, "Node id to join as (default: a free one)");
  auto* key = evict->add_option("--key", evict_args->key, "Key string");
  auto* all = evict->add_flag("--all", evict_args->all, "Every unpinned READY block, of every namespace");
  key->excludes(all);
  AddTlsOptions(evict, &evict_args->tls);
  evict->callback([evict_args, &result] {
    if (!evict_args->all && evict_args->key.empty()) {
      result.status = InvalidArgument("evict needs --key STRING or --all");
      return;
    }
    result.status = Evict(*evict_args);
  });
}

}  // namespace cxlkv::cli
