// The prefix index of a central-metadata pool as its clients see it (Beluga §6.2;
// docs/metadata.md): every index operation is a request to the metadata service over the
// shared-memory RPC; payload bytes still move between the caller and the region directly.
//
// A batch larger than one request (about 100 keys) goes in several, one after the other. The
// service's channel is opened on first use, so a client may start before any service has; a
// call with no service fails kUnavailable within the RPC's deadline, never hangs. A request the
// service accepted and then lost in a takeover comes back kUnavailable ("outcome unknown").
//
// Thread-safety: all methods are thread-safe (the process's threads share its channel).
#ifndef CXLKV_SRC_META_CLIENT_H_
#define CXLKV_SRC_META_CLIENT_H_

#include <atomic>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "cache/index.h"
#include "cache/index_api.h"
#include "cxlkv/pool.h"
#include "rpc/client.h"

namespace cxlkv::meta {

class CentralIndex final : public cache::IndexApi {
 public:
  // `local` is this process's view of the index's layout: the payload side (pointers, reads,
  // counters) and the sizes; it is never written through here.
  CentralIndex(Pool& pool, cache::Index& local, const rpc::RpcClientOptions& options = {});
  // Drops what this process reserved and never committed or aborted (as the decentralized
  // index does at close).
  ~CentralIndex() override;

  Result<NamespaceHandle> RegisterNamespace(const KeyNamespace& ns) override;
  Result<LookupResult> Lookup(const NamespaceHandle& ns, std::span<const BlockKey> keys, bool pin) override;
  void Release(std::span<const BlockPin> pins) override;
  Result<Reservation> Reserve(const NamespaceHandle& ns, const BlockKey& key, uint64_t bytes) override;
  Status Commit(Reservation& r) override;
  Status Abort(Reservation& r) override;
  Result<std::vector<KeyReservation>> ReserveMany(const NamespaceHandle& ns, std::span<const BlockKey> keys,
                                                  uint64_t bytes) override;
  Status CommitMany(std::span<Reservation> rs) override;
  Status AbortMany(std::span<Reservation> rs) override;
  Result<std::vector<KeyPeek>> Peek(const NamespaceHandle& ns, std::span<const BlockKey> keys) override;
  Result<uint64_t> EvictKeys(const NamespaceHandle& ns, std::span<const BlockKey> keys) override;
  Result<uint64_t> EvictAll() override;
  Result<uint64_t> EvictNamespace(const NamespaceHandle& ns) override;

  uint8_t* Payload(uint64_t offset, uint64_t bytes) override { return local_.Payload(offset, bytes); }
  void ReadPayload(void* dst, const uint8_t* p, uint64_t bytes) override { local_.ReadPayload(dst, p, bytes); }
  void InvalidateForRead(const uint8_t* p, uint64_t bytes, bool fence) override {
    local_.InvalidateForRead(p, bytes, fence);
  }
  bool checksums() const override { return local_.checksums(); }
  void CountRead(uint64_t bytes) override { local_.CountRead(bytes); }
  void CountWrite(uint64_t bytes) override { local_.CountWrite(bytes); }
  void CountChecksumFailure() override { local_.CountChecksumFailure(); }

  // Asks the service to drop the reservations of process `slot` of this node's life `inc`
  // (a surviving process reports a dead one). False when the service was not reached.
  bool ReclaimProcess(uint32_t slot, uint64_t inc);
  struct ServiceStats {
    uint64_t used_bytes = 0, capacity = 0, reclaimed = 0;
  };
  Result<ServiceStats> Stats();

 private:
  // This process's writer word now (its node's current life): the service acts for it.
  uint64_t Writer() const;
  Result<rpc::RpcClient*> Client();
  // One request and its answer; a full ring (kBusy: the process's other threads) is retried.
  // `request` starts with the writer word (but kRegister's): a refusal of a life that just
  // ended is retried once as this process's new life.
  Result<size_t> Call(uint32_t op, std::span<uint8_t> request, std::span<uint8_t> answer);
  // Keys per request for an operation whose answer has `answer_item` bytes per key.
  size_t KeysPerRequest(size_t answer_item, size_t answer_fixed);
  Status Finish(uint32_t op, std::span<Reservation> rs);

  Pool& pool_;
  cache::Index& local_;
  sync::Node& node_;
  rpc::RpcClientOptions options_;
  std::mutex open_mu_;
  std::unique_ptr<rpc::RpcClient> client_;  // guarded by open_mu_ until set
  std::atomic<rpc::RpcClient*> ready_{nullptr};
  std::atomic<bool> reserved_any_{false};
  // Open reservations of this process: (slot, generation) -> the life that made them. A
  // reservation of a life that ended commits nothing; it is refused here as the decentralized
  // index refuses it (kLeaseExpired), whether or not the service reclaimed it already.
  std::mutex open_reservations_mu_;
  std::unordered_map<uint64_t, uint64_t> open_reservations_;
  static uint64_t ReservationId(const Reservation& r) { return (r.generation << 32) ^ r.slot; }
};

}  // namespace cxlkv::meta

#endif  // CXLKV_SRC_META_CLIENT_H_
