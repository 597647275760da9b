// A client of etcd's v3 API through its JSON gateway (HTTP/1.1 over cpp-httplib): what rack
// membership needs — puts and ranges under leases, a create-if-absent and a compare-and-swap
// transaction, lease grant / keep-alive / revoke, and a watch that streams a prefix's events.
//
// Why the gateway and not gRPC: the gateway needs no generated code (gRPC stubs from etcd's
// .proto files would add a protobuf/gRPC build to every build of CI's two cores) and etcd serves
// it on the client port. It costs ~0.7 ms more per put (1.4–1.6 ms against 0.7–0.9 ms on one
// member here), which membership never feels: a rack link writes a few keys a second, and the
// directory of blocks lives in the racks, never in etcd.
//
// Endpoints: a request goes to the endpoint that answered last; on a transport failure or an
// "unavailable" answer (no leader, a member stopping) it tries each other endpoint once, so a
// dead or partitioned member costs at most one timeout per request. Every request is bounded by
// `request_timeout` (connect and each read). Responses are untrusted input: a body that is not
// the JSON etcd sends gives a kCorrupted Status naming the endpoint and the request, never a
// crash.
//
// Thread-safety: every method may be called from any thread at once (each request uses a
// connection of its own). Watch() blocks its caller; StopWatches() ends every Watch() in
// progress from another thread.
#ifndef CXLKV_SRC_RACK_ETCD_CLIENT_H_
#define CXLKV_SRC_RACK_ETCD_CLIENT_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "cxlkv/status.h"

namespace cxlkv::rack {

struct EtcdOptions {
  // "http://HOST:PORT" or "HOST:PORT", at least one; the members of one etcd cluster.
  std::vector<std::string> endpoints;
  // Bound of one request on one endpoint: connect, and each wait for bytes. Default 2 s.
  std::chrono::milliseconds request_timeout{2000};
};

struct EtcdKv {
  std::string key;
  std::string value;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
  int64_t lease = 0;  // 0: the key lives until deleted
};

struct EtcdRange {
  std::vector<EtcdKv> kvs;
  int64_t revision = 0;  // the store's revision the range was read at
};

// One condition of a transaction: the key's mod_revision (kMod) or create_revision (kCreate)
// equals `revision`. An absent key has both at 0.
struct EtcdCompare {
  enum class Target { kMod, kCreate };
  std::string key;
  Target target = Target::kMod;
  int64_t revision = 0;
};

struct EtcdPut {
  std::string key;
  std::string value;
  int64_t lease = 0;
};

struct EtcdEvent {
  enum class Type { kPut, kDelete };
  Type type = Type::kPut;
  EtcdKv kv;  // for kDelete: the key and mod_revision only
};

// How a Watch() ended.
struct EtcdWatchEnd {
  // The watch's start revision had been compacted: events were lost, the caller must read the
  // prefix again (a resync) and watch from that read's revision + 1.
  int64_t compact_revision = 0;
  // The last revision whose events were delivered (0 if none): resume from it + 1.
  int64_t last_revision = 0;
};

class EtcdClient {
 public:
  // Validates the endpoints (no I/O). Errors: kInvalidArgument naming the bad endpoint.
  static Result<std::unique_ptr<EtcdClient>> Create(EtcdOptions options);

  // Returns the revision of the put. lease 0: no lease.
  Result<int64_t> Put(const std::string& key, const std::string& value, int64_t lease = 0);
  // The key alone (kvs empty when absent).
  Result<EtcdRange> Get(const std::string& key);
  // Every key that starts with `prefix`.
  Result<EtcdRange> GetPrefix(const std::string& prefix);
  // Returns how many keys were deleted.
  Result<int64_t> Delete(const std::string& key);
  // Puts the key only if it does not exist. Returns whether it was put.
  Result<bool> PutIfAbsent(const std::string& key, const std::string& value, int64_t lease = 0);
  // Puts the key only if its mod_revision is still `mod_revision` (0: only if absent).
  // Returns whether it was put.
  Result<bool> PutIfUnchanged(const std::string& key, const std::string& value, int64_t mod_revision,
                              int64_t lease = 0);

  // Applies every put, atomically, only if every compare holds. Returns whether it applied.
  Result<bool> Txn(const std::vector<EtcdCompare>& compares, const std::vector<EtcdPut>& puts);

  // A new lease of `ttl_seconds` (etcd may raise a TTL below its minimum). Returns its id.
  Result<int64_t> LeaseGrant(int64_t ttl_seconds);
  // Renews the lease. Returns its TTL in seconds after the renewal; 0 when the lease no longer
  // exists (it expired or was revoked: whatever was under it is gone).
  Result<int64_t> LeaseKeepAlive(int64_t lease);
  // The lease's remaining TTL in seconds; -1 when it no longer exists.
  Result<int64_t> LeaseTimeToLive(int64_t lease);
  // Ends the lease now: its keys are deleted at once. A lease already gone is not an error.
  Status LeaseRevoke(int64_t lease);
  // Compacts the store's history up to `revision` (old revisions can no longer be watched).
  Status Compact(int64_t revision);

  // Streams the events of keys under `prefix` from `start_revision` (inclusive) to `on_events`,
  // one call per revision batch etcd sends; returning false from it ends the watch. Blocks until
  // then, until StopWatches(), until the stream breaks or is silent for `idle` (then OK with the
  // end's last_revision: resume from there), or until etcd cancels it (compact_revision set).
  // Errors: kUnavailable when no endpoint accepts the watch.
  using EventsFn = std::function<bool(const std::vector<EtcdEvent>& events, int64_t revision)>;
  Result<EtcdWatchEnd> Watch(const std::string& prefix, int64_t start_revision, const EventsFn& on_events,
                             std::chrono::milliseconds idle);
  // Ends every Watch() in progress (they return OK) and makes new ones return at once.
  void StopWatches();
  // Lets Watch() run again after StopWatches() (a watch stopped to simulate a lost connection).
  void ResumeWatches() { watches_stopped_.store(false); }

  const std::vector<std::string>& endpoints() const { return endpoints_; }

  ~EtcdClient();

 private:
  struct Endpoint;
  explicit EtcdClient(EtcdOptions options, std::vector<Endpoint> endpoints);
  // POSTs `body` to `path` on the endpoints in turn (the last good one first). Returns the
  // parsed JSON body as text (the caller parses what it needs).
  Result<std::string> Call(const std::string& path, const std::string& body);

  EtcdOptions options_;
  std::vector<std::string> endpoints_;
  std::vector<Endpoint> targets_;
  std::atomic<size_t> preferred_{0};
  std::atomic<bool> watches_stopped_{false};
  std::mutex watches_mu_;
  std::set<void*> watches_;  // the httplib clients of the watches in progress (to stop them)
};

// etcd's key encoding in the gateway (base64), exposed for tests.
std::string Base64Encode(const std::string& bytes);
Result<std::string> Base64Decode(const std::string& text);

// The key just past every key that starts with `prefix` (etcd's range_end of a prefix).
std::string PrefixEnd(const std::string& prefix);

}  // namespace cxlkv::rack

#endif  // CXLKV_SRC_RACK_ETCD_CLIENT_H_
