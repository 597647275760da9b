// cxlkvd: the pool daemon of one node (docs/daemon.md). Runs until SIGTERM or SIGINT, then
// stops gracefully: requests in hand answered, nothing published lost, the node marked left.
//
//   cxlkvd --path /dev/shm/pool --node 0 [--lease-ms 2000] [--metrics 127.0.0.1:9464]
//          [--tcp 0.0.0.0:7412] [--no-admin] [--no-manager] [--lock-dir /dev/shm]
//          [--tier dram:8G --tier ssd:/data/kv.tier:64G] [--tier-slot 2M]
//          [--pnm-threads N [--pnm-lease-ms 10000] [--pnm-max-contexts 1024]]
#include <signal.h>

#include <cstdio>
#include <sstream>

#include <CLI/CLI.hpp>

#include "daemon/daemon.h"
#include "util/units.h"

namespace {

std::vector<std::string> SplitPaths(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string p; std::getline(in, p, ',');) {
    if (!p.empty()) out.push_back(p);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cxlkvd: the cxlkv pool daemon of one node (heartbeat, lock manager, recovery, RPC, metrics)"};
  std::string paths;
  cxlkv::daemon::DaemonOptions o;
  bool no_admin = false, no_manager = false;
  app.add_option("--path", paths, "the pool's region paths, comma-separated, in 'cxlkv init' order")->required();
  app.add_option("--node", o.node_id, "this host's node id")->required();
  app.add_option("--lease-ms", o.lease_ms, "liveness lease in ms (default 2000)");
  app.add_option("--metrics", o.metrics_address, "serve Prometheus /metrics on HOST:PORT (port 0: any); off by default");
  app.add_option("--tcp", o.tcp_address, "serve the RPC services and the KV cache's blocks over TCP on IPV4:PORT (port 0: any), for hosts outside the CXL domain; off by default");
  app.add_option("--tcp-max-frame", o.tcp_max_frame, "largest frame payload (a block put or got over TCP) in bytes")->capture_default_str();
  app.add_option("--tls-cert", o.tcp_tls.cert_file, "the TCP front's certificate (PEM); with --tls-key and --tls-ca, every TCP client must present a certificate from that CA (mutual TLS); required for --tcp on a non-loopback address");
  app.add_option("--tls-key", o.tcp_tls.key_file, "the private key of --tls-cert (PEM)");
  app.add_option("--tls-ca", o.tcp_tls.ca_file, "the CA (PEM) that TCP clients' certificates must chain to");
  app.add_flag("--no-admin", no_admin, "do not serve or stand by for the pool's admin RPC service");
  app.add_flag("--no-manager", no_manager, "never host the lock manager on this node");
  app.add_option("--lock-dir", o.lock_dir, "where the one-daemon-per-node lock file lives (default /dev/shm)");
  app.add_option("--tier", o.tiers,
                 "a capacity tier of this node behind the region, repeatable: dram:SIZE[:numa=N] or ssd:PATH:SIZE[:catalog=DIR] "
                 "(e.g. --tier dram:8G --tier ssd:/data/kv.tier:64G; a device such as /dev/nvme0n1 or, for NVMe passthrough, "
                 "/dev/ng0n1 needs catalog=DIR, a directory for its restart catalog); evicted blocks spill there. Default: the "
                 "pool's tiers (cxlkv init --tier), if any");
  app.add_flag("--no-tiers", o.no_tiers, "serve no capacity tiers, whatever the pool's default");
  std::string tier_slot;
  app.add_option("--tier-slot", tier_slot, "the largest tier slot, header included: the largest block a tier holds "
                                           "is this less 64; each block takes a slot of its own size (default 2M+4K)");
  app.add_option("--pnm-threads", o.pnm_threads,
                 "serve near-memory attention (pnm-<node>) with an engine per NUMA node of the pool's regions, bound "
                 "to it: N threads each besides its lead (the serving thread on the first region's node); off by "
                 "default (-1)");
  app.add_option("--pnm-lease-ms", o.pnm_context_lease_ms, "close a near-memory context idle this long (default 10000)");
  app.add_option("--pnm-max-contexts", o.pnm_max_contexts, "near-memory contexts open at once (default 1024)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "cxlkvd: error: %s (see cxlkvd --help)\n", e.what());
    return 2;
  }
  o.paths = SplitPaths(paths);
  if (!tier_slot.empty()) {
    auto bytes = cxlkv::util::ParseByteSize(tier_slot);
    if (!bytes.ok()) {
      std::fprintf(stderr, "cxlkvd: error: --tier-slot: %s\n", bytes.status().ToString().c_str());
      return 2;
    }
    o.tier_slot_bytes = *bytes;
  }
  o.serve_admin = !no_admin;
  o.may_host_manager = !no_manager;
  // Block the stop signals in every thread (threads inherit the mask); main waits for them.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  auto d = cxlkv::daemon::Daemon::Start(o);
  if (!d.ok()) {
    std::fprintf(stderr, "cxlkvd: error: %s\n", d.status().ToString().c_str());
    return 1;
  }
  std::printf("cxlkvd: node %u of %s: running (pid %d)", o.node_id, paths.c_str(), static_cast<int>(::getpid()));
  if ((*d)->metrics_port() > 0) {
    std::printf("; metrics on http://%s:%d/metrics",
                o.metrics_address.substr(0, o.metrics_address.rfind(':')).c_str(), (*d)->metrics_port());
  }
  if ((*d)->tcp_port() > 0) {
    std::printf("; tcp on %s:%d%s", o.tcp_address.substr(0, o.tcp_address.rfind(':')).c_str(), (*d)->tcp_port(),
                o.tcp_tls.enabled() ? " (mutual TLS)" : "");
  }
  std::printf("\n");
  if (const cxlkv::tier::TierStore* tiers = (*d)->tiers(); tiers != nullptr) {
    // Each device's I/O path and every fallback it took, for the log (and `cxlkv stat`).
    for (const auto& dev : tiers->devices()) {
      std::printf("cxlkvd: node %u: tier %s%s\n", o.node_id, dev->Describe().c_str(),
                  (*d)->tiers_from_pool() ? " (the pool's default: cxlkv init --tier)" : "");
    }
  }
  if (const cxlkv::daemon::NearMemoryService* pnm = (*d)->pnm(); pnm != nullptr) {
    const auto st = pnm->stats();
    // One line per engine (one per memory node of the pool's regions), where it runs.
    for (size_t i = 0; i < st.engines.size(); ++i) {
      const auto& e = st.engines[i];
      std::printf("cxlkvd: node %u: near-memory attention (pnm-%u): engine %zu of %zu: %u worker(s) and %s, for %u "
                  "region(s), %s\n",
                  o.node_id, o.node_id, i + 1, st.engines.size(), e.threads - 1, i == 0 ? "the serving thread" : "its lead",
                  e.regions, e.numa_node >= 0 ? ("on NUMA node " + std::to_string(e.numa_node)).c_str() : e.note.c_str());
    }
  }
  std::fflush(stdout);
  int sig = 0;
  sigwait(&stop, &sig);
  std::printf("cxlkvd: node %u: %s, stopping\n", o.node_id, strsignal(sig));
  std::fflush(stdout);
  d->reset();
  std::printf("cxlkvd: node %u: stopped\n", o.node_id);
  return 0;
}
