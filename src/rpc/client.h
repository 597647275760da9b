// The calling side of a shared-memory RPC service (Beluga §6.2; docs/rpc.md).
//
//   auto client = rpc::RpcClient::Open(pool, "meta");
//   auto t = (*client)->Submit(kLookup, request_bytes);          // up to `depth` in flight
//   auto n = (*client)->Wait(*t, reply_buffer, deadline);        // bytes of the answer
//   auto bytes = (*client)->Call(kLookup, request_bytes);        // Submit + Wait
//   for (...) (*client)->Post(kLookup, request_bytes);           // many requests, then
//   (*client)->Ring();                                           // one doorbell for all
//
// A process's channel is the one of its process slot on its node (sync::Node::process_slot), so
// a channel has one writer; a process that takes over the slot of a dead one resumes the
// channel's ring where the dead one left it (its last requests are still answered, to nobody).
// A request is written to its ring slot (payload and opcode, flushed), then its number is
// published in one word (rule P4): never in the same write-back as the rest of its line, since
// memory is atomic only 8 bytes at a time. Posted requests share one doorbell: their flushes
// are issued together, fenced once, and their numbers published with one more fence.
// The answer is awaited by polling the response words of every outstanding request at once
// (one fence for all), a short spin, then sleeps that grow to half a millisecond. Every wait has a deadline; while
// waiting the client watches the server line, so a server that dies or is paused is noticed
// (its beat stops) and the call fails with kUnavailable when nobody takes over within leases —
// or completes when a successor answers.
//
// Thread-safety: all methods are thread-safe; each ticket is waited for by one thread.
#ifndef CXLKV_SRC_RPC_CLIENT_H_
#define CXLKV_SRC_RPC_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string_view>
#include <vector>

#include "cxlkv/pool.h"
#include "cxlkv/status.h"
#include "rpc/area.h"

namespace cxlkv::sync {
class Node;
}

namespace cxlkv::rpc {

struct RpcClientOptions {
  std::chrono::milliseconds timeout{5000};  // deadline of Call. Default 5 s.
  std::chrono::microseconds spin{50};       // poll without sleeping this long first. Default 50 µs.
  // Of that, poll without yielding the core this long: a round trip takes a few µs and a yield
  // costs more than one on a VM (1.4 µs measured), but when busy threads outnumber cores the
  // server may be waiting for this one. Default 3 µs.
  std::chrono::microseconds spin_without_yield{3};
};

class RpcClient {
 public:
  using Clock = std::chrono::steady_clock;
  using Ticket = uint64_t;

  // Opens the service's channel of this process. Errors: kNotFound (no such service in the
  // pool), kNoSpace (this process's slot has no channel: more processes on the node than the
  // service has channels per node), and those of RpcArea::Open.
  static Result<std::unique_ptr<RpcClient>> Open(Pool& pool, std::string_view service,
                                                 const RpcClientOptions& options = {});
  // Withdraws the channel from the server's polling.
  ~RpcClient();
  RpcClient(const RpcClient&) = delete;
  RpcClient& operator=(const RpcClient&) = delete;

  // Publishes a request (Post + Ring). Errors: kInvalidArgument (payload larger than
  // request_capacity()), kBusy (every slot of the ring holds a request not yet waited for or
  // answered).
  Result<Ticket> Submit(uint32_t opcode, std::span<const uint8_t> payload);
  // Writes a request into its slot without publishing it: the next Ring (or a Wait, which
  // rings first) publishes every posted request with one fence, or two when one of them spans
  // more than a line (the lines past the first, fence, the first lines with their numbers,
  // fence). Errors as Submit.
  Result<Ticket> Post(uint32_t opcode, std::span<const uint8_t> payload);
  // The doorbell: publishes every posted request.
  void Ring();
  // Waits for the answer to `ticket` and copies it into `out`; returns its length. Errors: the
  // handler's (its code and message), kTimeout at `deadline` (the ticket stays valid: wait
  // again or Abandon it), kUnavailable (the server died and nobody took over), kInvalidArgument
  // (`out` too small: the answer is dropped), kCorrupted (a malformed response).
  Result<size_t> Wait(Ticket ticket, std::span<uint8_t> out, Clock::time_point deadline);
  // True once `ticket`'s answer is published: Wait then returns at once. One poll of every
  // outstanding request's response word (one fence), unless an earlier poll saw it answered.
  bool Answered(Ticket ticket);
  // Forgets a ticket whose answer is not wanted; its slot is reused once it is answered.
  void Abandon(Ticket ticket);
  // Submit + Wait with the options' timeout.
  Result<size_t> Call(uint32_t opcode, std::span<const uint8_t> request, std::span<uint8_t> out);
  Result<std::vector<uint8_t>> Call(uint32_t opcode, std::span<const uint8_t> request);

  const RpcArea& area() const { return *area_; }
  uint64_t request_capacity() const { return area_->request_capacity(); }
  uint64_t response_capacity() const { return area_->response_capacity(); }
  uint32_t channel() const { return channel_; }

 private:
  RpcClient(Pool& pool, std::unique_ptr<RpcArea> area, uint32_t channel, const RpcClientOptions& options);
  void SetPresence(bool present);
  // Under mu_.
  Result<Ticket> PostLocked(uint32_t opcode, std::span<const uint8_t> payload);
  void RingLocked();
  // Reads the response words of the oldest requests waiting for an answer, and of `slot`'s
  // (one fence for all), notes in answered_ those whose answer is published, and invalidates
  // the further lines of those (one more fence): Finish reads an answer noted there without
  // another invalidate.
  void PollLocked(uint32_t slot);
  // Watches the server line; kUnavailable when nobody serves or the server is silent too long.
  Status CheckServer(uint64_t seq);
  Status Finish(uint64_t seq, uint32_t slot, std::span<uint8_t> out, size_t* length);

  sync::Node& node_;
  std::unique_ptr<RpcArea> area_;
  uint32_t channel_;
  RpcClientOptions options_;

  std::mutex mu_;
  uint64_t next_seq_ = 1;             // guarded by mu_
  std::vector<uint64_t> waiting_;     // per slot: the ticket's request number not yet waited for (0: none)
  std::vector<uint64_t> answered_;    // per slot: the highest request number seen answered there
  struct Posted {
    uint32_t slot;
    uint64_t seq;
    uint32_t length;  // payload bytes
  };
  std::vector<Posted> posted_;        // written, not yet rung
  std::vector<uint64_t> lines_;       // scratch: lines to flush or invalidate together
  std::vector<uint32_t> poll_slots_;  // scratch: the slot of each polled line
  std::vector<uint64_t> rest_lines_;  // scratch: lines past the first of answers just seen
  uint32_t poll_window_ = 1;          // outstanding requests the next poll reads
  uint64_t server_seen_word_ = 0;     // guarded by mu_: the server line as last read...
  uint64_t server_seen_beat_ = 0;
  Clock::time_point server_changed_;  // ...and when it last changed
};

}  // namespace cxlkv::rpc

#endif  // CXLKV_SRC_RPC_CLIENT_H_
