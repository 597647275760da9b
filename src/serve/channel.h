// A message channel between the router and a worker process: newline-delimited JSON over a
// stream socket (a socketpair made before fork/exec). The control plane only: KV bytes never
// cross it (they go through the pool, or the TCP baseline's own connection).
//
// Thread-safety: one reader and one writer thread per channel.
#ifndef CXLKV_SRC_SERVE_CHANNEL_H_
#define CXLKV_SRC_SERVE_CHANNEL_H_

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "cxlkv/status.h"

namespace cxlkv::serve {

class Channel {
 public:
  explicit Channel(int fd) : fd_(fd) {}
  ~Channel();
  Channel(Channel&& o) noexcept : fd_(o.fd_), buffer_(std::move(o.buffer_)) { o.fd_ = -1; }
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  int fd() const { return fd_; }
  // Errors: kIoError (the peer is gone).
  Status Send(const nlohmann::json& message);
  // A whole message if one is buffered or arrives within `timeout_ms` (-1: wait), nullopt on
  // timeout. Errors: kIoError (the peer closed or died: EOF), kInvalidArgument (not JSON).
  Result<std::optional<nlohmann::json>> Receive(int timeout_ms);
  // Whether a whole message is already buffered (poll() on fd() cannot see those).
  bool HasBuffered() const { return buffer_.find('\n') != std::string::npos; }

 private:
  int fd_;
  std::string buffer_;
};

// Monotonic nanoseconds (CLOCK_MONOTONIC: the same clock in every process of the host).
int64_t NowNs();

}  // namespace cxlkv::serve

#endif  // CXLKV_SRC_SERVE_CHANNEL_H_
