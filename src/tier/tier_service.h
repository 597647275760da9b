// The capacity tiers over the shared-memory RPC (docs/tiers.md, "Promote on hit").
//
// Each node's cxlkvd serves "tier-<node>" for its TierStore: a promote request names block keys;
// the owner reads them from its devices straight into fresh region space and moves their
// entries back to the region (TierStore::Promote). The shared region is the transport: nothing
// but the keys and three counts cross the RPC. A spill request asks it to free region space by
// moving the least recently used blocks to its devices: a writer that finds the region full asks
// its own node's tiers (then any other node's) before it drops anything.
//
// The calling side is a cache::CapacityPromoter that this file registers with the pool layer, so
// every decentralized pool's KvCache::Lookup asks the owners of the capacity blocks it meets.
// An owner that is not live is skipped; one with no service is left alone for a second, one whose
// call failed for ten: its blocks end hits (misses) instead of stalling lookups.
// Thread-safety: StartTierService's server runs on its own thread; the promoter is thread-safe.
#ifndef CXLKV_SRC_TIER_TIER_SERVICE_H_
#define CXLKV_SRC_TIER_TIER_SERVICE_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cxlkv/pool.h"
#include "rpc/server.h"
#include "tier/tier_store.h"

namespace cxlkv::tier {

inline constexpr uint32_t kTierPromote = 1;       // keys → promoted, missed, not_mine (u64 each)
inline constexpr uint32_t kTierSpill = 2;         // u64 bytes → u64 bytes freed in the region
inline constexpr uint32_t kTierRead = 3;          // keys, staging → payload bytes per key (u32; 0: miss)
inline constexpr size_t kPromoteKeysPerCall = 64;  // bounds one request's service time
inline constexpr size_t kReadKeysPerCall = 32;     // its answer (4 bytes a key) fits a response slot

std::string TierServiceName(uint32_t node);

// Request and answer of kTierPromote. Decoding checks lengths against the bytes (untrusted).
std::vector<uint8_t> EncodePromoteRequest(std::span<const BlockKey> keys);
Result<std::vector<BlockKey>> DecodePromoteRequest(std::span<const uint8_t> bytes);
std::vector<uint8_t> EncodePromoteResult(const PromoteResult& r);
Result<PromoteResult> DecodePromoteResult(std::span<const uint8_t> bytes);
// Request of kTierRead: the keys, the staging capacity of each, and one staging offset per key.
struct ReadRequest {
  std::vector<BlockKey> keys;
  uint64_t capacity = 0;
  std::vector<uint64_t> staging;
};
std::vector<uint8_t> EncodeReadRequest(const ReadRequest& r);
Result<ReadRequest> DecodeReadRequest(std::span<const uint8_t> bytes);
std::vector<uint8_t> EncodeReadResult(std::span<const uint32_t> bytes_read);
Result<std::vector<uint32_t>> DecodeReadResult(std::span<const uint8_t> bytes, size_t keys);

// Serves "tier-<this node>" for `store` until the server is destroyed (before the store).
Result<std::unique_ptr<rpc::RpcServer>> StartTierService(Pool& pool, TierStore& store);

}  // namespace cxlkv::tier

#endif  // CXLKV_SRC_TIER_TIER_SERVICE_H_
