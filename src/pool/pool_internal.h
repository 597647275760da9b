// What code under src/ and tests see of a Pool.
#ifndef CXLKV_SRC_POOL_POOL_INTERNAL_H_
#define CXLKV_SRC_POOL_POOL_INTERNAL_H_

#include <memory>
#include <mutex>
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

namespace pool {

// A central-metadata pool's link to the service (docs/metadata.md). The layer that implements
// it (src/meta, above the RPC) registers a factory, because the pool layer never calls up: a
// pool opened on a central index asks the factory for the cache's index (a client of the
// service) and, in processes that may host, a standby of the service itself.
class CentralMetadata {
 public:
  virtual ~CentralMetadata() = default;
  // The index the pool's KvCache runs on.
  virtual cache::IndexApi& index() = 0;
  // A process of this node died holding reservations: the service drops them. False when the
  // service was not reached (the node's recovery calls again later).
  virtual bool RecoverProcess(uint32_t slot, uint64_t inc) = 0;
};
using CentralMetadataFactory = Result<std::unique_ptr<CentralMetadata>> (*)(Pool& pool, const PoolOpenOptions& options);
// Installed once per program, before pools are opened (a static initializer of src/meta).
void RegisterCentralMetadata(CentralMetadataFactory factory);

// What brings blocks on capacity tiers into the region for a lookup (src/tier: it asks the
// owning node's cxlkvd over the RPC). Registered like the central metadata; a decentralized
// pool's cache gets one at open.
using CapacityPromoterFactory = std::unique_ptr<cache::CapacityPromoter> (*)(Pool& pool);
void RegisterCapacityPromoter(CapacityPromoterFactory factory);

}  // namespace pool

class Pool::Impl {
 public:
  std::vector<std::unique_ptr<Region>> regions;
  std::unique_ptr<sync::Node> node;
  std::unique_ptr<objstore::ObjectStore> roots;
  std::unique_ptr<alloc::Allocator> allocator;
  std::unique_ptr<cache::Index> index;   // null when the pool has no prefix index
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<cache::CapacityPromoter> promoter;  // installed on `cache`; reset after it
  // Central metadata only: the service's client (and standby), and the cache over it.
  std::unique_ptr<pool::CentralMetadata> central;  // set and reset under central_mu
  std::mutex central_mu;  // the node's process-recovery thread uses `central` too
  Status central_error;   // why `central` is missing, for Cache()
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
