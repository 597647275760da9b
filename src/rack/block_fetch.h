// Fetching KV blocks from another rack's pool over the rack link (docs/racks.md, "Fetching
// blocks"). The asking rack's pool ends with the blocks READY, so its next request is a local hit:
//
//   asker   ReserveMany(keys)                      its own pool: WRITING entries, space allocated
//           kFetch {namespace, the reserved keys}  ───────────────────────────────▶
//   holder                                         Lookup: the longest READY prefix, pinned
//           ◀─── per block: kFetchBlock {index, key, bytes, XXH3-64} + the payload, sent by UCX
//                straight out of the holder's pool into the asker's reservation (rendezvous)
//           ◀─── kFetchEnd {blocks sent}           each pin released once its send ended
//   asker   per block: length, key and checksum verified, lines flushed (P3), then CommitMany;
//           everything else (not sent, cut short, wrong, the holder died) AbortMany
//
// A block is READY in the asking pool only when all its bytes arrived and their checksum is the
// holder's: a stale directory entry, a holder that evicted or died, a peer that sends garbage —
// each costs the blocks it concerns a recompute, never wrong KV, and leaves nothing WRITING.
#ifndef CXLKV_SRC_RACK_BLOCK_FETCH_H_
#define CXLKV_SRC_RACK_BLOCK_FETCH_H_

#include <atomic>
#include <chrono>
#include <memory>
#include <span>
#include <string>

#include "cxlkv/cache.h"
#include "cxlkv/status.h"
#include "rack/ucx_link.h"

namespace cxlkv::rack {

struct FetchOutcome {
  size_t ready = 0;           // leading keys READY in this pool now (fetched or here before)
  size_t fetched = 0;         // blocks this fetch committed
  size_t already_cached = 0;  // leading keys that were READY here already (not asked for)
  size_t rejected = 0;        // payloads refused: wrong length, key or checksum, or cut short
  uint64_t bytes = 0;         // payload bytes committed
  // Ok, or why the holder's stream ended early (kUnavailable: it died or the link failed;
  // kTimeout; the holder's error). What arrived whole before that is committed all the same.
  Status link;
};

// The asking side. Thread-safe: fetches run concurrently (each owns its reservations).
class BlockFetcher {
 public:
  BlockFetcher(UcxLink& link, KvCache& cache) : link_(link), cache_(cache) {}

  // Makes the longest prefix of `keys` it can READY in this pool, from `holder` (a rack link's
  // address). Keys READY here already are not asked for; the run ends at the first key another
  // writer of this pool is writing, or that has no room. Errors (nothing reserved then):
  // kInvalidArgument (a namespace without a KV layout: the block size must be known before
  // bytes arrive; an empty or over-long key list), what Namespace and ReserveMany refuse.
  Result<FetchOutcome> Fetch(const std::string& holder, const KeyNamespace& ns, std::span<const BlockKey> keys,
                             std::chrono::milliseconds timeout);

 private:
  UcxLink& link_;
  KvCache& cache_;
};

// The holding side: serves kFetch requests out of this pool. Runs on the link's progress thread
// (part of its request handler); it pins and reads the pool and never waits on the network.
// Pins are held until UCX is done with each payload, so the cache must outlive the link.
class BlockFetchServer {
 public:
  explicit BlockFetchServer(KvCache& cache) : cache_(cache) {}

  // Serves `m` when it is a fetch (true); false: not a fetch, the caller answers it.
  bool Serve(const LinkMessage& m, LinkReply& reply);

  struct Counters {
    uint64_t fetches = 0;
    uint64_t blocks_sent = 0;
    uint64_t bytes_sent = 0;
    uint64_t send_failures = 0;  // payloads UCX could not deliver (the asker died, timed out)
    uint64_t pins_held = 0;      // now: pins whose payload is still on its way
  };
  Counters counters() const;

 private:
  struct Stream;
  void SendNext(const std::shared_ptr<Stream>& stream, LinkReply& reply);

  KvCache& cache_;
  std::atomic<uint64_t> fetches_{0}, blocks_{0}, bytes_{0}, failures_{0}, held_{0};
};

}  // namespace cxlkv::rack

#endif  // CXLKV_SRC_RACK_BLOCK_FETCH_H_
