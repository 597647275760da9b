#include "rpc/tcp_front.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>

#include "rpc/frame.h"
#include "util/host_port.h"

namespace cxlkv::rpc {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kReadChunk = 16 << 10;
constexpr std::chrono::milliseconds kLinger{1000};  // how long a refused peer may go on sending

enum class Got { kData, kWouldBlock, kEof, kError };

}  // namespace

struct TcpFront::Connection {
  uint64_t id = 0;
  int fd = -1;
  FrameDecoder decoder;
  std::deque<Frame> queued;  // decoded, waiting for a free RPC slot: no more reads meanwhile
  std::vector<uint8_t> out;  // encoded answers not yet sent
  size_t out_sent = 0;
  size_t inflight = 0;       // forwarded requests not yet answered
  bool eof = false;          // the peer closed its side: answer what is in flight, then close
  bool closing = false;      // close once `out` is sent (after an error frame)
  bool dead = false;         // close now
  // After an error frame: our side shut, the peer's bytes read and dropped for a while before
  // the close, so the close does not reset the connection (and lose the error frame) while the
  // peer is still sending the frame we refused.
  bool lingering = false;
  Clock::time_point linger_until;
  size_t discarded = 0;
  std::unique_ptr<TlsSession> tls;  // null on a plain front
  Clock::time_point handshake_deadline;

  // One read of at most `n` bytes, through TLS where it is on.
  Got Receive(uint8_t* buf, size_t n, size_t* got, Status* error) {
    if (!tls) {
      ssize_t r = ::recv(fd, buf, n, MSG_DONTWAIT);
      if (r == 0) return Got::kEof;
      if (r < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? Got::kWouldBlock : Got::kError;
      *got = static_cast<size_t>(r);
      return Got::kData;
    }
    switch (tls->Read(buf, n, got)) {
      case TlsSession::Io::kDone: return Got::kData;
      case TlsSession::Io::kWouldBlock: return Got::kWouldBlock;
      case TlsSession::Io::kClosed: return Got::kEof;
      case TlsSession::Io::kError: break;
    }
    *error = tls->error();
    return Got::kError;
  }
  bool authenticated() const { return !tls || tls->authenticated(); }

  Connection(uint64_t i, int f, uint32_t max_payload) : id(i), fd(f), decoder(max_payload) {}
};

struct TcpFront::Call {
  uint64_t connection;
  uint64_t frame_id;
  uint8_t service;
  RpcClient::Ticket ticket;
  Clock::time_point deadline;
};

Result<std::unique_ptr<TcpFront>> TcpFront::Start(std::vector<RpcClient*> services, const TcpFrontOptions& options,
                                                  std::vector<LocalService> local) {
  const std::string& a = options.address;
  CXLKV_ASSIGN_OR_RETURN(auto hp, util::ParseHostPort(a, "TCP address"));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(hp.port));
  if (::inet_pton(AF_INET, hp.host.c_str(), &addr.sin_addr) != 1) {
    return InvalidArgument("TCP host in '" + a + "' is not an IPv4 address");
  }
  std::shared_ptr<TlsContext> tls;
  if (options.tls.enabled()) {
    CXLKV_ASSIGN_OR_RETURN(tls, TlsContext::Create(TlsContext::Role::kServer, options.tls));
  } else if ((ntohl(addr.sin_addr.s_addr) >> 24) != 127) {
    return InvalidArgument("a TCP front on " + a + " would let anyone who reaches it read, write and evict any block: "
                           "give --tls-cert, --tls-key and --tls-ca (docs/rpc.md, \"TLS\"), or bind 127.0.0.1");
  }
  auto front = std::unique_ptr<TcpFront>(new TcpFront(std::move(services), std::move(local), options));
  front->tls_ = std::move(tls);
  front->listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (front->listener_ < 0) return IoError(std::string("socket: ") + std::strerror(errno));
  int one = 1;
  ::setsockopt(front->listener_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  socklen_t len = sizeof addr;
  if (::bind(front->listener_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(front->listener_, 64) != 0 ||
      ::getsockname(front->listener_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return IoError("cannot listen on " + a + ": " + std::strerror(errno));
  }
  front->port_ = ntohs(addr.sin_port);
  if (::pipe2(front->wake_, O_NONBLOCK | O_CLOEXEC) != 0) return IoError(std::string("pipe: ") + std::strerror(errno));
  front->thread_ = std::thread([f = front.get()] { f->Loop(); });
  return front;
}

TcpFront::TcpFront(std::vector<RpcClient*> services, std::vector<LocalService> local, const TcpFrontOptions& options)
    : services_(std::move(services)), local_(std::move(local)), options_(options) {}

TcpFront::~TcpFront() {
  stop_.store(true);
  if (wake_[1] >= 0) (void)!::write(wake_[1], "x", 1);
  if (thread_.joinable()) thread_.join();
  for (auto& c : connections_) ::close(c->fd);
  for (const Call& call : calls_) {
    if (call.service < services_.size() && services_[call.service]) services_[call.service]->Abandon(call.ticket);
  }
  if (listener_ >= 0) ::close(listener_);
  for (int fd : wake_) {
    if (fd >= 0) ::close(fd);
  }
}

TcpFrontStats TcpFront::stats() const {
  return {accepted_.load(), frames_.load(), errors_.load(), dropped_.load(), refused_.load()};
}

std::string TcpFront::last_refusal() const {
  std::lock_guard lock(refusal_mu_);
  return last_refusal_;
}

void TcpFront::Refuse(Connection& c, const std::string& why) {
  c.dead = true;
  refused_.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard lock(refusal_mu_);
  last_refusal_ = why;
}

void TcpFront::Loop() {
  std::vector<pollfd> fds;
  auto last_answer = Clock::now();
  while (!stop_.load()) {
    fds.clear();
    fds.push_back({wake_[0], POLLIN, 0});
    fds.push_back({listener_, POLLIN, 0});
    for (auto& c : connections_) {
      short ev = 0;
      if ((!c->eof && !c->closing && c->queued.empty()) || c->lingering) ev |= POLLIN;
      if (c->out.size() > c->out_sent || (c->tls && c->tls->wants_write())) ev |= POLLOUT;
      fds.push_back({c->fd, ev, 0});
    }
    // Forwarded requests are answered in microseconds: poll without sleeping briefly, then in
    // 1 ms steps (two cores); idle, block until a socket has something.
    int timeout = -1;
    if (!calls_.empty()) timeout = Clock::now() - last_answer < std::chrono::microseconds(200) ? 0 : 1;
    // A frame waiting for an RPC slot is retried at least every millisecond, answers or not.
    for (auto& c : connections_) {
      if (!c->queued.empty() && timeout != 0) timeout = 1;
      if ((c->lingering || !c->authenticated()) && (timeout < 0 || timeout > 50)) timeout = 50;  // to see deadlines pass
      // Decrypted bytes inside a TLS session: poll would not announce them.
      if (c->tls && !c->eof && !c->closing && c->queued.empty() && c->tls->has_buffered()) timeout = 0;
    }
    if (::poll(fds.data(), fds.size(), timeout) < 0 && errno != EINTR) break;
    if (fds[0].revents) {
      char drain[16];
      while (::read(wake_[0], drain, sizeof drain) > 0) {
      }
    }
    if (stop_.load()) break;
    if (fds[1].revents & POLLIN) Accept();
    for (size_t i = 0; i + 2 < fds.size() && i < connections_.size(); ++i) {
      Connection& c = *connections_[i];
      const short re = fds[i + 2].revents;
      if (c.lingering) {
        if ((re & (POLLIN | POLLHUP | POLLERR)) && !Discard(c)) c.dead = true;
        continue;
      }
      const bool tls_wants = c.tls && ((c.tls->wants_write() && (re & POLLOUT)) ||
                                       (!c.eof && !c.closing && c.queued.empty() && c.tls->has_buffered()));
      if (((re & (POLLIN | POLLHUP | POLLERR)) || tls_wants) && !ReadFrom(c)) c.dead = true;
      if ((re & POLLOUT) && c.authenticated() && !WriteTo(c)) c.dead = true;
    }
    for (auto& c : connections_) SubmitQueued(*c);
    bool any = false;
    CollectAnswers(&any);
    if (any) {
      last_answer = Clock::now();
      for (auto& c : connections_) SubmitQueued(*c);  // answers freed RPC slots
    }
    for (auto& c : connections_) {
      if (c->out.size() > c->out_sent && !c->dead && !WriteTo(*c)) c->dead = true;
    }
    const auto now = Clock::now();
    for (auto& c : connections_) {
      if (!c->dead && !c->authenticated() && now >= c->handshake_deadline) {
        Refuse(*c, "no TLS handshake within " + std::to_string(options_.handshake_timeout.count()) + " ms");
      }
    }
    std::erase_if(connections_, [now](const std::unique_ptr<Connection>& c) {
      const bool flushed = c->out.size() == c->out_sent;
      if (c->closing && flushed && !c->lingering && !c->dead) {
        if (c->tls) c->tls->Shutdown();
        ::shutdown(c->fd, SHUT_WR);  // the error frame is out: the peer sees our end
        c->lingering = true;
        c->linger_until = now + kLinger;
      }
      const bool done = c->dead || (c->lingering && now >= c->linger_until) ||
                        (c->eof && flushed && c->inflight == 0 && c->queued.empty());
      if (done) ::close(c->fd);
      return done;
    });
  }
}

void TcpFront::Accept() {
  for (;;) {
    int fd = ::accept4(listener_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;  // EAGAIN: no more; other errors: try at the next poll
    accepted_.fetch_add(1, std::memory_order_relaxed);
    if (connections_.size() >= options_.max_connections) {
      ::close(fd);
      dropped_.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    auto c = std::make_unique<Connection>(next_connection_++, fd, options_.max_payload);
    if (tls_) {
      auto session = TlsSession::Accept(tls_, fd);
      if (!session.ok()) {
        ::close(fd);
        Refuse(*c, session.status().message());
        continue;
      }
      c->tls = std::move(*session);
      c->handshake_deadline = Clock::now() + options_.handshake_timeout;
    }
    connections_.push_back(std::move(c));
  }
}

// A lingering connection's input: dropped. False (close now) at the peer's end of the stream,
// on an error, or past twice a frame's worth of bytes (a peer that never stops sending).
bool TcpFront::Discard(Connection& c) {
  uint8_t buf[kReadChunk];
  size_t n = 0;
  Status error;
  const Got g = c.Receive(buf, sizeof buf, &n, &error);
  if (g == Got::kWouldBlock) return true;
  if (g != Got::kData) return false;
  c.discarded += n;
  return c.discarded <= 2 * (size_t{options_.max_payload} + kFrameHeaderBytes);
}

// Reads what the peer sent and decodes whole frames into the queue. False: close now.
bool TcpFront::ReadFrom(Connection& c) {
  uint8_t buf[kReadChunk];
  size_t n = 0;
  Status error;
  const bool was_authenticated = c.authenticated();
  switch (c.Receive(buf, sizeof buf, &n, &error)) {
    case Got::kWouldBlock:
      return true;
    case Got::kEof:
      if (!was_authenticated) Refuse(c, "the peer left before completing its TLS handshake");
      c.eof = true;
      return !c.dead;
    case Got::kError:
      if (!was_authenticated) Refuse(c, error.message());
      return false;
    case Got::kData:
      break;
  }
  std::span<const uint8_t> in(buf, n);
  while (!in.empty()) {
    Frame f;
    const auto r = c.decoder.Next(in, &f);
    if (r == FrameDecoder::Result::kNeedMore) break;
    if (r == FrameDecoder::Result::kError) {
      // The stream cannot be resynchronized: say why, then close.
      Reply(c, c.decoder.pending_id(), 0, c.decoder.error(), {});
      c.closing = true;
      dropped_.fetch_add(1, std::memory_order_relaxed);
      return true;
    }
    c.queued.push_back(std::move(f));
  }
  return true;
}

void TcpFront::SubmitQueued(Connection& c) {
  while (!c.queued.empty() && !c.closing && !c.dead) {
    Frame& f = c.queued.front();
    if (f.service < local_.size() && local_[f.service]) {
      Result<std::vector<uint8_t>> answer = local_[f.service](f.code, f.payload);
      if (answer.ok()) {
        Reply(c, f.id, f.service, Status::Ok(), *answer);
      } else {
        Reply(c, f.id, f.service, answer.status(), {});
      }
      c.queued.pop_front();
      continue;
    }
    RpcClient* client = f.service < services_.size() ? services_[f.service] : nullptr;
    if (client == nullptr) {
      Reply(c, f.id, f.service, InvalidArgument("no service " + std::to_string(f.service) + " behind this TCP front"), {});
      c.queued.pop_front();
      continue;
    }
    auto t = client->Submit(f.code, f.payload);
    if (!t.ok() && t.status().code() == StatusCode::kBusy) return;  // every slot in flight: later
    if (!t.ok()) {
      Reply(c, f.id, f.service, t.status(), {});
      c.queued.pop_front();
      continue;
    }
    calls_.push_back({c.id, f.id, f.service, *t, Clock::now() + options_.call_timeout});
    ++c.inflight;
    c.queued.pop_front();
  }
}

void TcpFront::CollectAnswers(bool* any) {
  if (calls_.empty()) return;
  std::vector<uint8_t> buf;
  const auto now = Clock::now();
  std::erase_if(calls_, [&](const Call& call) {
    RpcClient* client = services_[call.service];
    Status status;
    size_t n = 0;
    if (client->Answered(call.ticket)) {
      buf.resize(client->response_capacity());
      auto r = client->Wait(call.ticket, buf, now);
      if (r.ok()) {
        n = *r;
      } else {
        status = r.status();
      }
    } else {
      if (now < call.deadline) return false;  // not answered yet
      client->Abandon(call.ticket);
      status = Timeout("the service did not answer within " + std::to_string(options_.call_timeout.count()) + " ms");
    }
    *any = true;
    for (auto& c : connections_) {
      if (c->id != call.connection) continue;
      --c->inflight;
      if (!c->dead) Reply(*c, call.frame_id, call.service, status, std::span<const uint8_t>(buf.data(), n));
    }
    return true;
  });
}

void TcpFront::Reply(Connection& c, uint64_t id, uint8_t service, const Status& status, std::span<const uint8_t> payload) {
  Frame f;
  f.service = service;
  f.id = id;
  f.code = static_cast<uint32_t>(status.code());
  if (status.ok()) {
    f.payload.assign(payload.begin(), payload.end());
  } else {
    f.payload.assign(status.message().begin(), status.message().end());
    errors_.fetch_add(1, std::memory_order_relaxed);
  }
  frames_.fetch_add(1, std::memory_order_relaxed);
  if (c.out_sent == c.out.size()) {
    c.out.clear();
    c.out_sent = 0;
  }
  EncodeFrame(f, c.out);
  if (c.out.size() - c.out_sent > options_.max_output_bytes) {
    c.dead = true;  // the peer does not read its answers
    dropped_.fetch_add(1, std::memory_order_relaxed);
  }
}

bool TcpFront::WriteTo(Connection& c) {
  while (c.out_sent < c.out.size()) {
    if (c.tls) {
      size_t put = 0;
      const auto io = c.tls->Write(c.out.data() + c.out_sent, c.out.size() - c.out_sent, &put);
      if (io == TlsSession::Io::kWouldBlock) return true;
      if (io != TlsSession::Io::kDone) return false;
      c.out_sent += put;
      continue;
    }
    ssize_t n = ::send(c.fd, c.out.data() + c.out_sent, c.out.size() - c.out_sent, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    c.out_sent += static_cast<size_t>(n);
  }
  c.out.clear();
  c.out_sent = 0;
  return true;
}

}  // namespace cxlkv::rpc
