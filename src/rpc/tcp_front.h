// The TCP front of the RPC services, for hosts outside the CXL domain (docs/rpc.md, "TCP
// front"): frames (frame.h) carry the same requests as the shared-memory RPC, payloads inside,
// and the front forwards each to the service over the shared-memory RPC, so whichever process
// of the pool serves it answers.
//
// One thread runs a poll(2) loop over the listener and every connection (Valkey's model: a
// small event loop, non-blocking sockets, pipelined requests answered in any order by id).
// Every connection's memory is bounded: its decoder holds at most one frame (header + the
// payload limit), it stops reading while a decoded frame waits for a free RPC slot, and a peer
// that does not read its answers is dropped once they exceed `max_output_bytes`. A malformed
// stream (bad magic, version, reserved flags, oversized length) gets an error frame and the
// connection is closed (after a lingering second in which what the peer still sends is read
// and dropped, so the close does not reset the connection before the error frame is read); a bad service or opcode gets an error frame and the connection goes on.
// Nothing a peer sends stops the loop from serving the others.
//
// With `tls` set, every connection first completes a mutual TLS handshake (tls.h) within
// `handshake_timeout`; a peer that does not (no certificate, one from another CA or past its
// dates, plain bytes, silence) is closed before one byte of a request is decoded, and counted
// as refused. Without TLS the front binds only loopback addresses: anyone who reaches the port
// could read, write and evict any block.
//
// Thread-safety: Start and the destructor from one thread; stats from any.
#ifndef CXLKV_SRC_RPC_TCP_FRONT_H_
#define CXLKV_SRC_RPC_TCP_FRONT_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <span>
#include <vector>

#include "cxlkv/status.h"
#include "rpc/client.h"
#include "rpc/tls.h"

namespace cxlkv::rpc {

struct TcpFrontOptions {
  std::string address;                             // "HOST:PORT"; port 0 picks one. Required.
  uint32_t max_payload = 64 << 10;                 // larger frames are refused. Default 64 KiB.
  uint32_t max_connections = 256;                  // more are accepted and closed at once. Default 256.
  size_t max_output_bytes = 4 << 20;               // unread answers beyond this drop the peer. Default 4 MiB.
  std::chrono::milliseconds call_timeout{5000};    // per forwarded request. Default 5 s.
  TlsOptions tls;                                  // mutual TLS; required on a non-loopback address
  std::chrono::milliseconds handshake_timeout{5000};  // a TLS peer's handshake. Default 5 s.
};

struct TcpFrontStats {
  uint64_t connections = 0;  // accepted, in total
  uint64_t frames = 0;       // requests answered (including with errors)
  uint64_t errors = 0;       // error frames sent
  uint64_t dropped = 0;      // connections closed for a malformed stream or unread output
  uint64_t refused = 0;      // connections closed before they authenticated (TLS)
};

// A service the front answers itself, on its loop thread, instead of forwarding: for requests
// whose work needs the caller's bytes in this process (the daemon's KV data operations). Returns
// the answer's payload, or the error to send.
using LocalService = std::function<Result<std::vector<uint8_t>>(uint32_t opcode, std::span<const uint8_t> request)>;

class TcpFront {
 public:
  // `services[s]` forwards frames whose service byte is s (null: no such service), unless
  // `local[s]` is set: then the front runs it. The clients must outlive the front.
  static Result<std::unique_ptr<TcpFront>> Start(std::vector<RpcClient*> services, const TcpFrontOptions& options,
                                                 std::vector<LocalService> local = {});
  ~TcpFront();  // stops the loop and closes every connection
  TcpFront(const TcpFront&) = delete;
  TcpFront& operator=(const TcpFront&) = delete;

  int port() const { return port_; }
  TcpFrontStats stats() const;
  // Why the last refused connection was refused ("" if none was), e.g. the TLS handshake's
  // error: what the operator reads when a client says it cannot get in.
  std::string last_refusal() const;

 private:
  struct Connection;
  struct Call;
  TcpFront(std::vector<RpcClient*> services, std::vector<LocalService> local, const TcpFrontOptions& options);
  void Loop();
  void Accept();
  bool ReadFrom(Connection& c);
  bool Discard(Connection& c);
  void SubmitQueued(Connection& c);
  void Reply(Connection& c, uint64_t id, uint8_t service, const Status& status, std::span<const uint8_t> payload);
  bool WriteTo(Connection& c);
  void Refuse(Connection& c, const std::string& why);
  void CollectAnswers(bool* any);

  std::vector<RpcClient*> services_;
  std::vector<LocalService> local_;
  TcpFrontOptions options_;
  int listener_ = -1;
  int wake_[2] = {-1, -1};
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::vector<std::unique_ptr<Connection>> connections_;  // loop thread only
  std::vector<Call> calls_;                                // loop thread only: forwarded, unanswered
  uint64_t next_connection_ = 1;
  std::shared_ptr<TlsContext> tls_;  // null: plain TCP (loopback only)
  std::atomic<uint64_t> accepted_{0}, frames_{0}, errors_{0}, dropped_{0}, refused_{0};
  mutable std::mutex refusal_mu_;
  std::string last_refusal_;  // guarded by refusal_mu_
};

}  // namespace cxlkv::rpc

#endif  // CXLKV_SRC_RPC_TCP_FRONT_H_
