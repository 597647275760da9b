// KvCache: the public face of the index — block keys, payload copies, convenience forms.
#include <xxhash.h>

#include <cstring>

#include "cache/index_api.h"
#include "cache/layout.h"
#include "region/coherence.h"

namespace cxlkv {

uint32_t DtypeBytes(KvDtype dtype) {
  switch (dtype) {
    case KvDtype::kFp16:
    case KvDtype::kBf16: return 2;
    case KvDtype::kFp8: return 1;
    case KvDtype::kFp32: return 4;
  }
  return 0;
}

uint64_t KvLayoutSignature::BlockBytes() const {
  if (num_layers == 0) return 0;
  return uint64_t{kv_parts} * num_layers * block_size * num_kv_heads * head_size * DtypeBytes(dtype);
}

Result<NamespaceHandle> KvCache::Namespace(const KeyNamespace& ns) { return index_.RegisterNamespace(ns); }

std::vector<BlockKey> KvCache::ChainKeys(const NamespaceHandle& ns, std::span<const int32_t> tokens) {
  std::vector<BlockKey> keys;
  const size_t bs = ns.block_size ? ns.block_size : 16;
  keys.reserve(tokens.size() / bs);
  BlockKey prev = ns.seed;
  XXH3_state_t* st = XXH3_createState();
  for (size_t b = 0; b + bs <= tokens.size(); b += bs) {
    // h_i = H(h_{i-1} ‖ tokens of block i): a block's key names its whole prefix.
    XXH3_128bits_reset(st);
    XXH3_128bits_update(st, &prev, sizeof prev);
    XXH3_128bits_update(st, tokens.data() + b, bs * sizeof(int32_t));
    XXH128_hash_t h = XXH3_128bits_digest(st);
    prev = BlockKey{h.low64, h.high64};
    keys.push_back(prev);
  }
  XXH3_freeState(st);
  return keys;
}

BlockKey KvCache::KeyFromEngineHash(const NamespaceHandle& ns, std::span<const uint8_t> hash) {
  XXH3_state_t* st = XXH3_createState();
  XXH3_128bits_reset(st);
  XXH3_128bits_update(st, &ns.seed, sizeof ns.seed);
  XXH3_128bits_update(st, hash.data(), hash.size());
  XXH128_hash_t h = XXH3_128bits_digest(st);
  XXH3_freeState(st);
  return BlockKey{h.low64, h.high64};
}

Result<LookupResult> KvCache::Lookup(const NamespaceHandle& ns, std::span<const BlockKey> keys,
                                     CapacityPolicy policy) {
  CXLKV_ASSIGN_OR_RETURN(LookupResult hit, index_.Lookup(ns, keys, /*pin=*/true));
  cache::CapacityPromoter* promoter = promoter_.load(std::memory_order_acquire);
  if (hit.capacity_run == 0 || promoter == nullptr) {
    hit.capacity_run = 0;
    return hit;
  }
  if (policy == CapacityPolicy::kLeave) return hit;
  // The hit stopped at a block on a capacity tier: have the owners bring the run in, then pin
  // on from there. Whatever was not brought in ends the hit, as a miss would.
  const std::span<const BlockKey> rest = keys.subspan(hit.hit_blocks);
  const std::vector<uint16_t> found_on = promoter->BringIn(ns, rest.first(hit.capacity_run));
  auto more = index_.LookupMore(ns, rest, hit.hit_blocks, hit.capacity_run);
  hit.capacity_run = 0;
  if (!more.ok()) return hit;  // the first part stands: its pins are the caller's
  for (size_t i = 0; i < more->pins.size() && i < found_on.size(); ++i) {
    hit.from_mem += found_on[i] == cache::kTierMem;
    hit.from_ssd += found_on[i] == cache::kTierSsd;
  }
  if (hit.from_ssd != 0) index_.CountCapacityHitsFromSsd(hit.from_ssd);
  hit.pins.insert(hit.pins.end(), more->pins.begin(), more->pins.end());
  hit.hit_blocks = hit.pins.size();
  return hit;
}

Result<CapacityRead> KvCache::ReadCapacity(const NamespaceHandle& ns, std::span<const BlockKey> keys,
                                           uint64_t block_bytes,
                                           const std::function<Status(std::span<const BlockPin>)>& use) {
  cache::CapacityPromoter* promoter = promoter_.load(std::memory_order_acquire);
  if (promoter == nullptr) return NotSupported("this pool reaches no capacity tiers (decentralized pools only)");
  if (block_bytes == 0) return InvalidArgument("read of capacity blocks of 0 bytes");
  if (keys.empty()) return CapacityRead{};
  CXLKV_ASSIGN_OR_RETURN(CapacityRead r, promoter->ReadOut(ns, keys, block_bytes, use));
  index_.CountStreamedHits(ns, r.blocks);  // the kLeave lookup before counted them as misses
  if (r.from_ssd != 0) index_.CountCapacityHitsFromSsd(r.from_ssd);
  return r;
}

Result<size_t> KvCache::Exists(const NamespaceHandle& ns, std::span<const BlockKey> keys) {
  CXLKV_ASSIGN_OR_RETURN(auto r, index_.Lookup(ns, keys, /*pin=*/false));
  return r.hit_blocks + r.capacity_run;
}

void KvCache::Release(std::span<const BlockPin> pins) { index_.Release(pins); }

Result<Reservation> KvCache::Reserve(const NamespaceHandle& ns, const BlockKey& key, uint64_t bytes) {
  return index_.Reserve(ns, key, bytes);
}

Status KvCache::Write(Reservation& r, uint64_t at, const void* src, uint64_t bytes) {
  if (!r.open) return InvalidArgument("reservation is not open (committed or aborted already)");
  if (at > r.bytes || bytes > r.bytes - at) {
    return InvalidArgument("write of " + std::to_string(bytes) + " bytes at " + std::to_string(at) +
                           " overruns the reserved block of " + std::to_string(r.bytes) + " bytes");
  }
  // P3: payload goes to memory with non-temporal stores, never dirty in this host's cache.
  region::NtCopy(index_.Payload(r.offset, r.bytes) + at, src, bytes);
  index_.CountWrite(bytes);
  return Status::Ok();
}

Result<std::vector<KeyReservation>> KvCache::ReserveMany(const NamespaceHandle& ns, std::span<const BlockKey> keys,
                                                         uint64_t bytes) {
  return index_.ReserveMany(ns, keys, bytes);
}
Status KvCache::CommitMany(std::span<Reservation> rs) { return index_.CommitMany(rs); }
Status KvCache::AbortMany(std::span<Reservation> rs) { return index_.AbortMany(rs); }
Result<std::vector<KeyPeek>> KvCache::Peek(const NamespaceHandle& ns, std::span<const BlockKey> keys) {
  return index_.Peek(ns, keys);
}

Status KvCache::Commit(Reservation& r) { return index_.Commit(r); }
Status KvCache::Abort(Reservation& r) { return index_.Abort(r); }

Status KvCache::Put(const NamespaceHandle& ns, const BlockKey& key, const void* data, uint64_t bytes) {
  CXLKV_ASSIGN_OR_RETURN(auto r, Reserve(ns, key, bytes));
  if (Status s = Write(r, 0, data, bytes); !s.ok()) {
    (void)Abort(r);
    return s;
  }
  return Commit(r);
}

Status KvCache::Read(const BlockPin& pin, uint64_t at, void* dst, uint64_t bytes) {
  if (at > pin.bytes || bytes > pin.bytes - at) {
    return InvalidArgument("read of " + std::to_string(bytes) + " bytes at " + std::to_string(at) +
                           " overruns the block of " + std::to_string(pin.bytes) + " bytes");
  }
  const uint8_t* src = index_.Payload(pin.offset, pin.bytes) + at;
  index_.ReadPayload(dst, src, bytes);  // P2 for payload: another host wrote it
  index_.CountRead(bytes);
  if (index_.checksums() && at == 0 && bytes == pin.bytes && XXH3_64bits(dst, bytes) != pin.checksum) {
    index_.CountChecksumFailure();
    return Corrupted("block payload fails its checksum (slot " + std::to_string(pin.slot) +
                     "): the pool's memory was damaged; evict the block and recompute it");
  }
  return Status::Ok();
}

const uint8_t* KvCache::PayloadPtr(const BlockPin& pin) { return index_.Payload(pin.offset, pin.bytes); }
uint8_t* KvCache::ReservedPtr(const Reservation& r) { return index_.Payload(r.offset, r.bytes); }
void KvCache::InvalidateForRead(const uint8_t* p, uint64_t bytes, bool fence) {
  index_.InvalidateForRead(p, bytes, fence);
}

Result<uint64_t> KvCache::Evict(const NamespaceHandle& ns, std::span<const BlockKey> keys) {
  return index_.EvictKeys(ns, keys);
}
Result<uint64_t> KvCache::EvictAll() { return index_.EvictAll(); }
Result<uint64_t> KvCache::EvictNamespace(const NamespaceHandle& ns) { return index_.EvictNamespace(ns); }

}  // namespace cxlkv
