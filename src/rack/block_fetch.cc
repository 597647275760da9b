#include "rack/block_fetch.h"

#include <xxhash.h>

#include <memory>
#include <vector>

#include "region/coherence.h"

namespace cxlkv::rack {
namespace {

// The asker's view of one fetch while it streams in (the link's progress thread calls it).
class ReservationSink final : public LinkStreamSink {
 public:
  enum class State : uint8_t { kWaiting, kReceiving, kVerified, kRejected };

  ReservationSink(KvCache& cache, std::vector<BlockKey> keys, std::vector<Reservation> rs)
      : cache_(cache), keys_(std::move(keys)), reservations_(std::move(rs)), states_(keys_.size(), State::kWaiting) {}

  Result<std::span<uint8_t>> PayloadBuffer(const LinkMessage& m, uint64_t bytes) override {
    const auto* b = std::get_if<LinkFetchBlock>(&m.body);
    // Untrusted: the holder names the block; only a block asked for, not yet arrived, of
    // exactly the reserved size, gets a buffer.
    if (!b || b->index >= keys_.size() || !(b->key == keys_[b->index]) || b->bytes != bytes ||
        bytes != reservations_[b->index].bytes || states_[b->index] != State::kWaiting) {
      ++rejected_;
      return InvalidArgument("a fetched block that was not asked for, or of the wrong size");
    }
    states_[b->index] = State::kReceiving;
    return std::span<uint8_t>(cache_.ReservedPtr(reservations_[b->index]), bytes);
  }

  void Arrived(const LinkMessage& m, Status status) override {
    const auto& b = std::get<LinkFetchBlock>(m.body);
    uint8_t* p = cache_.ReservedPtr(reservations_[b.index]);
    if (status.ok() && XXH3_64bits(p, b.bytes) == b.checksum) {
      // The payload was written with ordinary stores (by UCX): out of this host's cache before
      // it may be published (P3). One fence for all of them, before the commit.
      region::FlushLinesUnfenced(p, b.bytes);
      states_[b.index] = State::kVerified;
    } else {
      states_[b.index] = State::kRejected;
      ++rejected_;
    }
  }

  bool Message(const LinkMessage& m) override { return std::holds_alternative<LinkFetchEnd>(m.body); }

  // After the stream: only whole, verified blocks are committed; every other reservation is
  // aborted. Called once no payload can still land (UcxLink::Stream's guarantee).
  void Settle(FetchOutcome& out) {
    std::vector<Reservation> commit, abort;
    for (size_t i = 0; i < keys_.size(); ++i) {
      (states_[i] == State::kVerified ? commit : abort).push_back(reservations_[i]);
      if (states_[i] == State::kVerified) out.bytes += reservations_[i].bytes;
    }
    region::FullFence();
    const Status committed = cache_.CommitMany(commit);
    const Status aborted = cache_.AbortMany(abort);
    out.fetched = committed.ok() ? commit.size() : 0;
    if (!committed.ok() && out.link.ok()) out.link = committed;
    if (!aborted.ok() && out.link.ok()) out.link = aborted;
    out.rejected = rejected_;
  }
  bool verified(size_t i) const { return states_[i] == State::kVerified; }

 private:
  KvCache& cache_;
  std::vector<BlockKey> keys_;
  std::vector<Reservation> reservations_;
  std::vector<State> states_;
  size_t rejected_ = 0;
};

}  // namespace

Result<FetchOutcome> BlockFetcher::Fetch(const std::string& holder, const KeyNamespace& ns,
                                         std::span<const BlockKey> keys, std::chrono::milliseconds timeout) {
  if (keys.empty() || keys.size() > kLinkMaxFetchKeys) {
    return InvalidArgument("fetch: 1 to " + std::to_string(kLinkMaxFetchKeys) + " keys at a time");
  }
  CXLKV_ASSIGN_OR_RETURN(const NamespaceHandle handle, cache_.Namespace(ns));
  if (handle.block_bytes == 0) {
    return InvalidArgument("fetch: namespace '" + ns.model_id +
                           "' has no KV layout (num_layers 0): a fetch must know the block size before bytes arrive");
  }
  CXLKV_ASSIGN_OR_RETURN(std::vector<KeyReservation> rs, cache_.ReserveMany(handle, keys, handle.block_bytes));

  // The run to make READY: up to the first key being written by another writer here, or with
  // no room. Keys READY already are not asked for; reservations past the run are dropped.
  FetchOutcome out;
  size_t run = 0;
  while (run < rs.size() && (rs[run].outcome == ReserveOutcome::kReserved || rs[run].outcome == ReserveOutcome::kAlreadyCached)) ++run;
  std::vector<BlockKey> wanted_keys;
  std::vector<Reservation> wanted, past_run;
  std::vector<size_t> position;  // wanted[i] is keys[position[i]]
  for (size_t i = 0; i < rs.size(); ++i) {
    if (rs[i].outcome != ReserveOutcome::kReserved) {
      if (i < run) ++out.already_cached;
      continue;
    }
    if (i >= run) {
      past_run.push_back(rs[i].reservation);
      continue;
    }
    wanted_keys.push_back(keys[i]);
    wanted.push_back(rs[i].reservation);
    position.push_back(i);
  }
  if (!past_run.empty()) static_cast<void>(cache_.AbortMany(past_run));
  if (wanted.empty()) {
    out.ready = run;
    return out;
  }

  ReservationSink sink(cache_, wanted_keys, wanted);
  out.link = link_.Stream(holder, LinkFetch{ns, wanted_keys}, sink, timeout);
  sink.Settle(out);
  // READY now: the leading keys that were here already or arrived whole.
  size_t w = 0;
  out.ready = 0;
  for (size_t i = 0; i < run; ++i) {
    if (w < position.size() && position[w] == i) {
      if (!sink.verified(w) || out.fetched == 0) break;
      ++w;
    }
    out.ready = i + 1;
  }
  return out;
}

// One fetch being served: its pins, and the next block to send.
struct BlockFetchServer::Stream {
  uint64_t id = 0;
  std::vector<BlockKey> keys;
  std::vector<BlockPin> pins;
  size_t next = 0;
};

bool BlockFetchServer::Serve(const LinkMessage& m, LinkReply& reply) {
  const auto* fetch = std::get_if<LinkFetch>(&m.body);
  if (!fetch) return false;
  fetches_.fetch_add(1);
  auto fail = [&](const Status& s) { reply.Send(LinkMessage{m.id, LinkError{s.code(), s.message()}}); };
  auto handle = cache_.Namespace(fetch->ns);
  if (!handle.ok()) return fail(handle.status()), true;
  // kLeave: blocks on capacity tiers end the hit rather than wait here for a promotion (this
  // runs on the link's progress thread).
  auto hit = cache_.Lookup(*handle, fetch->keys, KvCache::CapacityPolicy::kLeave);
  if (!hit.ok()) return fail(hit.status()), true;
  auto stream = std::make_shared<Stream>(Stream{m.id, fetch->keys, std::move(hit->pins), 0});
  held_.fetch_add(stream->pins.size());
  SendNext(stream, reply);
  return true;
}

// Sends one block, then lets UCX progress before the next: the next block's invalidate and
// checksum overlap the last one's transfer instead of holding every send back.
void BlockFetchServer::SendNext(const std::shared_ptr<Stream>& stream, LinkReply& reply) {
  if (stream->next == stream->pins.size()) {
    reply.Send(LinkMessage{stream->id, LinkFetchEnd{static_cast<uint32_t>(stream->pins.size())}});
    return;
  }
  const size_t i = stream->next++;
  const BlockPin& pin = stream->pins[i];
  const uint8_t* p = cache_.PayloadPtr(pin);
  cache_.InvalidateForRead(p, pin.bytes);
  // The pool's own checksum when it keeps one: then the asker checks the bytes against what
  // was committed here, not only against what was read.
  const uint64_t checksum = pin.checksum != 0 ? pin.checksum : XXH3_64bits(p, pin.bytes);
  LinkFetchBlock block{static_cast<uint32_t>(i), stream->keys[i], pin.bytes, checksum};
  // The pin is released once UCX is done with the payload, delivered or not.
  reply.Send(LinkMessage{stream->id, block}, {p, pin.bytes}, [this, stream, i](Status sent) {
    if (sent.ok()) {
      blocks_.fetch_add(1);
      bytes_.fetch_add(stream->pins[i].bytes);
    } else {
      failures_.fetch_add(1);
    }
    cache_.Release({&stream->pins[i], 1});
    held_.fetch_sub(1);
  });
  reply.Later([this, stream](LinkReply& next) { SendNext(stream, next); });
}

BlockFetchServer::Counters BlockFetchServer::counters() const {
  Counters c;
  c.fetches = fetches_.load(), c.blocks_sent = blocks_.load(), c.bytes_sent = bytes_.load();
  c.send_failures = failures_.load(), c.pins_held = held_.load();
  return c;
}

}  // namespace cxlkv::rack
