#include "serve/channel.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>

namespace cxlkv::serve {

Channel::~Channel() {
  if (fd_ >= 0) ::close(fd_);
}

Status Channel::Send(const nlohmann::json& message) {
  const std::string line = message.dump() + "\n";
  size_t done = 0;
  while (done < line.size()) {
    // MSG_NOSIGNAL: a peer killed with -9 must give this side an error, not a SIGPIPE.
    ssize_t n = ::send(fd_, line.data() + done, line.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return IoError(std::string("channel write: ") + std::strerror(errno) + " (the peer is gone)");
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Result<std::optional<nlohmann::json>> Channel::Receive(int timeout_ms) {
  for (;;) {
    if (size_t nl = buffer_.find('\n'); nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded()) return InvalidArgument("channel: a message that is not JSON: " + line.substr(0, 80));
      return std::optional<nlohmann::json>(std::move(j));
    }
    pollfd p{fd_, POLLIN, 0};
    int r = ::poll(&p, 1, timeout_ms);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return IoError(std::string("channel poll: ") + std::strerror(errno));
    if (r == 0) return std::optional<nlohmann::json>();
    char chunk[65536];
    ssize_t n = ::read(fd_, chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return IoError("channel: the peer closed the connection (exited or was killed)");
    buffer_.append(chunk, static_cast<size_t>(n));
  }
}

int64_t NowNs() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

}  // namespace cxlkv::serve
