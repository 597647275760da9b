// The metadata service: request decoding, the index's operations for the named client, the
// sweep. Every body is untrusted: a malformed one is answered kInvalidArgument, never trusted.
#include "meta/service.h"

#include <algorithm>
#include <string>
#include <vector>

#include "cache/index.h"
#include "meta/protocol.h"
#include "pool/pool_internal.h"

namespace cxlkv::meta {
namespace {

Status Malformed(const char* op) {
  return InvalidArgument(std::string("malformed ") + op + " request (a client of another build, or a damaged slot)");
}

// The fields every request starts with: the caller's writer word.
struct Caller {
  uint64_t writer = 0;
};

}  // namespace

Result<std::unique_ptr<MetaService>> MetaService::Start(Pool& pool, const rpc::RpcServerOptions& options) {
  cache::Index* index = pool.impl().index.get();
  if (index == nullptr) return NotFound("this pool has no prefix index: the metadata service has nothing to serve");
  if (!index->central()) {
    return InvalidArgument("this pool's metadata is decentralized: every node writes the index itself; "
                           "re-create it with 'cxlkv init --metadata central' to run the metadata service");
  }
  auto service = std::unique_ptr<MetaService>(new MetaService(*index));
  rpc::RpcServerOptions o = options;
  o.geometry = MetaGeometry();
  MetaService* self = service.get();
  o.on_serving = [self](const rpc::RpcServer& server, bool serving) { self->OnServing(server, serving); };
  o.on_tick = [self] { self->OnTick(); };
  o.tick_every = std::max(std::chrono::milliseconds(50), pool.impl().node->lease() / 8);
  CXLKV_ASSIGN_OR_RETURN(service->server_, rpc::RpcServer::Start(pool, kMetaService, service->Handlers(), o));
  return service;
}

MetaService::~MetaService() {
  server_.reset();  // stops serving: OnServing(false) ends the writer role first
}

MetaServiceStats MetaService::stats() const {
  return {sweeps_.load(), reclaimed_.load(), server_ ? server_->stats() : rpc::RpcServerStats{}};
}

void MetaService::OnServing(const rpc::RpcServer& server, bool serving) {
  if (serving) {
    index_.BecomeCentralWriter([&server] { return server.Fence(); });
    // Before the first request: a predecessor may have died mid-eviction, and the pins of
    // nodes that died while nobody served are still in their rows.
    reclaimed_.fetch_add(index_.SweepCentral(/*repair_all=*/true));
    sweeps_.fetch_add(1);
  } else {
    index_.BecomeCentralWriter(nullptr);
  }
}

void MetaService::OnTick() {
  reclaimed_.fetch_add(index_.SweepCentral(/*repair_all=*/false));
  sweeps_.fetch_add(1);
}

std::map<uint32_t, rpc::Handler> MetaService::Handlers() {
  cache::Index& index = index_;
  std::map<uint32_t, rpc::Handler> ops;
  // Reads the caller's writer word and makes the index act for it.
  auto act = [&index](const rpc::Request& req, WireReader& r, const char* op) -> Status {
    Caller c;
    if (!r.Get(&c.writer)) return Malformed(op);
    if (cache::WriterSlot(c.writer) != req.channel) {
      return InvalidArgument(std::string(op) + " request names process slot " + std::to_string(cache::WriterSlot(c.writer)) +
                             " on the channel of slot " + std::to_string(req.channel));
    }
    return index.ActFor(req.node, c.writer);
  };

  ops[kRegister] = {[&index](const rpc::Request& req, std::span<uint8_t> out) -> Result<size_t> {
    WireReader r(req.payload);
    KeyNamespace ns;
    if (!GetNamespace(r, &ns) || !r.done()) return Malformed("register");
    CXLKV_ASSIGN_OR_RETURN(NamespaceHandle h, index.RegisterNamespace(ns));
    WireWriter w(out);
    w.Handle(h);
    return w.size();
  }};

  auto lookup = [&index, act](bool pin) {
    return [&index, act, pin](const rpc::Request& req, std::span<uint8_t> out) -> Result<size_t> {
      WireReader r(req.payload);
      CXLKV_RETURN_IF_ERROR(act(req, r, "lookup"));
      NamespaceHandle h;
      std::vector<BlockKey> keys;
      if (!r.Handle(&h) || !GetKeys(r, &keys)) return Malformed("lookup");
      if (pin && 4 + keys.size() * kPinBytes > out.size()) return InvalidArgument("lookup of too many keys for one answer");
      CXLKV_ASSIGN_OR_RETURN(LookupResult res, index.Lookup(h, keys, pin));
      WireWriter w(out);
      w.Put(static_cast<uint32_t>(res.hit_blocks));
      if (pin) {
        for (const BlockPin& p : res.pins) PutPin(w, p);
      }
      return w.size();
    };
  };
  ops[kLookupPin] = {lookup(true), /*idempotent=*/false};
  ops[kExists] = {lookup(false)};

  ops[kRelease] = {[&index, act](const rpc::Request& req, std::span<uint8_t>) -> Result<size_t> {
                     WireReader r(req.payload);
                     CXLKV_RETURN_IF_ERROR(act(req, r, "release"));
                     uint32_t n = 0;
                     if (!r.Count(&n, kReleaseBytes)) return Malformed("release");
                     std::vector<BlockPin> pins(n);
                     for (BlockPin& p : pins) r.Get(&p.slot);
                     index.Release(pins);
                     return size_t{0};
                   },
                   /*idempotent=*/false};

  ops[kReserve] = {[&index, act](const rpc::Request& req, std::span<uint8_t> out) -> Result<size_t> {
                     WireReader r(req.payload);
                     CXLKV_RETURN_IF_ERROR(act(req, r, "reserve"));
                     NamespaceHandle h;
                     uint64_t bytes = 0;
                     std::vector<BlockKey> keys;
                     if (!r.Handle(&h) || !r.Get(&bytes) || !GetKeys(r, &keys)) return Malformed("reserve");
                     if (keys.size() * kOutcomeBytes + 1 + 2 + kMaxMessageBytes > out.size()) {
                       return InvalidArgument("reserve of too many keys for one answer");
                     }
                     CXLKV_ASSIGN_OR_RETURN(auto res, index.ReserveMany(h, keys, bytes));
                     // Each key's status message, deduplicated, as many as fit after the
                     // records (the first always does); a key whose message did not fit
                     // gets kNoMessage and the client says what its code means.
                     std::vector<std::string> messages;
                     std::vector<uint8_t> message_of(res.size(), kNoMessage);
                     size_t room = out.size() - res.size() * kOutcomeBytes - 1;
                     for (size_t i = 0; i < res.size(); ++i) {
                       if (res[i].status.ok()) continue;
                       const std::string m = res[i].status.message().substr(0, kMaxMessageBytes);
                       auto it = std::find(messages.begin(), messages.end(), m);
                       if (it == messages.end()) {
                         if (messages.size() == kNoMessage || 2 + m.size() > room) continue;
                         room -= 2 + m.size();
                         it = messages.insert(messages.end(), m);
                       }
                       message_of[i] = static_cast<uint8_t>(it - messages.begin());
                     }
                     WireWriter w(out);
                     for (size_t i = 0; i < res.size(); ++i) {
                       const KeyReservation& k = res[i];
                       w.Put(static_cast<uint8_t>(k.outcome));
                       w.Put(static_cast<uint8_t>(k.status.code()));
                       w.Put(message_of[i]);
                       w.Put(uint8_t{0});
                       w.Put(k.writer_node);
                       PutReservation(w, k.reservation);
                       w.Put(k.writer_incarnation);
                     }
                     w.Put(static_cast<uint8_t>(messages.size()));
                     for (const std::string& m : messages) w.Text(m, kMaxMessageBytes);
                     if (w.overflow()) return Internal("reserve answer overflowed its slot");
                     return w.size();
                   },
                   /*idempotent=*/false};

  auto finish = [&index, act](bool commit) {
    return [&index, act, commit](const rpc::Request& req, std::span<uint8_t>) -> Result<size_t> {
      WireReader r(req.payload);
      CXLKV_RETURN_IF_ERROR(act(req, r, commit ? "commit" : "abort"));
      uint32_t n = 0;
      if (!r.Count(&n, kReservationBytes)) return Malformed(commit ? "commit" : "abort");
      std::vector<Reservation> rs(n);
      for (Reservation& x : rs) {
        GetReservation(r, &x);
        x.open = true;
      }
      CXLKV_RETURN_IF_ERROR(commit ? index.CommitMany(rs) : index.AbortMany(rs));
      return size_t{0};
    };
  };
  ops[kCommit] = {finish(true), /*idempotent=*/false};
  ops[kAbort] = {finish(false), /*idempotent=*/false};

  ops[kPeek] = {[&index, act](const rpc::Request& req, std::span<uint8_t> out) -> Result<size_t> {
    WireReader r(req.payload);
    CXLKV_RETURN_IF_ERROR(act(req, r, "peek"));
    NamespaceHandle h;
    std::vector<BlockKey> keys;
    if (!r.Handle(&h) || !GetKeys(r, &keys)) return Malformed("peek");
    if (keys.size() * kPeekBytes > out.size()) return InvalidArgument("peek of too many keys for one answer");
    CXLKV_ASSIGN_OR_RETURN(auto peeks, index.Peek(h, keys));
    WireWriter w(out);
    for (const KeyPeek& p : peeks) {
      w.Put(static_cast<uint8_t>(p.state));
      w.Put(static_cast<uint8_t>(p.writer_live));
      w.Put(uint16_t{0});
      w.Put(p.writer_node);
      w.Put(p.writer_incarnation);
    }
    return w.size();
  }};

  ops[kEvictKeys] = {[&index, act](const rpc::Request& req, std::span<uint8_t> out) -> Result<size_t> {
                       WireReader r(req.payload);
                       CXLKV_RETURN_IF_ERROR(act(req, r, "evict"));
                       NamespaceHandle h;
                       std::vector<BlockKey> keys;
                       if (!r.Handle(&h) || !GetKeys(r, &keys)) return Malformed("evict");
                       CXLKV_ASSIGN_OR_RETURN(uint64_t evicted, index.EvictKeys(h, keys));
                       WireWriter w(out);
                       w.Put(evicted);
                       return w.size();
                     },
                     /*idempotent=*/false};

  ops[kEvictAll] = {[&index, act](const rpc::Request& req, std::span<uint8_t> out) -> Result<size_t> {
                      WireReader r(req.payload);
                      CXLKV_RETURN_IF_ERROR(act(req, r, "evict-all"));
                      if (!r.done()) return Malformed("evict-all");
                      CXLKV_ASSIGN_OR_RETURN(uint64_t evicted, index.EvictAll());
                      WireWriter w(out);
                      w.Put(evicted);
                      return w.size();
                    },
                    /*idempotent=*/false};

  ops[kEvictNamespace] = {[&index, act](const rpc::Request& req, std::span<uint8_t> out) -> Result<size_t> {
                            WireReader r(req.payload);
                            CXLKV_RETURN_IF_ERROR(act(req, r, "evict-namespace"));
                            NamespaceHandle h;
                            if (!r.Handle(&h) || !r.done()) return Malformed("evict-namespace");
                            CXLKV_ASSIGN_OR_RETURN(uint64_t evicted, index.EvictNamespace(h));
                            WireWriter w(out);
                            w.Put(evicted);
                            return w.size();
                          },
                          /*idempotent=*/false};

  // A surviving process of the node reports a dead one: its reservations go (idempotent).
  ops[kReclaimWriter] = {[this, &index, act](const rpc::Request& req, std::span<uint8_t> out) -> Result<size_t> {
    WireReader r(req.payload);
    CXLKV_RETURN_IF_ERROR(act(req, r, "reclaim"));
    uint64_t inc = 0;
    uint32_t slot = 0;
    if (!r.Get(&inc) || !r.Get(&slot) || !r.done()) return Malformed("reclaim");
    const uint64_t n = index.ReclaimWriter(req.node, inc, slot);
    reclaimed_.fetch_add(n);
    WireWriter w(out);
    w.Put(n);
    return w.size();
  }};

  ops[kStats] = {[this, &index, act](const rpc::Request& req, std::span<uint8_t> out) -> Result<size_t> {
    WireReader r(req.payload);
    CXLKV_RETURN_IF_ERROR(act(req, r, "stats"));
    WireWriter w(out);
    w.Put(index.UsedBytes());
    w.Put(index.capacity());
    w.Put(reclaimed_.load());
    return w.size();
  }};
  return ops;
}

}  // namespace cxlkv::meta
