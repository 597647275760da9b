#include "rack/ucx_link.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

namespace cxlkv::rack {
namespace {

constexpr uint16_t kControlAm = 0x5201;
constexpr uint16_t kPayloadAm = 0x5202;
using Clock = std::chrono::steady_clock;
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(200);

std::string UcsWhy(ucs_status_t s) { return ucs_status_string(s); }

Result<sockaddr_in> ParseIpv4Address(const std::string& address) {
  const size_t colon = address.rfind(':');
  sockaddr_in sin{};
  sin.sin_family = AF_INET;
  if (colon == std::string::npos || inet_pton(AF_INET, address.substr(0, colon).c_str(), &sin.sin_addr) != 1) {
    return InvalidArgument("rack-link address '" + address + "' is not IPv4 IP:port");
  }
  const std::string port = address.substr(colon + 1);
  char* end = nullptr;
  const unsigned long p = std::strtoul(port.c_str(), &end, 10);
  if (port.empty() || *end != '\0' || p > 65535) return InvalidArgument("rack-link address '" + address + "' has no port 0-65535");
  sin.sin_port = htons(static_cast<uint16_t>(p));
  return sin;
}

bool IsRequest(LinkType t) { return t == LinkType::kAnnounce || t == LinkType::kLookup || t == LinkType::kFetch; }

}  // namespace

// One call in flight: the calling thread waits on `cv`; everything else is the progress thread's.
struct PendingCall {
  uint64_t id = 0;
  LinkBody request;
  LinkStreamSink* sink = nullptr;  // a stream; null: one answer
  Clock::time_point deadline;
  struct Conn* conn = nullptr;
  bool ended = false;     // the stream's last message (or the answer) arrived
  int receiving = 0;      // payloads on their way into the sink's buffers
  Status failure;         // set once: the call's end when it did not succeed
  bool failed = false;
  std::optional<LinkMessage> answer;

  std::mutex mu;
  std::condition_variable cv;
  bool done = false;  // under mu
  Status result;      // under mu
};

struct Conn {
  ucp_ep_h ep = nullptr;
  std::string address;  // what the client dialled; the server side: "" (not reusable for calls)
  bool client = false;
  std::optional<LinkHandshake> handshake;
  bool authenticated = false;
  bool closing = false;       // failed or refused: no new work; torn down once idle
  bool close_started = false;
  void* close_request = nullptr;
  Clock::time_point handshake_deadline;
  std::string peer_rack;
  int64_t peer_life = 0;
  Status why_closed;
  std::vector<std::shared_ptr<PendingCall>> queued;                     // waiting for the handshake
  std::unordered_map<uint64_t, std::shared_ptr<PendingCall>> calls;     // sent, awaiting answers
  int sends = 0;     // sends in flight
  int receives = 0;  // payload receives in flight
};

class UcxLink::Impl {
 public:
  Impl(UcxLinkOptions o, PoolSecret s, LinkRequestHandler h)
      : options_(std::move(o)), secret_(std::move(s)), handler_(std::move(h)) {}

  Status Init();
  void StartThread() { thread_ = std::thread([this] { Loop(); }); }
  void Stop();
  ~Impl() { Stop(); }

  Status Run(const std::string& peer, LinkBody request, LinkStreamSink* sink, std::chrono::milliseconds timeout,
             std::optional<LinkMessage>* answer);

  const std::string& address() const { return address_; }
  Counters counters() const {
    Counters c;
    c.connections = connections_.load(), c.refused = refused_.load(), c.peer_failures = peer_failures_.load();
    c.payload_bytes_in = bytes_in_.load(), c.payload_bytes_out = bytes_out_.load(), c.dropped = dropped_.load();
    return c;
  }
  std::string last_problem() const {
    std::lock_guard<std::mutex> l(problem_mu_);
    return last_problem_;
  }

 private:
  class Reply;
  struct SendContext {
    Impl* impl;
    Conn* conn;
    std::vector<uint8_t> bytes;  // the encoded message (UCX may read it until the send ends)
    std::function<void(Status)> done;
    bool close_after = false;    // a refusal: close the connection once it is out
  };
  struct ControlReceiveContext {  // a control message large enough that UCX sent it by rendezvous
    Impl* impl;
    Conn* conn;
    std::vector<uint8_t> bytes;
  };
  struct ReceiveContext {
    Impl* impl;
    Conn* conn;
    std::shared_ptr<PendingCall> call;
    LinkMessage message;
    uint64_t bytes;
  };

  void Loop();
  void Post(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> l(queue_mu_);
      queue_.push_back(std::move(f));
    }
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof one);
  }
  void Problem(const std::string& p) {
    std::lock_guard<std::mutex> l(problem_mu_);
    last_problem_ = p;
  }

  // Progress-thread only below.
  void Begin(std::shared_ptr<PendingCall> call, const std::string& peer);
  Conn* Dial(const std::string& peer, Status& why);
  Conn* Adopt(ucp_conn_request_h request);
  void SendMessage(Conn* c, const LinkMessage& m, std::span<const uint8_t> payload, std::function<void(Status)> done,
                   bool close_after = false);
  void SendCall(Conn* c, const std::shared_ptr<PendingCall>& call);
  void OnControl(Conn* c, std::span<const uint8_t> bytes);
  void OnHandshake(Conn* c, const LinkMessage& m);
  ucs_status_t OnPayload(Conn* c, std::span<const uint8_t> header, void* data, size_t length, bool rendezvous);
  void OnAnswer(Conn* c, LinkMessage m);
  void Refuse(Conn* c, const std::string& why);
  void Close(Conn* c, Status why);
  void Fail(const std::shared_ptr<PendingCall>& call, Status why);
  void MaybeFinish(const std::shared_ptr<PendingCall>& call);
  void Finish(const std::shared_ptr<PendingCall>& call, Status result);
  void Sweep();
  Clock::time_point NextDeadline() const;
  bool InFlight() const;
  bool SpinBriefly();  // true: progress was made or work was posted before the spin ran out
  Conn* ConnOf(ucp_ep_h ep) {
    auto it = by_ep_.find(ep);
    return it == by_ep_.end() ? nullptr : it->second;
  }

  static void OnConnRequest(ucp_conn_request_h request, void* arg) { static_cast<Impl*>(arg)->Adopt(request); }
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static ucs_status_t OnControlAm(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                  const ucp_am_recv_param_t* param);
  static ucs_status_t OnPayloadAm(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                  const ucp_am_recv_param_t* param);
  static void OnSent(void* request, ucs_status_t status, void* user_data);
  static void OnReceived(void* request, ucs_status_t status, size_t length, void* user_data);
  static void OnControlReceived(void* request, ucs_status_t status, size_t length, void* user_data);

  UcxLinkOptions options_;
  PoolSecret secret_;
  LinkRequestHandler handler_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_listener_h listener_ = nullptr;
  int worker_fd_ = -1;
  int wake_fd_ = -1;
  std::string address_;
  std::thread thread_;
  std::atomic<bool> stop_{false};

  std::mutex queue_mu_;
  std::deque<std::function<void()>> queue_;

  std::list<std::unique_ptr<Conn>> conns_;
  std::unordered_map<ucp_ep_h, Conn*> by_ep_;
  std::unordered_map<std::string, Conn*> by_address_;  // the live client connection per peer
  uint64_t next_id_ = 1;

  std::atomic<uint64_t> connections_{0}, refused_{0}, peer_failures_{0}, bytes_in_{0}, bytes_out_{0}, dropped_{0};
  mutable std::mutex problem_mu_;
  std::string last_problem_;
};

class UcxLink::Impl::Reply final : public LinkReply {
 public:
  Reply(Impl& impl, Conn* c) : impl_(impl), conn_(c) {}
  void Send(const LinkMessage& m, std::span<const uint8_t> payload, std::function<void(Status)> done) override {
    impl_.SendMessage(conn_, m, payload, std::move(done));
  }
  void Later(std::function<void(LinkReply&)> next) override {
    Conn* c = conn_;
    Impl* impl = &impl_;
    ++c->sends;  // keeps the connection from being torn down until `next` ran
    impl_.Post([impl, c, next = std::move(next)] {
      --c->sends;
      Reply reply(*impl, c);
      next(reply);
    });
  }
  const std::string& peer_rack() const override { return conn_->peer_rack; }
  int64_t peer_life() const override { return conn_->peer_life; }

 private:
  Impl& impl_;
  Conn* conn_;
};

Status UcxLink::Impl::Init() {
  ucp_config_t* config = nullptr;
  if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK) {
    return Unavailable("rack link: UCX could not read its configuration: " + UcsWhy(s));
  }
  if (!options_.transports.empty()) {
    if (ucs_status_t s = ucp_config_modify(config, "TLS", options_.transports.c_str()); s != UCS_OK) {
      ucp_config_release(config);
      return InvalidArgument("rack link: UCX refused transports '" + options_.transports + "': " + UcsWhy(s));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  const ucs_status_t init = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  const std::string tls = options_.transports.empty() ? "" : " (UCX_TLS " + options_.transports + ")";
  if (init != UCS_OK) return Unavailable("rack link: UCX did not start" + tls + ": " + UcsWhy(init));

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // the progress thread makes every UCX call
  if (ucs_status_t s = ucp_worker_create(context_, &wp, &worker_); s != UCS_OK) {
    return Unavailable("rack link: no UCX worker" + tls + ": " + UcsWhy(s));
  }
  if (ucs_status_t s = ucp_worker_get_efd(worker_, &worker_fd_); s != UCS_OK) {
    return Unavailable("rack link: UCX worker has no event fd (event-mode progress)" + tls + ": " + UcsWhy(s));
  }
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) return Unavailable(std::string("rack link: eventfd: ") + std::strerror(errno));

  for (uint16_t id : {kControlAm, kPayloadAm}) {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = id;
    hp.cb = id == kControlAm ? &Impl::OnControlAm : &Impl::OnPayloadAm;
    hp.arg = this;
    if (ucs_status_t s = ucp_worker_set_am_recv_handler(worker_, &hp); s != UCS_OK) {
      return Unavailable("rack link: UCX active-message handler: " + UcsWhy(s));
    }
  }

  if (!options_.listen.empty()) {
    CXLKV_ASSIGN_OR_RETURN(sockaddr_in sin, ParseIpv4Address(options_.listen));
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sin);
    lp.sockaddr.addrlen = sizeof sin;
    lp.conn_handler.cb = &Impl::OnConnRequest;
    lp.conn_handler.arg = this;
    if (ucs_status_t s = ucp_listener_create(worker_, &lp, &listener_); s != UCS_OK) {
      return Unavailable("rack link: cannot listen on " + options_.listen + tls + ": " + UcsWhy(s) +
                         " (is the address this host's, the port free?)");
    }
    ucp_listener_attr_t la{};
    la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    if (ucs_status_t s = ucp_listener_query(listener_, &la); s != UCS_OK) return Unavailable("rack link: listener query: " + UcsWhy(s));
    const auto* bound = reinterpret_cast<const sockaddr_in*>(&la.sockaddr);
    char ip[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &sin.sin_addr, ip, sizeof ip);
    address_ = std::string(ip) + ":" + std::to_string(ntohs(bound->sin_port));
  }
  return Status::Ok();
}

void UcxLink::Impl::Stop() {
  if (thread_.joinable()) {
    stop_.store(true);
    Post([] {});
    thread_.join();
  }
  if (listener_) ucp_listener_destroy(listener_), listener_ = nullptr;
  if (worker_) ucp_worker_destroy(worker_), worker_ = nullptr;
  if (context_) ucp_cleanup(context_), context_ = nullptr;
  if (wake_fd_ >= 0) close(wake_fd_), wake_fd_ = -1;
}

Status UcxLink::Impl::Run(const std::string& peer, LinkBody request, LinkStreamSink* sink,
                          std::chrono::milliseconds timeout, std::optional<LinkMessage>* answer) {
  auto call = std::make_shared<PendingCall>();
  call->request = std::move(request);
  call->sink = sink;
  call->deadline = Clock::now() + timeout;
  Post([this, call, peer] { Begin(call, peer); });
  // The progress thread ends every call by its deadline (closing its connection), and only once
  // no payload of it is still arriving, so this wait is bounded by the deadline.
  std::unique_lock<std::mutex> l(call->mu);
  call->cv.wait(l, [&] { return call->done; });
  if (answer) *answer = std::move(call->answer);
  return call->result;
}

void UcxLink::Impl::Loop() {
  while (true) {
    std::deque<std::function<void()>> work;
    {
      std::lock_guard<std::mutex> l(queue_mu_);
      work.swap(queue_);
    }
    for (auto& f : work) f();
    while (ucp_worker_progress(worker_) != 0) {
    }
    Sweep();
    if (stop_.load()) {
      // Close everything, then progress until the closes are through (bounded: a peer that
      // does not answer a close does not hold the link up).
      for (auto& c : conns_) Close(c.get(), Unavailable("the rack link is stopping"));
      const auto until = Clock::now() + std::chrono::seconds(2);
      while (!conns_.empty() && Clock::now() < until) {
        std::deque<std::function<void()>> late;  // Later() continuations: their sends fail fast
        {
          std::lock_guard<std::mutex> l(queue_mu_);
          late.swap(queue_);
        }
        for (auto& f : late) f();
        ucp_worker_progress(worker_);
        Sweep();
      }
      for (auto& c : conns_) {
        auto calls = c->calls;  // Finish erases from c->calls
        for (auto& [id, call] : calls) Finish(call, Unavailable("the rack link stopped"));
        for (auto& call : c->queued) Finish(call, Unavailable("the rack link stopped"));
      }
      return;
    }
    // With work in flight (a call, a send, a payload arriving), spin on progress a little before
    // sleeping: a rendezvous takes several round trips, and a thread woken from poll costs tens
    // of microseconds on small VMs — per round trip, per block. Idle, it sleeps at once.
    if (InFlight() && SpinBriefly()) continue;
    const ucs_status_t armed = ucp_worker_arm(worker_);
    if (armed == UCS_ERR_BUSY) continue;  // events arrived meanwhile: progress again
    {
      std::lock_guard<std::mutex> l(queue_mu_);
      if (!queue_.empty()) continue;
    }
    const auto next = NextDeadline();
    int wait_ms = 1000;
    if (next != Clock::time_point::max()) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count() + 1;
      wait_ms = static_cast<int>(std::clamp<int64_t>(left, 0, 1000));
    }
    pollfd fds[2] = {{worker_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    poll(fds, 2, wait_ms);
    uint64_t drained;
    [[maybe_unused]] ssize_t n = read(wake_fd_, &drained, sizeof drained);
  }
}

bool UcxLink::Impl::InFlight() const {
  for (const auto& c : conns_) {
    if (c->sends > 0 || c->receives > 0 || !c->calls.empty() || !c->queued.empty()) return true;
  }
  return false;
}

bool UcxLink::Impl::SpinBriefly() {
  const auto until = Clock::now() + kSpinBeforeSleep;
  do {
    if (ucp_worker_progress(worker_) != 0) return true;
    std::lock_guard<std::mutex> l(queue_mu_);
    if (!queue_.empty()) return true;
  } while (Clock::now() < until);
  return false;
}

Clock::time_point UcxLink::Impl::NextDeadline() const {
  auto next = Clock::time_point::max();
  for (const auto& c : conns_) {
    if (!c->authenticated && !c->closing) next = std::min(next, c->handshake_deadline);
    for (const auto& [id, call] : c->calls) next = std::min(next, call->deadline);
    for (const auto& call : c->queued) next = std::min(next, call->deadline);
  }
  return next;
}

// Deadlines, and tearing down connections that are closed and idle.
void UcxLink::Impl::Sweep() {
  const auto now = Clock::now();
  for (auto& cp : conns_) {
    Conn* c = cp.get();
    if (c->closing) continue;
    if (!c->authenticated && now >= c->handshake_deadline) {
      refused_.fetch_add(1);
      Problem("handshake with " + (c->address.empty() ? std::string("a peer") : c->address) + " timed out");
      Close(c, Timeout("rack link: the handshake with " + (c->client ? c->address : std::string("a peer")) +
                        " did not complete within " + std::to_string(options_.connect_timeout.count()) + " ms"));
      continue;
    }
    // A call still waiting for the handshake just ends; the handshake goes on for later calls.
    for (auto q = c->queued.begin(); q != c->queued.end();) {
      if (now < (*q)->deadline) {
        ++q;
        continue;
      }
      auto call = *q;
      q = c->queued.erase(q);
      Fail(call, Timeout("rack link: no connection to " + c->address + " within the call's deadline (handshake pending)"));
    }
    std::shared_ptr<PendingCall> late;
    for (auto& [id, call] : c->calls) {
      if (now >= call->deadline) late = call;
    }
    if (late) {
      // A call past its deadline closes its connection: UCX then cancels whatever of it was in
      // flight, so nothing lands in the sink's buffers after the call returns.
      Fail(late, Timeout("rack link: no answer from " + c->address + " within the call's deadline"));
      Close(c, Unavailable("rack link: the connection to " + c->address + " was closed after a call timed out"));
    }
  }
  for (auto it = conns_.begin(); it != conns_.end();) {
    Conn* c = it->get();
    if (c->closing && !c->close_started && c->sends == 0 && c->receives == 0) {
      c->close_started = true;
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;
      void* r = ucp_ep_close_nbx(c->ep, &p);
      c->close_request = UCS_PTR_IS_PTR(r) ? r : nullptr;
    }
    if (c->close_started && c->close_request && ucp_request_check_status(c->close_request) != UCS_INPROGRESS) {
      ucp_request_free(c->close_request);
      c->close_request = nullptr;
    }
    // Gone only once UCX has called back every send and receive it had (a force-close cancels
    // them, and their callbacks still name this connection).
    if (c->close_started && !c->close_request && c->sends == 0 && c->receives == 0) {
      by_ep_.erase(c->ep);
      it = conns_.erase(it);
    } else {
      ++it;
    }
  }
}

void UcxLink::Impl::Begin(std::shared_ptr<PendingCall> call, const std::string& peer) {
  if (stop_.load()) return Finish(call, Unavailable("the rack link is stopping"));
  call->id = next_id_++;
  Conn* c = nullptr;
  if (auto it = by_address_.find(peer); it != by_address_.end()) c = it->second;
  if (!c) {
    Status why;
    c = Dial(peer, why);
    if (!c) return Finish(call, why);
  }
  call->conn = c;
  if (c->authenticated) {
    SendCall(c, call);
  } else {
    c->queued.push_back(std::move(call));
  }
}

Conn* UcxLink::Impl::Dial(const std::string& peer, Status& why) {
  auto sin = ParseIpv4Address(peer);
  if (!sin.ok()) return why = sin.status(), nullptr;
  auto conn = std::make_unique<Conn>();
  Conn* c = conn.get();
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&*sin);
  ep.sockaddr.addrlen = sizeof *sin;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = &Impl::OnEndpointError;
  ep.err_handler.arg = this;
  if (ucs_status_t s = ucp_ep_create(worker_, &ep, &c->ep); s != UCS_OK) {
    why = Unavailable("rack link: cannot connect to " + peer + ": " + UcsWhy(s));
    return nullptr;
  }
  c->address = peer;
  c->client = true;
  c->handshake.emplace(LinkHandshake::Client(secret_, options_.rack, options_.life));
  c->handshake_deadline = Clock::now() + options_.connect_timeout;
  by_ep_[c->ep] = c;
  by_address_[peer] = c;
  conns_.push_back(std::move(conn));
  auto hello = c->handshake->Hello();
  if (!hello.ok()) {
    Close(c, hello.status());
  } else {
    SendMessage(c, LinkMessage{0, *hello}, {}, nullptr);
  }
  return c;
}

Conn* UcxLink::Impl::Adopt(ucp_conn_request_h request) {
  if (stop_.load()) return ucp_listener_reject(listener_, request), nullptr;
  auto conn = std::make_unique<Conn>();
  Conn* c = conn.get();
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.conn_request = request;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = &Impl::OnEndpointError;
  ep.err_handler.arg = this;
  if (ucs_status_t s = ucp_ep_create(worker_, &ep, &c->ep); s != UCS_OK) {
    Problem("could not accept a peer: " + UcsWhy(s));
    return nullptr;
  }
  c->handshake.emplace(LinkHandshake::Server(secret_, options_.rack, options_.life));
  c->handshake_deadline = Clock::now() + options_.connect_timeout;
  by_ep_[c->ep] = c;
  conns_.push_back(std::move(conn));
  return c;
}

void UcxLink::Impl::SendMessage(Conn* c, const LinkMessage& m, std::span<const uint8_t> payload,
                                std::function<void(Status)> done, bool close_after) {
  auto ctx = std::make_unique<SendContext>(SendContext{this, c, {}, std::move(done), close_after});
  Status encoded = EncodeLinkMessage(m, ctx->bytes);
  if (!encoded.ok() || (c->closing && !close_after)) {
    if (ctx->done) ctx->done(encoded.ok() ? c->why_closed : encoded);
    return;
  }
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = &Impl::OnSent;
  p.user_data = ctx.get();
  p.flags = UCP_AM_SEND_FLAG_REPLY;
  ucs_status_ptr_t r;
  if (payload.empty()) {
    r = ucp_am_send_nbx(c->ep, kControlAm, nullptr, 0, ctx->bytes.data(), ctx->bytes.size(), &p);
  } else {
    r = ucp_am_send_nbx(c->ep, kPayloadAm, ctx->bytes.data(), ctx->bytes.size(), payload.data(), payload.size(), &p);
    bytes_out_.fetch_add(payload.size());
  }
  if (UCS_PTR_IS_PTR(r)) {
    ++c->sends;
    ctx.release();  // OnSent owns it now
    return;
  }
  const ucs_status_t s = UCS_PTR_STATUS(r);
  if (ctx->done) ctx->done(s == UCS_OK ? Status::Ok() : Unavailable("rack link: send to " + c->peer_rack + " failed: " + UcsWhy(s)));
  if (close_after) Close(c, Unavailable("rack link: handshake refused"));
}

void UcxLink::Impl::OnSent(void* request, ucs_status_t status, void* user_data) {
  std::unique_ptr<SendContext> ctx(static_cast<SendContext*>(user_data));
  ucp_request_free(request);
  Conn* c = ctx->conn;
  --c->sends;
  if (ctx->done) {
    ctx->done(status == UCS_OK ? Status::Ok() : Unavailable("rack link: send to " + c->peer_rack + " failed: " + UcsWhy(status)));
  }
  if (ctx->close_after) ctx->impl->Close(c, Unavailable("rack link: handshake refused"));
}

void UcxLink::Impl::SendCall(Conn* c, const std::shared_ptr<PendingCall>& call) {
  c->calls[call->id] = call;
  SendMessage(c, LinkMessage{call->id, call->request}, {}, [this, call](Status s) {
    if (!s.ok()) Fail(call, s);
  });
}

void UcxLink::Impl::OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* self = static_cast<Impl*>(arg);
  Conn* c = self->ConnOf(ep);
  if (!c || c->closing) return;
  self->peer_failures_.fetch_add(1);
  const std::string who = c->authenticated ? "rack " + c->peer_rack : (c->client ? c->address : std::string("a peer"));
  self->Problem("lost " + who + ": " + UcsWhy(status));
  self->Close(c, Unavailable("rack link: lost " + who + (c->client ? " at " + c->address : std::string()) + ": " +
                             UcsWhy(status)));
}

ucs_status_t UcxLink::Impl::OnControlAm(void* arg, const void*, size_t, void* data, size_t length,
                                         const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  Conn* c = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? self->ConnOf(param->reply_ep) : nullptr;
  if (!c || c->closing) {
    self->dropped_.fetch_add(1);  // no connection of ours: dropped unread
    return UCS_OK;
  }
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    self->OnControl(c, {static_cast<const uint8_t*>(data), length});
    return UCS_OK;
  }
  // A large message (an announce batch): pulled only from an authenticated peer, and only up to
  // the largest message there is; anything else is never pulled.
  if (!c->authenticated || length > kLinkHeaderBytes + kLinkMaxBody) {
    self->dropped_.fetch_add(1);
    return UCS_OK;
  }
  auto ctx = std::make_unique<ControlReceiveContext>(ControlReceiveContext{self, c, std::vector<uint8_t>(length)});
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = &Impl::OnControlReceived;
  p.user_data = ctx.get();
  ucs_status_ptr_t r = ucp_am_recv_data_nbx(self->worker_, data, ctx->bytes.data(), length, &p);
  if (UCS_PTR_IS_PTR(r)) {
    ++c->receives;
    ctx.release();  // OnControlReceived owns it now
  } else if (UCS_PTR_STATUS(r) == UCS_OK) {
    self->OnControl(c, ctx->bytes);
  } else {
    self->dropped_.fetch_add(1);
  }
  return UCS_OK;
}

void UcxLink::Impl::OnControlReceived(void* request, ucs_status_t status, size_t, void* user_data) {
  std::unique_ptr<ControlReceiveContext> ctx(static_cast<ControlReceiveContext*>(user_data));
  ucp_request_free(request);
  --ctx->conn->receives;
  if (status == UCS_OK && !ctx->conn->closing) {
    ctx->impl->OnControl(ctx->conn, ctx->bytes);
  } else {
    ctx->impl->dropped_.fetch_add(1);
  }
}

void UcxLink::Impl::OnControl(Conn* c, std::span<const uint8_t> bytes) {
  auto m = DecodeLinkMessage(bytes);
  if (!m.ok()) {
    dropped_.fetch_add(1);
    Problem("a malformed message from " + (c->authenticated ? c->peer_rack : std::string("a peer")) + ": " + m.status().message());
    if (!c->authenticated) return Refuse(c, m.status().message());
    // An authenticated peer that sends garbage is broken: fail what it owes us, drop it.
    return Close(c, Unavailable("rack link: " + c->peer_rack + " sent a malformed message: " + m.status().message()));
  }
  if (!c->authenticated) return OnHandshake(c, *m);
  if (IsRequest(m->type())) {
    Reply reply(*this, c);
    handler_(*m, reply);
    return;
  }
  OnAnswer(c, std::move(*m));
}

void UcxLink::Impl::OnHandshake(Conn* c, const LinkMessage& m) {
  LinkHandshake& hs = *c->handshake;
  Status s;
  if (c->client) {
    if (const auto* ch = std::get_if<LinkChallenge>(&m.body)) {
      auto proof = hs.OnChallenge(*ch);
      if (!proof.ok()) return Refuse(c, proof.status().message());
      return SendMessage(c, LinkMessage{0, *proof}, {}, nullptr);
    }
    if (std::holds_alternative<LinkWelcome>(m.body)) {
      s = hs.OnWelcome();
    } else if (const auto* r = std::get_if<LinkRefused>(&m.body)) {
      refused_.fetch_add(1);
      Problem(c->address + " refused this link: " + r->reason);
      return Close(c, PermissionDenied("rack link: " + c->address + " refused the handshake: " + r->reason));
    } else {
      return Refuse(c, "unexpected message before the handshake completed");
    }
  } else {
    if (const auto* h = std::get_if<LinkHello>(&m.body)) {
      auto challenge = hs.OnHello(*h);
      if (!challenge.ok()) return Refuse(c, challenge.status().message());
      return SendMessage(c, LinkMessage{0, *challenge}, {}, nullptr);
    }
    if (const auto* p = std::get_if<LinkProof>(&m.body)) {
      s = hs.OnProof(*p);
      if (s.ok()) SendMessage(c, LinkMessage{0, LinkWelcome{}}, {}, nullptr);
    } else {
      return Refuse(c, "unexpected message before the handshake completed");
    }
  }
  if (!s.ok()) return Refuse(c, s.message());
  c->authenticated = true;
  c->peer_rack = hs.peer_rack();
  c->peer_life = hs.peer_life();
  connections_.fetch_add(1);
  auto queued = std::move(c->queued);
  for (auto& call : queued) SendCall(c, call);
}

void UcxLink::Impl::Refuse(Conn* c, const std::string& why) {
  refused_.fetch_add(1);
  Problem("refused " + (c->client ? c->address : std::string("a peer")) + ": " + why);
  c->why_closed = PermissionDenied("rack link: handshake with " + (c->client ? c->address : std::string("a peer")) +
                                   " refused: " + why);
  // Tell the peer why, then close once that is out.
  SendMessage(c, LinkMessage{0, LinkRefused{why}}, {}, nullptr, /*close_after=*/true);
  Close(c, c->why_closed);
}

void UcxLink::Impl::OnAnswer(Conn* c, LinkMessage m) {
  auto it = c->calls.find(m.id);
  if (it == c->calls.end()) {
    dropped_.fetch_add(1);  // an answer to a call that ended (timed out) or never was
    return;
  }
  std::shared_ptr<PendingCall> call = it->second;
  if (const auto* e = std::get_if<LinkError>(&m.body)) {
    call->ended = true;
    Fail(call, Status(e->code, c->peer_rack + ": " + e->message));
    return;
  }
  if (call->sink) {
    if (call->sink->Message(m)) call->ended = true;
  } else {
    call->answer = std::move(m);
    call->ended = true;
  }
  MaybeFinish(call);
}

ucs_status_t UcxLink::Impl::OnPayloadAm(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                         const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  Conn* c = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? self->ConnOf(param->reply_ep) : nullptr;
  if (!c || c->closing || !c->authenticated) {
    self->dropped_.fetch_add(1);  // a payload from no one we authenticated: dropped unread
    return UCS_OK;
  }
  return self->OnPayload(c, {static_cast<const uint8_t*>(header), header_length}, data, length,
                         (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0);
}

ucs_status_t UcxLink::Impl::OnPayload(Conn* c, std::span<const uint8_t> header, void* data, size_t length,
                                       bool rendezvous) {
  auto m = DecodeLinkMessage(header);
  std::shared_ptr<PendingCall> call;
  if (m.ok()) {
    if (auto it = c->calls.find(m->id); it != c->calls.end() && it->second->sink && !it->second->failed) call = it->second;
  }
  if (!call) {
    dropped_.fetch_add(1);
    return UCS_OK;  // UCX drops the data (a rendezvous is never pulled)
  }
  auto buffer = call->sink->PayloadBuffer(*m, length);
  if (!buffer.ok() || buffer->size() != length) {
    dropped_.fetch_add(1);
    return UCS_OK;
  }
  if (!rendezvous) {
    std::memcpy(buffer->data(), data, length);
    bytes_in_.fetch_add(length);
    call->sink->Arrived(*m, Status::Ok());
    return UCS_OK;
  }
  auto ctx = std::make_unique<ReceiveContext>(ReceiveContext{this, c, call, std::move(*m), length});
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = &Impl::OnReceived;
  p.user_data = ctx.get();
  ucs_status_ptr_t r = ucp_am_recv_data_nbx(worker_, data, buffer->data(), length, &p);
  if (UCS_PTR_IS_PTR(r)) {
    ++c->receives;
    ++call->receiving;
    ctx.release();
    return UCS_OK;
  }
  const ucs_status_t s = UCS_PTR_STATUS(r);
  if (s == UCS_OK) bytes_in_.fetch_add(length);
  call->sink->Arrived(ctx->message, s == UCS_OK ? Status::Ok() : Unavailable("rack link: receiving a payload: " + UcsWhy(s)));
  return UCS_OK;
}

void UcxLink::Impl::OnReceived(void* request, ucs_status_t status, size_t, void* user_data) {
  std::unique_ptr<ReceiveContext> ctx(static_cast<ReceiveContext*>(user_data));
  ucp_request_free(request);
  --ctx->conn->receives;
  --ctx->call->receiving;
  if (status == UCS_OK) ctx->impl->bytes_in_.fetch_add(ctx->bytes);
  ctx->call->sink->Arrived(ctx->message, status == UCS_OK ? Status::Ok() : Unavailable("rack link: a payload was lost: " + UcsWhy(status)));
  ctx->impl->MaybeFinish(ctx->call);
}

void UcxLink::Impl::Close(Conn* c, Status why) {
  if (c->closing) return;
  c->closing = true;
  if (c->why_closed.ok()) c->why_closed = why;
  if (c->client) {
    if (auto it = by_address_.find(c->address); it != by_address_.end() && it->second == c) by_address_.erase(it);
  }
  auto queued = std::move(c->queued);
  for (auto& call : queued) Fail(call, c->why_closed);
  auto calls = c->calls;  // Fail may finish and erase
  for (auto& [id, call] : calls) Fail(call, c->why_closed);
  // The endpoint itself is closed by Sweep once no send or receive is in flight on it; a
  // receive in flight ends when UCX fails the endpoint or the peer's data arrives.
  if (c->receives > 0 || c->sends > 0) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    c->close_started = true;  // force-close now: UCX cancels every request in flight on it
    void* r = ucp_ep_close_nbx(c->ep, &p);
    c->close_request = UCS_PTR_IS_PTR(r) ? r : nullptr;
  }
}

void UcxLink::Impl::Fail(const std::shared_ptr<PendingCall>& call, Status why) {
  if (!call->failed) {
    call->failed = true;
    call->failure = std::move(why);
  }
  MaybeFinish(call);
}

void UcxLink::Impl::MaybeFinish(const std::shared_ptr<PendingCall>& call) {
  if (call->receiving > 0) return;  // a payload may still land in the sink's buffers
  if (call->failed) return Finish(call, call->failure);
  if (call->ended) return Finish(call, Status::Ok());
}

void UcxLink::Impl::Finish(const std::shared_ptr<PendingCall>& call, Status result) {
  if (call->conn) call->conn->calls.erase(call->id);
  std::lock_guard<std::mutex> l(call->mu);
  if (call->done) return;
  call->done = true;
  call->result = std::move(result);
  call->cv.notify_all();
}

UcxLink::UcxLink(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
UcxLink::~UcxLink() = default;

Result<std::unique_ptr<UcxLink>> UcxLink::Start(UcxLinkOptions options, PoolSecret secret, LinkRequestHandler handler) {
  if (options.rack.empty() || options.rack.size() > kLinkMaxName) {
    return InvalidArgument("rack link: the rack name must be 1 to " + std::to_string(kLinkMaxName) + " bytes");
  }
  if (!handler) handler = [](const LinkMessage& m, LinkReply& reply) {
    reply.Send(LinkMessage{m.id, LinkError{StatusCode::kNotSupported, "this rack link serves no requests"}});
  };
  auto impl = std::make_unique<Impl>(std::move(options), std::move(secret), std::move(handler));
  CXLKV_RETURN_IF_ERROR(impl->Init());
  impl->StartThread();
  return std::unique_ptr<UcxLink>(new UcxLink(std::move(impl)));
}

const std::string& UcxLink::address() const { return impl_->address(); }

Result<LinkMessage> UcxLink::Call(const std::string& peer, LinkBody request, std::chrono::milliseconds timeout) {
  std::optional<LinkMessage> answer;
  CXLKV_RETURN_IF_ERROR(impl_->Run(peer, std::move(request), nullptr, timeout, &answer));
  if (!answer) return Internal("rack link: a call ended without an answer");
  return std::move(*answer);
}

Status UcxLink::Stream(const std::string& peer, LinkBody request, LinkStreamSink& sink, std::chrono::milliseconds timeout) {
  return impl_->Run(peer, std::move(request), &sink, timeout, nullptr);
}

UcxLink::Counters UcxLink::counters() const { return impl_->counters(); }
std::string UcxLink::last_problem() const { return impl_->last_problem(); }

}  // namespace cxlkv::rack
