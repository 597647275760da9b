#include "daemon/daemon.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "daemon/admin.h"
#include "daemon/node_lock.h"
#include "daemon/node_status.h"
#include "pool/pool_internal.h"
#include "pool/status_doc.h"
#include "tier/pool_tiers.h"
#include "tier/tier_service.h"
#include "util/host_port.h"

namespace cxlkv::daemon {
namespace {

Result<size_t> Reply(const nlohmann::json& j, std::span<uint8_t> out) {
  const std::string s = j.dump();
  if (s.size() > out.size()) return NoSpace("admin answer of " + std::to_string(s.size()) + " bytes exceeds its slot");
  std::memcpy(out.data(), s.data(), s.size());
  return s.size();
}

std::map<uint32_t, rpc::Handler> AdminOps(Daemon& d) {
  std::map<uint32_t, rpc::Handler> ops;
  ops[kAdminPing] = {[&d](const rpc::Request&, std::span<uint8_t> out) -> Result<size_t> {
    const auto up = std::chrono::steady_clock::now() - d.started();
    return Reply({{"node", d.options().node_id},
                  {"pid", ::getpid()},
                  {"uptime_s", std::chrono::duration<double>(up).count()}},
                 out);
  }};
  ops[kAdminStat] = {[&d](const rpc::Request&, std::span<uint8_t> out) -> Result<size_t> {
    auto& impl = d.pool().impl();
    const auto statuses = NodeStatuses(impl.node->Nodes());
    auto stat = pool::Stat(impl.regions, statuses);
    nlohmann::json j;
    uint32_t live = 0, silent = 0;
    for (auto s : statuses) {
      live += s == cache::NodeStatus::kLive;
      silent += s == cache::NodeStatus::kSilent;
    }
    j["nodes"] = {{"live", live}, {"silent", silent}};
    j["lock_manager"] = stat["lock_manager"];
    j["allocated_bytes"] = stat["allocated_bytes"];
    if (!stat["cache"].is_null()) {
      j["cache"] = {{"used_bytes", stat["cache"]["used_bytes"]},
                    {"capacity_bytes", stat["cache"]["capacity_bytes"]},
                    {"totals", stat["cache"]["totals"]},
                    {"hit_rate", stat["cache"]["hit_rate"]}};
    }
    return Reply(j, out);
  }};
  return ops;
}

}  // namespace

Result<std::unique_ptr<Daemon>> Daemon::Start(const DaemonOptions& options) {
  if (options.paths.empty()) return InvalidArgument("cxlkvd needs the pool's region paths (--path)");
  if (options.lease_ms < 50) return InvalidArgument("a lease under 50 ms cannot be kept: use --lease-ms 50 or more");
  if (options.no_tiers && !options.tiers.empty()) return InvalidArgument("--no-tiers and --tier contradict each other");
  auto d = std::unique_ptr<Daemon>(new Daemon(options));
  std::vector<std::string> tiers = options.tiers;
  uint64_t tier_slot_bytes = options.tier_slot_bytes;
  {
    // Read the pool's identity (and validate it) before joining: the lock file is per pool and node.
    CXLKV_ASSIGN_OR_RETURN(auto regions, pool::AttachAll(options.paths));
    const RegionInfo& info = regions[0]->info();
    if (options.node_id >= info.max_nodes) {
      return InvalidArgument("node " + std::to_string(options.node_id) + " is outside this pool's " +
                             std::to_string(info.max_nodes) + " nodes");
    }
    CXLKV_RETURN_IF_ERROR(d->TakeNodeLock(info.pool_id));
    if (tiers.empty() && !options.no_tiers) {
      CXLKV_ASSIGN_OR_RETURN(auto defaults, tier::FindPoolTierConfig(pool::ReadStatusDocs(regions)));
      if (defaults) {
        tiers = tier::SpecsForNode(*defaults, options.node_id);
        if (tier_slot_bytes == 0) tier_slot_bytes = defaults->slot_bytes;
        d->tiers_from_pool_ = true;
      }
    }
  }
  PoolOpenOptions po;
  po.node_id = options.node_id;
  po.lease_ms = options.lease_ms;
  po.may_host_manager = options.may_host_manager;
  po.recovers = true;
  po.prefault = true;
  CXLKV_ASSIGN_OR_RETURN(d->pool_, Pool::Open(options.paths, po));
  if (!tiers.empty()) {
    tier::TierStoreOptions to;
    for (const std::string& text : tiers) {
      CXLKV_ASSIGN_OR_RETURN(tier::TierSpec spec, tier::ParseTierSpec(text));
      to.tiers.push_back(spec);
    }
    if (tier_slot_bytes != 0) to.slot_bytes = tier_slot_bytes;
    CXLKV_ASSIGN_OR_RETURN(d->tiers_, tier::TierStore::Open(*d->pool_, to));
    CXLKV_ASSIGN_OR_RETURN(d->tier_service_, tier::StartTierService(*d->pool_, *d->tiers_));
  }
  if (options.pnm_threads >= 0) {
    NearMemoryServiceOptions no;
    no.threads = static_cast<uint32_t>(options.pnm_threads);
    no.context_lease_ms = options.pnm_context_lease_ms;
    no.max_contexts = options.pnm_max_contexts;
    CXLKV_ASSIGN_OR_RETURN(d->pnm_, NearMemoryService::Start(*d->pool_, no));
  }
  if (options.serve_admin) {
    rpc::RpcServerOptions so;
    so.geometry = AdminGeometry();
    so.hot_window = std::chrono::microseconds(50);  // admin calls are rare: sleep soon,
    so.max_idle_sleep = std::chrono::milliseconds(5);  // and long (each wake-up costs ~25 us here)
    CXLKV_ASSIGN_OR_RETURN(d->admin_, rpc::RpcServer::Start(*d->pool_, kAdminService, AdminOps(*d), so));
  }
  if (options.tcp_address.empty() && options.tcp_tls.enabled()) {
    return InvalidArgument("--tls-cert, --tls-key and --tls-ca secure the TCP front: give --tcp IPV4:PORT too");
  }
  if (!options.tcp_address.empty()) {
    // The front forwards to whichever daemon serves the admin service (this one or another).
    CXLKV_RETURN_IF_ERROR(rpc::RpcArea::OpenOrCreate(*d->pool_, kAdminService, AdminGeometry()).status());
    CXLKV_ASSIGN_OR_RETURN(d->tcp_admin_client_, rpc::RpcClient::Open(*d->pool_, kAdminService));
    rpc::TcpFrontOptions to;
    to.address = options.tcp_address;
    to.tls = options.tcp_tls;
    if (options.tcp_max_frame < 4096) return InvalidArgument("--tcp-max-frame under 4 KiB cannot carry a block");
    to.max_payload = options.tcp_max_frame;
    // Room for two answers of the largest size before a peer that does not read is dropped.
    to.max_output_bytes = std::max<size_t>(to.max_output_bytes, 2 * size_t{options.tcp_max_frame} + (64 << 10));
    static_assert(static_cast<uint8_t>(rpc::FrameService::kAdmin) == 0 && static_cast<uint8_t>(rpc::FrameService::kKv) == 1);
    d->kv_front_ = std::make_unique<KvFront>(*d->pool_);
    std::vector<rpc::LocalService> local(rpc::kFrameServices);
    local[static_cast<uint8_t>(rpc::FrameService::kKv)] = [kv = d->kv_front_.get()](uint32_t op, std::span<const uint8_t> req) {
      return kv->Handle(op, req);
    };
    CXLKV_ASSIGN_OR_RETURN(d->tcp_, rpc::TcpFront::Start({d->tcp_admin_client_.get(), nullptr}, to, std::move(local)));
  }
  if (!options.metrics_address.empty()) CXLKV_RETURN_IF_ERROR(d->StartMetrics());
  return d;
}

Daemon::Daemon(const DaemonOptions& options) : options_(options) {}

Daemon::~Daemon() {
  if (http_) {
    http_->stop();
    if (http_thread_.joinable()) http_thread_.join();
  }
  tcp_.reset();  // before the kv front it calls
  kv_front_.reset();
  tcp_admin_client_.reset();
  admin_.reset();
  pnm_.reset();  // releases its contexts' pins while the pool is open
  tier_service_.reset();  // before the store it calls
  tiers_.reset();
  pool_.reset();
  if (lock_fd_ >= 0) {
    ::unlink(lock_path_.c_str());
    ::close(lock_fd_);  // releases the flock
  }
}

// One daemon per node and host: an exclusive flock on a file named after the pool and node.
// The kernel drops it when the holder dies, however it dies. The inode check closes the race
// with a holder that unlinks the file between our open and our flock.
Status Daemon::TakeNodeLock(const std::string& pool_id) {
  lock_path_ = NodeLockPath(options_.lock_dir, pool_id, options_.node_id);
  for (int attempt = 0; attempt < 5; ++attempt) {
    int fd = ::open(lock_path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return IoError("cannot open " + lock_path_ + ": " + std::strerror(errno));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      char pid[32] = {};
      ssize_t n = ::pread(fd, pid, sizeof pid - 1, 0);
      ::close(fd);
      if (err != EWOULDBLOCK) return IoError("cannot lock " + lock_path_ + ": " + std::strerror(err));
      std::string holder = n > 0 ? std::string(pid, static_cast<size_t>(n)) : std::string("unknown");
      while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
      return AlreadyExists("a cxlkvd already runs for node " + std::to_string(options_.node_id) + " of pool " +
                           pool_id + " on this host (pid " + holder + "): stop it first (kill -TERM " + holder +
                           "), or start this one for another node");
    }
    struct stat held{}, named{};
    if (::fstat(fd, &held) == 0 && ::stat(lock_path_.c_str(), &named) == 0 && held.st_ino == named.st_ino) {
      const std::string pid = std::to_string(::getpid()) + "\n";
      if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
        ::close(fd);
        return IoError("cannot write " + lock_path_ + ": " + std::strerror(errno));
      }
      lock_fd_ = fd;
      return Status::Ok();
    }
    ::close(fd);  // the file we locked was unlinked by its previous holder: take the new one
  }
  return IoError("could not take " + lock_path_ + " (it keeps being replaced)");
}

Status Daemon::StartMetrics() {
  const std::string& a = options_.metrics_address;
  CXLKV_ASSIGN_OR_RETURN(auto hp, util::ParseHostPort(a, "metrics address"));
  const std::string& host = hp.host;
  int port = hp.port;
  http_ = std::make_unique<httplib::Server>();
  http_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(RenderMetrics(), "text/plain; version=0.0.4; charset=utf-8");
  });
  if (port == 0) {
    port = http_->bind_to_any_port(host);
    if (port < 0) return IoError("cannot bind the metrics endpoint to " + host);
  } else if (!http_->bind_to_port(host, port)) {
    return IoError("cannot bind the metrics endpoint to " + a + " (in use, or not an address of this host)");
  }
  metrics_port_ = port;
  http_thread_ = std::thread([this] { http_->listen_after_bind(); });
  return Status::Ok();
}

}  // namespace cxlkv::daemon
