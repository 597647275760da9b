// A blocking client of the TCP front (tcp_front.h): one connection, one request at a time.
// For tools and tests on hosts outside the CXL domain (`cxlkv ping --tcp HOST:PORT`).
//
// Thread-safety: one thread at a time.
#ifndef CXLKV_SRC_RPC_TCP_CLIENT_H_
#define CXLKV_SRC_RPC_TCP_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cxlkv/status.h"
#include "rpc/frame.h"
#include "rpc/tls.h"

namespace cxlkv::rpc {

class TcpClient {
 public:
  // Errors: kInvalidArgument (address, TLS files), kIoError (cannot connect), kPermissionDenied
  // (the TLS handshake failed: the server's certificate did not verify or name `address`).
  // With `tls` enabled the session is mutual TLS (tls.h); a server that refuses this client's
  // certificate says so at the first Call (kPermissionDenied).
  static Result<std::unique_ptr<TcpClient>> Connect(const std::string& address,
                                                    std::chrono::milliseconds timeout = std::chrono::seconds(5),
                                                    const TlsOptions& tls = {});
  ~TcpClient();
  TcpClient(const TcpClient&) = delete;
  TcpClient& operator=(const TcpClient&) = delete;

  // Sends one request and returns its answer's payload, or the answer's error (its code and
  // message). kIoError when the connection breaks, kTimeout past the timeout, kCorrupted on a
  // malformed answer.
  Result<std::vector<uint8_t>> Call(uint8_t service, uint32_t opcode, std::span<const uint8_t> payload);

 private:
  TcpClient(int fd, std::chrono::milliseconds timeout) : fd_(fd), timeout_(timeout), decoder_(64u << 20) {}
  Status Send(const std::vector<uint8_t>& bytes);
  Result<size_t> Receive(uint8_t* buf, size_t n);
  Status TlsFailure() const;
  int fd_;
  std::string address_;
  std::unique_ptr<TlsSession> tls_;
  bool answered_ = false;  // an answer came back on this connection (so TLS let us in)
  std::chrono::milliseconds timeout_;
  FrameDecoder decoder_;
  uint64_t next_id_ = 1;
};

}  // namespace cxlkv::rpc

#endif  // CXLKV_SRC_RPC_TCP_CLIENT_H_
