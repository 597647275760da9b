// A one-member etcd (Debian's etcd-server) on free loopback ports in a temporary directory, for
// the rack tests. Start it before the test starts threads (it forks). Stopping sends SIGTERM,
// then SIGKILL after a grace period: a member that lost its quorum ignores SIGTERM.
#ifndef CXLKV_TESTS_RACK_ETCD_SERVER_H_
#define CXLKV_TESTS_RACK_ETCD_SERVER_H_

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include "rack/etcd_client.h"

namespace cxlkv::testing {

class EtcdServer {
 public:
  // Starts etcd and waits until it answers. On failure returns null and says why in *error.
  static std::unique_ptr<EtcdServer> Start(std::string* error) {
    if (std::system("command -v etcd >/dev/null 2>&1") != 0) {
      *error = "etcd is not installed: run scripts/setup (Debian's etcd-server)";
      return nullptr;
    }
    for (int attempt = 0; attempt < 3; ++attempt) {
      std::unique_ptr<EtcdServer> s(new EtcdServer());
      if (s->Launch(error)) return s;
    }
    return nullptr;
  }

  ~EtcdServer() {
    Stop();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  const std::string& url() const { return url_; }
  pid_t pid() const { return pid_; }

  // A loopback TCP port free now (0 if none): for etcd's ports, and ucx_perftest's in bench racks.
  static int FreePort() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    int port = 0;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
      port = ntohs(a.sin_port);
    }
    ::close(fd);
    return port;
  }

  void Stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    for (int i = 0; i < 300; ++i) {
      if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  std::string LogTail() const {
    std::ifstream in(dir_ + "/etcd.log");
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string all = ss.str();
    return all.size() > 2000 ? all.substr(all.size() - 2000) : all;
  }

 private:
  EtcdServer() {
    char tmpl[] = "/tmp/cxlkv-etcd-XXXXXX";
    const char* d = ::mkdtemp(tmpl);
    dir_ = d != nullptr ? d : "/tmp";
  }


  bool Launch(std::string* error) {
    const std::string client = "http://127.0.0.1:" + std::to_string(FreePort());
    const std::string peer = "http://127.0.0.1:" + std::to_string(FreePort());
    url_ = client;
    const std::string log = dir_ + "/etcd.log";
    pid_ = ::fork();
    if (pid_ == 0) {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
      }
      ::setpgid(0, 0);
      const std::string data = "--data-dir=" + dir_ + "/data";
      const std::string lc = "--listen-client-urls=" + client, ac = "--advertise-client-urls=" + client;
      const std::string lp = "--listen-peer-urls=" + peer, ap = "--initial-advertise-peer-urls=" + peer;
      const std::string ic = "--initial-cluster=n1=" + peer;
      ::execlp("etcd", "etcd", "--name=n1", data.c_str(), lc.c_str(), ac.c_str(), lp.c_str(), ap.c_str(), ic.c_str(),
               "--logger=zap", "--log-outputs=stderr", "--log-level=warn", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    // Ready when a range answers; an etcd that exited (a port taken meanwhile) is retried.
    auto probe = rack::EtcdClient::Create({{client}, std::chrono::milliseconds(500)});
    for (int i = 0; i < 300; ++i) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        *error = "etcd exited at start: " + LogTail();
        return false;
      }
      if (probe.ok() && (*probe)->Get("/probe").ok()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    *error = "etcd did not answer within 15 s: " + LogTail();
    Stop();
    return false;
  }

  std::string dir_;
  std::string url_;
  pid_t pid_ = -1;
};

}  // namespace cxlkv::testing

#endif  // CXLKV_TESTS_RACK_ETCD_SERVER_H_
