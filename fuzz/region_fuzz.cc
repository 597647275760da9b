// libFuzzer target: the fuzzer's bytes are mutations of a small formatted pool's
// metadata — superblock, node table, lock array, chunk table, heap headers, named roots, index
// header and entries — and every input then runs what a reader of a damaged region runs:
// attach, `cxlkv stat`, `cxlkv check`, and (when the input asks) join the pool and get / put
// through the allocator, the roots and the cache. A crash, an abort in a bounds check, a hang
// or an ASan report is a value read from the region that some code trusted.
//
// Input: byte 0 = flags (bit 0: re-seal the superblock checksum after mutating, so the checks
// behind it are reached; bit 1: join and run operations), then records
//   [target u8][offset u32 LE][length u8][length bytes]
// that overwrite bytes of the target area at offset (mod the area's size).
//
// The pool is made once per process in /dev/shm; a pristine copy is kept in memory and written
// back before every input. Joining starts the node's heartbeat and recovery threads; the pool
// is closed (threads joined) and the node-local files are removed before the input returns.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cxlkv/cache.h"
#include "cxlkv/pool.h"
#include "pool/pool_internal.h"
#include "region/superblock.h"
#include "sync/local_node.h"
#include "util/units.h"

namespace {

using namespace cxlkv;

constexpr uint64_t kPoolBytes = 8 << 20;
constexpr uint32_t kNodes = 2;

struct Fixture {
  std::string path;
  std::vector<uint8_t> pristine;
  uint8_t* map = nullptr;
  region::Superblock sb{};
  uint64_t root_offset = 0;
};

KeyNamespace Ns() {
  KeyNamespace ns;
  ns.model_id = "fuzz";
  ns.layout.block_size = 16;
  return ns;
}

std::vector<BlockKey> Keys(KvCache& cache, const NamespaceHandle& ns) {
  std::vector<int32_t> tokens(64);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i * 7);
  return cache.ChainKeys(ns, tokens);
}

PoolOpenOptions OpenOptions() {
  PoolOpenOptions o;
  o.node_id = 0;
  o.lease_ms = 50;  // the shortest lease Join accepts: a corrupted "live" node line costs 50 ms
  return o;
}

void Die(const char* what, const Status& s) {
  std::fprintf(stderr, "region_fuzz: %s: %s\n", what, s.ToString().c_str());
  std::abort();
}

void RemoveLocalFiles(const std::string& region_id) {
  for (uint32_t n = 0; n < kNodes; ++n) ::unlink(sync::LocalNode::PathFor(region_id, n).c_str());
}

Fixture& Setup() {
  static Fixture* f = [] {
    auto* fx = new Fixture;
    fx->path = "/dev/shm/cxlkv-fuzz-" + std::to_string(::getpid());
    PoolCreateOptions co;
    co.size = kPoolBytes;
    co.max_nodes = kNodes;
    co.max_locks = 8;
    co.max_roots = 8;
    co.chunk_bytes = 512 << 10;
    co.index_entries = 128;
    co.index_stripes = 2;
    co.checksum = true;
    co.overwrite = true;
    if (Status s = Pool::Create({fx->path}, co); !s.ok()) Die("create", s);
    {
      auto pool = Pool::Open({fx->path}, OpenOptions());
      if (!pool.ok()) Die("open", pool.status());
      auto small = (*pool)->Alloc(100);
      auto large = (*pool)->Alloc(700 << 10);  // a run of two chunks
      if (!small.ok() || !large.ok()) Die("alloc", small.ok() ? large.status() : small.status());
      (void)(*pool)->Put("small", *small, 100);
      (void)(*pool)->Put("large", *large, 700 << 10);
      fx->root_offset = *small;
      auto cache = (*pool)->Cache();
      if (!cache.ok()) Die("cache", cache.status());
      auto ns = (*cache)->Namespace(Ns());
      if (!ns.ok()) Die("namespace", ns.status());
      auto keys = Keys(**cache, *ns);
      std::vector<uint8_t> block(4096, 0x5a);
      for (size_t i = 0; i < 2; ++i) (void)(*cache)->Put(*ns, keys[i], block.data(), block.size());
    }
    int fd = ::open(fx->path.c_str(), O_RDWR);
    void* m = ::mmap(nullptr, kPoolBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (m == MAP_FAILED) Die("mmap", IoError("mmap"));
    fx->map = static_cast<uint8_t*>(m);
    fx->pristine.assign(fx->map, fx->map + kPoolBytes);
    std::memcpy(&fx->sb, fx->map, sizeof fx->sb);
    RemoveLocalFiles(util::HexBytes(fx->sb.region_id, sizeof fx->sb.region_id));
    std::atexit([] {
      ::unlink(Setup().path.c_str());
      RemoveLocalFiles(util::HexBytes(Setup().sb.region_id, sizeof Setup().sb.region_id));
    });
    return fx;
  }();
  return *f;
}

// [begin, size) of mutation target `t`.
void Target(const Fixture& f, uint8_t t, uint64_t* begin, uint64_t* size) {
  using region::AreaKind;
  static constexpr AreaKind kKinds[] = {AreaKind::kNodeTable, AreaKind::kLockArray, AreaKind::kChunkTable,
                                        AreaKind::kObjectStore, AreaKind::kIndex};
  const auto* data = region::FindArea(f.sb, AreaKind::kData);
  switch (t % 8) {
    case 0:  // superblock
      *begin = 0;
      *size = sizeof(region::Superblock);
      return;
    case 6: {  // the first line of every data chunk: heap headers and slot bitmaps
      *begin = data->offset;
      *size = data->size;
      return;
    }
    case 7: {  // index header and entries
      const auto* index = region::FindArea(f.sb, AreaKind::kIndex);
      *begin = index->offset;
      *size = std::min<uint64_t>(index->size, 4096 + 64 * 256 + 128 * 64);
      return;
    }
    default: {
      const auto* a = region::FindArea(f.sb, kKinds[(t % 8) - 1]);
      *begin = a->offset;
      *size = a->size;
      return;
    }
  }
}

void Mutate(Fixture& f, const uint8_t* data, size_t size) {
  const auto* data_area = region::FindArea(f.sb, region::AreaKind::kData);
  size_t i = 1;
  while (i + 6 <= size) {
    uint8_t target = data[i];
    uint32_t off;
    std::memcpy(&off, data + i + 1, 4);
    size_t len = std::min<size_t>(data[i + 5], size - (i + 6));
    const uint8_t* bytes = data + i + 6;
    i += 6 + len;
    uint64_t begin, area;
    Target(f, target, &begin, &area);
    if (area == 0 || len == 0) continue;
    uint64_t at = off % area;
    if (target % 8 == 6) {  // heap headers: stay within a chunk's first 4 KiB
      uint64_t chunk = (off >> 12) % (data_area->size / f.sb.chunk_bytes);
      at = chunk * f.sb.chunk_bytes + (off % 4096);
    }
    len = std::min<uint64_t>(len, area - at);
    std::memcpy(f.map + begin + at, bytes, len);
  }
  if (size > 0 && (data[0] & 1)) {
    region::Superblock sb;
    std::memcpy(&sb, f.map, sizeof sb);
    sb.checksum = region::SuperblockChecksum(sb);
    std::memcpy(f.map, &sb, sizeof sb);
  }
}

void Operate(Fixture& f) {
  auto pool = Pool::Open({f.path}, OpenOptions());
  if (!pool.ok()) return;
  Pool& p = **pool;
  if (auto root = p.Get("small"); root.ok()) {
    if (uint8_t* ptr = p.Ptr(root->offset, 1)) (void)*static_cast<volatile uint8_t*>(ptr);
  }
  (void)p.Ptr(f.root_offset, 100);
  if (auto off = p.Alloc(200); off.ok()) (void)p.Free(*off);
  if (auto off = p.Alloc(600 << 10); off.ok()) (void)p.Free(*off);
  if (auto root = p.Get("large"); root.ok()) (void)p.Free(root->offset);
  (void)p.Put("new", f.root_offset, 100);
  if (auto cache = p.Cache(); cache.ok()) {
    if (auto ns = (*cache)->Namespace(Ns()); ns.ok()) {
      auto keys = Keys(**cache, *ns);
      if (auto hit = (*cache)->Lookup(*ns, keys); hit.ok()) {
        std::vector<uint8_t> buf(4096);
        for (const auto& pin : hit->pins) {
          if (pin.bytes <= buf.size()) (void)(*cache)->Read(pin, 0, buf.data(), pin.bytes);
        }
        (*cache)->Release(hit->pins);
      }
      std::vector<uint8_t> block(4096, 1);
      (void)(*cache)->Put(*ns, keys[3], block.data(), block.size());
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Fixture& f = Setup();
  std::memcpy(f.map, f.pristine.data(), f.pristine.size());
  Mutate(f, data, size);
  {
    auto regions = pool::AttachAll({f.path});
    if (regions.ok()) {
      // As `cxlkv stat --json` and `cxlkv check` print them (a dump throws on bad UTF-8).
      (void)pool::Stat(*regions, 0).dump();
      for (const std::string& line : pool::Check(*regions, 0)) (void)nlohmann::json(line).dump();
    }
  }
  if (size > 0 && (data[0] & 2)) Operate(f);
  // Node-local files are named by the region id, which a mutation may have changed.
  region::Superblock now;
  std::memcpy(&now, f.map, sizeof now);
  RemoveLocalFiles(util::HexBytes(now.region_id, sizeof now.region_id));
  RemoveLocalFiles(util::HexBytes(f.sb.region_id, sizeof f.sb.region_id));
  return 0;
}
