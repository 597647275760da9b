// The pool's default capacity tiers (`cxlkv init --tier ...`): one configuration recorded in the
// pool for every node's cxlkvd, so a rack is configured once, where the pool is made, rather
// than on each daemon's command line. A cxlkvd started without --tier (and without --no-tiers)
// serves these; "%n" in an SSD path becomes its node id, so daemons sharing a host get files of
// their own (an SSD file has one owner: a second opener is refused).
//
// It is the pool's status document "pool-tiers" (pool/status_doc.h):
//   {"tiers": ["dram:8G", "ssd:/data/kv-%n.tier:64G"], "slot_bytes": 2101248}
// Everything read back is untrusted: each spec is parsed again and the slot size checked.
// Thread-safety: pure functions.
#ifndef CXLKV_SRC_TIER_POOL_TIERS_H_
#define CXLKV_SRC_TIER_POOL_TIERS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cxlkv/status.h"

namespace cxlkv::tier {

inline constexpr char kPoolTiersDoc[] = "pool-tiers";

struct PoolTierConfig {
  std::vector<std::string> specs;  // as cxlkvd's --tier; "%n" in an SSD path: the node id
  uint64_t slot_bytes = 0;         // 0: the store's default
};

// kInvalidArgument naming what is wrong: no spec, a spec that does not parse, a slot size that
// is not a multiple of 4 KiB of at least 8 KiB.
Status ValidatePoolTierConfig(const PoolTierConfig& config);
nlohmann::json PoolTierConfigJson(const PoolTierConfig& config);

// The configuration among the pool's status documents (ReadStatusDocs): nullopt when the pool
// has none; kCorrupted when it is there but unreadable or invalid.
Result<std::optional<PoolTierConfig>> FindPoolTierConfig(const nlohmann::json& status_docs);

// The specs as node `node` serves them ("%n" → the node id).
std::vector<std::string> SpecsForNode(const PoolTierConfig& config, uint32_t node);

}  // namespace cxlkv::tier

#endif  // CXLKV_SRC_TIER_POOL_TIERS_H_
