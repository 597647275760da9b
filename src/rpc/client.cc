#include "rpc/client.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "pool/pool_internal.h"
#include "region/coherence.h"
#include "sync/node.h"

namespace cxlkv::rpc {
namespace {

// How long a server line may stay unchanged (no beat, no takeover) before the client gives up
// on it: a dead server's node is declared dead after one lease, its lock recovered and granted
// to a standby within about another; a third covers a slow takeover.
constexpr int kSilentLeases = 3;

}  // namespace

Result<std::unique_ptr<RpcClient>> RpcClient::Open(Pool& pool, std::string_view service,
                                                   const RpcClientOptions& options) {
  CXLKV_ASSIGN_OR_RETURN(auto area, RpcArea::Open(pool, service));
  sync::Node& node = *pool.impl().node;
  const uint32_t channel = node.process_slot();
  if (channel >= area->geometry().clients_per_node) {
    return NoSpace("RPC service '" + std::string(service) + "' has " +
                   std::to_string(area->geometry().clients_per_node) + " channels per node and this process is " +
                   "process " + std::to_string(channel) + " of node " + std::to_string(node.id()) +
                   ": run fewer processes per node or re-create the service with more channels");
  }
  auto client = std::unique_ptr<RpcClient>(new RpcClient(pool, std::move(area), channel, options));
  client->SetPresence(true);
  return client;
}

RpcClient::RpcClient(Pool& pool, std::unique_ptr<RpcArea> area, uint32_t channel, const RpcClientOptions& options)
    : node_(*pool.impl().node), area_(std::move(area)), channel_(channel), options_(options) {
  const uint32_t depth = area_->geometry().depth;
  waiting_.assign(depth, 0);
  answered_.assign(depth, 0);
  // Resume the ring after the highest number an earlier owner of this channel published.
  region::MetaAccess& meta = area_->meta();
  uint64_t last = 0;
  for (uint32_t s = 0; s < depth; ++s) last = std::max(last, meta.Fetch(area_->request(node_.id(), channel_, s)));
  next_seq_ = last + 1;
  server_changed_ = Clock::now();
}

RpcClient::~RpcClient() { SetPresence(false); }

// The presence bit is shared by the processes of one node (one host): a local atomic suffices
// (rule 4), and the flush publishes it to servers on other hosts.
void RpcClient::SetPresence(bool present) {
  region::MetaAccess& meta = area_->meta();
  const uint64_t off = area_->presence(node_.id());
  const uint64_t bit = uint64_t{1} << channel_;
  uint64_t cur = meta.Load(off);
  while (!meta.LocalCompareExchange(off, cur, present ? (cur | bit) : (cur & ~bit))) {
  }
  meta.Flush(off, 8);
}

Result<RpcClient::Ticket> RpcClient::Submit(uint32_t opcode, std::span<const uint8_t> payload) {
  std::lock_guard<std::mutex> lock(mu_);
  CXLKV_ASSIGN_OR_RETURN(Ticket t, PostLocked(opcode, payload));
  RingLocked();
  return t;
}

Result<RpcClient::Ticket> RpcClient::Post(uint32_t opcode, std::span<const uint8_t> payload) {
  std::lock_guard<std::mutex> lock(mu_);
  return PostLocked(opcode, payload);
}

void RpcClient::Ring() {
  std::lock_guard<std::mutex> lock(mu_);
  RingLocked();
}

Result<RpcClient::Ticket> RpcClient::PostLocked(uint32_t opcode, std::span<const uint8_t> payload) {
  if (payload.size() > area_->request_capacity()) {
    return InvalidArgument("RPC request of " + std::to_string(payload.size()) + " bytes: service '" +
                           area_->service() + "' takes at most " + std::to_string(area_->request_capacity()));
  }
  region::MetaAccess& meta = area_->meta();
  const uint32_t depth = area_->geometry().depth;
  const uint64_t seq = next_seq_;
  const uint32_t slot = static_cast<uint32_t>((seq - 1) % depth);
  if (waiting_[slot] != 0) {
    return Busy("all " + std::to_string(depth) + " slots of this RPC channel hold requests not yet waited for");
  }
  if (seq > depth && answered_[slot] < seq - depth) {
    // The slot's previous request (an abandoned one, or a dead predecessor's) must be answered
    // first: until then the server may still read the slot.
    const uint64_t w = meta.Fetch(area_->response(node_.id(), channel_, slot));
    if (ResponseState(w) != SlotState::kDone || ResponseSeq(w) < seq - depth) {
      return Busy("the next slot of this RPC channel still holds an unanswered (abandoned) request");
    }
    answered_[slot] = ResponseSeq(w);
  }
  // Everything but the number now; Ring flushes it, then writes the numbers (rule P4).
  const uint64_t req = area_->request(node_.id(), channel_, slot);
  meta.Store(req + 8, (uint64_t{opcode} << 32) | payload.size());
  meta.Write(req + kSlotHeaderBytes, payload.data(), payload.size());
  posted_.push_back({slot, seq, static_cast<uint32_t>(payload.size())});
  waiting_[slot] = seq;
  next_seq_ = seq + 1;
  return seq;
}

// Two fences for any number of posted requests: their lines, then their numbers. The number
// shares the first line with the header and the payload's first bytes, and memory is only
// written 8 bytes at a time atomically (a line fill may see half of a concurrent write-back:
// the simulator does), so the rest of the line is in memory before the number is written.
void RpcClient::RingLocked() {
  if (posted_.empty()) return;
  region::MetaAccess& meta = area_->meta();
  lines_.clear();
  for (const Posted& p : posted_) {
    const uint64_t req = area_->request(node_.id(), channel_, p.slot);
    for (uint64_t l = 0; l < kSlotHeaderBytes + p.length; l += kLine) lines_.push_back(req + l);
  }
  meta.FlushEach(lines_, kLine);  // rule P1: every line of every posted request first
  lines_.clear();
  for (const Posted& p : posted_) {
    const uint64_t req = area_->request(node_.id(), channel_, p.slot);
    meta.Store(req, p.seq);  // rule P4: the number last
    lines_.push_back(req);
  }
  meta.FlushEach(lines_, 8);  // one fence publishes them all
  posted_.clear();
}

void RpcClient::PollLocked(uint32_t slot) {
  region::MetaAccess& meta = area_->meta();
  lines_.clear();
  poll_slots_.clear();
  // The oldest outstanding requests first, a window of them: the server answers a channel in
  // ring order, so a window all answered doubles for the next poll and one that was not shrinks
  // to what was answered. Polling every outstanding line at once would take lines from the
  // server while it writes them.
  const uint32_t depth = area_->geometry().depth;
  bool has_slot = false;
  for (uint64_t seq = next_seq_ > depth ? next_seq_ - depth : 1; seq < next_seq_ && lines_.size() < poll_window_; ++seq) {
    const uint32_t s = static_cast<uint32_t>((seq - 1) % depth);
    if (waiting_[s] != seq || answered_[s] == seq) continue;
    lines_.push_back(area_->response(node_.id(), channel_, s));
    poll_slots_.push_back(s);
    has_slot |= s == slot;
  }
  if (!has_slot && waiting_[slot] != 0 && answered_[slot] != waiting_[slot]) {
    lines_.push_back(area_->response(node_.id(), channel_, slot));
    poll_slots_.push_back(slot);
  }
  if (lines_.empty()) return;
  meta.InvalidateEach(lines_, 8);  // rule P2, one fence for all
  // An answer longer than a line: the lines past its first are read fresh too, all of them
  // with one more fence, before Finish reads them (rule P2).
  std::vector<uint64_t>& rest = rest_lines_;
  rest.clear();
  uint32_t found = 0;
  for (size_t i = 0; i < lines_.size(); ++i) {
    const uint64_t w = meta.Load(lines_[i]);
    const uint32_t s = poll_slots_[i];
    if (ResponseState(w) != SlotState::kDone || ResponseSeq(w) != waiting_[s]) continue;
    answered_[s] = waiting_[s];
    ++found;
    const uint64_t n = static_cast<uint32_t>(meta.Load(lines_[i] + 8));
    if (n <= area_->response_capacity() && kSlotHeaderBytes + n > kLine) {
      for (uint64_t l = kLine; l < kSlotHeaderBytes + n; l += kLine) rest.push_back(lines_[i] + l);
    }
  }
  if (!rest.empty()) meta.InvalidateEach(rest, kLine);
  poll_window_ = found == lines_.size() ? std::min(depth, poll_window_ * 2) : std::max<uint32_t>(1, found);
}

bool RpcClient::Answered(Ticket ticket) {
  if (ticket == 0) return false;
  const uint32_t slot = static_cast<uint32_t>((ticket - 1) % area_->geometry().depth);
  std::lock_guard<std::mutex> lock(mu_);
  if (answered_[slot] == ticket) return true;
  if (waiting_[slot] == ticket) {
    RingLocked();
    PollLocked(slot);
    return answered_[slot] == ticket;
  }
  const uint64_t w = area_->meta().Fetch(area_->response(node_.id(), channel_, slot));
  return ResponseState(w) == SlotState::kDone && ResponseSeq(w) == ticket;
}

void RpcClient::Abandon(Ticket ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint32_t slot = static_cast<uint32_t>((ticket - 1) % area_->geometry().depth);
  if (waiting_[slot] == ticket) waiting_[slot] = 0;
}

Status RpcClient::CheckServer(uint64_t seq) {
  region::MetaAccess& meta = area_->meta();
  meta.Invalidate(area_->server_word(), 16);
  const uint64_t word = meta.Load(area_->server_word());
  const uint64_t beat = meta.Load(area_->server_beat());
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = Clock::now();
  if (word != server_seen_word_ || beat != server_seen_beat_) {
    server_seen_word_ = word;
    server_seen_beat_ = beat;
    server_changed_ = now;
    return Status::Ok();
  }
  const auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(now - server_changed_);
  if (!ServerPresent(word) && silent > node_.lease()) {
    return Unavailable("no server serves RPC service '" + area_->service() + "' (request " + std::to_string(seq) +
                       " waited " + std::to_string(silent.count()) + " ms): start cxlkvd, or retry once it serves");
  }
  if (silent > node_.lease() * kSilentLeases) {
    return Unavailable("the server of RPC service '" + area_->service() + "' (node " +
                       std::to_string(ServerNode(word)) + ", term " + std::to_string(ServerTerm(word)) +
                       ") has been silent for " + std::to_string(silent.count()) +
                       " ms and nobody took over: request " + std::to_string(seq) + " may or may not have run");
  }
  return Status::Ok();
}

Status RpcClient::Finish(uint64_t seq, uint32_t slot, std::span<uint8_t> out, size_t* length) {
  region::MetaAccess& meta = area_->meta();
  const uint64_t resp = area_->response(node_.id(), channel_, slot);
  // Fresh: the poll that saw it answered invalidated its lines (PollLocked), and the server
  // writes the slot again only for this channel's next request there.
  const uint64_t word1 = meta.Load(resp + 8);
  const uint64_t n = static_cast<uint32_t>(word1);
  const uint32_t code = static_cast<uint32_t>(word1 >> 32);
  if (n > area_->response_capacity() || code > static_cast<uint32_t>(StatusCode::kUnavailable)) {
    return Corrupted("malformed RPC response to request " + std::to_string(seq) + " of service '" +
                     area_->service() + "' (status " + std::to_string(code) + ", " + std::to_string(n) + " bytes)");
  }
  if (code != 0) {
    std::string msg(n, '\0');
    meta.Read(resp + kSlotHeaderBytes, msg.data(), n);
    return Status(static_cast<StatusCode>(code), msg);
  }
  if (n > out.size()) {
    return InvalidArgument("RPC response of " + std::to_string(n) + " bytes does not fit a buffer of " +
                           std::to_string(out.size()));
  }
  meta.Read(resp + kSlotHeaderBytes, out.data(), n);
  *length = n;
  return Status::Ok();
}

Result<size_t> RpcClient::Wait(Ticket ticket, std::span<uint8_t> out, Clock::time_point deadline) {
  const uint32_t slot = static_cast<uint32_t>((ticket - 1) % area_->geometry().depth);
  Clock::time_point start{};  // read only when the answer is not in at once: a pipelined
  Clock::time_point next_check{};  // client reaps most answers on the first look
  const auto check_every = node_.lease() / 8;
  uint32_t sleeps = 0;
  for (bool first = true;; first = false) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (first) {
        if (ticket == 0 || waiting_[slot] != ticket) {
          return InvalidArgument("RPC ticket " + std::to_string(ticket) + " is not waiting for an answer");
        }
        RingLocked();  // a posted request is published before anyone waits for it
      }
      if (answered_[slot] != ticket) PollLocked(slot);
      if (answered_[slot] == ticket) {
        size_t n = 0;
        Status s = Finish(ticket, slot, out, &n);
        waiting_[slot] = 0;
        if (!s.ok()) return s;
        return n;
      }
    }
    if (first) {
      start = Clock::now();
      next_check = start + check_every;
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      return Timeout("no answer to RPC request " + std::to_string(ticket) + " of service '" + area_->service() +
                     "' in " + std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(now - start).count()) +
                     " ms: wait again, or abandon it");
    }
    if (now >= next_check) {
      next_check = now + check_every;
      Status alive = CheckServer(ticket);
      if (!alive.ok()) {
        Abandon(ticket);
        return alive;
      }
    }
    if (now - start < options_.spin_without_yield) {
      region::CpuRelax();
      continue;
    }
    if (now - start < options_.spin) {
      // Yield rather than spin: on a machine with fewer cores than busy threads, the server (or
      // the client the server is about to answer) may be waiting for this core.
      std::this_thread::yield();
      continue;
    }
    // 10 µs, 20 µs, ... up to 500 µs: two cores, and a server that sleeps when idle.
    const std::chrono::microseconds sleep(10 * (int64_t{1} << std::min<uint32_t>(sleeps++, 6)));
    std::this_thread::sleep_for(std::min(sleep, std::chrono::microseconds(500)));
  }
}

Result<size_t> RpcClient::Call(uint32_t opcode, std::span<const uint8_t> request, std::span<uint8_t> out) {
  CXLKV_ASSIGN_OR_RETURN(Ticket t, Submit(opcode, request));
  return Wait(t, out, Clock::now() + options_.timeout);
}

Result<std::vector<uint8_t>> RpcClient::Call(uint32_t opcode, std::span<const uint8_t> request) {
  std::vector<uint8_t> out(area_->response_capacity());
  CXLKV_ASSIGN_OR_RETURN(size_t n, Call(opcode, request, out));
  out.resize(n);
  return out;
}

}  // namespace cxlkv::rpc
