// The central index's client: batches cut to the RPC's slot sizes, answers decoded with the
// same bounds checks the service applies to requests (an answer is untrusted too).
#include "meta/client.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "cache/layout.h"
#include "meta/protocol.h"
#include "pool/pool_internal.h"

namespace cxlkv::meta {
namespace {

Status BadAnswer(const char* op) {
  return Corrupted(std::string("malformed ") + op + " answer from the metadata service (another build?)");
}

// Per-thread scratch for one request and one answer (a slot's capacity at most).
struct Scratch {
  std::vector<uint8_t> request, answer;
};
Scratch& ThreadScratch(size_t request_bytes, size_t answer_bytes) {
  thread_local Scratch s;
  if (s.request.size() < request_bytes) s.request.resize(request_bytes);
  if (s.answer.size() < answer_bytes) s.answer.resize(answer_bytes);
  return s;
}

}  // namespace

CentralIndex::CentralIndex(Pool& pool, cache::Index& local, const rpc::RpcClientOptions& options)
    : pool_(pool), local_(local), node_(*pool.impl().node), options_(options) {}

CentralIndex::~CentralIndex() {
  if (reserved_any_.load() && ready_.load() != nullptr) {
    if (!ReclaimProcess(node_.process_slot(), node_.incarnation())) {
      // The service was not reached: the slot is left for the node's other processes (or the
      // sweep of this life once it ends), which report it again.
      node_.LeaveProcessSlotForRecovery();
    }
  }
}

uint64_t CentralIndex::Writer() const {
  return cache::WriterWord(node_.id(), node_.incarnation(), node_.process_slot());
}

Result<rpc::RpcClient*> CentralIndex::Client() {
  if (rpc::RpcClient* c = ready_.load(std::memory_order_acquire)) return c;
  std::lock_guard<std::mutex> g(open_mu_);
  // The service's area appears when a service first starts: a client that starts first (a
  // serving process beside a daemon that is still starting) waits for it up to its deadline.
  const auto deadline = rpc::RpcClient::Clock::now() + options_.timeout;
  while (!client_) {
    auto c = rpc::RpcClient::Open(pool_, kMetaService, options_);
    if (c.ok()) {
      client_ = std::move(*c);
      ready_.store(client_.get(), std::memory_order_release);
      break;
    }
    if (c.status().code() != StatusCode::kNotFound) return c.status();
    if (rpc::RpcClient::Clock::now() > deadline) {
      return Unavailable("this pool's metadata is central and no metadata service has run on it yet: start "
                         "cxlkvd on a node of the pool (or open the pool from a serving process)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return client_.get();
}

Result<size_t> CentralIndex::Call(uint32_t op, std::span<uint8_t> request, std::span<uint8_t> answer) {
  CXLKV_ASSIGN_OR_RETURN(rpc::RpcClient * c, Client());
  const auto deadline = rpc::RpcClient::Clock::now() + options_.timeout;
  bool rewritten = false;
  for (;;) {
    auto t = c->Submit(op, request);
    if (!t.ok()) {
      if (t.status().code() != StatusCode::kBusy || rpc::RpcClient::Clock::now() > deadline) return t.status();
      std::this_thread::sleep_for(std::chrono::microseconds(20));  // the process's other threads fill the ring
      continue;
    }
    auto got = c->Wait(*t, answer, deadline);
    // Refused for a life of this node that ended (paused or silent past its lease): the service
    // did nothing with the request. As the decentralized index's lock requests do, go on as the
    // node's next life: wait for the node to rejoin (it notices its lapsed lease within about a
    // lease), then send it once more. A commit is not retried: a reservation of an ended life
    // never commits.
    if (!got.ok() && got.status().code() == StatusCode::kLeaseExpired && op != kRegister && op != kCommit &&
        !rewritten && request.size() >= 8) {
      uint64_t sent = 0;
      std::memcpy(&sent, request.data(), 8);
      const auto rejoin_deadline = std::min(deadline, rpc::RpcClient::Clock::now() + node_.lease() * 2);
      while (cache::WriterInc(Writer()) == cache::WriterInc(sent) && rpc::RpcClient::Clock::now() < rejoin_deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      const uint64_t now = Writer();
      if (cache::WriterInc(sent) != cache::WriterInc(now)) {
        std::memcpy(request.data(), &now, 8);
        rewritten = true;
        continue;
      }
    }
    return got;
  }
}

size_t CentralIndex::KeysPerRequest(size_t answer_item, size_t answer_fixed) {
  // The area's slot sizes once open (another build may have made it), else the ones it will have.
  const rpc::RpcClient* c = ready_.load(std::memory_order_acquire);
  const size_t request = c ? c->request_capacity() : MetaGeometry().request_bytes - rpc::kSlotHeaderBytes;
  const size_t response = c ? c->response_capacity() : MetaGeometry().response_bytes - rpc::kSlotHeaderBytes;
  const size_t fixed = 8 + kHandleBytes + 8 + 4;  // writer, handle, bytes, count
  if (request <= fixed || response <= answer_fixed) return 1;
  const size_t req = (request - fixed) / kKeyBytes;
  const size_t ans = answer_item == 0 ? req : (response - answer_fixed) / answer_item;
  return std::max<size_t>(1, std::min(req, ans));
}

Result<NamespaceHandle> CentralIndex::RegisterNamespace(const KeyNamespace& ns) {
  if (ns.model_id.size() > 255 || ns.extra_key.size() > 255) {
    return InvalidArgument("model id and extra key are at most 95 and 63 bytes");
  }
  Scratch& s = ThreadScratch(4096, 4096);
  WireWriter w(s.request);
  PutNamespace(w, ns);
  CXLKV_ASSIGN_OR_RETURN(size_t n, Call(kRegister, {s.request.data(), w.size()}, s.answer));
  WireReader r({s.answer.data(), n});
  NamespaceHandle h;
  if (!r.Handle(&h) || !r.done()) return BadAnswer("register");
  return h;
}

Result<LookupResult> CentralIndex::Lookup(const NamespaceHandle& ns, std::span<const BlockKey> keys, bool pin) {
  LookupResult out;
  const size_t per = KeysPerRequest(pin ? kPinBytes : 0, 4);
  Scratch& s = ThreadScratch(16384, 16384);
  // The longest READY prefix: request by request, stopping at the first one that misses.
  for (size_t at = 0; at < keys.size();) {
    const size_t n = std::min(per, keys.size() - at);
    WireWriter w(s.request);
    w.Put(Writer());
    w.Handle(ns);
    PutKeys(w, keys.subspan(at, n));
    auto got = Call(pin ? kLookupPin : kExists, {s.request.data(), w.size()}, s.answer);
    if (!got.ok()) {
      Release(out.pins);
      return got.status();
    }
    WireReader r({s.answer.data(), *got});
    uint32_t hit = 0;
    if (!r.Get(&hit) || hit > n || (pin && r.remaining() != uint64_t{hit} * kPinBytes)) {
      Release(out.pins);
      return BadAnswer("lookup");
    }
    if (pin) {
      for (uint32_t i = 0; i < hit; ++i) {
        BlockPin p;
        GetPin(r, &p);
        out.pins.push_back(p);
      }
    }
    out.hit_blocks += hit;
    if (hit < n) break;
    at += n;
  }
  // Hit rates per node: this node's row counts its lookups (the service counts none), once per
  // lookup however many requests it took.
  if (pin) local_.CountLookup(ns, keys.size(), out.hit_blocks);
  return out;
}

void CentralIndex::Release(std::span<const BlockPin> pins) {
  if (pins.empty()) return;
  const size_t per = KeysPerRequest(0, 0) * kKeyBytes / kReleaseBytes;
  Scratch& s = ThreadScratch(16384, 16384);
  for (size_t at = 0; at < pins.size();) {
    const size_t n = std::min(std::max<size_t>(per, 1), pins.size() - at);
    WireWriter w(s.request);
    w.Put(Writer());
    w.Put(static_cast<uint32_t>(n));
    for (size_t i = 0; i < n; ++i) w.Put(pins[at + i].slot);
    if (auto got = Call(kRelease, {s.request.data(), w.size()}, s.answer); !got.ok()) {
      // The pins stay until this node's life ends (then the service drops them): space, not
      // correctness, is what a lost release costs.
      std::fprintf(stderr, "cxlkv: central index: releasing %zu pins: %s\n", n, got.status().ToString().c_str());
    }
    at += n;
  }
}

Result<Reservation> CentralIndex::Reserve(const NamespaceHandle& ns, const BlockKey& key, uint64_t bytes) {
  CXLKV_ASSIGN_OR_RETURN(auto many, ReserveMany(ns, {&key, 1}, bytes));
  if (many[0].outcome == ReserveOutcome::kReserved) return many[0].reservation;
  return many[0].status;
}

Status CentralIndex::Commit(Reservation& r) {
  if (!r.open) return InvalidArgument("reservation is not open (committed or aborted already)");
  return CommitMany({&r, 1});
}

Status CentralIndex::Abort(Reservation& r) {
  if (!r.open) return InvalidArgument("reservation is not open (committed or aborted already)");
  return AbortMany({&r, 1});
}

Result<std::vector<KeyReservation>> CentralIndex::ReserveMany(const NamespaceHandle& ns,
                                                              std::span<const BlockKey> keys, uint64_t bytes) {
  std::vector<KeyReservation> out;
  out.reserve(keys.size());
  const size_t per = KeysPerRequest(kOutcomeBytes, 1 + 2 + kMaxMessageBytes);
  Scratch& s = ThreadScratch(16384, 16384);
  for (size_t at = 0; at < keys.size();) {
    const size_t n = std::min(per, keys.size() - at);
    WireWriter w(s.request);
    w.Put(Writer());
    w.Handle(ns);
    w.Put(bytes);
    PutKeys(w, keys.subspan(at, n));
    reserved_any_.store(true, std::memory_order_relaxed);
    auto got = Call(kReserve, {s.request.data(), w.size()}, s.answer);
    if (!got.ok()) {
      if (out.empty()) return got.status();
      // Earlier requests reserved: their keys keep their outcomes, the rest fail with this.
      for (size_t i = at; i < keys.size(); ++i) out.push_back({ReserveOutcome::kError, {}, got.status(), 0, 0});
      return out;
    }
    WireReader r({s.answer.data(), *got});
    const size_t first = out.size();
    std::vector<uint8_t> message_of(n);
    for (size_t i = 0; i < n; ++i) {
      KeyReservation k;
      uint8_t outcome = 0, code = 0, pad = 0;
      if (!r.Get(&outcome) || !r.Get(&code) || !r.Get(&message_of[i]) || !r.Get(&pad) || !r.Get(&k.writer_node) ||
          !GetReservation(r, &k.reservation) || !r.Get(&k.writer_incarnation) ||
          outcome > static_cast<uint8_t>(ReserveOutcome::kError) || code > static_cast<uint8_t>(StatusCode::kUnavailable)) {
        return BadAnswer("reserve");
      }
      k.outcome = static_cast<ReserveOutcome>(outcome);
      k.reservation.open = k.outcome == ReserveOutcome::kReserved;
      k.status = Status(static_cast<StatusCode>(code), "");
      out.push_back(std::move(k));
    }
    uint8_t count = 0;
    std::vector<std::string> messages;
    if (!r.Get(&count)) return BadAnswer("reserve");
    messages.resize(count);
    for (std::string& m : messages) {
      if (!r.Text(&m, kMaxMessageBytes)) return BadAnswer("reserve");
    }
    if (!r.done()) return BadAnswer("reserve");
    {
      const uint64_t life = node_.incarnation();
      std::lock_guard<std::mutex> g(open_reservations_mu_);
      for (size_t i = 0; i < n; ++i) {
        if (out[first + i].outcome == ReserveOutcome::kReserved) {
          open_reservations_[ReservationId(out[first + i].reservation)] = life;
        }
      }
    }
    for (size_t i = 0; i < n; ++i) {
      Status& st = out[first + i].status;
      if (st.ok()) continue;
      const uint8_t m = message_of[i];
      st = Status(st.code(), m < messages.size() ? messages[m]
                                                 : "reserve refused (" + std::string(StatusCodeName(st.code())) + ")");
    }
    at += n;
  }
  return out;
}

Status CentralIndex::Finish(uint32_t op, std::span<Reservation> rs) {
  Status first_error;
  std::vector<Reservation*> open;
  {
    const uint64_t life = node_.incarnation();
    std::lock_guard<std::mutex> g(open_reservations_mu_);
    for (Reservation& r : rs) {
      if (!r.open) {
        if (first_error.ok()) first_error = InvalidArgument("reservation is not open (committed or aborted already)");
        continue;
      }
      auto it = open_reservations_.find(ReservationId(r));
      const uint64_t made_by = it == open_reservations_.end() ? life : it->second;
      if (it != open_reservations_.end()) open_reservations_.erase(it);
      if (op == kCommit && cache::WriterInc(made_by) != cache::WriterInc(life)) {
        // Reserved by this node's earlier life (it was paused or silent past its lease): that
        // life is over and its reservations are the service's to reclaim, never to commit.
        r.open = false;
        if (first_error.ok()) {
          first_error = LeaseExpired("commit refused: the block was reserved by node " + std::to_string(node_.id()) +
                                     "'s life " + std::to_string(cache::WriterInc(made_by)) + ", which ended (paused "
                                     "or silent past its lease); its recovery drops the block: reserve it again");
        }
        continue;
      }
      open.push_back(&r);
    }
  }
  // Publish-after-payload (P3): this process wrote the payloads with non-temporal stores and
  // fenced; the service publishes READY only after this request arrives. A life that is over
  // commits nothing (the service checks too, with its own view).
  if (op == kCommit && !open.empty()) {
    if (Status s = node_.Fence("commit"); !s.ok()) {
      for (Reservation* r : open) r->open = false;
      return s;
    }
  }
  const size_t per = KeysPerRequest(0, 0) * kKeyBytes / kReservationBytes;
  Scratch& s = ThreadScratch(16384, 16384);
  for (size_t at = 0; at < open.size();) {
    const size_t n = std::min(std::max<size_t>(per, 1), open.size() - at);
    WireWriter w(s.request);
    w.Put(Writer());
    w.Put(static_cast<uint32_t>(n));
    for (size_t i = 0; i < n; ++i) PutReservation(w, *open[at + i]);
    auto got = Call(op, {s.request.data(), w.size()}, s.answer);
    for (size_t i = 0; i < n; ++i) open[at + i]->open = false;
    if (!got.ok() && first_error.ok()) first_error = got.status();
    at += n;
  }
  return first_error;
}

Status CentralIndex::CommitMany(std::span<Reservation> rs) { return Finish(kCommit, rs); }
Status CentralIndex::AbortMany(std::span<Reservation> rs) { return Finish(kAbort, rs); }

Result<std::vector<KeyPeek>> CentralIndex::Peek(const NamespaceHandle& ns, std::span<const BlockKey> keys) {
  std::vector<KeyPeek> out;
  out.reserve(keys.size());
  const size_t per = KeysPerRequest(kPeekBytes, 0);
  Scratch& s = ThreadScratch(16384, 16384);
  for (size_t at = 0; at < keys.size();) {
    const size_t n = std::min(per, keys.size() - at);
    WireWriter w(s.request);
    w.Put(Writer());
    w.Handle(ns);
    PutKeys(w, keys.subspan(at, n));
    CXLKV_ASSIGN_OR_RETURN(size_t got, Call(kPeek, {s.request.data(), w.size()}, s.answer));
    WireReader r({s.answer.data(), got});
    if (got != n * kPeekBytes) return BadAnswer("peek");
    for (size_t i = 0; i < n; ++i) {
      KeyPeek p;
      uint8_t state = 0, live = 0;
      uint16_t pad = 0;
      r.Get(&state);
      r.Get(&live);
      r.Get(&pad);
      r.Get(&p.writer_node);
      r.Get(&p.writer_incarnation);
      if (state > static_cast<uint8_t>(PeekState::kOther)) return BadAnswer("peek");
      p.state = static_cast<PeekState>(state);
      p.writer_live = live != 0;
      out.push_back(p);
    }
    at += n;
  }
  return out;
}

Result<uint64_t> CentralIndex::EvictKeys(const NamespaceHandle& ns, std::span<const BlockKey> keys) {
  uint64_t evicted = 0;
  const size_t per = KeysPerRequest(0, 0);
  Scratch& s = ThreadScratch(16384, 16384);
  for (size_t at = 0; at < keys.size();) {
    const size_t n = std::min(per, keys.size() - at);
    WireWriter w(s.request);
    w.Put(Writer());
    w.Handle(ns);
    PutKeys(w, keys.subspan(at, n));
    CXLKV_ASSIGN_OR_RETURN(size_t got, Call(kEvictKeys, {s.request.data(), w.size()}, s.answer));
    WireReader r({s.answer.data(), got});
    uint64_t e = 0;
    if (!r.Get(&e) || !r.done()) return BadAnswer("evict");
    evicted += e;
    at += n;
  }
  return evicted;
}

Result<uint64_t> CentralIndex::EvictAll() {
  Scratch& s = ThreadScratch(16384, 16384);
  WireWriter w(s.request);
  w.Put(Writer());
  CXLKV_ASSIGN_OR_RETURN(size_t got, Call(kEvictAll, {s.request.data(), w.size()}, s.answer));
  WireReader r({s.answer.data(), got});
  uint64_t e = 0;
  if (!r.Get(&e) || !r.done()) return BadAnswer("evict-all");
  return e;
}

Result<uint64_t> CentralIndex::EvictNamespace(const NamespaceHandle& ns) {
  Scratch& s = ThreadScratch(16384, 16384);
  WireWriter w(s.request);
  w.Put(Writer());
  w.Handle(ns);
  CXLKV_ASSIGN_OR_RETURN(size_t got, Call(kEvictNamespace, {s.request.data(), w.size()}, s.answer));
  WireReader r({s.answer.data(), got});
  uint64_t e = 0;
  if (!r.Get(&e) || !r.done()) return BadAnswer("evict-namespace");
  return e;
}

bool CentralIndex::ReclaimProcess(uint32_t slot, uint64_t inc) {
  Scratch& s = ThreadScratch(16384, 16384);
  WireWriter w(s.request);
  w.Put(Writer());
  w.Put(inc);
  w.Put(slot);
  return Call(kReclaimWriter, {s.request.data(), w.size()}, s.answer).ok();
}

Result<CentralIndex::ServiceStats> CentralIndex::Stats() {
  Scratch& s = ThreadScratch(16384, 16384);
  WireWriter w(s.request);
  w.Put(Writer());
  CXLKV_ASSIGN_OR_RETURN(size_t got, Call(kStats, {s.request.data(), w.size()}, s.answer));
  WireReader r({s.answer.data(), got});
  ServiceStats st;
  if (!r.Get(&st.used_bytes) || !r.Get(&st.capacity) || !r.Get(&st.reclaimed) || !r.done()) return BadAnswer("stats");
  return st;
}

}  // namespace cxlkv::meta
