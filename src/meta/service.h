// The metadata service of a central-metadata pool (Beluga §6.2; docs/metadata.md): the prefix
// index's one writer, reached over the shared-memory RPC.
//
//   auto service = meta::MetaService::Start(pool);   // serves, or stands by for, "meta"
//
// Any number of processes may Start it (each node's cxlkvd; serving processes stand in where no
// daemon runs); the holder of the service's lock serves and the others stand by (rpc::RpcServer).
// While serving, this process's Index is the central writer: operations run on the serving
// thread one at a time with a process-local lock instead of stripe locks, each for the client
// named in the request (its writer word on reservations, its node's row for pins), and every
// commit passes the service's fence (its lock held in a valid lease) before READY is published.
// Between batches, every few hundred milliseconds, it sweeps: WRITING entries of lives that
// ended are reclaimed, pins of nodes that died are dropped; after a takeover it also finishes
// the evictions its predecessor left half done.
//
// Thread-safety: Start/stats/destructor from any thread; the handlers run on the serving thread.
#ifndef CXLKV_SRC_META_SERVICE_H_
#define CXLKV_SRC_META_SERVICE_H_

#include <atomic>
#include <chrono>
#include <memory>

#include "cxlkv/pool.h"
#include "rpc/server.h"

namespace cxlkv::cache {
class Index;
}

namespace cxlkv::meta {

struct MetaServiceStats {
  uint64_t sweeps = 0;     // sweeps run while serving
  uint64_t reclaimed = 0;  // WRITING entries of ended lives (or dead processes) dropped
  rpc::RpcServerStats rpc;
};

class MetaService {
 public:
  // Errors: kNotFound (the pool has no index), kInvalidArgument (its metadata is not central),
  // and those of RpcServer::Start.
  static Result<std::unique_ptr<MetaService>> Start(Pool& pool, const rpc::RpcServerOptions& options = {});
  // Stops serving (the batch in hand is answered); a standby takes over.
  ~MetaService();
  MetaService(const MetaService&) = delete;
  MetaService& operator=(const MetaService&) = delete;

  MetaServiceStats stats() const;
  const rpc::RpcServer& server() const { return *server_; }

 private:
  explicit MetaService(cache::Index& index) : index_(index) {}
  std::map<uint32_t, rpc::Handler> Handlers();
  void OnServing(const rpc::RpcServer& server, bool serving);
  void OnTick();

  cache::Index& index_;
  std::unique_ptr<rpc::RpcServer> server_;
  bool repair_pending_ = false;  // serving thread: the first sweep of a term repairs everything
  std::atomic<uint64_t> sweeps_{0}, reclaimed_{0};
};

// The service (serving or standing by) a pool opened in this process hosts; null when the
// pool's metadata is decentralized or the process hosts none (attach.cc).
const MetaService* ServiceOf(Pool& pool);

}  // namespace cxlkv::meta

#endif  // CXLKV_SRC_META_SERVICE_H_
