// Read-only views of the prefix index for `cxlkv stat` and `cxlkv check` (no lock taken: run
// them on a quiet pool, or accept a snapshot).
#ifndef CXLKV_SRC_CACHE_INSPECT_H_
#define CXLKV_SRC_CACHE_INSPECT_H_

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cxlkv/region.h"

namespace cxlkv::cache {

// How the inspector saw each node: never joined, heartbeating, silent (dead, maybe not yet
// recovered), or left.
enum class NodeStatus { kNever, kLive, kSilent, kLeft };

// Entries by state and tier, bytes per node, pins, counters per node and in total, hit rates,
// namespaces. Null when the pool has no index.
nlohmann::json Stat(Region& first, const std::vector<NodeStatus>& nodes);

// One line per violated invariant: states, probe paths, payloads in allocated space and
// disjoint (from each other and from roots), no WRITING entry or pin of a node that is not
// live.
void Check(const std::vector<Region*>& regions, const std::vector<NodeStatus>& nodes,
           const std::vector<uint64_t>& root_offsets, std::vector<std::string>& problems);

}  // namespace cxlkv::cache

#endif  // CXLKV_SRC_CACHE_INSPECT_H_
