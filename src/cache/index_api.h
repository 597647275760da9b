// What KvCache needs of an index, whichever node runs it: the decentralized index (Index: every
// node operates on the table in the region under stripe locks, TraCT) today; a client of a
// centralized metadata service over the shared-memory RPC (Beluga) with the daemon. Payload
// bytes move between the caller and the region directly in both modes.
#ifndef CXLKV_SRC_CACHE_INDEX_API_H_
#define CXLKV_SRC_CACHE_INDEX_API_H_

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "cxlkv/cache.h"

namespace cxlkv::cache {

class IndexApi {
 public:
  virtual ~IndexApi() = default;

  virtual Result<NamespaceHandle> RegisterNamespace(const KeyNamespace& ns) = 0;
  // pin = false: the length of the READY prefix only (Exists).
  virtual Result<LookupResult> Lookup(const NamespaceHandle& ns, std::span<const BlockKey> keys, bool pin) = 0;
  // The second look of a lookup whose first answer had a capacity run (KvCache brought those
  // blocks in): pins like Lookup, and counts only what it adds to the first look's figures.
  virtual Result<LookupResult> LookupMore(const NamespaceHandle& ns, std::span<const BlockKey> keys,
                                          size_t earlier_hits, size_t capacity_run) {
    (void)earlier_hits;
    (void)capacity_run;
    return Lookup(ns, keys, /*pin=*/true);
  }
  virtual void Release(std::span<const BlockPin> pins) = 0;
  virtual Result<Reservation> Reserve(const NamespaceHandle& ns, const BlockKey& key, uint64_t bytes) = 0;
  virtual Status Commit(Reservation& r) = 0;
  virtual Status Abort(Reservation& r) = 0;
  // Batched forms (see KvCache::ReserveMany...).
  virtual Result<std::vector<KeyReservation>> ReserveMany(const NamespaceHandle& ns, std::span<const BlockKey> keys,
                                                          uint64_t bytes) = 0;
  virtual Status CommitMany(std::span<Reservation> rs) = 0;
  virtual Status AbortMany(std::span<Reservation> rs) = 0;
  virtual Result<std::vector<KeyPeek>> Peek(const NamespaceHandle& ns, std::span<const BlockKey> keys) = 0;
  virtual Result<uint64_t> EvictKeys(const NamespaceHandle& ns, std::span<const BlockKey> keys) = 0;
  virtual Result<uint64_t> EvictAll() = 0;
  // Every unpinned READY block of `ns` (one engine's namespace), and only those.
  virtual Result<uint64_t> EvictNamespace(const NamespaceHandle& ns) = 0;

  // The payload side: where a block lives in this process's mapping, and how to read it.
  virtual uint8_t* Payload(uint64_t offset, uint64_t bytes) = 0;
  virtual void ReadPayload(void* dst, const uint8_t* p, uint64_t bytes) = 0;
  virtual void InvalidateForRead(const uint8_t* p, uint64_t bytes, bool fence) = 0;
  virtual bool checksums() const = 0;
  virtual void CountRead(uint64_t bytes) = 0;
  virtual void CountWrite(uint64_t bytes) = 0;
  virtual void CountChecksumFailure() = 0;
  // Of the blocks a lookup brought in from capacity tiers, those that were on SSD. Capacity
  // tiers exist only where this process writes the index (decentralized): elsewhere, nothing.
  virtual void CountCapacityHitsFromSsd(uint64_t) {}
  // Blocks a lookup left on capacity tiers (counted as misses) that were then read out of them:
  // hits after all.
  virtual void CountStreamedHits(const NamespaceHandle&, uint64_t) {}
};

// Brings blocks that the index holds on capacity tiers into the region (their owners' cxlkvd
// promote them), so a lookup can pin them; and makes room by spilling rather than dropping. Installed on a KvCache by the layer that reaches the
// owners (src/tier); best effort: a block not brought in simply ends the hit.
class CapacityPromoter {
 public:
  virtual ~CapacityPromoter() = default;
  // Returns, per key, the tier (EntryTier) it was found on: kTierRegion where it was not on a
  // capacity tier (already in, or gone).
  virtual std::vector<uint16_t> BringIn(const NamespaceHandle& ns, std::span<const BlockKey> keys) = 0;
  // Asks a node's tiers to spill about `bytes` of the region's least recently used blocks, so a
  // reserve need not drop them. Returns the bytes freed (0: no tiers reached; the caller evicts).
  virtual uint64_t MakeRoom(uint64_t bytes) = 0;
  // Reads the longest prefix of `keys` it can out of capacity tiers without moving the blocks:
  // the owners read their slots (validated) into region staging space this call allocates, a
  // bounded window at a time, and `use` gets pins of those copies (`block_bytes` each, valid
  // only during that call) for consecutive parts of the prefix, in key order. Errors: what
  // `use` returned (after the staging is released).
  virtual Result<CapacityRead> ReadOut(const NamespaceHandle& ns, std::span<const BlockKey> keys, uint64_t block_bytes,
                                       const std::function<Status(std::span<const BlockPin>)>& use) = 0;
};

}  // namespace cxlkv::cache

#endif  // CXLKV_SRC_CACHE_INDEX_API_H_
