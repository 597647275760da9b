// What code under src/ and tests see of a Pool.
#ifndef CXLKV_SRC_POOL_POOL_INTERNAL_H_
#define CXLKV_SRC_POOL_POOL_INTERNAL_H_

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "alloc/allocator.h"
#include "cache/index.h"
#include "cache/inspect.h"
#include "cxlkv/pool.h"
#include "objstore/object_store.h"
#include "sync/node.h"

namespace cxlkv {

class Pool::Impl {
 public:
  std::vector<std::unique_ptr<Region>> regions;
  std::unique_ptr<sync::Node> node;
  std::unique_ptr<objstore::ObjectStore> roots;
  std::unique_ptr<alloc::Allocator> allocator;
  std::unique_ptr<cache::Index> index;   // null when the pool has no prefix index
  std::unique_ptr<KvCache> cache;
};

namespace pool {

// Attaches the regions of a pool without joining (read-only inspection).
Result<std::vector<std::unique_ptr<Region>>> AttachAll(const std::vector<std::string>& paths);
// `cxlkv stat`: nodes (as the node table says; live = heartbeat moved within `watch_ms`),
// lock manager, chunks per region and node, roots.
nlohmann::json Stat(std::vector<std::unique_ptr<Region>>& regions, uint32_t watch_ms);
// The same with liveness as an observer already knows it (a daemon's node view), without a watch.
nlohmann::json Stat(std::vector<std::unique_ptr<Region>>& regions, const std::vector<cache::NodeStatus>& statuses);
// `cxlkv check`: one line per violated invariant; empty when healthy. Watches heartbeats for
// `watch_ms` to tell live nodes (whose in-flight entries and pins are legitimate) from dead.
std::vector<std::string> Check(std::vector<std::unique_ptr<Region>>& regions, uint32_t watch_ms = 300);

}  // namespace pool
}  // namespace cxlkv

#endif  // CXLKV_SRC_POOL_POOL_INTERNAL_H_
