// Baseline (c)'s prefill→decode handoff: KV blocks staged in host memory and sent over a TCP
// connection, the network path of NIXL/UCX-style stacks (here on loopback: the best case of
// that path, with no NIC in the way).
//
// Wire format per request: one JSON line {"id": N, "bytes": B}, then B bytes.
// Thread-safety: TcpHandoffServer::Take from one thread; the server's threads do the rest.
#ifndef CXLKV_SRC_SERVE_TCP_HANDOFF_H_
#define CXLKV_SRC_SERVE_TCP_HANDOFF_H_

#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "cxlkv/status.h"

namespace cxlkv::serve {

// The decode side: listens on 127.0.0.1 (an ephemeral port) and collects payloads by request.
class TcpHandoffServer {
 public:
  static Result<std::unique_ptr<TcpHandoffServer>> Start();
  ~TcpHandoffServer();
  uint16_t port() const { return port_; }
  // The payload of `request_id`, waiting up to `timeout_ms` for it. Errors: kTimeout.
  Result<std::vector<uint8_t>> Take(uint64_t request_id, int timeout_ms);

 private:
  TcpHandoffServer(int listen_fd, uint16_t port);
  void AcceptLoop();
  void ReadLoop(int fd);

  int listen_fd_;
  uint16_t port_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, std::vector<uint8_t>> arrived_;
  std::vector<int> conns_;
  bool stop_ = false;
  std::thread acceptor_;
  std::vector<std::thread> readers_;
};

// The prefill side: one connection per decode worker, kept open.
class TcpHandoffClient {
 public:
  ~TcpHandoffClient();
  // Errors: kIoError (connect or send failed).
  Status Send(uint16_t port, uint64_t request_id, const std::vector<uint8_t>& payload);

 private:
  std::map<uint16_t, int> fds_;
};

}  // namespace cxlkv::serve

#endif  // CXLKV_SRC_SERVE_TCP_HANDOFF_H_
