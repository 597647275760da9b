// `cxlkv bench rpc`: the shared-memory RPC (Beluga §6.2, Exp #11) next to its limits.
//
//   rpc_64B_qd1          round trip of a 64-byte request and a 64-byte reply (one line each: the
//                        16-byte slot header and 48 bytes of payload, as Beluga's Exp #11 sends
//                        64-byte messages), one client process (node 1) and one server process
//                        (node 0), one request in flight; reference: a cache-line ping-pong
//                        between two processes (goal ratio <= 2) and, separately, TCP loopback
//                        with the same 64-byte echo (goal: >= 10x lower latency)
//   rpc_64B_qd128        requests per second one server thread answers with 128 in flight from
//                        one client that posts what it can before each doorbell; reference: the
//                        QD1 rate (what batching buys); goal >= 4 Mops
//   rpc_64B_qd128_server the same requests over the time the server thread was busy (polls that
//                        found requests, and answering them): what the thread alone reaches
//   rpc_128B_qd128       as rpc_64B_qd128 with two-line messages (112 bytes of payload): bodies,
//                        fence, numbers, fence on both sides
//   index_*/MODE         the prefix index in central vs decentralized metadata mode (meta_bench.cc)
// Every process is forked before any pool is opened here (threads do not cross a fork).
#include <netinet/in.h>
#include <signal.h>
#include <netinet/tcp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <thread>

#include "bench_clock.h"
#include "rpc/client.h"
#include "rpc/server.h"
#include "suites.h"

namespace cxlkv::bench {
namespace {

constexpr uint32_t kEchoOp = 1;
constexpr size_t kMessage = 64;            // bytes on the wire of the TCP echo, and of one RPC message
constexpr size_t kLinePayload = kMessage - rpc::kSlotHeaderBytes;  // an RPC message of one line
constexpr size_t kTwoLinePayload = 2 * kMessage - rpc::kSlotHeaderBytes;
constexpr int kDepth = 128;


struct Shared {
  std::atomic<int> server_ready;
  std::atomic<int> client_done;
  std::atomic<int> failed;
  double qd1_ns;
  double qd128_ops;
  double qd128_two_line_ops;
  std::atomic<uint64_t> server_requests;  // what the server answered, and how long it was busy,
  std::atomic<uint64_t> server_busy_ns;   // over the QD128 phase of one-line messages
  std::atomic<int> phase;                 // the client: 1 when that phase starts, 2 when it ends
};

int ServeEcho(const std::string& path, Shared* s) {
  PoolOpenOptions o;
  o.node_id = 0;
  auto pool = Pool::Open({path}, o);
  if (!pool.ok()) return 1;
  std::map<uint32_t, rpc::Handler> ops;
  ops[kEchoOp] = {[](const rpc::Request& r, std::span<uint8_t> out) -> Result<size_t> {
    std::memcpy(out.data(), r.payload.data(), std::min(out.size(), r.payload.size()));
    return std::min(out.size(), r.payload.size());
  }};
  rpc::RpcServerOptions so;
  so.geometry = {.clients_per_node = 4, .depth = 128, .request_bytes = 128, .response_bytes = 128};
  so.hot_window = std::chrono::milliseconds(2);
  auto server = rpc::RpcServer::Start(**pool, "bench", std::move(ops), so);
  if (!server.ok() || !(*server)->WaitServing(std::chrono::seconds(30))) {
    s->failed = 1;
    return 2;
  }
  s->server_ready = 1;
  rpc::RpcServerStats at_start{};
  while (!s->client_done.load()) {
    const int phase = s->phase.load();
    if (phase == 1 && at_start.requests == 0) at_start = (*server)->stats();
    if (phase == 2 && s->server_requests.load() == 0) {
      const auto end = (*server)->stats();
      s->server_busy_ns = end.busy_ns - at_start.busy_ns;
      s->server_requests = end.requests - at_start.requests;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return 0;
}

// `calls` echoes of `payload` bytes with up to kDepth in flight: post what the ring has room
// for, one doorbell, then every answer that is in. Returns requests per second, or a negative
// code on failure.
double Pipelined(rpc::RpcClient& c, size_t payload, int calls) {
  std::vector<uint8_t> msg(payload), out(payload);
  for (size_t i = 0; i < payload; ++i) msg[i] = static_cast<uint8_t>(i * 7 + payload);
  std::deque<rpc::RpcClient::Ticket> inflight;
  const auto t0 = Clock::now();
  int submitted = 0;
  int answered = 0;
  while (answered < calls) {
    while (submitted < calls && inflight.size() < kDepth) {
      auto t = c.Post(kEchoOp, msg);
      if (!t.ok()) return -6;
      inflight.push_back(*t);
      ++submitted;
    }
    c.Ring();
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    do {
      auto n = c.Wait(inflight.front(), out, deadline);
      if (!n.ok() || *n != payload || std::memcmp(out.data(), msg.data(), payload) != 0) return -7;
      inflight.pop_front();
      ++answered;
    } while (!inflight.empty() && c.Answered(inflight.front()));
  }
  return calls / (NsSince(t0) / 1e9);
}

int CallEcho(const std::string& path, Shared* s, int qd1_calls, int qd128_calls) {
  while (!s->server_ready.load()) {
    if (s->failed.load()) return 1;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  PoolOpenOptions o;
  o.node_id = 1;
  auto pool = Pool::Open({path}, o);
  if (!pool.ok()) return 2;
  auto client = rpc::RpcClient::Open(**pool, "bench");
  if (!client.ok()) return 3;
  rpc::RpcClient& c = **client;
  uint8_t msg[kLinePayload];
  uint8_t out[kLinePayload];
  std::memset(msg, 0x5a, sizeof msg);
  for (int i = 0; i < 1000; ++i) {  // warm-up: the server sees this channel, everything is mapped
    if (!c.Call(kEchoOp, msg, out).ok()) return 4;
  }
  auto t0 = Clock::now();
  for (int i = 0; i < qd1_calls; ++i) {
    auto n = c.Call(kEchoOp, msg, out);
    if (!n.ok() || *n != kLinePayload) return 5;
  }
  s->qd1_ns = NsSince(t0) / qd1_calls;
  if (Pipelined(c, kLinePayload, qd128_calls / 10) < 0) return 6;  // warm-up of the windows
  s->phase = 1;
  std::this_thread::sleep_for(std::chrono::milliseconds(1));  // the server notes its counters
  s->qd128_ops = Pipelined(c, kLinePayload, qd128_calls);
  s->phase = 2;
  if (s->qd128_ops < 0) return 7;
  s->qd128_two_line_ops = Pipelined(c, kTwoLinePayload, qd128_calls);
  if (s->qd128_two_line_ops < 0) return 8;
  return 0;
}

// One measurement of the RPC figures: a server process and a client process on a fresh pool.
struct RpcFigures {
  double qd1_ns = 0;
  double qd128_ops = 0;
  double server_ops = 0;  // requests per second of the server thread's busy time
  double qd128_two_line_ops = 0;
};

Status MeasureRpc(const std::string& path, int qd1_calls, int qd128_calls, RpcFigures* f) {
  PoolCreateOptions co;
  co.size = 64 << 20;
  co.max_nodes = 2;
  co.overwrite = true;
  CXLKV_RETURN_IF_ERROR(Pool::Create({path}, co));
  auto* s = static_cast<Shared*>(mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (s == MAP_FAILED) return IoError("mmap of the bench's shared page failed");
  new (s) Shared{};
  pid_t server = ::fork();
  if (server == 0) ::_exit(ServeEcho(path, s));
  pid_t client = ::fork();
  if (client == 0) {
    int rc = CallEcho(path, s, qd1_calls, qd128_calls);
    s->client_done = 1;
    ::_exit(rc);
  }
  int cs = 0, ss = 0;
  ::waitpid(client, &cs, 0);
  s->client_done = 1;
  ::waitpid(server, &ss, 0);
  f->qd1_ns = s->qd1_ns;
  f->qd128_ops = s->qd128_ops;
  f->qd128_two_line_ops = s->qd128_two_line_ops;
  f->server_ops = s->server_busy_ns > 0 ? s->server_requests * 1e9 / s->server_busy_ns : 0;
  munmap(s, sizeof(Shared));
  ::unlink(path.c_str());
  if (!WIFEXITED(cs) || WEXITSTATUS(cs) != 0 || !WIFEXITED(ss) || WEXITSTATUS(ss) != 0) {
    return Internal("an RPC benchmark process failed (client status " + std::to_string(cs) + ", server " +
                    std::to_string(ss) + ")");
  }
  return Status::Ok();
}

bool FullIo(int fd, uint8_t* p, size_t n, bool write) {
  while (n > 0) {
    ssize_t r = write ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// The same 64-byte echo over TCP on loopback (TCP_NODELAY): the transport a host outside the
// CXL domain would use. Returns ns per round trip.
Result<double> TcpEchoNs(int calls) {
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  if (listener < 0) return IoError("socket: " + std::string(std::strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(listener, 1) != 0 ||
      ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(listener);
    return IoError("loopback listen: " + std::string(std::strerror(errno)));
  }
  pid_t child = ::fork();
  if (child == 0) {
    int c = ::accept(listener, nullptr, nullptr);
    int one = 1;
    ::setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    uint8_t buf[kMessage];
    while (FullIo(c, buf, sizeof buf, false) && FullIo(c, buf, sizeof buf, true)) {
    }
    ::_exit(0);
  }
  ::close(listener);
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
    return IoError("loopback connect: " + std::string(std::strerror(errno)));
  }
  uint8_t buf[kMessage];
  std::memset(buf, 0x5a, sizeof buf);
  bool ok = true;
  for (int i = 0; i < 200 && ok; ++i) ok = FullIo(fd, buf, sizeof buf, true) && FullIo(fd, buf, sizeof buf, false);
  auto t0 = Clock::now();
  for (int i = 0; i < calls && ok; ++i) ok = FullIo(fd, buf, sizeof buf, true) && FullIo(fd, buf, sizeof buf, false);
  double ns = NsSince(t0) / calls;
  ::close(fd);
  ::waitpid(child, nullptr, 0);
  if (!ok) return IoError("loopback echo failed");
  return ns;
}

}  // namespace

Result<nlohmann::json> RunRpcBench(const BenchOptions& options) {
  const int reps = options.quick ? 2 : options.repetitions;
  const int qd1 = options.quick ? 2000 : 20000;
  const int qd128 = options.quick ? 20000 : 200000;
  const std::string path = options.workdir + "/cxlkv-bench-rpc-" + std::to_string(::getpid());
  nlohmann::json machine = MachineJsonWithLimits(options);
  std::vector<double> pingpong, rpc_ns, rpc_ops, server_ops, two_line_ops, qd1_ops, tcp_ns, speedup;
  for (int rep = 0; rep < reps; ++rep) {
    pingpong.push_back(LinePingPongNs(qd1));
    RpcFigures f;
    CXLKV_RETURN_IF_ERROR(MeasureRpc(path, qd1, qd128, &f));
    rpc_ns.push_back(f.qd1_ns);
    rpc_ops.push_back(f.qd128_ops / 1e6);
    server_ops.push_back(f.server_ops / 1e6);
    two_line_ops.push_back(f.qd128_two_line_ops / 1e6);
    qd1_ops.push_back(1e3 / f.qd1_ns);
    CXLKV_ASSIGN_OR_RETURN(double tcp, TcpEchoNs(qd1));
    tcp_ns.push_back(tcp);
    speedup.push_back(tcp / f.qd1_ns);
  }
  nlohmann::json results = nlohmann::json::array();
  results.push_back(FigureJson({"line_pingpong/2proc", "ns/round trip", false, pingpong, "", {},
                                "two processes, store+clflush then invalidate+load each way: the limit"}));
  results.push_back(FigureJson({"rpc_64B_qd1", "ns/round trip", false, rpc_ns, "line_pingpong/2proc", pingpong,
                                "64-byte request and reply (one line each), client node 1 -> server node 0, "
                                "software-coherent; goal ratio <= 2",
                                Goal::RatioAtMost(2)}));
  results.push_back(FigureJson({"tcp_loopback_64B_qd1", "ns/round trip", false, tcp_ns, "", {},
                                "the same echo over TCP on loopback (TCP_NODELAY)"}));
  results.push_back(FigureJson({"rpc_vs_tcp_latency", "x lower latency", true, speedup, "", {},
                                "TCP loopback round trip / RPC round trip, same repetition; goal >= 10",
                                Goal::MedianAtLeast(10)}));
  results.push_back(FigureJson({"rpc_64B_qd128", "Mops", true, rpc_ops, "rpc_64B_qd1_rate", qd1_ops,
                                "one server thread, 128 requests in flight from one client posting before each "
                                "doorbell, client and server on this machine's cores; ratio to the QD1 rate; goal >= 4 Mops",
                                Goal::MedianAtLeast(4)}));
  results.push_back(FigureJson({"rpc_64B_qd128_server", "Mops", true, server_ops, "rpc_64B_qd128", rpc_ops,
                                "the same requests over the server thread's busy time: what it reaches alone"}));
  results.push_back(FigureJson({"rpc_128B_qd128", "Mops", true, two_line_ops, "rpc_64B_qd128", rpc_ops,
                                "two-line requests and replies (112 bytes of payload), otherwise as rpc_64B_qd128"}));
  CXLKV_ASSIGN_OR_RETURN(auto modes, MetadataModeFigures(options));
  for (auto& f : modes) results.push_back(std::move(f));
  nlohmann::json report;
  report["suite"] = "rpc";
  report["machine"] = std::move(machine);
  report["repetitions"] = reps;
  report["results"] = results;
  return report;
}

}  // namespace cxlkv::bench
