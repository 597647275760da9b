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
  static unsigned char buf[kBlockBytes], want[kBlockBytes];
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
