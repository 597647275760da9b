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
