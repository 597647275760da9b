// cxlkv ping: asks the pool's admin service — served by one cxlkvd of the pool, over the
// shared-memory RPC — who serves it and, with --stat, for its summary of the pool.
#include <cstdio>

#include "commands.h"
#include "daemon/admin.h"
#include "rpc/client.h"
#include "rpc/tcp_client.h"

namespace cxlkv::cli {
namespace {

struct PingArgs {
  std::string path;
  std::string tcp;
  rpc::TlsOptions tls;
  int node = -1;
  bool stat = false;
  bool json = false;
  uint32_t timeout_ms = 5000;
};

using Clock = std::chrono::steady_clock;

double MicrosSince(Clock::time_point t0) { return std::chrono::duration<double, std::micro>(Clock::now() - t0).count(); }

Result<std::vector<uint8_t>> AskOverTcp(const PingArgs& a, double* us) {
  CXLKV_ASSIGN_OR_RETURN(auto c, rpc::TcpClient::Connect(a.tcp, std::chrono::milliseconds(a.timeout_ms), a.tls));
  const auto t0 = Clock::now();
  auto r = c->Call(static_cast<uint8_t>(rpc::FrameService::kAdmin), a.stat ? daemon::kAdminStat : daemon::kAdminPing, {});
  *us = MicrosSince(t0);
  return r;
}

Result<std::vector<uint8_t>> AskOverSharedMemory(const PingArgs& a, double* us) {
  CXLKV_ASSIGN_OR_RETURN(auto pool, OpenAsNode(a.path, a.node));
  rpc::RpcClientOptions o;
  o.timeout = std::chrono::milliseconds(a.timeout_ms);
  auto client = rpc::RpcClient::Open(*pool, daemon::kAdminService, o);
  if (!client.ok()) {
    if (client.status().code() == StatusCode::kNotFound) {
      return NotFound("no cxlkvd has served this pool yet: start one (cxlkvd --path " + a.path + " --node N)");
    }
    return client.status();
  }
  const auto t0 = Clock::now();
  auto r = (*client)->Call(a.stat ? daemon::kAdminStat : daemon::kAdminPing, {});
  *us = MicrosSince(t0);
  return r;
}

Status Ping(const PingArgs& a) {
  if (a.path.empty() == a.tcp.empty()) return InvalidArgument("give either --path (shared memory) or --tcp HOST:PORT");
  double us = 0;
  CXLKV_ASSIGN_OR_RETURN(auto reply, a.tcp.empty() ? AskOverSharedMemory(a, &us) : AskOverTcp(a, &us));
  auto j = nlohmann::json::parse(std::string(reply.begin(), reply.end()), nullptr, false);
  if (j.is_discarded()) return Corrupted("the admin service answered something that is not JSON");
  if (a.json) {
    j["round_trip_us"] = us;
    std::printf("%s\n", j.dump(2).c_str());
  } else if (a.stat) {
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("admin service: cxlkvd of node %s (pid %s), up %.1f s; round trip %.1f us\n", j["node"].dump().c_str(),
                j["pid"].dump().c_str(), j["uptime_s"].get<double>(), us);
  }
  return Status::Ok();
}

}  // namespace

void AddTlsOptions(CLI::App* command, rpc::TlsOptions* tls) {
  command->add_option("--tls-cert", tls->cert_file, "With --tcp: this client's certificate (PEM), signed by the daemon's CA")
      ->envname("CXLKV_TLS_CERT");
  command->add_option("--tls-key", tls->key_file, "With --tcp: the certificate's private key (PEM)")->envname("CXLKV_TLS_KEY");
  command->add_option("--tls-ca", tls->ca_file, "With --tcp: the CA the daemon's certificate must chain to (PEM)")
      ->envname("CXLKV_TLS_CA");
}

void AddDaemonCommands(CLI::App& app, CommandResult& result) {
  auto args = std::make_shared<PingArgs>();
  auto* ping = app.add_subcommand("ping", "Ask the pool's admin service (a cxlkvd) who serves it, over the shared-memory RPC");
  ping->add_option("--path", args->path, "Pool region path(s), comma-separated: ask over the shared-memory RPC");
  ping->add_option("--tcp", args->tcp, "IPV4:PORT of a cxlkvd's TCP front: ask over TCP instead (no pool mapping needed)");
  ping->add_option("--node", args->node, "Node id to join as (default: a free one)");
  ping->add_flag("--stat", args->stat, "Ask for the daemon's summary of the pool instead");
  ping->add_flag("--json", args->json, "Print the answer as JSON");
  ping->add_option("--timeout-ms", args->timeout_ms, "Give up after this long (default 5000)");
  AddTlsOptions(ping, &args->tls);
  ping->callback([args, &result] { result.status = Ping(*args); });
}

}  // namespace cxlkv::cli
