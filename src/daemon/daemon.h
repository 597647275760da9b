// `cxlkvd`, the pool daemon: the always-on process of one node (DESIGN.md, "One daemon per
// node"; docs/daemon.md).
//
//   auto d = daemon::Daemon::Start({.paths = {"/dev/shm/pool"}, .node_id = 3,
//                                   .metrics_address = "127.0.0.1:9464"});
//   ... until SIGTERM ...
//   d->reset();   // answers what it holds, clears its server words, leaves the node
//
// What it owns: the node's membership (heartbeat, the lock manager when elected, recovery of
// dead nodes' lives, remote-free drains — all of them in the Pool it keeps open), the node's
// capacity tiers and their service (tier-<node>: spill, promote; docs/tiers.md), its near-memory
// attention engines when asked for (pnm-<node>: attention where the KV lives; docs/pnm.md), the pool's
// admin RPC service (served by one daemon at a time, the others standing by), and the
// Prometheus endpoint. One daemon per node and host: a second one for the same node is
// refused by name (a flock on /dev/shm/cxlkvd-<pool id>-node<N>.lock, released by the kernel
// if the daemon dies, so a restart after kill -9 needs no clean-up).
//
// Thread-safety: Start and the destructor from one thread; metrics from any.
#ifndef CXLKV_SRC_DAEMON_DAEMON_H_
#define CXLKV_SRC_DAEMON_DAEMON_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cxlkv/pool.h"
#include "cxlkv/status.h"
#include "daemon/kv_front.h"
#include "daemon/pnm_service.h"
#include "rpc/client.h"
#include "rpc/server.h"
#include "rpc/frame.h"
#include "rpc/tcp_front.h"
#include "tier/tier_store.h"

namespace httplib {
class Server;
}

namespace cxlkv::daemon {

struct DaemonOptions {
  std::vector<std::string> paths;     // the pool's regions, in order; required
  uint32_t node_id = 0;               // this host's node; required
  uint32_t lease_ms = 2000;           // liveness lease. Default 2 s.
  bool may_host_manager = true;       // default true
  bool serve_admin = true;            // serve (or stand by for) the pool's admin service. Default true.
  std::string metrics_address;        // "HOST:PORT" for GET /metrics; port 0 picks one; "" = off. Default off.
  std::string lock_dir = "/dev/shm";  // where the one-daemon-per-node lock file lives (node_lock.h). Default /dev/shm.
  std::string tcp_address;            // "IPV4:PORT" of the TCP front (hosts outside the CXL domain);
                                      // port 0 picks one; "" = off. Default off.
  uint32_t tcp_max_frame = 4u << 20;  // largest frame payload the TCP front takes: a block put or
                                      // got over TCP must fit. Default 4 MiB.
  rpc::TlsOptions tcp_tls;            // the TCP front's mutual TLS (rpc/tls.h); required unless it
                                      // binds a loopback address. Default off.
  // The node's capacity tiers behind the region (docs/tiers.md): "dram:SIZE[:numa=N]",
  // "ssd:PATH:SIZE". Empty: the pool's default tiers (`cxlkv init --tier`, tier/pool_tiers.h)
  // if it has some, else none (evicted blocks are dropped).
  std::vector<std::string> tiers;
  bool no_tiers = false;              // serve no tiers, whatever the pool's default
  uint64_t tier_slot_bytes = 0;       // per device slot, header included; 0: the pool's default,
                                      // else TierStoreOptions' default
  // Near-memory attention engines (pnm-<node>, docs/pnm.md): engine threads per memory node of
  // the pool's regions, besides each engine's lead (the serving thread on region 0's); -1 = off (the service's RPC area takes 8 MiB of a 16-node region). Default off.
  int pnm_threads = -1;
  uint32_t pnm_context_lease_ms = 10000;  // an idle context is closed after this. Default 10 s.
  uint32_t pnm_max_contexts = 1024;       // default 1024
};

class Daemon {
 public:
  // Errors: kInvalidArgument (options), kAlreadyExists (a daemon already runs for this node on
  // this host, or the node is live on another host), kIoError (the metrics address cannot be
  // bound), and those of Pool::Open.
  static Result<std::unique_ptr<Daemon>> Start(const DaemonOptions& options);
  // A graceful stop: metrics off, the admin service's batch in hand answered and its server
  // word cleared, the pool closed (reservations dropped, the node marked left when this is its
  // last process), the lock file released.
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  Pool& pool() { return *pool_; }
  const DaemonOptions& options() const { return options_; }
  // The port /metrics listens on (the chosen one when the address asked for port 0); 0 if off.
  int metrics_port() const { return metrics_port_; }
  // The port of the TCP front; 0 if off.
  int tcp_port() const { return tcp_ ? tcp_->port() : 0; }
  // The Prometheus text exposition of this node's and the pool's figures (docs/daemon.md).
  std::string RenderMetrics();
  const rpc::RpcServer* admin() const { return admin_.get(); }
  // The node's capacity tiers; null when none were given.
  tier::TierStore* tiers() const { return tiers_.get(); }
  // The near-memory attention engines; null when off.
  const NearMemoryService* pnm() const { return pnm_.get(); }
  // True when the tiers are the pool's default (`cxlkv init --tier`), not this daemon's --tier.
  bool tiers_from_pool() const { return tiers_from_pool_; }
  std::chrono::steady_clock::time_point started() const { return started_; }

 private:
  explicit Daemon(const DaemonOptions& options);
  Status TakeNodeLock(const std::string& pool_id);
  Status StartMetrics();

  DaemonOptions options_;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  int lock_fd_ = -1;
  std::string lock_path_;
  std::unique_ptr<Pool> pool_;
  std::unique_ptr<tier::TierStore> tiers_;           // spill thread, device workers
  bool tiers_from_pool_ = false;
  std::unique_ptr<rpc::RpcServer> tier_service_;     // tier-<node>: promote requests for tiers_
  std::unique_ptr<rpc::RpcServer> admin_;
  std::unique_ptr<NearMemoryService> pnm_;
  std::unique_ptr<rpc::RpcClient> tcp_admin_client_;  // the TCP front's way to the admin service
  std::unique_ptr<KvFront> kv_front_;  // the TCP front's `kv` service (runs on its loop thread)
  std::unique_ptr<rpc::TcpFront> tcp_;
  std::unique_ptr<httplib::Server> http_;
  std::thread http_thread_;
  int metrics_port_ = 0;
};

}  // namespace cxlkv::daemon

#endif  // CXLKV_SRC_DAEMON_DAEMON_H_
