// What the cxlkvd tests share: the binaries, a shell, a pool, /metrics scraping, raw TCP frames,
// and a cxlkvd child process (daemon_test.cc, kv_tcp_test.cc).
#ifndef CXLKV_TESTS_DAEMON_DAEMON_HARNESS_H_
#define CXLKV_TESTS_DAEMON_DAEMON_HARNESS_H_

#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cstdio>
#include <fstream>
#include <map>
#include <regex>
#include <set>
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
#include "rpc/frame.h"
#include "rpc/tcp_client.h"

namespace cxlkv::testing {

using namespace std::chrono_literals;

inline std::string Cli() {
  const char* cli = std::getenv("CXLKV_CLI");
  return cli ? cli : "";
}
// cxlkvd is built next to the CLI: build/<preset>/tools/{cxlkv/cxlkv,cxlkvd/cxlkvd}.
inline std::string DaemonBinary() {
  std::string cli = Cli();
  auto slash = cli.rfind('/');
  auto up = cli.rfind('/', slash - 1);
  return cli.substr(0, up) + "/cxlkvd/cxlkvd";
}

struct Output {
  int code;
  std::string out;
};
inline Output Sh(const std::string& cmd) {
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

// A cxlkvd process with its stdout on a pipe. One still running when the test ends (a failed
// assertion) is killed, or ctest would wait on its inherited output forever.
struct DaemonProcess {
  pid_t pid = -1;
  FILE* out = nullptr;
  std::string first_line;

  DaemonProcess() = default;
  DaemonProcess(DaemonProcess&& o) noexcept : pid(o.pid), out(o.out), first_line(std::move(o.first_line)) {
    o.pid = -1;
    o.out = nullptr;
  }
  DaemonProcess& operator=(DaemonProcess&&) = delete;
  ~DaemonProcess() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    if (out) std::fclose(out);
  }

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
  int TcpPort() const {
    std::smatch m;
    static const std::regex re("tcp on [0-9.]+:([0-9]+)");
    return std::regex_search(first_line, m, re) ? std::stoi(m[1]) : -1;
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
    pid = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
};

inline void MakePool(const std::string& path, MetadataMode metadata = MetadataMode::kDecentralized) {
  PoolCreateOptions o;
  o.size = 128 << 20;
  o.max_nodes = 8;
  o.overwrite = true;
  o.metadata = metadata;
  ASSERT_TRUE(Pool::Create({path}, o).ok());
}

inline std::string Scrape(int port) {
  httplib::Client c("127.0.0.1", port);
  auto res = c.Get("/metrics");
  return res && res->status == 200 ? res->body : "";
}

// The sum of a metric's samples whose labels contain `labels` ("" = all of them).
inline double SumOf(const std::string& text, const std::string& name, const std::string& labels = "") {
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

inline int PromtoolCheck(const std::string& text, std::string* report) {
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
inline int CacheTraffic(const std::string& path, uint32_t node, int blocks) {
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

// A raw TCP connection to the front: bytes out, frames (or the end of the stream) back.
struct RawConn {
  int fd = -1;
  rpc::FrameDecoder decoder{1u << 20};
  explicit RawConn(int port) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    timeval tv{10, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ~RawConn() {
    if (fd >= 0) ::close(fd);
  }
  void Send(const std::vector<uint8_t>& b) { ASSERT_EQ(::send(fd, b.data(), b.size(), MSG_NOSIGNAL), static_cast<ssize_t>(b.size())); }
  // The next frame; false at the end of the stream (the daemon closed it) or a timeout.
  bool Read(rpc::Frame* f) {
    for (;;) {
      if (!pending.empty()) {
        std::span<const uint8_t> in(pending);
        auto r = decoder.Next(in, f);
        pending.erase(pending.begin(), pending.end() - static_cast<std::ptrdiff_t>(in.size()));
        if (r == rpc::FrameDecoder::Result::kFrame) return true;
        if (r == rpc::FrameDecoder::Result::kError) return false;
      }
      uint8_t buf[4096];
      ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) return false;
      pending.insert(pending.end(), buf, buf + n);
    }
  }
  bool Closed() {
    uint8_t b;
    return ::recv(fd, &b, 1, 0) == 0;
  }
  std::vector<uint8_t> pending;
};

inline std::vector<uint8_t> Encode(uint8_t service, uint32_t code, uint64_t id, std::vector<uint8_t> payload = {}) {
  std::vector<uint8_t> out;
  rpc::EncodeFrame({service, code, id, std::move(payload)}, out);
  return out;
}

}  // namespace cxlkv::testing

#endif  // CXLKV_TESTS_DAEMON_DAEMON_HARNESS_H_
