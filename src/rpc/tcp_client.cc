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

Result<std::unique_ptr<TcpClient>> TcpClient::Connect(const std::string& address, std::chrono::milliseconds timeout,
                                                      const TlsOptions& tls) {
  std::shared_ptr<TlsContext> context;
  if (tls.enabled()) {
    CXLKV_ASSIGN_OR_RETURN(context, TlsContext::Create(TlsContext::Role::kClient, tls));
  }
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
  auto client = std::unique_ptr<TcpClient>(new TcpClient(fd, timeout));
  client->address_ = address;
  if (context) {
    CXLKV_ASSIGN_OR_RETURN(client->tls_, TlsSession::Connect(std::move(context), fd, hp.host));
    const auto io = client->tls_->Handshake();
    if (io == TlsSession::Io::kWouldBlock) return Timeout("no TLS handshake with " + address + " within " + std::to_string(timeout.count()) + " ms");
    if (io != TlsSession::Io::kDone) {
      const Status& e = client->tls_->error();
      const bool verified = e.message().find("certificate") == std::string::npos;
      return Status(e.code(), e.message() + " (with " + address + (verified ? "; does it serve TLS?)" : ")"));
    }
  }
  return client;
}

TcpClient::~TcpClient() {
  if (tls_) tls_->Shutdown();
  tls_.reset();
  ::close(fd_);
}

Status TcpClient::Send(const std::vector<uint8_t>& bytes) {
  for (size_t sent = 0; sent < bytes.size();) {
    if (tls_) {
      size_t put = 0;
      const auto io = tls_->Write(bytes.data() + sent, bytes.size() - sent, &put);
      if (io == TlsSession::Io::kWouldBlock) return Timeout("cannot send within " + std::to_string(timeout_.count()) + " ms");
      if (io != TlsSession::Io::kDone) return TlsFailure();
      sent += put;
      continue;
    }
    ssize_t n = ::send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return IoError(std::string("send: ") + std::strerror(errno));
    sent += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status TcpClient::TlsFailure() const {
  // Under TLS 1.3 a server refuses a client's certificate after the client's side of the
  // handshake is done: the refusal arrives as an alert, or a reset, at the first read or write.
  if (!answered_) {
    return PermissionDenied("the daemon at " + address_ + " refused this client's TLS session: " + tls_->error().message() +
                            " (is --tls-cert signed by the daemon's --tls-ca, and within its dates?)");
  }
  return tls_->error();
}

// Some bytes of the stream; 0 when the daemon closed it.
Result<size_t> TcpClient::Receive(uint8_t* buf, size_t n) {
  const auto timeout = [&] { return Timeout("no answer within " + std::to_string(timeout_.count()) + " ms"); };
  if (tls_) {
    size_t got = 0;
    switch (tls_->Read(buf, n, &got)) {
      case TlsSession::Io::kDone: return got;
      case TlsSession::Io::kClosed: return size_t{0};
      case TlsSession::Io::kWouldBlock: return timeout();
      case TlsSession::Io::kError: break;
    }
    return TlsFailure();
  }
  ssize_t r = ::recv(fd_, buf, n, 0);
  if (r < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) return timeout();
    return IoError(std::string("recv: ") + std::strerror(errno) +
                   (answered_ ? "" : " (does the daemon require TLS? give --tls-cert, --tls-key and --tls-ca)"));
  }
  return static_cast<size_t>(r);
}

Result<std::vector<uint8_t>> TcpClient::Call(uint8_t service, uint32_t opcode, std::span<const uint8_t> payload) {
  Frame req;
  req.service = service;
  req.code = opcode;
  req.id = next_id_++;
  req.payload.assign(payload.begin(), payload.end());
  std::vector<uint8_t> bytes;
  EncodeFrame(req, bytes);
  CXLKV_RETURN_IF_ERROR(Send(bytes));
  uint8_t buf[16 << 10];
  for (;;) {
    CXLKV_ASSIGN_OR_RETURN(const size_t n, Receive(buf, sizeof buf));
    if (n == 0) {
      return IoError(answered_ || tls_ ? "the daemon closed the connection"
                                       : "the daemon closed the connection (does it require TLS? give --tls-cert, --tls-key and --tls-ca)");
    }
    std::span<const uint8_t> in(buf, n);
    while (!in.empty()) {
      Frame f;
      const auto r = decoder_.Next(in, &f);
      if (r == FrameDecoder::Result::kNeedMore) break;
      if (r == FrameDecoder::Result::kError) return Corrupted("malformed answer: " + decoder_.error().message());
      answered_ = true;
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
