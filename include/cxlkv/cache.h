// The prefix KV cache in the shared region (TraCT §4.2, Beluga §6): every node can look up,
// pin, read, insert and evict KV blocks, keyed by chained block hashes.
//
//   auto pool = cxlkv::Pool::Open({"/dev/shm/cxlkv"}, opts);
//   cxlkv::KvCache& cache = *(*pool)->Cache();
//   auto ns = cache.Namespace({.model_id = "llama-3.1-8b", .layout = layout});
//   auto keys = cache.ChainKeys(*ns, prompt_tokens);        // one key per full block
//   auto hit = cache.Lookup(*ns, keys);                     // longest READY prefix, pinned
//   ... read hit->pins[i] with cache.Read, compute the rest ...
//   auto r = cache.Reserve(*ns, keys[k], bytes);            // WRITING, space allocated
//   cache.Write(*r, 0, kv, bytes); cache.Commit(*r);        // READY: visible everywhere
//   cache.Release(hit->pins);
//
// A block is READY only after its payload is complete and flushed (the visibility boundary).
// Pinned blocks are never evicted; when space runs out, unpinned READY blocks are evicted
// least-recently-used first, from a high to a low watermark.
//
// Thread-safety: all methods are thread-safe. A KvCache belongs to its Pool.
#ifndef CXLKV_CACHE_H_
#define CXLKV_CACHE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "cxlkv/status.h"

namespace cxlkv {

namespace cache {
class IndexApi;
class CapacityPromoter;
}

// A 128-bit block key (xxh3-128). Opaque: compare, hash, store.
struct BlockKey {
  uint64_t lo = 0;
  uint64_t hi = 0;
  friend bool operator==(const BlockKey&, const BlockKey&) = default;
};

enum class KvDtype : uint32_t { kFp16 = 0, kBf16 = 1, kFp8 = 2, kFp32 = 3 };
uint32_t DtypeBytes(KvDtype dtype);

// What a block of KV is, as the engine computes it. Two engines share blocks only when every
// field is equal (and the model id and extra key are).
//
// Pool block formats (include/cxlkv/layout.h describes them): 1 keeps each (layer, K or V) slab
// token-major, [block_size][heads][head_size]; 2 keeps it head-major, [heads][block_size][head_size].
inline constexpr uint32_t kPoolBlockFormat = 1;
inline constexpr uint32_t kPoolBlockFormatHeadMajor = 2;

struct KvLayoutSignature {
  KvDtype dtype = KvDtype::kFp16;
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;      // heads of this tensor-parallel rank's slice
  uint32_t head_size = 0;
  uint32_t block_size = 16;       // tokens per block (vLLM's default)
  uint32_t tp_rank = 0;
  uint32_t tp_size = 1;
  uint32_t pp_stage = 0;
  uint32_t kv_parts = 2;          // 2: K and V; 1: one latent (MLA)
  uint32_t block_format = kPoolBlockFormat;  // pool-side block layout: 1 or 2 (above)

  // Bytes of one block: parts × layers × tokens × heads × head size × dtype. 0 when the
  // layout is unspecified (num_layers == 0): blocks of any size are accepted.
  uint64_t BlockBytes() const;
};

struct KeyNamespace {
  std::string model_id;           // required, at most 95 bytes
  KvLayoutSignature layout;
  std::string extra_key;          // LoRA id, multimodal hash...; at most 63 bytes
};

// A namespace registered in the pool (its slot in the index's namespace table).
struct NamespaceHandle {
  uint32_t id = 0;
  uint32_t block_size = 16;
  uint64_t block_bytes = 0;       // 0: any size
  BlockKey seed;                  // h_0 of every chain
};

// A pinned READY block: where its payload is. Valid until released.
struct BlockPin {
  uint32_t slot = 0;
  uint64_t generation = 0;
  uint64_t offset = 0;            // pool offset of the payload
  uint64_t bytes = 0;
  uint32_t tier = 0;              // 0: the shared region (a pin is always on tier 0: blocks on
                                  // capacity tiers are brought in before they are pinned)
  uint64_t checksum = 0;          // xxh3-64 of the payload, 0 when checksums are off
  uint64_t pin_word = 0;          // where the pin is held (opaque: Release finds it faster with it)
};

struct LookupResult {
  size_t hit_blocks = 0;          // the longest prefix of `keys` that is READY
  std::vector<BlockPin> pins;     // one per hit block, in key order
  // READY blocks right after the hit, the first of them on a capacity tier (node DRAM, SSD):
  // present in the pool but not in the region. KvCache::Lookup brings them in (the owner's
  // cxlkvd promotes them) and extends the hit; what it could not bring in ends the hit.
  size_t capacity_run = 0;
  // Of the hit, the blocks KvCache::Lookup brought in from node DRAM and from SSD (where each
  // was when the lookup found it); the rest were in the region already.
  size_t from_mem = 0;
  size_t from_ssd = 0;
};

// What KvCache::ReadCapacity read: the longest prefix of its keys read out of capacity tiers,
// and of those, how many were on node DRAM and on SSD.
struct CapacityRead {
  size_t blocks = 0;
  size_t from_mem = 0;
  size_t from_ssd = 0;
};

// A WRITING entry this process owns until Commit or Abort.
struct Reservation {
  uint32_t slot = 0;
  uint64_t generation = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  bool open = false;
};

// Per-key outcome of a batched reserve (KvCache::ReserveMany). The batch keeps the single-key
// semantics: each key ends exactly as Reserve would have left it.
enum class ReserveOutcome : uint8_t {
  kReserved = 0,       // WRITING, owned by this process: `reservation` is open
  kAlreadyCached = 1,  // READY already: nothing to do (Reserve's kAlreadyExists)
  kBusy = 2,           // being written (writer_node/writer_incarnation name the writer; a key
                       // repeated within one batch is busy with this node as its writer) or
                       // being evicted (writer_incarnation 0)
  kError = 3,          // `status` says why (kNoSpace, kInvalidArgument...)
};

struct KeyReservation {
  ReserveOutcome outcome = ReserveOutcome::kError;
  Reservation reservation;          // open iff kReserved
  Status status;                    // kBusy/kAlreadyCached/kError: Reserve's status
  uint32_t writer_node = 0;         // kBusy while WRITING: the writer
  uint64_t writer_incarnation = 0;  // its life; 0 when evicting
};

// What a lock-free Peek saw of a key (a snapshot: may change at once).
enum class PeekState : uint8_t {
  kAbsent = 0,    // no entry (or a tombstone)
  kWriting = 1,   // being written: writer_node / writer_incarnation name the writer
  kReady = 2,     // published
  kOther = 3,     // being evicted
};

struct KeyPeek {
  PeekState state = PeekState::kAbsent;
  uint32_t writer_node = 0;         // kWriting: the writer
  uint64_t writer_incarnation = 0;  // kWriting: the writer's life
  bool writer_live = false;         // kWriting: that life is live in this process's view (a
                                    // dead writer's entry is reclaimed by the next Reserve)
};

class KvCache {
 public:
  // Over the decentralized index (Pool::Cache) or, later, a client of the metadata service.
  explicit KvCache(cache::IndexApi& index) : index_(index) {}

  // Registers the namespace, or finds it. Errors: kInvalidArgument (empty or over-long model
  // id, inconsistent layout), kVersionMismatch (the model is registered with another KV
  // layout), kNoSpace (namespace table full).
  Result<NamespaceHandle> Namespace(const KeyNamespace& ns);

  // Keys of every *full* block of `tokens`: h_i = xxh3-128(h_{i-1} ‖ tokens of block i).
  static std::vector<BlockKey> ChainKeys(const NamespaceHandle& ns, std::span<const int32_t> tokens);
  // An engine's own block hash (vLLM, SGLang), folded into the namespace.
  static BlockKey KeyFromEngineHash(const NamespaceHandle& ns, std::span<const uint8_t> hash);

  // Longest READY prefix of `keys`, pinned. With kPromote (the default), blocks found on capacity
  // tiers are brought into the region first (promoted by their owner's cxlkvd) and pinned too;
  // with kLeave the hit stops there and `capacity_run` says how many follow on capacity tiers,
  // for ReadCapacity. Errors: kInvalidArgument (a key of another namespace, a stale handle).
  enum class CapacityPolicy { kPromote, kLeave };
  Result<LookupResult> Lookup(const NamespaceHandle& ns, std::span<const BlockKey> keys,
                              CapacityPolicy policy = CapacityPolicy::kPromote);
  // The streaming source: reads the longest prefix of `keys` it can out of capacity tiers
  // without promoting them (they stay where they are, the region is not filled with a scan):
  // each owner's cxlkvd reads its slots, validated, into region staging space (a bounded window
  // at a time), and `use` gets pins of those copies for consecutive parts of the prefix, in key
  // order (`block_bytes` each; valid only during that call) — e.g. to scatter them straight into
  // an engine's buffers (transfer::CpuTransfer::LoadFromCapacity). Errors:
  // kNotSupported (no capacity tiers reachable from this pool), what `use` returned.
  Result<CapacityRead> ReadCapacity(const NamespaceHandle& ns, std::span<const BlockKey> keys, uint64_t block_bytes,
                                    const std::function<Status(std::span<const BlockPin>)>& use);
  // Length of the READY prefix without pinning, capacity tiers included (for schedulers; may be
  // stale at once, and a lookup may hit less when a capacity block cannot be brought in).
  Result<size_t> Exists(const NamespaceHandle& ns, std::span<const BlockKey> keys);
  void Release(std::span<const BlockPin> pins);

  // Errors: kAlreadyExists (READY: nothing to do), kBusy (being written or evicted; the message
  // names the writer node), kInvalidArgument (size 0, not the namespace's block size, larger
  // than a region), kNoSpace (pool full of pinned or in-flight blocks).
  Result<Reservation> Reserve(const NamespaceHandle& ns, const BlockKey& key, uint64_t bytes);
  // Reserve for every key of a batch: payloads allocated first, then one stripe lock per stripe
  // touched (ascending) and one flush batch per stripe. One outcome per key, in key order.
  // Errors (the whole batch, nothing reserved): kInvalidArgument (bad size, stale handle).
  Result<std::vector<KeyReservation>> ReserveMany(const NamespaceHandle& ns, std::span<const BlockKey> keys,
                                                  uint64_t bytes);
  // Commits every open reservation (lock-free; one flush batch for the fields, one for the
  // states). All are attempted; returns the first error (a reservation reclaimed because this
  // node was presumed dead). Every reservation is closed afterwards.
  Status CommitMany(std::span<Reservation> rs);
  // Aborts every open reservation: one stripe lock per stripe touched. Returns the first error.
  Status AbortMany(std::span<Reservation> rs);
  // Per key, what the index holds now, without a lock, a pin or a write (P2 invalidates only).
  Result<std::vector<KeyPeek>> Peek(const NamespaceHandle& ns, std::span<const BlockKey> keys);

  // Non-temporal copy into bytes [at, at+n) of the reserved payload.
  Status Write(Reservation& r, uint64_t at, const void* src, uint64_t bytes);
  Status Commit(Reservation& r);
  Status Abort(Reservation& r);
  // Reserve + Write + Commit; kAlreadyExists when the block is there already.
  Status Put(const NamespaceHandle& ns, const BlockKey& key, const void* data, uint64_t bytes);

  // Reads bytes [at, at+n) of a pinned block (invalidating first where the mode needs it);
  // verifies the checksum when the pool keeps them and the whole block is read.
  Status Read(const BlockPin& pin, uint64_t at, void* dst, uint64_t bytes);
  // Pointer to a pinned block's payload (for DMA engines and batched readers, which call
  // InvalidateForRead on what they read first).
  const uint8_t* PayloadPtr(const BlockPin& pin);
  // Pointer to a reservation's payload (for batched writers: non-temporal stores, or plain
  // stores followed by a flush — payload must not stay dirty in this host's cache, P3).
  uint8_t* ReservedPtr(const Reservation& r);
  // Drops this host's copies of [p, p+bytes) where the coherence mode requires (P2). A batch
  // passes fence = false for all but its last range (or fences itself) so the misses overlap.
  void InvalidateForRead(const uint8_t* p, uint64_t bytes, bool fence = true);

  // Evicts these keys if unpinned; returns how many were evicted.
  Result<uint64_t> Evict(const NamespaceHandle& ns, std::span<const BlockKey> keys);
  // Evicts every unpinned READY block; returns how many.
  Result<uint64_t> EvictAll();
  // Evicts every unpinned READY block of `ns` and no other; returns how many (an engine's
  // "clear my cache" on a pool other engines share).
  Result<uint64_t> EvictNamespace(const NamespaceHandle& ns);

  cache::IndexApi& index() { return index_; }
  // Internal: what brings blocks on capacity tiers into the region for Lookup (src/tier
  // installs it with the pool; null: such blocks end a hit).
  void SetCapacityPromoter(cache::CapacityPromoter* promoter) { promoter_.store(promoter, std::memory_order_release); }

 private:
  cache::IndexApi& index_;
  std::atomic<cache::CapacityPromoter*> promoter_{nullptr};
};

}  // namespace cxlkv

#endif  // CXLKV_CACHE_H_
