#include "serve/tcp_handoff.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>

#include <nlohmann/json.hpp>

namespace cxlkv::serve {

namespace {

constexpr uint64_t kMaxPayloadBytes = 16ull << 30;  // one request's KV; anything larger is not a header of ours

bool WriteAll(int fd, const void* data, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (bytes > 0) {
    ssize_t n = ::send(fd, p, bytes, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

bool ReadAll(int fd, void* data, size_t bytes) {
  auto* p = static_cast<uint8_t*>(data);
  while (bytes > 0) {
    ssize_t n = ::recv(fd, p, bytes, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

bool ReadLine(int fd, std::string& line) {
  line.clear();
  char c;
  for (;;) {
    if (!ReadAll(fd, &c, 1)) return false;
    if (c == '\n') return true;
    line.push_back(c);
    if (line.size() > 4096) return false;
  }
}

}  // namespace

Result<std::unique_ptr<TcpHandoffServer>> TcpHandoffServer::Start() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return IoError(std::string("tcp handoff: socket: ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 16) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::string err = std::strerror(errno);
    ::close(fd);
    return IoError("tcp handoff: cannot listen on loopback: " + err);
  }
  return std::unique_ptr<TcpHandoffServer>(new TcpHandoffServer(fd, ntohs(addr.sin_port)));
}

TcpHandoffServer::TcpHandoffServer(int listen_fd, uint16_t port) : listen_fd_(listen_fd), port_(port) {
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

TcpHandoffServer::~TcpHandoffServer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    for (int fd : conns_) ::shutdown(fd, SHUT_RDWR);
  }
  ::shutdown(listen_fd_, SHUT_RDWR);
  acceptor_.join();
  for (auto& t : readers_) t.join();
  for (int fd : conns_) ::close(fd);
  ::close(listen_fd_);
}

void TcpHandoffServer::AcceptLoop() {
  for (;;) {
    // Poll with a timeout so a shutdown is seen even where shutdown() does not wake accept().
    pollfd p{listen_fd_, POLLIN, 0};
    int r = ::poll(&p, 1, 200);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
    }
    if (r <= 0) continue;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    std::lock_guard<std::mutex> lock(mu_);
    conns_.push_back(fd);
    readers_.emplace_back([this, fd] { ReadLoop(fd); });
  }
}

void TcpHandoffServer::ReadLoop(int fd) {
  std::string header;
  while (ReadLine(fd, header)) {
    // A header that is not ours ends the connection (the sender sees the error); it never
    // takes the decode worker down.
    auto j = nlohmann::json::parse(header, nullptr, false);
    if (j.is_discarded() || !j.contains("id") || !j.contains("bytes") || !j["id"].is_number_unsigned() ||
        !j["bytes"].is_number_unsigned() || j["bytes"].get<uint64_t>() > kMaxPayloadBytes) {
      return;
    }
    std::vector<uint8_t> payload(j["bytes"].get<uint64_t>());
    if (!ReadAll(fd, payload.data(), payload.size())) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      arrived_[j["id"].get<uint64_t>()] = std::move(payload);
    }
    cv_.notify_all();
  }
}

Result<std::vector<uint8_t>> TcpHandoffServer::Take(uint64_t request_id, int timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return arrived_.count(request_id) > 0; })) {
    return Status(StatusCode::kTimeout, "tcp handoff: request " + std::to_string(request_id) + "'s KV did not arrive");
  }
  auto node = arrived_.extract(request_id);
  return std::move(node.mapped());
}

TcpHandoffClient::~TcpHandoffClient() {
  for (auto& [port, fd] : fds_) ::close(fd);
}

Status TcpHandoffClient::Send(uint16_t port, uint64_t request_id, const std::vector<uint8_t>& payload) {
  auto it = fds_.find(port);
  if (it == fds_.end()) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(port);
    if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      std::string err = std::strerror(errno);
      if (fd >= 0) ::close(fd);
      return IoError("tcp handoff: cannot connect to the decode worker on port " + std::to_string(port) + ": " + err);
    }
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    it = fds_.emplace(port, fd).first;
  }
  const std::string header = nlohmann::json{{"id", request_id}, {"bytes", payload.size()}}.dump() + "\n";
  if (!WriteAll(it->second, header.data(), header.size()) || !WriteAll(it->second, payload.data(), payload.size())) {
    ::close(it->second);
    fds_.erase(it);
    return IoError("tcp handoff: sending request " + std::to_string(request_id) + "'s KV failed");
  }
  return Status::Ok();
}

}  // namespace cxlkv::serve
