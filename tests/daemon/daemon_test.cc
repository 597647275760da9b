// cxlkvd as an operator runs it: the real binary on a real pool. One daemon per node, /metrics
// checked by Prometheus's own promtool and moving with traffic, SIGTERM with requests in
// flight, kill -9 and restart while the admin service moves to another daemon.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <regex>
#include <string>
#include <thread>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "../pool/pool_test_util.h"
#include "child.h"
#include "cxlkv/cache.h"
#include "daemon/admin.h"
#include "daemon/daemon.h"
#include "rpc/client.h"

namespace cxlkv::testing {
namespace {

using namespace std::chrono_literals;

std::string Cli() {
  const char* cli = std::getenv("CXLKV_CLI");
  return cli ? cli : "";
}
// cxlkvd is built next to the CLI: build/<preset>/tools/{cxlkv/cxlkv,cxlkvd/cxlkvd}.
std::string DaemonBinary() {
  std::string cli = Cli();
  auto slash = cli.rfind('/');
  auto up = cli.rfind('/', slash - 1);
  return cli.substr(0, up) + "/cxlkvd/cxlkvd";
}

struct Output {
  int code;
  std::string out;
};
Output Sh(const std::string& cmd) {
  Output r{-1, ""};
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// A cxlkvd process with its stdout on a pipe.
struct DaemonProcess {
  pid_t pid = -1;
  FILE* out = nullptr;
  std::string first_line;

  static DaemonProcess Start(const std::string& path, uint32_t node, const std::string& extra = "") {
    DaemonProcess d;
    int fds[2];
    if (::pipe(fds) != 0) return d;
    d.pid = ::fork();
    if (d.pid == 0) {
      ::dup2(fds[1], 1);
      ::close(fds[0]);
      ::close(fds[1]);
      std::string cmd = DaemonBinary() + " --path " + path + " --node " + std::to_string(node) + " --lease-ms " +
                        std::to_string(kTestLeaseMs) + " " + extra;
      ::execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), nullptr);
      ::_exit(127);
    }
    ::close(fds[1]);
    d.out = ::fdopen(fds[0], "r");
    char line[512];
    if (std::fgets(line, sizeof line, d.out)) d.first_line = line;
    return d;
  }
  int MetricsPort() const {
    std::smatch m;
    static const std::regex re("127\\.0\\.0\\.1:([0-9]+)/metrics");
    return std::regex_search(first_line, m, re) ? std::stoi(m[1]) : -1;
  }
  // Waits for the exit (up to `limit`); the exit code, 128 + signal, or -1 on a hang.
  int Wait(std::chrono::seconds limit = 20s) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    int status = 0;
    while (::waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        return -1;
      }
      std::this_thread::sleep_for(10ms);
    }
    if (out) std::fclose(out);
    out = nullptr;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
};

void MakePool(const std::string& path) {
  PoolCreateOptions o;
  o.size = 128 << 20;
  o.max_nodes = 8;
  o.overwrite = true;
  ASSERT_TRUE(Pool::Create({path}, o).ok());
}

std::string Scrape(int port) {
  httplib::Client c("127.0.0.1", port);
  auto res = c.Get("/metrics");
  return res && res->status == 200 ? res->body : "";
}

// The sum of a metric's samples whose labels contain `labels` ("" = all of them).
double SumOf(const std::string& text, const std::string& name, const std::string& labels = "") {
  double sum = 0;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(name, 0) != 0 || line.size() <= name.size()) continue;
    char next = line[name.size()];
    if (next != '{' && next != ' ') continue;
    if (!labels.empty() && line.find(labels) == std::string::npos) continue;
    sum += std::stod(line.substr(line.rfind(' ') + 1));
  }
  return sum;
}

int PromtoolCheck(const std::string& text, std::string* report) {
  char tmpl[] = "/tmp/cxlkv-metrics-XXXXXX";
  int fd = ::mkstemp(tmpl);
  if (fd < 0) return -1;
  (void)!::write(fd, text.data(), text.size());
  ::close(fd);
  Output r = Sh(std::string("promtool check metrics < ") + tmpl);
  ::unlink(tmpl);
  *report = r.out;
  return r.code;
}

// Cache traffic from another node: `blocks` inserted, then looked up (all hits).
int CacheTraffic(const std::string& path, uint32_t node, int blocks) {
  auto pool = OpenOrNull({path}, node);
  CHILD_CHECK(pool != nullptr, "open");
  auto cache = pool->Cache();
  CHILD_CHECK(cache.ok(), "cache");
  KeyNamespace kns;
  kns.model_id = "metrics-test";
  kns.layout.block_size = 1;
  auto ns = (*cache)->Namespace(kns);
  CHILD_CHECK(ns.ok(), "ns: %s", ns.status().ToString().c_str());
  std::vector<int32_t> tokens(blocks);
  for (int i = 0; i < blocks; ++i) tokens[i] = 1000 + i;
  auto keys = KvCache::ChainKeys(*ns, tokens);
  std::vector<uint8_t> data(4096, 7);
  for (const auto& k : keys) {
    auto r = (*cache)->Reserve(*ns, k, data.size());
    CHILD_CHECK(r.ok(), "reserve: %s", r.status().ToString().c_str());
    CHILD_CHECK((*cache)->Write(*r, 0, data.data(), data.size()).ok(), "write");
    CHILD_CHECK((*cache)->Commit(*r).ok(), "commit");
  }
  auto hit = (*cache)->Lookup(*ns, keys);
  CHILD_CHECK(hit.ok() && hit->hit_blocks == static_cast<size_t>(blocks), "lookup");
  (*cache)->Release(hit->pins);
  return 0;  // closing the pool publishes this node's counters
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

}  // namespace
}  // namespace cxlkv::testing
