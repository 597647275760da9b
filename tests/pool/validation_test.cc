// Everything read from the region is checked in every build. Each test writes one
// corruption a damaged device or a buggy host could leave, and expects a named error — never a
// crash, a hang or a write out of bounds (these run under ASan too). Pool identity: a foreign
// or reordered region is refused by name.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "../cache/cache_test_util.h"
#include "corrupt.h"
#include "pool_test_util.h"

namespace cxlkv {
namespace {

using ::testing::HasSubstr;
using testing::ForgeSuperblock;
using testing::OpenOrNull;
using testing::TempRegionPath;

constexpr uint64_t kValidationRegionBytes = 16 << 20;

Status CreateIndexedPool(const std::vector<std::string>& paths, bool index = true) {
  PoolCreateOptions co;
  co.size = kValidationRegionBytes;
  co.max_nodes = 4;
  co.overwrite = true;
  co.index = index;
  co.index_entries = 1024;
  return Pool::Create(paths, co);
}

Status OpenStatus(const std::vector<std::string>& paths) {
  PoolOpenOptions o;
  o.lease_ms = testing::kTestLeaseMs;
  auto p = Pool::Open(paths, o);
  return p.ok() ? Status::Ok() : p.status();
}

Status AttachAllStatus(const std::vector<std::string>& paths) {
  auto r = pool::AttachAll(paths);
  return r.ok() ? Status::Ok() : r.status();
}

std::vector<std::string> CheckProblemsQuickly(const std::vector<std::string>& paths) {
  auto regions = pool::AttachAll(paths);
  EXPECT_TRUE(regions.ok()) << regions.status().ToString();
  if (!regions.ok()) return {"attach failed"};
  return pool::Check(*regions, 50);
}

bool AnyContains(const std::vector<std::string>& lines, const std::string& s) {
  for (const auto& l : lines) if (l.find(s) != std::string::npos) return true;
  return false;
}

// ---- pool identity ----

TEST(PoolIdentity, ForeignRegionIsRefusedByName) {
  TempRegionPath a0("ident-a0"), a1("ident-a1"), b0("ident-b0"), b1("ident-b1");
  ASSERT_TRUE(CreateIndexedPool({a0.path(), a1.path()}).ok());
  ASSERT_TRUE(CreateIndexedPool({b0.path(), b1.path()}).ok());
  Status s = OpenStatus({a0.path(), b1.path()});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("region " + b1.path() + " belongs to another pool"));
  EXPECT_THAT(s.message(), HasSubstr(a0.path()));
  EXPECT_TRUE(OpenStatus({a0.path(), a1.path()}).ok());
}

TEST(PoolIdentity, ReorderedRegionsAreRefusedByName) {
  TempRegionPath a0("order-a0"), a1("order-a1"), a2("order-a2");
  ASSERT_TRUE(CreateIndexedPool({a0.path(), a1.path(), a2.path()}).ok());
  Status s = OpenStatus({a0.path(), a2.path(), a1.path()});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr("region " + a2.path() + " is region 2 of its pool of 3 but was given as region 1"));
  s = OpenStatus({a1.path(), a0.path(), a2.path()});
  EXPECT_THAT(s.message(), HasSubstr("region " + a1.path() + " is region 1"));
  s = OpenStatus({a0.path(), a1.path()});
  EXPECT_THAT(s.message(), HasSubstr("pool of 3 regions, but 2 paths were given"));
  EXPECT_TRUE(OpenStatus({a0.path(), a1.path(), a2.path()}).ok());
}

// ---- area parameters, refused at attach by name ----

TEST(AreaValidation, CorruptAreaParametersAreRefusedByName) {
  struct Case {
    const char* name;
    region::AreaKind kind;
    uint64_t param;
    const char* expect;
  };
  const Case cases[] = {
      {"lock-array", region::AreaKind::kLockArray, 1u << 19, "area lock-array is corrupt: parameter 524288"},
      {"lock-array-small", region::AreaKind::kLockArray, 1, "area lock-array is corrupt: parameter 1 "},
      {"chunk-table", region::AreaKind::kChunkTable, 1u << 30, "area chunk-table is corrupt: parameter 1073741824"},
      {"chunk-table-short", region::AreaKind::kChunkTable, 1, "area chunk-table is corrupt: parameter 1 "},
      {"object-store", region::AreaKind::kObjectStore, 1u << 20, "area object-store is corrupt: parameter 1048576"},
      {"object-store-zero", region::AreaKind::kObjectStore, 0, "area object-store is corrupt: parameter 0"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TempRegionPath path("area");
    ASSERT_TRUE(CreateIndexedPool({path.path()}).ok());
    ASSERT_TRUE(ForgeSuperblock(path.path(), [&](region::Superblock& sb) {
      const_cast<region::AreaDesc*>(region::FindArea(sb, c.kind))->param = c.param;
    }));
    for (Status s : {OpenStatus({path.path()}), AttachAllStatus({path.path()})}) {
      EXPECT_EQ(s.code(), StatusCode::kCorrupted) << s.ToString();
      EXPECT_THAT(s.message(), HasSubstr(c.expect));
      EXPECT_THAT(s.message(), HasSubstr(path.path()));
      EXPECT_THAT(s.message(), HasSubstr("cxlkv init"));
    }
  }
}

TEST(AreaValidation, CorruptIndexHeaderIsRefusedByName) {
  struct Case {
    const char* field;
    size_t at;
    uint64_t value;
    size_t width;
  };
  const Case cases[] = {
      {"max_nodes", offsetof(cache::IndexHeader, max_nodes), 64, 4},
      {"stripes", offsetof(cache::IndexHeader, stripes), 0, 4},
      {"slots_per_stripe", offsetof(cache::IndexHeader, slots_per_stripe), 0xffffffff, 4},
      {"lock_base", offsetof(cache::IndexHeader, lock_base), 60000, 4},
      {"entries_offset", offsetof(cache::IndexHeader, entries_offset), 1ull << 40, 8},
      {"stamps_offset", offsetof(cache::IndexHeader, stamps_offset), 8, 8},
      {"pin_pages", offsetof(cache::IndexHeader, pin_pages), 3, 4},
      {"pin_pages_offset", offsetof(cache::IndexHeader, pin_pages_offset), 1ull << 40, 8},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.field);
    TempRegionPath path("index-hdr");
    ASSERT_TRUE(CreateIndexedPool({path.path()}).ok());
    const uint64_t at = testing::AreaOf(path.path(), region::AreaKind::kIndex).offset + c.at;
    ASSERT_TRUE(testing::PokeBytes(path.path(), at, &c.value, c.width));
    Status s = OpenStatus({path.path()});
    EXPECT_EQ(s.code(), StatusCode::kCorrupted) << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr("area index is corrupt"));
    EXPECT_THAT(s.message(), HasSubstr(c.field));
    EXPECT_THAT(s.message(), HasSubstr("cxlkv init"));
    // stat and check attach without the index: they report, never crash.
    auto regions = pool::AttachAll({path.path()});
    ASSERT_TRUE(regions.ok());
    (void)pool::Stat(*regions, 10);
    (void)pool::Check(*regions, 10);
  }
}

// ---- values decoded from chunk tables and heap headers ----

struct OpenPool {
  TempRegionPath path{"decode"};
  std::unique_ptr<Pool> pool;
  alloc::ChunkTableLayout table;

  void SetUp() {
    ASSERT_TRUE(CreateIndexedPool({path.path()}, /*index=*/false).ok());
    pool = OpenOrNull({path.path()}, 0);
    ASSERT_TRUE(pool);
    table = alloc::ChunkTableLayout(pool->impl().regions[0]->impl(), 4);
  }
  region::MetaAccess& meta() { return testing::Meta(*pool); }
  uint64_t ChunkOf(uint64_t raw) const {
    return (region::Offset<void>(raw).byte_offset() - table.data_offset()) / table.chunk_bytes();
  }
  void SetRunLength(uint64_t chunk, uint32_t detail) {
    auto w = alloc::OwnerWord::Decode(meta().Fetch(table.owner(chunk)));
    w.detail = detail;
    meta().Publish(table.owner(chunk), w.Encode());
  }
};

TEST(DecodeValidation, LargeRunLengthOutOfRangeIsCorruptedNotACrash) {
  OpenPool f;
  ASSERT_NO_FATAL_FAILURE(f.SetUp());
  auto off = f.pool->Alloc(3 << 20);  // two chunks
  ASSERT_TRUE(off.ok()) << off.status().ToString();
  const uint64_t head = f.ChunkOf(*off);
  for (uint32_t bad : {0u, 1u << 30, static_cast<uint32_t>(f.table.chunks() - head + 1)}) {
    SCOPED_TRACE(bad);
    f.SetRunLength(head, bad);
    Status s = f.pool->Free(*off);
    EXPECT_EQ(s.code(), StatusCode::kCorrupted) << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr("heads a run of " + std::to_string(bad)));
    EXPECT_TRUE(AnyContains(CheckProblemsQuickly({f.path.path()}), "large run length " + std::to_string(bad)));
    // Recovery of the life that owns the run skips it instead of looping or running off the
    // table (a run length of 0 would make the scan revisit the same chunk forever).
    f.pool->impl().allocator->Recover(0, f.pool->impl().node->incarnation() + 1);
  }
  f.SetRunLength(head, 2);
  EXPECT_TRUE(f.pool->Free(*off).ok());
}

TEST(DecodeValidation, ZeroedRunIsNotFreedTwice) {
  OpenPool f;
  ASSERT_NO_FATAL_FAILURE(f.SetUp());
  auto off = f.pool->Alloc(3 << 20);
  ASSERT_TRUE(off.ok());
  const uint64_t head = f.ChunkOf(*off);
  f.meta().Publish(f.table.owner(head), 0);  // owner word zeroed, bitmap bit still set
  Status s = f.pool->Free(*off);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  auto problems = CheckProblemsQuickly({f.path.path()});
  EXPECT_TRUE(AnyContains(problems, "marked allocated but has no owner"));
  EXPECT_TRUE(AnyContains(problems, "a run tail without its head"));
}

TEST(DecodeValidation, HeapClassBytesZeroIsCorruptedNotADivisionByZero) {
  OpenPool f;
  ASSERT_NO_FATAL_FAILURE(f.SetUp());
  auto off = f.pool->Alloc(100);
  ASSERT_TRUE(off.ok());
  const uint64_t base = f.table.header(f.ChunkOf(*off));
  // A root so `check` looks the object up in the heap (IsAllocated divides by the class).
  ASSERT_TRUE(f.pool->Put("obj", *off, 100).ok());
  for (uint64_t bad : {uint64_t{0}, uint64_t{96}, uint64_t{1} << 61}) {
    SCOPED_TRACE(bad);
    f.meta().Publish(base + offsetof(alloc::HeapHeader, class_bytes), bad);
    Status s = f.pool->Free(*off);
    EXPECT_EQ(s.code(), StatusCode::kCorrupted) << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr("corrupt header"));
    auto problems = CheckProblemsQuickly({f.path.path()});
    EXPECT_TRUE(AnyContains(problems, "heap header is corrupt")) << ::testing::PrintToString(problems);
    EXPECT_TRUE(AnyContains(problems, "root 'obj' points at unallocated space"));
    // The heap passes over the damaged chunk: new objects of that class go elsewhere.
    auto again = f.pool->Alloc(100);
    ASSERT_TRUE(again.ok()) << again.status().ToString();
    EXPECT_NE(f.ChunkOf(*again), f.ChunkOf(*off));
    EXPECT_TRUE(f.pool->Free(*again).ok());
  }
}

TEST(DecodeValidation, CorruptIntentRecordIsRefusedNotApplied) {
  OpenPool f;
  ASSERT_NO_FATAL_FAILURE(f.SetUp());
  alloc::Intent intent{1, 1, 0, f.table.chunks() - 1, 1000, 0, {0, 0}};
  f.meta().WriteStruct(f.table.intent(), intent);
  f.meta().Flush(f.table.intent(), sizeof intent);
  auto off = f.pool->Alloc(3 << 20);
  ASSERT_FALSE(off.ok());
  EXPECT_EQ(off.status().code(), StatusCode::kCorrupted) << off.status().ToString();
  EXPECT_THAT(off.status().message(), HasSubstr("intent record"));
  EXPECT_TRUE(AnyContains(CheckProblemsQuickly({f.path.path()}), "corrupted allocator intent"));
  // Another region index out of range: refused the same way.
  intent.region = 200;
  intent.first = 0;
  intent.count = 1;
  f.meta().WriteStruct(f.table.intent(), intent);
  f.meta().Flush(f.table.intent(), sizeof intent);
  off = f.pool->Alloc(3 << 20);
  EXPECT_EQ(off.status().code(), StatusCode::kCorrupted);
}

// Found by fuzz/region_fuzz.cc (fuzz/corpus/regress-remote-free-ring-tail): a remote-free
// ring whose tail word was overwritten made the owner's heartbeat thread walk [head, tail) for
// 2^64 steps, so the pool could never be closed.
TEST(DecodeValidation, CorruptRemoteFreeRingIsSkippedNotWalked) {
  OpenPool f;
  ASSERT_NO_FATAL_FAILURE(f.SetUp());
  const uint64_t ring = f.table.inbox(0, 1);
  f.meta().Publish(ring, ~uint64_t{0} - 0xd0);  // tail
  f.pool->impl().allocator->DrainRemoteFrees();
  f.pool->impl().allocator->Recover(0, f.pool->impl().node->incarnation() + 1);
  EXPECT_TRUE(AnyContains(CheckProblemsQuickly({f.path.path()}), "remote-free ring of node 0 from node 1 is corrupt"));
  f.meta().Publish(ring + 64, 5);  // head past tail
  f.meta().Publish(ring, 3);
  f.pool->impl().allocator->DrainRemoteFrees();
  EXPECT_TRUE(AnyContains(CheckProblemsQuickly({f.path.path()}), "head 5, tail 3"));
  f.meta().Publish(ring + 64, 0);
  f.meta().Publish(ring, 0);
}

// Names read from the region reach `cxlkv stat --json`: bytes that are not UTF-8 made the JSON
// dump throw (an uncaught exception in the CLI). They print as '?' now.
TEST(DecodeValidation, NonUtf8RootNameIsPrintedNotThrown) {
  OpenPool f;
  ASSERT_NO_FATAL_FAILURE(f.SetUp());
  auto off = f.pool->Alloc(64);
  ASSERT_TRUE(off.ok());
  ASSERT_TRUE(f.pool->Put("bad\xff\xfe\x01name", *off, 64).ok());
  auto regions = pool::AttachAll({f.path.path()});
  ASSERT_TRUE(regions.ok());
  std::string dumped;
  EXPECT_NO_THROW(dumped = pool::Stat(*regions, 10).dump());
  EXPECT_THAT(dumped, HasSubstr("bad???name"));
}

// ---- region indexes in object offsets ----

TEST(DecodeValidation, OutOfRangeRegionIndexInAnOffset) {
  OpenPool f;
  ASSERT_NO_FATAL_FAILURE(f.SetUp());
  auto off = f.pool->Alloc(4096);
  ASSERT_TRUE(off.ok());
  const uint64_t foreign = region::Offset<void>::Make(7, region::Offset<void>(*off).byte_offset()).raw();
  EXPECT_EQ(f.pool->Ptr(foreign, 4096), nullptr);
  EXPECT_EQ(f.pool->Ptr(*off, uint64_t{1} << 40), nullptr);
  EXPECT_NE(f.pool->Ptr(*off, 4096), nullptr);
  EXPECT_EQ(f.pool->Free(foreign).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(f.pool->Put("far", foreign, 4096).ok());
  EXPECT_TRUE(AnyContains(CheckProblemsQuickly({f.path.path()}), "root 'far' points at unallocated space"));
}

TEST(DecodeValidation, IndexEntryWithAForeignPayloadIsCorruptedOnLookup) {
  TempRegionPath path("entry");
  ASSERT_TRUE(CreateIndexedPool({path.path()}).ok());
  auto pool = OpenOrNull({path.path()}, 0);
  ASSERT_TRUE(pool);
  auto cache = pool->Cache();
  ASSERT_TRUE(cache.ok());
  auto ns = (*cache)->Namespace(testing::TestNamespace());
  ASSERT_TRUE(ns.ok());
  std::vector<int32_t> tokens(16, 5);
  auto keys = KvCache::ChainKeys(*ns, tokens);
  std::vector<uint8_t> block(4096, 1);
  ASSERT_TRUE((*cache)->Put(*ns, keys[0], block.data(), block.size()).ok());
  cache::Index& index = *pool->impl().index;
  auto& meta = testing::Meta(*pool);
  uint64_t slot = 0;
  for (; slot < index.layout().entries(); ++slot) {
    if (cache::StateOf(meta.Fetch(index.layout().entry(slot))) == cache::kReady) break;
  }
  ASSERT_LT(slot, index.layout().entries());
  const uint64_t payload_at = index.layout().entry(slot) + offsetof(cache::Entry, payload);
  const uint64_t good = meta.Fetch(payload_at);
  for (uint64_t bad : {region::Offset<void>::Make(7, region::Offset<void>(good).byte_offset()).raw(),
                       uint64_t{kValidationRegionBytes} - 100}) {
    meta.Publish(payload_at, bad);
    auto hit = (*cache)->Lookup(*ns, keys);
    ASSERT_FALSE(hit.ok());
    EXPECT_EQ(hit.status().code(), StatusCode::kCorrupted) << hit.status().ToString();
    EXPECT_THAT(hit.status().message(), HasSubstr("outside the pool's data areas"));
  }
  meta.Publish(payload_at, good);
  auto hit = (*cache)->Lookup(*ns, keys);
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(hit->pins.size(), 1u);
  (*cache)->Release(hit->pins);
}

}  // namespace
}  // namespace cxlkv
