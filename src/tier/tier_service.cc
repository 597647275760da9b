// The tier service and the promoter every pool's cache uses (tier_service.h).
#include "tier/tier_service.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>

#include "meta/protocol.h"
#include "pool/pool_internal.h"
#include "rpc/client.h"

namespace cxlkv::tier {

std::string TierServiceName(uint32_t node) { return "tier-" + std::to_string(node); }

// The wire forms are the metadata protocol's (meta/protocol.h): a key batch is a u32 count and
// the keys, read back only when the count fills the body exactly.
std::vector<uint8_t> EncodePromoteRequest(std::span<const BlockKey> keys) {
  std::vector<uint8_t> out(4 + keys.size() * meta::kKeyBytes);
  meta::WireWriter w(out);
  meta::PutKeys(w, keys);
  return out;
}

Result<std::vector<BlockKey>> DecodePromoteRequest(std::span<const uint8_t> bytes) {
  meta::WireReader r(bytes);
  std::vector<BlockKey> keys;
  if (!meta::GetKeys(r, &keys) || keys.size() > kPromoteKeysPerCall * 4) {
    return InvalidArgument("promote request of " + std::to_string(bytes.size()) + " bytes is not a batch of at most " +
                           std::to_string(kPromoteKeysPerCall * 4) + " keys of 16 bytes");
  }
  return keys;
}

std::vector<uint8_t> EncodePromoteResult(const PromoteResult& r) {
  std::vector<uint8_t> out(24);
  meta::WireWriter w(out);
  w.Put(r.promoted);
  w.Put(r.missed);
  w.Put(r.not_mine);
  return out;
}

Result<PromoteResult> DecodePromoteResult(std::span<const uint8_t> bytes) {
  meta::WireReader r(bytes);
  PromoteResult out;
  if (!r.Get(&out.promoted) || !r.Get(&out.missed) || !r.Get(&out.not_mine) || !r.done()) {
    return Corrupted("promote answer of " + std::to_string(bytes.size()) + " bytes, expected 24");
  }
  return out;
}

std::vector<uint8_t> EncodeReadRequest(const ReadRequest& r) {
  std::vector<uint8_t> out(4 + r.keys.size() * meta::kKeyBytes + 8 + r.staging.size() * 8);
  meta::WireWriter w(out);
  meta::PutKeys(w, r.keys);
  w.Put(r.capacity);
  for (uint64_t off : r.staging) w.Put(off);
  return out;
}

Result<ReadRequest> DecodeReadRequest(std::span<const uint8_t> bytes) {
  ReadRequest r;
  const size_t keys = bytes.size() >= 4 ? (bytes.size() - 4 - 8) / (meta::kKeyBytes + 8) : 0;
  if (bytes.size() < 12 || bytes.size() != 4 + keys * (meta::kKeyBytes + 8) + 8 || keys > kReadKeysPerCall) {
    return InvalidArgument("read request of " + std::to_string(bytes.size()) + " bytes is not a batch of at most " +
                           std::to_string(kReadKeysPerCall) + " keys with their staging");
  }
  // The key batch ends where the capacity begins: read it from its own span, whose length the
  // count must fill exactly.
  meta::WireReader kr(bytes.first(4 + keys * meta::kKeyBytes));
  meta::WireReader r8(bytes.subspan(4 + keys * meta::kKeyBytes));
  if (!meta::GetKeys(kr, &r.keys) || r.keys.size() != keys || !r8.Get(&r.capacity)) {
    return InvalidArgument("read request: its key count does not match its length");
  }
  r.staging.resize(keys);
  for (uint64_t& off : r.staging) {
    if (!r8.Get(&off)) return InvalidArgument("read request: staging offsets cut short");
  }
  if (!r8.done()) return InvalidArgument("read request: bytes after the staging offsets");
  return r;
}

std::vector<uint8_t> EncodeReadResult(std::span<const uint32_t> bytes_read) {
  std::vector<uint8_t> out(bytes_read.size() * 4);
  meta::WireWriter w(out);
  for (uint32_t b : bytes_read) w.Put(b);
  return out;
}

Result<std::vector<uint32_t>> DecodeReadResult(std::span<const uint8_t> bytes, size_t keys) {
  meta::WireReader r(bytes);
  std::vector<uint32_t> out(keys);
  for (uint32_t& b : out) {
    if (!r.Get(&b)) return Corrupted("read answer of " + std::to_string(bytes.size()) + " bytes for " + std::to_string(keys) + " keys");
  }
  if (!r.done()) return Corrupted("read answer of " + std::to_string(bytes.size()) + " bytes for " + std::to_string(keys) + " keys");
  return out;
}

Result<std::unique_ptr<rpc::RpcServer>> StartTierService(Pool& pool, TierStore& store) {
  std::map<uint32_t, rpc::Handler> ops;
  // Idempotent: reading the same slots into the same staging again writes the same bytes.
  ops[kTierRead] = {[&store](const rpc::Request& req, std::span<uint8_t> out) -> Result<size_t> {
                      CXLKV_ASSIGN_OR_RETURN(ReadRequest r, DecodeReadRequest(req.payload));
                      std::vector<uint8_t> answer = EncodeReadResult(store.ReadOut(r.keys, r.staging, r.capacity));
                      if (answer.size() > out.size()) return NoSpace("read answer exceeds its slot");
                      std::memcpy(out.data(), answer.data(), answer.size());
                      return answer.size();
                    },
                    /*idempotent=*/true};
  // Idempotent: promoting a block twice finds it in the region the second time (not_mine).
  ops[kTierPromote] = {[&store](const rpc::Request& req, std::span<uint8_t> out) -> Result<size_t> {
                         CXLKV_ASSIGN_OR_RETURN(std::vector<BlockKey> keys, DecodePromoteRequest(req.payload));
                         std::vector<uint8_t> answer = EncodePromoteResult(store.Promote(keys));
                         if (answer.size() > out.size()) return NoSpace("promote answer exceeds its slot");
                         std::memcpy(out.data(), answer.data(), answer.size());
                         return answer.size();
                       },
                       /*idempotent=*/true};
  ops[kTierSpill] = {[&store](const rpc::Request& req, std::span<uint8_t> out) -> Result<size_t> {
                       meta::WireReader r(req.payload);
                       uint64_t want = 0;
                       if (!r.Get(&want) || !r.done()) {
                         return InvalidArgument("spill request of " + std::to_string(req.payload.size()) +
                                                " bytes, expected 8");
                       }
                       const uint64_t before = store.RegionUsedBytes();
                       auto moved = store.Spill(want);
                       if (!moved.ok()) return moved.status();
                       const uint64_t after = store.RegionUsedBytes();
                       const uint64_t freed = before > after ? before - after : 0;
                       if (out.size() < 8) return NoSpace("spill answer exceeds its slot");
                       std::memcpy(out.data(), &freed, 8);
                       return size_t{8};
                     },
                     /*idempotent=*/true};
  rpc::RpcServerOptions so;
  so.geometry.request_bytes = 2048;   // 4 + 64 keys × 16 bytes, with room to spare
  so.geometry.response_bytes = 256;
  so.geometry.depth = 2;  // a promoter's calls are synchronous: one in flight per process (the
                          // area is nodes × clients × depth × slot bytes of the region)
  so.hot_window = std::chrono::microseconds(200);
  so.max_idle_sleep = std::chrono::microseconds(2000);  // idle: ~500 wake-ups a second at most
  return rpc::RpcServer::Start(pool, TierServiceName(pool.impl().node->id()), std::move(ops), so);
}

namespace {

// The calling side: asks each capacity block's owner to bring it in.
class RemotePromoter final : public cache::CapacityPromoter {
 public:
  explicit RemotePromoter(Pool& pool) : pool_(pool), index_(*pool.impl().index) {}

  uint64_t MakeRoom(uint64_t bytes) override {
    if (TierStore::InsideMove()) return TierStore::MakeRoomInsideMove(bytes);  // the store's own thread
    // This node's tiers first (its cxlkvd), then any other node's.
    const uint32_t self = pool_.impl().node->id();
    const uint32_t nodes = pool_.impl().regions[0]->info().max_nodes;
    std::vector<uint8_t> req(8);
    std::memcpy(req.data(), &bytes, 8);
    for (uint32_t k = 0; k < nodes; ++k) {
      const uint32_t node = (self + k) % nodes;
      rpc::RpcClient* client = ClientFor(node);
      if (client == nullptr) continue;
      auto answer = client->Call(kTierSpill, req);
      if (!answer.ok() || answer->size() != 8) {
        MarkDown(node);
        continue;
      }
      uint64_t freed = 0;
      std::memcpy(&freed, answer->data(), 8);
      if (freed != 0) return freed;
    }
    return 0;
  }

  std::vector<uint16_t> BringIn(const NamespaceHandle&, std::span<const BlockKey> keys) override {
    std::vector<uint16_t> found_on(keys.size(), cache::kTierRegion);
    std::map<uint32_t, std::vector<BlockKey>> by_owner;
    size_t at_key = 0;
    for (const auto& b : index_.FindCapacity(keys)) {  // in key order
      by_owner[cache::WriterNode(b.writer)].push_back(b.key);
      while (at_key < keys.size() && !(keys[at_key] == b.key)) ++at_key;
      if (at_key < keys.size()) found_on[at_key++] = b.tier;
    }
    for (auto& [node, owned] : by_owner) {
      rpc::RpcClient* client = ClientFor(node);
      if (client == nullptr) continue;
      for (size_t at = 0; at < owned.size(); at += kPromoteKeysPerCall) {
        const size_t n = std::min(kPromoteKeysPerCall, owned.size() - at);
        std::vector<uint8_t> req = EncodePromoteRequest(std::span<const BlockKey>(owned).subspan(at, n));
        auto answer = client->Call(kTierPromote, req);
        if (!answer.ok()) {
          MarkDown(node);
          break;
        }
      }
    }
    return found_on;
  }

  Result<CapacityRead> ReadOut(const NamespaceHandle& ns, std::span<const BlockKey> keys, uint64_t block_bytes,
                               const std::function<Status(std::span<const BlockPin>)>& use) override {
    // A window at a time: the staging a read holds stays bounded however long the run (a scan
    // of a long context must not fill the region it is meant to bypass).
    CapacityRead total;
    for (size_t at = 0; at < keys.size();) {
      const size_t n = std::min(kReadWindow, keys.size() - at);
      CXLKV_ASSIGN_OR_RETURN(CapacityRead w, ReadWindow(ns, keys.subspan(at, n), block_bytes, use));
      total.blocks += w.blocks;
      total.from_mem += w.from_mem;
      total.from_ssd += w.from_ssd;
      if (w.blocks < n) break;  // the prefix ends in this window
      at += n;
    }
    return total;
  }

 private:
  using Clock = std::chrono::steady_clock;
  static constexpr size_t kReadWindow = 2 * kReadKeysPerCall;

  // One window of ReadOut: `use` gets the window's read prefix.
  Result<CapacityRead> ReadWindow(const NamespaceHandle&, std::span<const BlockKey> keys, uint64_t block_bytes,
                                  const std::function<Status(std::span<const BlockPin>)>& use) {
    CapacityRead out;
    // Staging, one block each, until the region says no (the rest would miss anyway).
    std::vector<uint64_t> staging;
    for (size_t i = 0; i < keys.size(); ++i) {
      auto off = index_.AllocateRegionPayload(block_bytes);
      if (!off.ok()) break;
      staging.push_back(*off);
    }
    const size_t n = staging.size();
    std::vector<uint32_t> got(n, 0);
    std::vector<uint16_t> tier(n, cache::kTierRegion);
    std::vector<bool> unknown(n, false);  // a call whose outcome never came: its owner may still write
    std::map<uint32_t, std::vector<size_t>> by_owner;
    size_t at_key = 0;
    for (const auto& b : index_.FindCapacity(keys.first(n))) {  // in key order
      while (at_key < n && !(keys[at_key] == b.key)) ++at_key;
      if (at_key == n) break;
      tier[at_key] = b.tier;
      by_owner[cache::WriterNode(b.writer)].push_back(at_key++);
    }
    for (auto& [node, idx] : by_owner) {
      rpc::RpcClient* client = ClientFor(node);
      for (size_t at = 0; client != nullptr && at < idx.size(); at += kReadKeysPerCall) {
        ReadRequest r;
        r.capacity = block_bytes;
        for (size_t j = at; j < std::min(idx.size(), at + kReadKeysPerCall); ++j) {
          r.keys.push_back(keys[idx[j]]);
          r.staging.push_back(staging[idx[j]]);
        }
        auto answer = client->Call(kTierRead, EncodeReadRequest(r));
        if (!answer.ok()) {
          for (size_t j = at; j < std::min(idx.size(), at + kReadKeysPerCall); ++j) unknown[idx[j]] = true;
          MarkDown(node);
          break;
        }
        auto bytes = DecodeReadResult(*answer, r.keys.size());
        if (!bytes.ok()) continue;  // answered (so done writing), but not understood: misses
        for (size_t j = 0; j < r.keys.size(); ++j) got[idx[at + j]] = (*bytes)[j];
      }
    }
    size_t prefix = 0;
    while (prefix < n && got[prefix] == block_bytes) ++prefix;
    std::vector<BlockPin> pins(prefix);
    for (size_t i = 0; i < prefix; ++i) {
      pins[i].offset = staging[i];
      pins[i].bytes = block_bytes;
      out.from_mem += tier[i] == cache::kTierMem;
      out.from_ssd += tier[i] == cache::kTierSsd;
    }
    out.blocks = prefix;
    const Status used = prefix ? use(pins) : Status::Ok();
    for (size_t i = 0; i < n; ++i) {
      // Staging an owner may still be writing into (its call failed: paused or killed mid-read,
      // or the answer was lost) is never reused: left allocated, counted. Freeing it could let
      // a late write land in another block.
      if (unknown[i]) {
        staging_abandoned_.fetch_add(1, std::memory_order_relaxed);
      } else {
        index_.FreeRegionPayload(staging[i]);
      }
    }
    if (!used.ok()) return used;
    return out;
  }

  rpc::RpcClient* ClientFor(uint32_t node) {
    std::lock_guard<std::mutex> g(mu_);
    auto down = down_until_.find(node);
    if (down != down_until_.end() && Clock::now() < down->second) return nullptr;
    const std::optional<sync::NodeView> v = pool_.impl().node->ViewOf(node);
    if (v && v->incarnation != 0 && !v->live) return nullptr;  // its blocks wait for its next cxlkvd
    auto& client = clients_[node];
    if (!client) {
      rpc::RpcClientOptions o;
      o.timeout = std::chrono::milliseconds(3000);
      auto c = rpc::RpcClient::Open(pool_, TierServiceName(node), o);
      if (!c.ok()) {
        down_until_[node] = Clock::now() + std::chrono::seconds(1);
        return nullptr;
      }
      client = std::move(*c);
    }
    return client.get();
  }

  // A failed call may have waited out the server's silence (leases): a node whose tier service
  // failed is left alone for longer than one that merely has none, so a dead cxlkvd costs a
  // reserve or a lookup that wait at most once every 10 s.
  void MarkDown(uint32_t node) {
    std::lock_guard<std::mutex> g(mu_);
    down_until_[node] = Clock::now() + std::chrono::seconds(10);
  }

  Pool& pool_;
  cache::Index& index_;
  std::mutex mu_;
  std::map<uint32_t, std::unique_ptr<rpc::RpcClient>> clients_;  // guarded by mu_
  std::map<uint32_t, Clock::time_point> down_until_;             // guarded by mu_
  std::atomic<uint64_t> staging_abandoned_{0};
};

std::unique_ptr<cache::CapacityPromoter> MakePromoter(Pool& pool) {
  if (!pool.impl().index) return nullptr;
  return std::make_unique<RemotePromoter>(pool);
}

[[maybe_unused]] const bool kInstalled = [] {
  pool::RegisterCapacityPromoter(&MakePromoter);
  return true;
}();

}  // namespace
}  // namespace cxlkv::tier
