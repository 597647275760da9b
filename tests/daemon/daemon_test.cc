// cxlkvd as an operator runs it: the real binary on a real pool. One daemon per node, /metrics
// checked by Prometheus's own promtool and moving with traffic, SIGTERM with requests in
// flight, kill -9 and restart while the admin service moves to another daemon.
#include "daemon_harness.h"

namespace cxlkv::testing {
namespace {

using namespace std::chrono_literals;

TEST(Cxlkvd, TcpFrontAnswersPipelinedFramesAndSurvivesMalformedOnes) {
  TempRegionPath path("cxlkvdtcp");
  MakePool(path.path());
  DaemonProcess d = DaemonProcess::Start(path.path(), 0, "--tcp 127.0.0.1:0");
  const int port = d.TcpPort();
  ASSERT_GT(port, 0) << d.first_line;
  {  // Ten pipelined requests in one write: ten answers, each id once.
    RawConn c(port);
    std::vector<uint8_t> burst;
    for (uint64_t id = 1; id <= 10; ++id) {
      auto f = Encode(0, daemon::kAdminPing, id);
      burst.insert(burst.end(), f.begin(), f.end());
    }
    c.Send(burst);
    std::set<uint64_t> ids;
    for (int i = 0; i < 10; ++i) {
      rpc::Frame f;
      ASSERT_TRUE(c.Read(&f));
      EXPECT_EQ(f.code, 0u) << std::string(f.payload.begin(), f.payload.end());
      EXPECT_EQ(nlohmann::json::parse(std::string(f.payload.begin(), f.payload.end()))["node"], 0);
      ids.insert(f.id);
    }
    EXPECT_EQ(ids.size(), 10u);
  }
  {  // A bad opcode, an unknown service, a payload larger than the service's slot: error
     // answers, and the connection goes on.
    RawConn c(port);
    rpc::Frame f;
    c.Send(Encode(0, 99, 7));
    ASSERT_TRUE(c.Read(&f));
    EXPECT_EQ(f.id, 7u);
    EXPECT_EQ(f.code, static_cast<uint32_t>(StatusCode::kInvalidArgument));
    c.Send(Encode(9, daemon::kAdminPing, 8));
    ASSERT_TRUE(c.Read(&f));
    EXPECT_EQ(f.code, static_cast<uint32_t>(StatusCode::kInvalidArgument));
    c.Send(Encode(0, daemon::kAdminPing, 9, std::vector<uint8_t>(10000, 1)));
    ASSERT_TRUE(c.Read(&f));
    EXPECT_EQ(f.code, static_cast<uint32_t>(StatusCode::kInvalidArgument));
    c.Send(Encode(0, daemon::kAdminPing, 10));
    ASSERT_TRUE(c.Read(&f));
    EXPECT_EQ(f.id, 10u);
    EXPECT_EQ(f.code, 0u);
  }
  // Malformed streams: an error answer, then the connection is closed.
  auto header = Encode(0, daemon::kAdminPing, 11);
  for (int kind = 0; kind < 4; ++kind) {
    SCOPED_TRACE("malformed kind " + std::to_string(kind));
    auto bad = header;
    if (kind == 0) bad[0] = 'G';                                 // not our magic
    if (kind == 1) bad[2] = 2;                                   // another version
    if (kind == 2) bad[20] = 1;                                  // reserved flags
    if (kind == 3) bad[19] = 0x40;                               // a 1 GiB payload announced
    RawConn c(port);
    c.Send(bad);
    rpc::Frame f;
    ASSERT_TRUE(c.Read(&f));
    EXPECT_NE(f.code, 0u);
    EXPECT_TRUE(c.Closed());
  }
  {  // A frame cut short by a peer that goes away: nothing to answer, nothing broken.
    RawConn c(port);
    c.Send(std::vector<uint8_t>(header.begin(), header.begin() + 10));
  }
  // Twenty clients at once, then the daemon still answers over both transports.
  std::vector<std::unique_ptr<RawConn>> many;
  for (int i = 0; i < 20; ++i) many.push_back(std::make_unique<RawConn>(port));
  for (int i = 0; i < 20; ++i) many[i]->Send(Encode(0, daemon::kAdminPing, 100 + i));
  for (int i = 0; i < 20; ++i) {
    rpc::Frame f;
    ASSERT_TRUE(many[i]->Read(&f));
    EXPECT_EQ(f.id, 100u + i);
    EXPECT_EQ(f.code, 0u);
  }
  auto client = rpc::TcpClient::Connect("127.0.0.1:" + std::to_string(port));
  ASSERT_TRUE(client.ok());
  auto stat = (*client)->Call(0, daemon::kAdminStat, {});
  ASSERT_TRUE(stat.ok()) << stat.status().ToString();
  EXPECT_EQ(Sh(Cli() + " ping --path " + path.path()).code, 0);
  ::kill(d.pid, SIGTERM);
  EXPECT_EQ(d.Wait(), 0);
}

TEST(Cxlkvd, ASecondDaemonForTheSameNodeIsRefusedByName) {
  TempRegionPath path("cxlkvd2");
  MakePool(path.path());
  daemon::DaemonOptions o;
  o.paths = {path.path()};
  o.node_id = 0;
  o.lease_ms = kTestLeaseMs;
  auto first = daemon::Daemon::Start(o);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto second = daemon::Daemon::Start(o);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kAlreadyExists);
  EXPECT_NE(second.status().message().find("already runs for node 0"), std::string::npos) << second.status().message();
  o.node_id = 1;
  auto other = daemon::Daemon::Start(o);
  EXPECT_TRUE(other.ok()) << other.status().ToString();
  o.metrics_address = "not-an-address";
  o.node_id = 2;
  auto bad = daemon::Daemon::Start(o);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
}

TEST(Cxlkvd, MetricsPassPromtoolAndMoveWithTraffic) {
  TempRegionPath path("cxlkvdmetrics");
  MakePool(path.path());
  DaemonProcess d = DaemonProcess::Start(path.path(), 0, "--metrics 127.0.0.1:0");
  const int port = d.MetricsPort();
  ASSERT_GT(port, 0) << d.first_line;
  const std::string before = Scrape(port);
  ASSERT_FALSE(before.empty());
  std::string report;
  EXPECT_EQ(PromtoolCheck(before, &report), 0) << "promtool (Debian package prometheus): " << report;
  EXPECT_EQ(SumOf(before, "cxlkv_node_live", "node=\"0\""), 1);
  auto codes = RunForked(1, [&](int) { return CacheTraffic(path.path(), 3, 20); });
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(Sh(Cli() + " ping --path " + path.path()).code, 0);
  const std::string after = Scrape(port);
  EXPECT_EQ(PromtoolCheck(after, &report), 0) << report;
  EXPECT_EQ(SumOf(after, "cxlkv_cache_inserts_total", "node=\"3\""), 20);
  EXPECT_EQ(SumOf(after, "cxlkv_cache_hit_blocks_total", "node=\"3\""), 20);
  EXPECT_EQ(SumOf(after, "cxlkv_cache_lookups_total", "node=\"3\""), 1);
  EXPECT_EQ(SumOf(after, "cxlkv_cache_entries", "state=\"ready\""), 20);
  EXPECT_GT(SumOf(after, "cxlkv_rpc_requests_total"), SumOf(before, "cxlkv_rpc_requests_total"));
  EXPECT_GT(SumOf(after, "cxlkv_rpc_service_seconds_count"), 0);
  ::kill(d.pid, SIGTERM);
  EXPECT_EQ(d.Wait(), 0);
}

TEST(Cxlkvd, SigtermWithRequestsInFlightLosesNothingAndLeavesTheNode) {
  TempRegionPath path("cxlkvdterm");
  MakePool(path.path());
  auto put = RunForked(1, [&](int) { return CacheTraffic(path.path(), 3, 10); });
  ASSERT_EQ(put[0], 0);
  DaemonProcess d = DaemonProcess::Start(path.path(), 0);
  ASSERT_NE(d.first_line.find("running"), std::string::npos) << d.first_line;
  // A client calling the admin service without pause; it stops at the first failure, which
  // must be a clean one.
  Child caller = Child::Fork([&](int, int out) {
    auto pool = OpenOrNull({path.path()}, 2);
    if (!pool) return 1;
    rpc::RpcClientOptions o;
    o.timeout = 10s;
    auto client = rpc::RpcClient::Open(*pool, daemon::kAdminService, o);
    if (!client.ok()) return 2;
    uint64_t answered = 0;
    for (;;) {
      auto r = (*client)->Call(daemon::kAdminPing, {});
      if (!r.ok()) {
        Put(out, answered);
        const auto code = r.status().code();
        return code == StatusCode::kUnavailable || code == StatusCode::kTimeout ? 0 : 3;
      }
      if (++answered == 50) Put(out, answered);
    }
  });
  uint64_t answered = 0;
  ASSERT_TRUE(caller.Receive(&answered));
  ::kill(d.pid, SIGTERM);
  EXPECT_EQ(d.Wait(), 0) << "cxlkvd did not stop cleanly within 20 s";
  ASSERT_TRUE(caller.Receive(&answered));
  EXPECT_GE(answered, 50u);
  EXPECT_EQ(caller.Wait(), 0) << "a call failed uncleanly or hung";
  Output stat = Sh(Cli() + " stat --path " + path.path() + " --json");
  ASSERT_EQ(stat.code, 0) << stat.out;
  auto j = nlohmann::json::parse(stat.out.substr(stat.out.find('{')));
  bool left = false;
  for (const auto& n : j["nodes"]) left |= n["id"] == 0 && n["state"] == "left";
  EXPECT_TRUE(left) << j["nodes"].dump();
  EXPECT_EQ(j["cache"]["states"]["ready"], 10) << "a published block was lost";
  Output check = Sh(Cli() + " check --path " + path.path());
  EXPECT_EQ(check.code, 0) << check.out;
}

TEST(Cxlkvd, KillNineThenRestartWhileTheAdminServiceMovesToAnotherDaemon) {
  TempRegionPath path("cxlkvdkill");
  MakePool(path.path());
  DaemonProcess a = DaemonProcess::Start(path.path(), 0);
  ASSERT_NE(a.first_line.find("running"), std::string::npos) << a.first_line;
  Output ping = Sh(Cli() + " ping --json --path " + path.path());
  ASSERT_EQ(ping.code, 0) << ping.out;
  EXPECT_EQ(nlohmann::json::parse(ping.out)["node"], 0);
  DaemonProcess b = DaemonProcess::Start(path.path(), 1);
  ASSERT_NE(b.first_line.find("running"), std::string::npos) << b.first_line;
  ::kill(a.pid, SIGKILL);
  EXPECT_EQ(a.Wait(), 128 + SIGKILL);
  ping = Sh(Cli() + " ping --json --timeout-ms 20000 --path " + path.path());
  ASSERT_EQ(ping.code, 0) << ping.out;
  EXPECT_EQ(nlohmann::json::parse(ping.out)["node"], 1) << "the standby daemon did not take the service over";
  // The killed daemon's node restarts: its lock file was released with it.
  DaemonProcess again = DaemonProcess::Start(path.path(), 0);
  EXPECT_NE(again.first_line.find("running"), std::string::npos) << again.first_line;
  ping = Sh(Cli() + " ping --json --path " + path.path());
  ASSERT_EQ(ping.code, 0) << ping.out;
  EXPECT_EQ(nlohmann::json::parse(ping.out)["node"], 1) << "a restarted daemon took the service back";
  ::kill(again.pid, SIGTERM);
  ::kill(b.pid, SIGTERM);
  EXPECT_EQ(again.Wait(), 0);
  EXPECT_EQ(b.Wait(), 0);
  Output check = Sh(Cli() + " check --path " + path.path());
  EXPECT_EQ(check.code, 0) << check.out;
}

// Central metadata with two daemons: the first serves the metadata service, the CLI's puts and
// gets go through it; it is killed -9, the other daemon takes the service over, what was put is
// still there with its bytes, new puts work, /metrics says who serves, `cxlkv check` is clean.
TEST(Cxlkvd, TheMetadataServiceMovesToAnotherDaemonWhenItsDaemonIsKilled) {
  TempRegionPath path("cxlkvdmeta");
  MakePool(path.path(), MetadataMode::kCentral);
  Output info = Sh(Cli() + " info --path " + path.path());
  EXPECT_NE(info.out.find("metadata        central"), std::string::npos) << info.out;
  DaemonProcess a = DaemonProcess::Start(path.path(), 0, "--metrics 127.0.0.1:0");
  ASSERT_NE(a.first_line.find("running"), std::string::npos) << a.first_line;
  DaemonProcess b = DaemonProcess::Start(path.path(), 1, "--metrics 127.0.0.1:0");
  ASSERT_NE(b.first_line.find("running"), std::string::npos) << b.first_line;
  // The daemon that serves "meta" (the first to take its lock) is the one to kill.
  DaemonProcess* serving = nullptr;
  DaemonProcess* standby = nullptr;
  for (int tries = 0; tries < 200 && serving == nullptr; ++tries) {
    if (SumOf(Scrape(a.MetricsPort()), "cxlkv_rpc_serving", "service=\"meta\"") == 1) serving = &a, standby = &b;
    if (SumOf(Scrape(b.MetricsPort()), "cxlkv_rpc_serving", "service=\"meta\"") == 1) serving = &b, standby = &a;
    if (serving == nullptr) std::this_thread::sleep_for(20ms);
  }
  ASSERT_NE(serving, nullptr) << "no daemon serves the metadata service";
  std::string report;
  const std::string metrics = Scrape(serving->MetricsPort());
  EXPECT_EQ(PromtoolCheck(metrics, &report), 0) << report;

  const std::string data = path.path() + "-data";
  {
    std::ofstream f(data, std::ios::binary);
    for (int i = 0; i < 5000; ++i) f.put(static_cast<char>(i * 7));
  }
  // A put whose outcome a takeover made unknown (a sanitizer-slowed server can lose its lease)
  // is run again; if the first one did land, the next says the block is already cached.
  Output put{-1, ""};
  for (int tries = 0; tries < 10 && put.code != 0 && put.out.find("already cached") == std::string::npos; ++tries) {
    put = Sh(Cli() + " put --path " + path.path() + " --key before --data " + data);
  }
  ASSERT_TRUE(put.code == 0 || put.out.find("already cached") != std::string::npos) << put.out;
  EXPECT_GT(SumOf(Scrape(serving->MetricsPort()), "cxlkv_rpc_requests_total", "service=\"meta\""), 0);

  ::kill(serving->pid, SIGKILL);
  EXPECT_EQ(serving->Wait(), 128 + SIGKILL);
  // The CLI's calls wait through the takeover (or fail kUnavailable, and it is run again).
  Output put2{-1, ""};
  for (int tries = 0; tries < 10 && put2.code != 0 && put2.out.find("already cached") == std::string::npos; ++tries) {
    put2 = Sh(Cli() + " put --path " + path.path() + " --key after --data " + data);
  }
  ASSERT_TRUE(put2.code == 0 || put2.out.find("already cached") != std::string::npos) << put2.out;
  EXPECT_EQ(SumOf(Scrape(standby->MetricsPort()), "cxlkv_rpc_serving", "service=\"meta\""), 1);
  for (const char* key : {"before", "after"}) {
    const std::string out = path.path() + "-out-" + key;
    Output get = Sh(Cli() + " get --path " + path.path() + " --key " + key + " --out " + out);
    EXPECT_EQ(get.code, 0) << get.out;
    EXPECT_EQ(Sh("cmp " + data + " " + out).code, 0) << key << ": bytes differ after the takeover";
    ::unlink(out.c_str());
  }
  ::unlink(data.c_str());
  ::kill(standby->pid, SIGTERM);
  EXPECT_EQ(standby->Wait(), 0);
  Output check = Sh(Cli() + " check --path " + path.path());
  EXPECT_EQ(check.code, 0) << check.out;
}

// A CLI command joins the node whose cxlkvd runs on this host as one more process of it: no
// node life of its own starts or ends. Without a daemon it takes a node of its own, as before.
TEST(Cxlkvd, CliCommandsJoinTheLocalDaemonsNodeAndWorkWithoutIt) {
  TempRegionPath path("cxlkvdcli");
  MakePool(path.path());
  const std::string data = path.path() + "-data";
  {
    std::ofstream f(data, std::ios::binary);
    for (int i = 0; i < 3000; ++i) f.put(static_cast<char>(i * 13));
  }
  // The nodes that ever joined: id -> state.
  auto nodes = [&] {
    // Watch a lease's worth of beats: under a sanitizer a beat can take longer than 50 ms, and
    // a node whose beat was not seen reads as silent.
    Output stat = Sh(Cli() + " stat --watch-ms " + std::to_string(kTestLeaseMs) + " --json --path " + path.path());
    std::map<int, std::string> out;
    if (stat.code != 0) return out;
    auto j = nlohmann::json::parse(stat.out.substr(stat.out.find('{')));
    for (const auto& n : j["nodes"]) out[n["id"].get<int>()] = n["state"].get<std::string>();
    return out;
  };
  {
    DaemonProcess d = DaemonProcess::Start(path.path(), 2);
    ASSERT_NE(d.first_line.find("running"), std::string::npos) << d.first_line;
    Output put = Sh(Cli() + " put --path " + path.path() + " --key with-daemon --data " + data);
    ASSERT_EQ(put.code, 0) << put.out;
    const std::string out = path.path() + "-out";
    Output get = Sh(Cli() + " get --path " + path.path() + " --key with-daemon --out " + out);
    ASSERT_EQ(get.code, 0) << get.out;
    EXPECT_EQ(Sh("cmp " + data + " " + out).code, 0) << "bytes differ";
    ::unlink(out.c_str());
    EXPECT_EQ(Sh(Cli() + " ping --path " + path.path()).code, 0);
    const std::map<int, std::string> joined = nodes();
    EXPECT_EQ(joined, (std::map<int, std::string>{{2, "live"}})) << "a CLI command started a node life of its own";
    ::kill(d.pid, SIGTERM);
    ASSERT_EQ(d.Wait(), 0);
  }
  // No daemon (its lock file went with it): a node of the CLI's own.
  Output put = Sh(Cli() + " put --path " + path.path() + " --key without-daemon --data " + data);
  ASSERT_EQ(put.code, 0) << put.out;
  const std::map<int, std::string> joined = nodes();
  EXPECT_EQ(joined.size(), 2u);
  EXPECT_EQ(joined.count(2), 1u);
  for (const auto& [id, state] : joined) EXPECT_EQ(state, "left") << "node " << id;
  ::unlink(data.c_str());
  Output check = Sh(Cli() + " check --path " + path.path());
  EXPECT_EQ(check.code, 0) << check.out;
}

}  // namespace
}  // namespace cxlkv::testing
