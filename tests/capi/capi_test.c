/* The C API as an FFI user sees it, compiled as C and linked against libcxlkv.so: a writer
 * process publishes a chain, a reader process (another node) looks it up and reads identical
 * bytes; refusals come back as status codes with a message. Exit 0 = pass. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cxlkv/cxlkv.h"

#define CHECK(cond)                                                                   \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      fprintf(stderr, "%s:%d: check failed: %s (%s)\n", __FILE__, __LINE__, #cond,    \
              cxlkv_last_error());                                                    \
      return 1;                                                                       \
    }                                                                                 \
  } while (0)

enum { kBlocks = 8, kBlockBytes = 64 << 10 };

static void Fill(unsigned char* p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; ++i) p[i] = (unsigned char)((i * 2654435761u + seed * 40503u) >> 13);
}

/* The engine-keyed batch API: engine tensors registered once, blocks moved by id. The writer
 * puts engine blocks 3, 0, 2 under three engine hashes; the reader (another process and node)
 * gets them into its blocks 0, 1, 2. */
enum { kEngBlocks = 4, kEngLayers = 2 };
static const cxlkv_engine_layout kEngine = {0, 0, kEngBlocks, 4, 1, 16, 0, 0, 1, 0};
static size_t EngineTensorBytes(void) { return (size_t)2 * kEngBlocks * 4 * 1 * 16 * 2; }

static int EngineKv(cxlkv_pool* pool, int write) {
  cxlkv_layout sig = cxlkv_engine_layout_signature(&kEngine, kEngLayers);
  cxlkv_namespace ns;
  CHECK(cxlkv_namespace_register(pool, "c-engine", &sig, "", &ns) == CXLKV_OK);
  cxlkv_key keys[3];
  for (unsigned i = 0; i < 3; ++i) {
    unsigned char hash[32];
    Fill(hash, sizeof hash, 500 + i);
    keys[i] = cxlkv_key_from_engine_hash(&ns, hash, sizeof hash);
  }
  static unsigned char tensors[kEngLayers][2 * kEngBlocks * 4 * 16 * 2];
  void* layers[kEngLayers];
  for (unsigned l = 0; l < kEngLayers; ++l) {
    layers[l] = tensors[l];
    Fill(tensors[l], EngineTensorBytes(), write ? 600 + l : 700 + l);
  }
  cxlkv_kv_store* store = NULL;
  CHECK(cxlkv_kv_store_register(pool, &ns, &kEngine, layers, kEngLayers, 1, &store) == CXLKV_OK);
  size_t prefix = 99;
  if (write) {
    const uint32_t ids[3] = {3, 0, 2};
    uint64_t written = 0, skipped = 0;
    CHECK(cxlkv_exists_prefix(pool, &ns, keys, 3, &prefix) == CXLKV_OK && prefix == 0);
    CHECK(cxlkv_put_many(store, keys, ids, 3, &written, &skipped) == CXLKV_OK && written == 3 && skipped == 0);
    CHECK(cxlkv_put_many(store, keys, ids, 3, &written, &skipped) == CXLKV_OK && written == 0 && skipped == 3);
    CHECK(cxlkv_put_many(store, keys, ids, 2, &written, NULL) == CXLKV_OK);
    const uint32_t bad[1] = {kEngBlocks};
    CHECK(cxlkv_put_many(store, keys, bad, 1, &written, &skipped) == CXLKV_INVALID_ARGUMENT);
    CHECK(strstr(cxlkv_last_error(), "out of range") != NULL);
  } else {
    const uint32_t ids[3] = {0, 1, 2}, from[3] = {3, 0, 2};
    CHECK(cxlkv_exists_prefix(pool, &ns, keys, 3, &prefix) == CXLKV_OK && prefix == 3);
    CHECK(cxlkv_get_many_into(store, keys, ids, 3, &prefix) == CXLKV_OK && prefix == 3);
    /* Each (layer, K/V) piece of engine block i is the writer's piece of block from[i]. */
    static unsigned char want[2 * kEngBlocks * 4 * 16 * 2];
    const size_t piece = 4 * 16 * 2;
    for (unsigned l = 0; l < kEngLayers; ++l) {
      Fill(want, EngineTensorBytes(), 600 + l);
      for (unsigned part = 0; part < 2; ++part) {
        for (unsigned i = 0; i < 3; ++i) {
          const size_t at = (part * kEngBlocks + ids[i]) * piece, was = (part * kEngBlocks + from[i]) * piece;
          CHECK(memcmp(tensors[l] + at, want + was, piece) == 0);
        }
      }
    }
    CHECK(cxlkv_get_many_into(store, keys, ids, 2, NULL) == CXLKV_INVALID_ARGUMENT);
  }
  cxlkv_kv_store_close(store);
  /* Host memory is not a device tensor; here (no GPU, or no CUDA build) the refusal says why. */
  cxlkv_status dev = cxlkv_kv_store_register_device(pool, &ns, &kEngine, layers, kEngLayers, 0, &store);
  if (dev == CXLKV_OK) {
    cxlkv_kv_store_close(store);
  } else {
    CHECK(dev == CXLKV_NOT_SUPPORTED && strstr(cxlkv_last_error(), "CUDA") != NULL);
  }
  cxlkv_layout other = sig;
  other.head_size = 32;
  cxlkv_namespace wrong;
  CHECK(cxlkv_namespace_register(pool, "c-engine-2", &other, "", &wrong) == CXLKV_OK);
  CHECK(cxlkv_kv_store_register(pool, &wrong, &kEngine, layers, kEngLayers, 1, &store) == CXLKV_INVALID_ARGUMENT);
  return 0;
}

static int Run(const char* path, unsigned node, int write) {
  cxlkv_pool* pool = NULL;
  CHECK(cxlkv_pool_open(path, node, 400, &pool) == CXLKV_OK);
  cxlkv_layout layout = cxlkv_layout_default();
  cxlkv_namespace ns;
  CHECK(cxlkv_namespace_register(pool, "c-model", &layout, "", &ns) == CXLKV_OK);
  int32_t tokens[16 * kBlocks + 5];
  for (size_t i = 0; i < sizeof tokens / sizeof tokens[0]; ++i) tokens[i] = (int32_t)(i * 31 % 32000);
  cxlkv_key keys[kBlocks + 1];
  CHECK(cxlkv_chain_keys(&ns, tokens, sizeof tokens / sizeof tokens[0], keys, kBlocks + 1) == kBlocks);
  /* A second chain, written with the batched calls. */
  int32_t tokens2[16 * kBlocks];
  for (size_t i = 0; i < sizeof tokens2 / sizeof tokens2[0]; ++i) tokens2[i] = (int32_t)(i * 17 % 32000 + 1);
  cxlkv_key keys2[kBlocks];
  CHECK(cxlkv_chain_keys(&ns, tokens2, sizeof tokens2 / sizeof tokens2[0], keys2, kBlocks) == kBlocks);
  static unsigned char buf[kBlockBytes], want[kBlockBytes];
  cxlkv_key_reservation kr[kBlocks];
  cxlkv_reservation rs[kBlocks];
  cxlkv_key_peek peek[kBlocks];
  if (write) {
    for (unsigned b = 0; b < kBlocks; ++b) {
      Fill(buf, kBlockBytes, b);
      cxlkv_reservation r;
      CHECK(cxlkv_reserve(pool, &ns, &keys[b], kBlockBytes, &r) == CXLKV_OK);
      CHECK(cxlkv_write(pool, &r, 0, buf, kBlockBytes) == CXLKV_OK);
      CHECK(cxlkv_commit(pool, &r) == CXLKV_OK);
      CHECK(r.open == 0);
    }
    CHECK(cxlkv_put(pool, &ns, &keys[0], buf, kBlockBytes) == CXLKV_ALREADY_EXISTS);
    CHECK(strstr(cxlkv_last_error(), "already") != NULL);
    /* Batched: reserve all, abort all (nothing left), reserve again, write, commit all. */
    CHECK(cxlkv_reserve_many(pool, &ns, keys2, kBlocks, kBlockBytes, kr) == CXLKV_OK);
    for (unsigned b = 0; b < kBlocks; ++b) {
      CHECK(kr[b].outcome == CXLKV_RESERVED && kr[b].status == CXLKV_OK && kr[b].reservation.open);
      rs[b] = kr[b].reservation;
    }
    CHECK(cxlkv_peek(pool, &ns, keys2, kBlocks, peek) == CXLKV_OK);
    CHECK(peek[0].state == 1 && peek[0].writer_node == node && peek[0].writer_live == 1);
    CHECK(cxlkv_abort_many(pool, rs, kBlocks) == CXLKV_OK && rs[0].open == 0);
    CHECK(cxlkv_peek(pool, &ns, keys2, kBlocks, peek) == CXLKV_OK && peek[kBlocks - 1].state == 0);
    CHECK(cxlkv_reserve_many(pool, &ns, keys2, kBlocks, kBlockBytes, kr) == CXLKV_OK);
    for (unsigned b = 0; b < kBlocks; ++b) {
      CHECK(kr[b].outcome == CXLKV_RESERVED);
      rs[b] = kr[b].reservation;
      Fill(buf, kBlockBytes, 100 + b);
      CHECK(cxlkv_write(pool, &rs[b], 0, buf, kBlockBytes) == CXLKV_OK);
    }
    CHECK(cxlkv_commit_many(pool, rs, kBlocks) == CXLKV_OK);
    CHECK(rs[0].open == 0 && rs[kBlocks - 1].open == 0);
    CHECK(cxlkv_reserve_many(pool, &ns, keys2, kBlocks, kBlockBytes, kr) == CXLKV_OK);
    CHECK(kr[0].outcome == CXLKV_ALREADY_CACHED && kr[0].status == CXLKV_ALREADY_EXISTS && !kr[0].reservation.open);
    CHECK(cxlkv_reserve_many(pool, &ns, keys2, 1, 0, kr) == CXLKV_INVALID_ARGUMENT); /* a 0-byte block */
    CHECK(cxlkv_peek(NULL, &ns, keys2, 1, peek) == CXLKV_INVALID_ARGUMENT);
  } else {
    cxlkv_pin pins[kBlocks];
    size_t hits = 0;
    CHECK(cxlkv_lookup(pool, &ns, keys, kBlocks, pins, &hits) == CXLKV_OK);
    CHECK(hits == kBlocks);
    for (unsigned b = 0; b < kBlocks; ++b) {
      CHECK(cxlkv_read(pool, &pins[b], 0, buf, kBlockBytes) == CXLKV_OK);
      Fill(want, kBlockBytes, b);
      CHECK(memcmp(buf, want, kBlockBytes) == 0);
    }
    CHECK(cxlkv_read(pool, &pins[0], kBlockBytes, buf, 1) == CXLKV_INVALID_ARGUMENT);
    /* The batch-written chain, read back by another node. */
    CHECK(cxlkv_peek(pool, &ns, keys2, kBlocks, peek) == CXLKV_OK && peek[kBlocks - 1].state == 2);
    cxlkv_pin pins2[kBlocks];
    size_t hits2 = 0;
    CHECK(cxlkv_lookup(pool, &ns, keys2, kBlocks, pins2, &hits2) == CXLKV_OK && hits2 == kBlocks);
    for (unsigned b = 0; b < kBlocks; ++b) {
      CHECK(cxlkv_read(pool, &pins2[b], 0, buf, kBlockBytes) == CXLKV_OK);
      Fill(want, kBlockBytes, 100 + b);
      CHECK(memcmp(buf, want, kBlockBytes) == 0);
    }
    cxlkv_release(pool, pins2, hits2);
    uint64_t evicted = 99;
    CHECK(cxlkv_evict(pool, &ns, keys, 1, &evicted) == CXLKV_OK && evicted == 0); /* pinned */
    cxlkv_release(pool, pins, hits);
    CHECK(cxlkv_evict(pool, &ns, keys, 1, &evicted) == CXLKV_OK && evicted == 1);
    CHECK(cxlkv_exists(pool, &ns, keys, kBlocks, &hits) == CXLKV_OK && hits == 0);
    cxlkv_layout other = layout;
    other.num_layers = 2;
    other.num_kv_heads = 1;
    other.head_size = 64;
    cxlkv_namespace bad;
    CHECK(cxlkv_namespace_register(pool, "c-model", &other, "", &bad) == CXLKV_VERSION_MISMATCH);
    CHECK(cxlkv_lookup(NULL, &ns, keys, 1, pins, &hits) == CXLKV_INVALID_ARGUMENT);
  }
  if (EngineKv(pool, write) != 0) return 1;
  cxlkv_pool_close(pool);
  return 0;
}

int main(void) {
  char path[128];
  snprintf(path, sizeof path, "/dev/shm/cxlkv-capi-test-%d", (int)getpid());
  if (cxlkv_pool_create(path, 64u << 20, 4, 1) != CXLKV_OK) {
    fprintf(stderr, "create: %s\n", cxlkv_last_error());
    return 1;
  }
  cxlkv_pool* none = NULL;
  if (cxlkv_pool_open("/dev/shm/cxlkv-capi-no-such-region", 0, 0, &none) != CXLKV_NOT_FOUND || none != NULL ||
      strlen(cxlkv_last_error()) == 0) {
    fprintf(stderr, "opening a missing region did not fail clearly: %s\n", cxlkv_last_error());
    unlink(path);
    return 1;
  }
  int rc = 0;
  for (int step = 0; step < 2 && rc == 0; ++step) {
    pid_t pid = fork();
    if (pid == 0) _exit(Run(path, (unsigned)step, step == 0));
    int status = 0;
    waitpid(pid, &status, 0);
    rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
    if (rc) fprintf(stderr, "%s process failed\n", step == 0 ? "writer" : "reader");
  }
  unlink(path);
  if (rc == 0) printf("capi: ok\n");
  return rc;
}
