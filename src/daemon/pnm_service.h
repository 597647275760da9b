// Near-memory attention engines in cxlkvd (PNM §3.2; docs/pnm.md, "Engines in
// cxlkvd"): the node's daemon serves "pnm-<node>" (pnm/service_protocol.h), so decode attention
// over a long context runs next to the memory that holds its KV and only queries, outputs and
// log-sum-exps cross the link.
//
//   auto s = daemon::NearMemoryService::Start(pool, {.threads = 2});
//   ... clients: pnm::NearMemoryClient::Open(pool, node) (pnm/remote.h) ...
//
// A context is a client's list of pool blocks (pages) of one KV namespace. Extending it pins the
// blocks (they cannot be evicted while it is open), invalidates them once (they are immutable
// once READY) and gives every page its digest: read from the pool when a reader before stored
// it, else built from the keys and stored next to the KV (a block of the digest namespace keyed
// by the KV block's key), so the next daemon that opens the same prefix reads 1/16 of the bytes.
// Attention requests are data-parallel (§3.2): selection and attention of a batch's requests run
// on the engines' threads, one engine per NUMA node of the pool's regions, each attending the
// pages its node holds (node_engines.h).
//
// Leases: a context the client neither uses nor renews for `context_lease_ms` is closed and its
// pins released (a crashed client, or one paused past the lease: it then gets kNotFound and opens
// again). A context whose client's node life ended is closed at once. When this daemon's own
// life ends (paused past its lease: recovery took its pins) every context is forgotten without
// releasing pins that are no longer its own; answers computed meanwhile are never published (the
// RPC server fences every publish).
//
// Thread-safety: Start, the destructor and stats from any thread; requests are handled on the
// RPC server's thread.
#ifndef CXLKV_SRC_DAEMON_PNM_SERVICE_H_
#define CXLKV_SRC_DAEMON_PNM_SERVICE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cxlkv/cache.h"
#include "cxlkv/pool.h"
#include "cxlkv/status.h"
#include "daemon/node_engines.h"
#include "pnm/service_protocol.h"
#include "rpc/server.h"

namespace cxlkv::daemon {

struct NearMemoryServiceOptions {
  uint32_t threads = 1;               // engine threads per memory node besides its lead (node_engines.h). Default 1.
  uint32_t context_lease_ms = 10000;  // idle time after which a context is closed. Default 10 s.
  uint32_t max_contexts = 1024;       // open at once (all clients). Default 1024.
  bool bind_numa = true;              // an engine per memory node, bound to it. Default true.
  region::Platform* platform = nullptr;  // NUMA queries and binding (tests: fake nodes); null: the OS
};

struct NearMemoryServiceStats {
  uint64_t contexts_open = 0;
  uint64_t contexts_opened = 0;
  uint64_t contexts_expired = 0;       // closed by the lease or the client node's death
  uint64_t pages_pinned = 0;           // over the open contexts
  uint64_t bytes_pinned = 0;
  uint64_t attend_jobs = 0;
  uint64_t attend_errors = 0;
  uint64_t pages_attended = 0;
  uint64_t kv_bytes_read = 0;          // KV bytes the attention read
  uint64_t link_bytes = 0;             // query, output and lse bytes of the attention requests
  uint64_t digests_found = 0;
  uint64_t digests_built = 0;
  uint64_t digests_stored = 0;
  int numa_node = -1;                  // where the first engine's threads run (-1: not bound)
  std::string numa_note;               // why not, when not bound
  std::vector<NodeEngineStats> engines;  // one per memory node of the pool's regions
};

class NearMemoryService {
 public:
  // Serves "pnm-<this node>" until destroyed. Errors: kInvalidArgument (options), those of
  // RpcServer::Start (kNoSpace: the region has no room for the service's RPC area).
  static Result<std::unique_ptr<NearMemoryService>> Start(Pool& pool, const NearMemoryServiceOptions& options = {});
  // Stops serving, then releases every context's pins.
  ~NearMemoryService();
  NearMemoryService(const NearMemoryService&) = delete;
  NearMemoryService& operator=(const NearMemoryService&) = delete;

  NearMemoryServiceStats stats() const;
  const rpc::RpcServer& server() const { return *server_; }

 private:
  struct Context;
  NearMemoryService(Pool& pool, const NearMemoryServiceOptions& options);

  Result<size_t> Open(const rpc::Request& req, std::span<uint8_t> out);
  Result<size_t> Extend(const rpc::Request& req, std::span<uint8_t> out);
  Result<size_t> Attend(const rpc::Request& req, std::span<uint8_t> out);
  Result<size_t> AttendSplit(const rpc::Request& req, std::span<uint8_t> out);
  // A split attend's held pages: a list per KV head, each page inside the context, and a budget.
  static Status CheckHeld(const Context& c, const pnm::AttendJobRequest& j);
  // Both attends: `split` leaves each job's held pages to the engine and answers, per KV head,
  // with the held pages that stay selected and the pages to recall (SplitHeadOf).
  Result<size_t> RunAttend(const rpc::Request& req, std::vector<pnm::AttendJobRequest>& jobs, bool split,
                           std::span<uint8_t> out);
  Result<size_t> Renew(const rpc::Request& req, std::span<uint8_t> out);
  Result<size_t> Close(const rpc::Request& req, std::span<uint8_t> out);
  // The caller's open context, renewed. kNotFound when closed or expired, kInvalidArgument
  // when another client's.
  Result<Context*> Find(const rpc::Request& req, uint64_t id);
  // Drops contexts past their lease or of dead client lives; forgets all after a life change.
  void Sweep();
  // Releases the pins (when this life took them) and forgets the context.
  void Drop(std::map<uint64_t, std::unique_ptr<Context>>::iterator it);
  void DropAll();
  // Forgets every context (without releasing) when this node's life is no longer the one their
  // pins were taken in. Runs before every request (Start wraps the handlers) and each sweep.
  void ForgetIfLifeChanged();
  Status LoadOrBuildDigests(Context& c, uint64_t first_page, std::span<const BlockKey> keys, pnm::ExtendAnswer* a);

  Pool& pool_;
  KvCache* cache_ = nullptr;
  NearMemoryServiceOptions options_;
  std::unique_ptr<NodeEngines> engines_;
  uint64_t epoch_ = 0;      // high bits of context ids: an id of an earlier daemon is unknown
  uint64_t next_id_ = 1;
  uint64_t life_ = 0;       // the node life the open contexts' pins were taken in
  // Serving thread only (handlers, on_tick, on_serving); the destructor after the server stops.
  std::map<uint64_t, std::unique_ptr<Context>> contexts_;
  std::unique_ptr<rpc::RpcServer> server_;

  std::atomic<uint64_t> opened_{0}, expired_{0}, open_{0}, pages_pinned_{0}, bytes_pinned_{0};
  std::atomic<uint64_t> jobs_{0}, job_errors_{0}, pages_attended_{0}, kv_bytes_read_{0}, link_bytes_{0};
  std::atomic<uint64_t> digests_found_{0}, digests_built_{0}, digests_stored_{0};
};

}  // namespace cxlkv::daemon

#endif  // CXLKV_SRC_DAEMON_PNM_SERVICE_H_
