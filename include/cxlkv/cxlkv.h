/* cxlkv's C API, for FFI (Python ctypes/cffi, Rust, Go): the prefix KV cache of a pool.
 *
 *   cxlkv_pool* pool;
 *   if (cxlkv_pool_open("/dev/shm/cxlkv", 3, 0, &pool) != CXLKV_OK) puts(cxlkv_last_error());
 *   cxlkv_layout layout = cxlkv_layout_default();            // any block size
 *   cxlkv_namespace ns;
 *   cxlkv_namespace_register(pool, "llama-3.1-8b", &layout, "", &ns);
 *   cxlkv_key keys[64];
 *   size_t n = cxlkv_chain_keys(&ns, tokens, n_tokens, keys, 64);
 *   cxlkv_pin pins[64]; size_t hits;
 *   cxlkv_lookup(pool, &ns, keys, n, pins, &hits);           // pinned: read, then release
 *   cxlkv_release(pool, pins, hits);
 *
 * Every function that can fail returns a cxlkv_status (0 = CXLKV_OK); the message of the
 * calling thread's last failure is cxlkv_last_error(). Thread-safe like the C++ API
 * (include/cxlkv/cache.h), whose semantics these functions share exactly.
 */
#ifndef CXLKV_CXLKV_H_
#define CXLKV_CXLKV_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The same values as cxlkv::StatusCode. */
typedef enum {
  CXLKV_OK = 0,
  CXLKV_INVALID_ARGUMENT = 1,
  CXLKV_NOT_FOUND = 2,
  CXLKV_ALREADY_EXISTS = 3,
  CXLKV_CORRUPTED = 4,
  CXLKV_VERSION_MISMATCH = 5,
  CXLKV_NO_SPACE = 6,
  CXLKV_PERMISSION_DENIED = 7,
  CXLKV_IO_ERROR = 8,
  CXLKV_BUSY = 9,
  CXLKV_TIMEOUT = 10,
  CXLKV_NOT_SUPPORTED = 11,
  CXLKV_INTERNAL = 12,
  CXLKV_LEASE_EXPIRED = 13, /* this node was paused past its lease; nothing was published: retry */
  CXLKV_UNAVAILABLE = 14    /* no server answered (cxlkvd down or failing over): retry, or start it */
} cxlkv_status;

typedef struct cxlkv_pool cxlkv_pool;

typedef struct {
  uint64_t lo, hi;
} cxlkv_key;

/* A KV layout signature; see cxlkv::KvLayoutSignature. dtype: 0 fp16, 1 bf16, 2 fp8, 3 fp32. */
typedef struct {
  uint32_t dtype, num_layers, num_kv_heads, head_size, block_size;
  uint32_t tp_rank, tp_size, pp_stage, kv_parts, block_format;
} cxlkv_layout;

typedef struct {
  uint32_t id, block_size;
  uint64_t block_bytes;
  cxlkv_key seed;
} cxlkv_namespace;

typedef struct {
  uint32_t slot, tier;
  uint64_t generation, offset, bytes, checksum;
  uint64_t pin_word; /* opaque: where the pin is held; pass pins back unchanged */
} cxlkv_pin;

typedef struct {
  uint32_t slot, open;
  uint64_t generation, offset, bytes;
} cxlkv_reservation;

/* The calling thread's last error message ("" after success). */
const char* cxlkv_last_error(void);

/* Formats a pool (as `cxlkv init`): size_bytes per region, default index and options. */
cxlkv_status cxlkv_pool_create(const char* paths, uint64_t size_bytes, uint32_t max_nodes, int overwrite);
/* paths: comma-separated region paths. lease_ms 0: the default (2000). */
cxlkv_status cxlkv_pool_open(const char* paths, uint32_t node_id, uint32_t lease_ms, cxlkv_pool** out);
void cxlkv_pool_close(cxlkv_pool* pool);

/* Layers 0 (blocks of any size), 16-token blocks, TP 1. */
cxlkv_layout cxlkv_layout_default(void);
cxlkv_status cxlkv_namespace_register(cxlkv_pool* pool, const char* model_id, const cxlkv_layout* layout,
                                      const char* extra_key, cxlkv_namespace* out);

/* Keys of the full blocks of tokens[0..n_tokens); returns how many were written (<= max_keys). */
size_t cxlkv_chain_keys(const cxlkv_namespace* ns, const int32_t* tokens, size_t n_tokens, cxlkv_key* out,
                        size_t max_keys);
cxlkv_key cxlkv_key_from_engine_hash(const cxlkv_namespace* ns, const void* hash, size_t hash_bytes);

/* pins must hold n entries; *hits gets the length of the pinned READY prefix. */
cxlkv_status cxlkv_lookup(cxlkv_pool* pool, const cxlkv_namespace* ns, const cxlkv_key* keys, size_t n,
                          cxlkv_pin* pins, size_t* hits);
cxlkv_status cxlkv_exists(cxlkv_pool* pool, const cxlkv_namespace* ns, const cxlkv_key* keys, size_t n,
                          size_t* hits);
void cxlkv_release(cxlkv_pool* pool, const cxlkv_pin* pins, size_t n);

cxlkv_status cxlkv_reserve(cxlkv_pool* pool, const cxlkv_namespace* ns, const cxlkv_key* key, uint64_t bytes,
                           cxlkv_reservation* out);
cxlkv_status cxlkv_write(cxlkv_pool* pool, cxlkv_reservation* r, uint64_t at, const void* src, uint64_t bytes);
cxlkv_status cxlkv_commit(cxlkv_pool* pool, cxlkv_reservation* r);
cxlkv_status cxlkv_abort(cxlkv_pool* pool, cxlkv_reservation* r);
cxlkv_status cxlkv_put(cxlkv_pool* pool, const cxlkv_namespace* ns, const cxlkv_key* key, const void* data,
                       uint64_t bytes);
cxlkv_status cxlkv_read(cxlkv_pool* pool, const cxlkv_pin* pin, uint64_t at, void* dst, uint64_t bytes);

/* Batched forms: one stripe lock per stripe the keys touch, not one per key. */

/* Per key of a cxlkv_reserve_many (the values of cxlkv::ReserveOutcome). */
typedef enum {
  CXLKV_RESERVED = 0,        /* WRITING, owned by this process: its reservation is open */
  CXLKV_ALREADY_CACHED = 1,  /* READY already: nothing to write */
  CXLKV_RESERVE_BUSY = 2,    /* being written (writer_node names the writer) or evicted */
  CXLKV_RESERVE_ERROR = 3    /* status says why (CXLKV_NO_SPACE, ...) */
} cxlkv_reserve_outcome;

typedef struct {
  uint32_t outcome;            /* cxlkv_reserve_outcome */
  uint32_t status;             /* cxlkv_status of this key (CXLKV_OK when reserved) */
  uint32_t writer_node;        /* CXLKV_RESERVE_BUSY while being written: the writer */
  uint64_t writer_incarnation; /* its life (0 while being evicted) */
  cxlkv_reservation reservation; /* open iff CXLKV_RESERVED */
} cxlkv_key_reservation;

/* Reserves every key for `bytes` each; out must hold n entries, one per key in key order.
 * Returns an error only when the whole batch failed (nothing reserved). */
cxlkv_status cxlkv_reserve_many(cxlkv_pool* pool, const cxlkv_namespace* ns, const cxlkv_key* keys, size_t n,
                                uint64_t bytes, cxlkv_key_reservation* out);
/* Commits (or aborts) every open reservation of rs[0..n); all are attempted and closed; returns
 * the first error (CXLKV_LEASE_EXPIRED: this node was paused past its lease, nothing published). */
cxlkv_status cxlkv_commit_many(cxlkv_pool* pool, cxlkv_reservation* rs, size_t n);
cxlkv_status cxlkv_abort_many(cxlkv_pool* pool, cxlkv_reservation* rs, size_t n);

/* What the index holds for each key now, without a lock or a pin (the values of
 * cxlkv::PeekState): 0 absent, 1 being written, 2 ready, 3 being evicted. */
typedef struct {
  uint32_t state;
  uint32_t writer_node;        /* state 1: the writer */
  uint64_t writer_incarnation; /* state 1: its life */
  uint32_t writer_live;        /* state 1: that life is live (a dead writer's entry is reclaimed) */
  uint32_t reserved_;
} cxlkv_key_peek;
cxlkv_status cxlkv_peek(cxlkv_pool* pool, const cxlkv_namespace* ns, const cxlkv_key* keys, size_t n,
                        cxlkv_key_peek* out);

cxlkv_status cxlkv_evict(cxlkv_pool* pool, const cxlkv_namespace* ns, const cxlkv_key* keys, size_t n,
                         uint64_t* evicted);
cxlkv_status cxlkv_evict_all(cxlkv_pool* pool, uint64_t* evicted);

/* ---- The engine-keyed batch API (cxlkv/kv_store.h): register an engine's paged KV tensors
 * once, then move blocks by engine block id. ---- */

/* An engine's paged KV tensors (the values of cxlkv::EngineLayoutKind):
 *   kind 0  vLLM FlashAttention, per layer [2, num_blocks, block_size, num_kv_heads, head_size]
 *   kind 1  FlashInfer,          per layer [num_blocks, 2, block_size, num_kv_heads, head_size]
 *   kind 2  MLA latent,          per layer [num_blocks, block_size, latent_dim]
 *   kind 3  FlashInfer HND,      per layer [num_blocks, 2, num_kv_heads, block_size, head_size]
 *           (pool block format 2: its namespace's cxlkv_layout has block_format 2)
 * dtype as in cxlkv_layout. num_kv_heads is this tensor-parallel rank's slice. */
typedef struct {
  uint32_t kind, dtype, num_blocks, block_size, num_kv_heads, head_size, latent_dim;
  uint32_t tp_rank, tp_size, pp_stage;
} cxlkv_engine_layout;

typedef struct cxlkv_kv_store cxlkv_kv_store;

/* The namespace layout signature of these tensors (register the namespace with it). */
cxlkv_layout cxlkv_engine_layout_signature(const cxlkv_engine_layout* layout, uint32_t num_layers);
/* Registers num_layers layer tensors (base pointers, owned by the caller and kept allocated
 * until cxlkv_kv_store_close) for namespace ns; copy_threads workers (0 = 1). The store lives
 * no longer than its pool. */
cxlkv_status cxlkv_kv_store_register(cxlkv_pool* pool, const cxlkv_namespace* ns, const cxlkv_engine_layout* layout,
                                     void* const* layers, uint32_t num_layers, uint32_t copy_threads,
                                     cxlkv_kv_store** out);
/* The same for tensors in GPU memory: layers are device pointers of CUDA device cuda_device;
 * copies run through the CUDA transfer path. CXLKV_NOT_SUPPORTED when this build has no CUDA
 * path or the host no usable CUDA device (the message says which). */
cxlkv_status cxlkv_kv_store_register_device(cxlkv_pool* pool, const cxlkv_namespace* ns,
                                            const cxlkv_engine_layout* layout, void* const* layers,
                                            uint32_t num_layers, int cuda_device, cxlkv_kv_store** out);
void cxlkv_kv_store_close(cxlkv_kv_store* store);
/* How many leading keys the pool holds, without pinning (for schedulers). */
cxlkv_status cxlkv_exists_prefix(cxlkv_pool* pool, const cxlkv_namespace* ns, const cxlkv_key* keys, size_t n,
                                 size_t* prefix);
/* Engine blocks block_ids[i] -> the pool under keys[i]; cached keys are skipped and counted. */
cxlkv_status cxlkv_put_many(cxlkv_kv_store* store, const cxlkv_key* keys, const uint32_t* block_ids, size_t n,
                            uint64_t* written, uint64_t* skipped);
/* The longest cached prefix of keys -> engine blocks block_ids[0..*loaded). */
cxlkv_status cxlkv_get_many_into(cxlkv_kv_store* store, const cxlkv_key* keys, const uint32_t* block_ids, size_t n,
                                 size_t* loaded);

#ifdef __cplusplus
}
#endif

#endif /* CXLKV_CXLKV_H_ */
