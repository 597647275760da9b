// `cxlkv racks`: the racks of a fleet as etcd's membership shows them (src/rack): each rack's
// life, link address, capacity, namespaces, what is left of its lease, and its share of the home
// ring (rack/home_ring.h) the live racks make.
#include <cstdio>
#include <memory>

#include "commands.h"
#include "rack/home_ring.h"
#include "rack/membership.h"

namespace cxlkv::cli {
namespace {

struct RacksArgs {
  std::string etcd;
  std::string cluster = "default";
  bool json = false;
  int timeout_ms = 2000;
};

Status ListRacks(const RacksArgs& a) {
  rack::MembershipOptions o;
  o.etcd.endpoints = SplitPaths(a.etcd);
  o.etcd.request_timeout = std::chrono::milliseconds(a.timeout_ms);
  o.cluster = a.cluster;
  CXLKV_ASSIGN_OR_RETURN(std::unique_ptr<rack::RackMembership> view, rack::RackMembership::Observe(o));
  CXLKV_ASSIGN_OR_RETURN(std::unique_ptr<rack::EtcdClient> etcd, rack::EtcdClient::Create(o.etcd));
  nlohmann::json out = nlohmann::json::array();
  const std::vector<rack::RackMember> members = view->Members();
  std::vector<std::string> names;
  for (const rack::RackMember& m : members) names.push_back(m.rack);
  const rack::HomeRing ring = rack::HomeRing::Build(names);
  for (const rack::RackMember& m : members) {
    auto ttl = etcd->LeaseTimeToLive(m.lease);
    out.push_back({{"rack", m.rack},
                   {"life", m.life},
                   {"link_address", m.link_address},
                   {"capacity_bytes", m.capacity_bytes},
                   {"namespaces", m.namespaces},
                   {"lease", m.lease},
                   {"lease_ttl_s", ttl.ok() ? *ttl : -1},
                   {"ring_share", ring.Share(m.rack)}});
  }
  if (a.json) {
    std::printf("%s\n", nlohmann::json{{"cluster", a.cluster}, {"racks", out}}.dump(2).c_str());
    return Status::Ok();
  }
  std::printf("cluster %s: %zu rack(s)\n", a.cluster.c_str(), out.size());
  for (const auto& r : out) {
    std::printf("  %-16s life %-4lld link %-22s capacity %8.1f GiB  lease %llx (%lld s left)  ring %5.1f%%  namespaces %s\n",
                r["rack"].get<std::string>().c_str(), static_cast<long long>(r["life"].get<int64_t>()),
                r["link_address"].get<std::string>().c_str(), r["capacity_bytes"].get<double>() / (1 << 30),
                static_cast<unsigned long long>(r["lease"].get<int64_t>()),
                static_cast<long long>(r["lease_ttl_s"].get<int64_t>()), 100 * r["ring_share"].get<double>(),
                r["namespaces"].dump().c_str());
  }
  if (view->malformed_values() != 0) {
    std::printf("  (%llu member value(s) under /cxlkv/%s/racks/ did not parse and are not shown)\n",
                static_cast<unsigned long long>(view->malformed_values()), a.cluster.c_str());
  }
  return Status::Ok();
}

}  // namespace

void AddRacksCommands(CLI::App& app, CommandResult& result) {
  auto args = std::make_shared<RacksArgs>();
  auto* cmd = app.add_subcommand("racks", "List the racks registered in etcd: life, link address, capacity, lease");
  cmd->add_option("--etcd", args->etcd, "etcd endpoints, comma-separated (http://HOST:PORT,...)")->required();
  cmd->add_option("--cluster", args->cluster, "The fleet's cluster name (default: default)");
  cmd->add_flag("--json", args->json, "Print JSON");
  cmd->add_option("--timeout-ms", args->timeout_ms, "Bound of each etcd request (default 2000)");
  cmd->callback([args, &result] { result.status = ListRacks(*args); });
}

}  // namespace cxlkv::cli
