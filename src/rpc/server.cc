#include "rpc/server.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "pool/pool_internal.h"
#include "region/coherence.h"
#include "sync/node.h"

namespace cxlkv::rpc {
namespace {

using Clock = std::chrono::steady_clock;

// The lines [off, off + n) covers, for a batched flush.
void AppendLines(std::vector<uint64_t>& out, uint64_t off, uint64_t n) {
  for (uint64_t l = off / kLine * kLine; l < off + n; l += kLine) out.push_back(l);
}

}  // namespace

struct RpcServer::Pending {
  uint32_t node;
  uint32_t channel;
  uint32_t slot;
  uint64_t seq;
  uint32_t opcode;
  uint32_t length;  // as the client wrote it: untrusted until checked against the slot
};

Result<std::unique_ptr<RpcServer>> RpcServer::Start(Pool& pool, std::string_view service,
                                                    std::map<uint32_t, Handler> ops,
                                                    const RpcServerOptions& options) {
  for (const auto& [op, h] : ops) {
    if (!h.run) return InvalidArgument("RPC opcode " + std::to_string(op) + " has no handler");
  }
  if (options.max_batch < 1) return InvalidArgument("RPC server batch must be at least 1");
  CXLKV_ASSIGN_OR_RETURN(auto area, RpcArea::OpenOrCreate(pool, service, options.geometry));
  auto server = std::unique_ptr<RpcServer>(new RpcServer(pool, std::move(area), std::move(ops), options));
  server->thread_ = std::thread([s = server.get()] { s->Run(); });
  return server;
}

RpcServer::RpcServer(Pool& pool, std::unique_ptr<RpcArea> area, std::map<uint32_t, Handler> ops,
                     const RpcServerOptions& options)
    : pool_(pool), node_(*pool.impl().node), area_(std::move(area)), ops_(std::move(ops)), options_(options) {
  request_buf_.resize(area_->request_capacity());
  response_buf_.resize(area_->response_capacity());
}

RpcServer::~RpcServer() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

RpcServerStats RpcServer::stats() const {
  return {requests_.load(), batches_.load(), errors_.load(), takeovers_.load(), unknown_.load(), serving_.load(),
          busy_ns_.load()};
}

Status RpcServer::Fence() const { return node_.CheckHeld(area_->lock()); }

bool RpcServer::WaitServing(std::chrono::milliseconds timeout) const {
  const auto deadline = Clock::now() + timeout;
  while (!serving_.load()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// Stand by on the service's lock; serve while it is held; give it back when stopping or when
// the fence says this process may no longer act.
void RpcServer::Run() {
  const uint32_t lock = area_->lock();
  while (!stop_.load()) {
    auto held = node_.AcquireFor(lock, std::chrono::milliseconds(200));
    if (!held.ok()) {
      if (held.status().code() != StatusCode::kTimeout) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    Status s = TakeOver();
    if (s.ok()) {
      if (options_.on_serving) options_.on_serving(*this, true);
      serving_.store(true);
      s = Serve();
      serving_.store(false);
      if (options_.on_serving) options_.on_serving(*this, false);
    }
    // A clean stop tells clients at once that nobody serves, rather than after a lease.
    if (stop_.load() && node_.CheckHeld(lock).ok()) area_->meta().Publish(area_->server_word(), 0);
    node_.Release(lock);
  }
}

// The takeover: a new term in the server line, then every slot read once so the rings resume
// where the predecessor stopped, and what it accepted without answering is answered now.
Status RpcServer::TakeOver() {
  region::MetaAccess& meta = area_->meta();
  CXLKV_RETURN_IF_ERROR(node_.CheckHeld(area_->lock()));
  const uint64_t prev = meta.Fetch(area_->server_word());
  term_ = (ServerTerm(prev) + 1) & 0xffffff;
  beat_ = meta.Fetch(area_->server_beat());
  meta.Publish(area_->server_word(), ServerWord(node_.id(), node_.incarnation(), term_));
  Beat();
  takeovers_.fetch_add(1);

  const RpcGeometry& g = area_->geometry();
  const uint32_t channels = area_->max_nodes() * g.clients_per_node;
  expected_.assign(channels, 1);
  window_.assign(channels, 1);
  for (uint32_t n = 0; n < area_->max_nodes(); ++n) {
    for (uint32_t c = 0; c < g.clients_per_node; ++c) {
      uint64_t done = 0;
      for (uint32_t s = 0; s < g.depth; ++s) {
        const uint64_t resp = area_->response(n, c, s);
        const uint64_t word = meta.Fetch(resp);
        uint64_t seq = ResponseSeq(word);
        if (ResponseState(word) == SlotState::kAccepted) {
          // Run by the predecessor, or not, or half: only the client can find out. Say so.
          static constexpr char kMsg[] =
              "the RPC server stopped after accepting this request: its outcome is unknown; check and retry";
          const uint32_t n_msg = static_cast<uint32_t>(std::min<uint64_t>(sizeof kMsg - 1, area_->response_capacity()));
          meta.Store(resp + 8, (uint64_t{static_cast<uint32_t>(StatusCode::kUnavailable)} << 32) | n_msg);
          meta.Write(resp + kSlotHeaderBytes, kMsg, n_msg);
          meta.Flush(resp, kSlotHeaderBytes + n_msg);
          meta.Publish(resp, ResponseWord(seq, SlotState::kDone));
          unknown_.fetch_add(1);
        } else if (ResponseState(word) != SlotState::kDone) {
          seq = 0;
        }
        done = std::max(done, seq);
      }
      expected_[n * g.clients_per_node + c] = done + 1;
    }
  }
  RefreshPresence();
  return Status::Ok();
}

void RpcServer::Beat() {
  area_->meta().Publish(area_->server_beat(), ++beat_);
  next_beat_ = Clock::now() + node_.lease() / 8;
}

void RpcServer::RefreshPresence() {
  region::MetaAccess& meta = area_->meta();
  const uint32_t clients = area_->geometry().clients_per_node;
  active_.clear();
  for (uint32_t n = 0; n < area_->max_nodes(); ++n) {
    const uint64_t bits = meta.Fetch(area_->presence(n));
    for (uint32_t c = 0; c < clients; ++c) {
      if (bits & (uint64_t{1} << c)) active_.push_back(n * clients + c);
    }
  }
  next_presence_ = Clock::now() + std::chrono::milliseconds(1);
}

Status RpcServer::Serve() {
  std::vector<Pending> batch;
  batch.reserve(options_.max_batch);
  auto last_work = Clock::now();
  auto next_tick = last_work;
  uint32_t idle_rounds = 0;
  while (!stop_.load()) {
    const auto now = Clock::now();
    if (now >= next_beat_) {
      CXLKV_RETURN_IF_ERROR(node_.CheckHeld(area_->lock()));
      Beat();
    }
    if (options_.on_tick && now >= next_tick) {
      options_.on_tick();
      next_tick = Clock::now() + options_.tick_every;
    }
    if (now >= next_presence_) RefreshPresence();
    batch.clear();
    Collect(batch);
    if (!batch.empty()) {
      const auto found = Clock::now();
      CXLKV_RETURN_IF_ERROR(Answer(batch));
      const auto answered = Clock::now();
      service_time_.Record(answered - found, batch.size());
      busy_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(answered - now).count(),
                         std::memory_order_relaxed);
      last_work = Clock::now();
      idle_rounds = 0;
      continue;
    }
    if (now - last_work < options_.spin_without_yield) {
      region::CpuRelax();
      continue;
    }
    if (now - last_work < options_.hot_window) {
      // Yield rather than spin: with fewer cores than busy threads, the clients whose requests
      // this thread waits for may be waiting for this core (a yield with nothing else runnable
      // returns at once). docs/metadata.md has the figures.
      std::this_thread::yield();
      continue;
    }
    // Idle: sleep 20 µs, 40 µs, ... up to max_idle_sleep, so a burst after a pause is seen soon
    // and an idle server costs almost nothing.
    const std::chrono::microseconds sleep(20 * (int64_t{1} << std::min<uint32_t>(idle_rounds, 10)));
    std::this_thread::sleep_for(std::min(sleep, options_.max_idle_sleep));
    ++idle_rounds;
  }
  return Status::Ok();
}

// Reads the next requests of every open channel and takes those published in order there. Each
// channel is probed a window of slots ahead, all windows invalidated with one fence: a window a
// channel filled doubles for the next poll (up to the ring), one it did not fill shrinks to what
// it held, so a pipelined client's burst is taken in a few polls and an idle channel costs a line.
void RpcServer::Collect(std::vector<Pending>& batch) {
  region::MetaAccess& meta = area_->meta();
  const RpcGeometry& g = area_->geometry();
  probe_.clear();
  probe_windows_.clear();
  uint32_t budget = options_.max_batch;
  const size_t channels = active_.size();
  for (size_t k = 0; k < channels && budget > 0; ++k) {
    const uint32_t idx = active_[(next_channel_ + k) % channels];
    const uint32_t n = idx / g.clients_per_node;
    const uint32_t c = idx % g.clients_per_node;
    const uint32_t w = std::min(window_[idx], budget);
    budget -= w;
    for (uint32_t i = 0; i < w; ++i) {
      probe_.push_back(area_->request(n, c, static_cast<uint32_t>((expected_[idx] - 1 + i) % g.depth)));
    }
    probe_windows_.push_back({idx, w});
  }
  if (channels > 0) next_channel_ = (next_channel_ + 1) % channels;  // no channel always goes first
  if (probe_.empty()) return;
  meta.InvalidateEach(probe_, kLine);  // rule P2: the clients' requests, not our stale copies
  size_t at = 0;
  for (const auto& [idx, w] : probe_windows_) {
    const uint32_t n = idx / g.clients_per_node;
    const uint32_t c = idx % g.clients_per_node;
    uint32_t found = 0;
    while (found < w) {
      const uint64_t seq = expected_[idx];
      const uint64_t off = probe_[at + found];
      if (meta.Load(off) != seq) break;
      const uint64_t word1 = meta.Load(off + 8);
      batch.push_back({n, c, static_cast<uint32_t>((seq - 1) % g.depth), seq, static_cast<uint32_t>(word1 >> 32),
                       static_cast<uint32_t>(word1)});
      expected_[idx] = seq + 1;
      ++found;
    }
    at += w;
    window_[idx] = found == w ? std::min(g.depth, w * 2) : std::max(1u, found);
  }
}

// Runs a batch and publishes its responses (rule P4, fencing): every line of every answer but
// its number is written and flushed (one fence); then, right after the fence that says this
// process still serves, the "done" numbers, published by one more flush batch. The number
// shares its line with the status, the length and the payload's first 48 bytes, and memory is
// written atomically only 8 bytes at a time, so that line is in memory before its number is.
// Two fences for a batch (and one more before running non-idempotent requests).
Status RpcServer::Answer(const std::vector<Pending>& batch) {
  region::MetaAccess& meta = area_->meta();
  const uint32_t lock = area_->lock();
  CXLKV_RETURN_IF_ERROR(node_.CheckHeld(lock));
  std::vector<uint64_t>& lines = lines_;
  lines.clear();
  for (const Pending& p : batch) {
    auto it = ops_.find(p.opcode);
    if (it != ops_.end() && !it->second.idempotent) {
      meta.Store(area_->response(p.node, p.channel, p.slot), ResponseWord(p.seq, SlotState::kAccepted));
      lines.push_back(area_->response(p.node, p.channel, p.slot));
    }
  }
  if (!lines.empty()) meta.FlushEach(lines, 8);
  // Collect read line 0 of each request fresh; the lines past it are invalidated together.
  lines.clear();
  for (const Pending& p : batch) {
    if (p.length <= area_->request_capacity() && kSlotHeaderBytes + p.length > kLine) {
      AppendLines(lines, area_->request(p.node, p.channel, p.slot) + kLine, kSlotHeaderBytes + p.length - kLine);
    }
  }
  if (!lines.empty()) meta.InvalidateEach(lines, kLine);  // rule P2
  lines.clear();
  for (const Pending& p : batch) {
    const uint64_t req = area_->request(p.node, p.channel, p.slot);
    const uint64_t resp = area_->response(p.node, p.channel, p.slot);
    Result<size_t> answer = 0;
    auto it = ops_.find(p.opcode);
    if (p.length > area_->request_capacity()) {
      answer = InvalidArgument("malformed RPC request: a payload of " + std::to_string(p.length) +
                               " bytes in a slot that holds " + std::to_string(area_->request_capacity()));
    } else if (it == ops_.end()) {
      answer = InvalidArgument("RPC service '" + area_->service() + "' has no opcode " + std::to_string(p.opcode));
    } else {
      meta.Read(req + kSlotHeaderBytes, request_buf_.data(), p.length);
      Request r{this, p.node, p.channel, p.seq, p.opcode, {request_buf_.data(), p.length}};
      answer = it->second.run(r, {response_buf_.data(), response_buf_.size()});
      if (answer.ok() && *answer > response_buf_.size()) {
        answer = Internal("RPC handler of opcode " + std::to_string(p.opcode) + " overran its response buffer");
      }
    }
    const uint8_t* body = response_buf_.data();
    uint64_t length = 0;
    StatusCode code = StatusCode::kOk;
    if (answer.ok()) {
      length = *answer;
    } else {
      const Status failed = answer.status();
      code = failed.code();
      const std::string& msg = failed.message();
      length = std::min<uint64_t>(msg.size(), area_->response_capacity());
      std::memcpy(response_buf_.data(), msg.data(), length);
      errors_.fetch_add(1, std::memory_order_relaxed);
    }
    meta.Store(resp + 8, (uint64_t{static_cast<uint32_t>(code)} << 32) | length);
    meta.Write(resp + kSlotHeaderBytes, body, length);
    AppendLines(lines, resp, kSlotHeaderBytes + length);
  }
  meta.FlushEach(lines, kLine);  // rule P1: every line of every answer first
  CXLKV_RETURN_IF_ERROR(node_.CheckHeld(lock));
  lines.clear();
  for (const Pending& p : batch) {
    const uint64_t resp = area_->response(p.node, p.channel, p.slot);
    meta.Store(resp, ResponseWord(p.seq, SlotState::kDone));  // rule P4: last
    lines.push_back(resp);
  }
  meta.FlushEach(lines, 8);
  requests_.fetch_add(batch.size(), std::memory_order_relaxed);
  batches_.fetch_add(1, std::memory_order_relaxed);
  return Status::Ok();
}

}  // namespace cxlkv::rpc
