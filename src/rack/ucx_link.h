// The rack link's transport (docs/racks.md, "The link over UCX"): one rack link talks to
// another's over UCX, client–server endpoints on a socket address, messages as UCX active
// messages. A message is a rack-link message (link_messages.h) and, for block data, a payload:
//
//   kControlAm  data = the encoded message (eager; a hello, a lookup, an announce, an answer)
//   kPayloadAm  header = the encoded message, data = its payload (UCX picks eager or
//               rendezvous by size; a rendezvous payload lands straight in the buffer the
//               receiver names, e.g. a block it reserved in its own pool)
//
// Every connection runs the challenge-response of link_auth.h first; until it completes, the
// only messages read are the handshake's, and a payload is dropped unread.
//
// Threads: one progress thread owns the UCX worker and makes every UCX call. It waits on the
// worker's event fd (ucp_worker_arm, then poll) and never spins while idle; callers hand it work
// through a queue and wake it with ucp_worker_signal. Handlers and sinks run on it, so they
// must not block on the network (reading the pool is fine).
//
// Failures: endpoints run with UCP_ERR_HANDLING_MODE_PEER, so a peer that dies or whose link
// goes away fails the endpoint; every call in flight on it ends with kUnavailable naming the
// peer and UCX's reason, never a hang. A call past its deadline closes its connection (UCX
// cancels what was in flight on it), so no payload can land in a buffer after the call
// returned. The next call to that address connects again, and authenticates again.
//
// UCX payloads are not encrypted (as in NIXL and Mooncake): the link assumes a network only the
// racks reach (docs/racks.md, "What the link assumes").
#ifndef CXLKV_SRC_RACK_UCX_LINK_H_
#define CXLKV_SRC_RACK_UCX_LINK_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "cxlkv/status.h"
#include "rack/link_auth.h"
#include "rack/link_messages.h"

namespace cxlkv::rack {

struct UcxLinkOptions {
  std::string rack;   // this rack's name (membership.h)
  int64_t life = 1;   // its life: what the handshake tells peers
  // "IP:port" to accept peers on ("" : this link only dials out; port 0: any free port).
  std::string listen;
  // UCX's transports for this link (UCX_TLS: "tcp", "rc,tcp", ...); "" : UCX_TLS from the
  // environment, or UCX's own choice.
  std::string transports;
  std::chrono::milliseconds connect_timeout{3000};  // connect + handshake
};

// What an authenticated peer said, and how to answer it.
class LinkReply {
 public:
  virtual ~LinkReply() = default;
  // Sends `m` (its id should be the request's) to the peer; with a payload, as kPayloadAm.
  // `payload` must stay valid until `done` runs (on the progress thread) with the send's end.
  virtual void Send(const LinkMessage& m, std::span<const uint8_t> payload = {},
                    std::function<void(Status)> done = nullptr) = 0;
  // Runs `next` on the progress thread after UCX has progressed what is queued, with a reply to
  // the same peer: a handler that streams many payloads prepares one while the last is on the
  // wire. If the connection closed meanwhile, `next` still runs and its sends end at once with
  // the connection's error (so what they hold is released).
  virtual void Later(std::function<void(LinkReply&)> next) = 0;
  virtual const std::string& peer_rack() const = 0;
  virtual int64_t peer_life() const = 0;
};

// Serves requests from authenticated peers (lookups, announces, fetches). Runs on the progress
// thread; `reply` is valid only during the call (a handler that answers later keeps nothing of it).
using LinkRequestHandler = std::function<void(const LinkMessage& request, LinkReply& reply)>;

// The asking side of a call whose answer is a stream: zero or more messages with payloads,
// then one message that ends it. Runs on the progress thread.
class LinkStreamSink {
 public:
  virtual ~LinkStreamSink() = default;
  // A message with a payload of `bytes`: where to put the payload (exactly `bytes` long), or an
  // error to drop it (the stream goes on; Arrived is not called for it).
  virtual Result<std::span<uint8_t>> PayloadBuffer(const LinkMessage& m, uint64_t bytes) = 0;
  // The payload of `m` is all in its buffer (ok), or never will be.
  virtual void Arrived(const LinkMessage& m, Status status) = 0;
  // A message without a payload: true if it ends the stream.
  virtual bool Message(const LinkMessage& m) = 0;
};

class UcxLink {
 public:
  // Creates the UCX context and worker, the listener when options.listen is set, and the
  // progress thread. Errors: kInvalidArgument (bad address, name), kUnavailable (UCX could not
  // start: the message names UCX's reason, and UCX_TLS when it was set).
  static Result<std::unique_ptr<UcxLink>> Start(UcxLinkOptions options, PoolSecret secret,
                                                LinkRequestHandler handler);
  ~UcxLink();  // closes every endpoint, ends every call in flight (kUnavailable), joins

  // The address peers dial ("IP:port"), with the port the listener got; "" without a listener.
  const std::string& address() const;

  // One request, one answer (the first message back with the request's id). Connects and
  // authenticates first when there is no connection to `peer` yet. Errors: kUnavailable (cannot
  // connect, the peer failed), kPermissionDenied (the handshake refused: the message says why),
  // kTimedOut, the peer's kError answer as its status.
  Result<LinkMessage> Call(const std::string& peer, LinkBody request, std::chrono::milliseconds timeout);
  // A request whose answer is a stream (a fetch): returns when `sink` said it ended and every
  // payload it asked for arrived or failed, or on failure or the deadline — and in every case
  // only once no payload can still land in a buffer the sink handed out.
  Status Stream(const std::string& peer, LinkBody request, LinkStreamSink& sink, std::chrono::milliseconds timeout);

  // Counters (monotonic), for metrics and tests.
  struct Counters {
    uint64_t connections = 0;      // authenticated, both directions
    uint64_t refused = 0;          // handshakes that failed, both directions
    uint64_t peer_failures = 0;    // endpoints UCX failed (a peer died, a link went down)
    uint64_t payload_bytes_in = 0;
    uint64_t payload_bytes_out = 0;
    uint64_t dropped = 0;          // messages dropped: malformed, unauthenticated, unexpected
  };
  Counters counters() const;
  // The last refusal or failure, for operators (empty: none).
  std::string last_problem() const;

  class Impl;

 private:
  explicit UcxLink(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace cxlkv::rack

#endif  // CXLKV_SRC_RACK_UCX_LINK_H_
