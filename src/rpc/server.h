// The serving side of a shared-memory RPC service (Beluga §6.2; docs/rpc.md).
//
//   std::map<uint32_t, rpc::Handler> ops;
//   ops[kEcho] = {[](const rpc::Request& r, std::span<uint8_t> out) -> Result<size_t> {...}};
//   auto server = rpc::RpcServer::Start(pool, "meta", std::move(ops));
//
// One process of the pool serves a service at a time: the one that holds the service's pool
// lock. Any number of processes (one per node, normally each node's cxlkvd) may Start the same
// service; all but one stand by on the lock and the next takes over when the server dies, is
// paused past its lease, or stops. A takeover bumps the term in the server line, then answers
// every request its predecessor accepted but did not answer with kUnavailable ("outcome
// unknown"), so no request runs twice and none is lost silently.
//
// The serving thread polls the next slots of every open channel (a window that grows with the
// channel's bursts, one fence for all; the presence lines, one per node, are re-read every
// millisecond or so), answers what it finds in batches (one fence for a batch of one-line
// answers, one more when an answer spans lines) and, when idle,
// polls a short hot window (yielding the core between polls), then sleeps in growing steps up to `max_idle_sleep` (two cores:
// an idle server costs almost nothing). Before publishing anything it checks that it still
// holds the lock in a valid lease (a fence): a server paused past its lease publishes nothing
// and stands by again.
//
// Thread-safety: Start/Stop/stats from any thread; handlers run on the serving thread only.
#ifndef CXLKV_SRC_RPC_SERVER_H_
#define CXLKV_SRC_RPC_SERVER_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string_view>
#include <thread>
#include <vector>

#include "cxlkv/pool.h"
#include "cxlkv/status.h"
#include "rpc/area.h"
#include "util/histogram.h"

namespace cxlkv::sync {
class Node;
}

namespace cxlkv::rpc {

class RpcServer;

struct Request {
  const RpcServer* server = nullptr;  // to Fence() right before a write others rely on
  uint32_t node = 0;     // the client's node
  uint32_t channel = 0;  // its channel (process slot) on that node
  uint64_t seq = 0;      // the request's number on that channel
  uint32_t opcode = 0;
  std::span<const uint8_t> payload;  // untrusted bytes from another process
};

struct Handler {
  // Answers `request`: writes at most out.size() bytes of response into `out` and returns how
  // many, or an error, whose message the client receives. Runs on the serving thread.
  std::function<Result<size_t>(const Request& request, std::span<uint8_t> out)> run;
  // true: running it twice is harmless (a lookup); after a takeover it simply runs again.
  // false: the server publishes "accepted" before running it, and a successor answers an
  // accepted request with kUnavailable instead of running it again. Default true.
  bool idempotent = true;
};

struct RpcServerOptions {
  RpcGeometry geometry;                            // used only when the service's area is created
  std::chrono::microseconds hot_window{200};       // keep polling this long after the last request. Default 200 µs.
  // Of that, poll without yielding the core this long (a client's next request usually comes
  // within a round trip; a yield costs more than one on a VM). Default 3 µs.
  std::chrono::microseconds spin_without_yield{3};
  std::chrono::microseconds max_idle_sleep{1000};  // longest idle sleep between polls. Default 1 ms.
  uint32_t max_batch = 128;                        // requests answered per fence. Default 128.
  // Called on the serving thread when this process begins serving (after the takeover, before
  // the first request) and when it stops serving. Optional.
  std::function<void(const RpcServer& server, bool serving)> on_serving;
  // Called on the serving thread about every `tick_every` while it serves, between batches (a
  // service's housekeeping). Optional.
  std::function<void()> on_tick;
  std::chrono::milliseconds tick_every{250};
};

struct RpcServerStats {
  uint64_t requests = 0;      // answered by this server
  uint64_t batches = 0;       // polls that found at least one request
  uint64_t errors = 0;        // answered with an error (handler, malformed, unknown opcode)
  uint64_t takeovers = 0;     // terms this process began
  uint64_t unknown_outcome = 0;  // accepted by a predecessor, answered kUnavailable at takeover
  bool serving = false;
  // Time the serving thread spent on polls that found requests and on answering them: what it
  // would take alone, without the clients' share of the machine or its idle polls.
  uint64_t busy_ns = 0;
};

class RpcServer {
 public:
  // Opens (or creates) the service's area and starts the serving thread, which stands by until
  // it holds the service's lock. `ops` maps opcodes to handlers.
  static Result<std::unique_ptr<RpcServer>> Start(Pool& pool, std::string_view service,
                                                  std::map<uint32_t, Handler> ops,
                                                  const RpcServerOptions& options = {});
  // Stops serving: the batch in hand is answered, the server word cleared (clients see "no
  // server" at once instead of waiting a lease) and the lock released for a standby server.
  ~RpcServer();
  RpcServer(const RpcServer&) = delete;
  RpcServer& operator=(const RpcServer&) = delete;

  RpcServerStats stats() const;
  // Ok iff this process still serves: it holds the service's lock in a valid lease. A handler
  // calls it right before each write others rely on (as the server does before publishing).
  Status Fence() const;
  const RpcArea& area() const { return *area_; }
  // Per request: from the poll that found it to the publish of its answer.
  const util::LatencyHistogram& service_time() const { return service_time_; }
  // Blocks until this process serves or `timeout` passes; true when it serves.
  bool WaitServing(std::chrono::milliseconds timeout) const;

 private:
  RpcServer(Pool& pool, std::unique_ptr<RpcArea> area, std::map<uint32_t, Handler> ops,
            const RpcServerOptions& options);
  struct Pending;
  void Run();
  Status TakeOver();
  Status Serve();
  void RefreshPresence();
  void Collect(std::vector<Pending>& batch);
  Status Answer(const std::vector<Pending>& batch);
  void Beat();

  Pool& pool_;
  sync::Node& node_;
  std::unique_ptr<RpcArea> area_;
  std::map<uint32_t, Handler> ops_;
  RpcServerOptions options_;
  std::atomic<bool> stop_{false};
  std::thread thread_;

  // Serving thread only.
  uint32_t term_ = 0;
  uint64_t beat_ = 0;
  std::chrono::steady_clock::time_point next_beat_{};
  std::chrono::steady_clock::time_point next_presence_{};
  std::vector<uint64_t> expected_;     // per (node, channel): the next request number
  std::vector<uint32_t> active_;       // (node, channel) indices with their presence bit set
  std::vector<uint32_t> window_;       // per (node, channel): slots to probe ahead on the next poll
  size_t next_channel_ = 0;            // the active channel probed first on the next poll
  std::vector<uint64_t> probe_;        // scratch of Collect: request lines probed this poll...
  std::vector<std::pair<uint32_t, uint32_t>> probe_windows_;  // ...per channel index, how many
  std::vector<uint64_t> lines_;        // scratch of Answer: lines flushed or invalidated together
  std::vector<uint8_t> request_buf_;
  std::vector<uint8_t> response_buf_;

  std::atomic<uint64_t> requests_{0}, batches_{0}, errors_{0}, takeovers_{0}, unknown_{0}, busy_ns_{0};
  std::atomic<bool> serving_{false};
  util::LatencyHistogram service_time_;
};

}  // namespace cxlkv::rpc

#endif  // CXLKV_SRC_RPC_SERVER_H_
