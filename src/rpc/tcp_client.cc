#include "rpc/tcp_client.h"

#include "util/host_port.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace cxlkv::rpc {

Result<std::unique_ptr<TcpClient>> TcpClient::Connect(const std::string& address, std::chrono::milliseconds timeout) {
  CXLKV_ASSIGN_OR_RETURN(auto hp, util::ParseHostPort(address, "daemon address"));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (hp.port == 0 || ::inet_pton(AF_INET, hp.host.c_str(), &addr.sin_addr) != 1) {
    return InvalidArgument("daemon address '" + address + "' is not IPV4:PORT with a port above 0");
  }
  addr.sin_port = htons(static_cast<uint16_t>(hp.port));
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return IoError(std::string("socket: ") + std::strerror(errno));
  timeval tv{static_cast<time_t>(timeout.count() / 1000), static_cast<suseconds_t>((timeout.count() % 1000) * 1000)};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    const int err = errno;
    ::close(fd);
    return IoError("cannot connect to " + address + ": " + std::strerror(err) + " (is cxlkvd running with --tcp?)");
  }
  return std::unique_ptr<TcpClient>(new TcpClient(fd, timeout));
}

TcpClient::~TcpClient() { ::close(fd_); }

Result<std::vector<uint8_t>> TcpClient::Call(uint8_t service, uint32_t opcode, std::span<const uint8_t> payload) {
  Frame req;
  req.service = service;
  req.code = opcode;
  req.id = next_id_++;
  req.payload.assign(payload.begin(), payload.end());
  std::vector<uint8_t> bytes;
  EncodeFrame(req, bytes);
  for (size_t sent = 0; sent < bytes.size();) {
    ssize_t n = ::send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return IoError(std::string("send: ") + std::strerror(errno));
    sent += static_cast<size_t>(n);
  }
  uint8_t buf[16 << 10];
  for (;;) {
    ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    if (n == 0) return IoError("the daemon closed the connection");
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return Timeout("no answer within " + std::to_string(timeout_.count()) + " ms");
      return IoError(std::string("recv: ") + std::strerror(errno));
    }
    std::span<const uint8_t> in(buf, static_cast<size_t>(n));
    while (!in.empty()) {
      Frame f;
      const auto r = decoder_.Next(in, &f);
      if (r == FrameDecoder::Result::kNeedMore) break;
      if (r == FrameDecoder::Result::kError) return Corrupted("malformed answer: " + decoder_.error().message());
      if (f.id != req.id) continue;  // an answer to an earlier, abandoned call
      if (f.code > static_cast<uint32_t>(StatusCode::kUnavailable)) {
        return Corrupted("answer with unknown status " + std::to_string(f.code));
      }
      if (f.code != 0) return Status(static_cast<StatusCode>(f.code), std::string(f.payload.begin(), f.payload.end()));
      return std::move(f.payload);
    }
  }
}

}  // namespace cxlkv::rpc
