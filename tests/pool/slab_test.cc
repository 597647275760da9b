// Exact-size slabs: every block size of a real model packs its slabs, the slots never overlap,
// a slab of several chunks is freed from another node and recovered from a dead one, an empty
// slab goes back to the pool, and `cxlkv check` verifies and refuses what is broken.
#include <algorithm>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "alloc_test_util.h"
#include "pool_test_util.h"
#include "region/coherence.h"

namespace cxlkv {
namespace {

using testing::FreeChunks;
using testing::OpenOrNull;

constexpr uint64_t kSlabRegionBytes = 128 << 20;
constexpr uint64_t kSlabMiB = uint64_t{1} << 20;

// Block sizes of real models (16-token fp16 blocks) and odd ones: a heap-sized slot, slabs of
// one chunk and of several, sizes above the chunk, and one whole chunks fit exactly.
constexpr uint64_t kBlockSizes[] = {4 << 10, 20 << 10, 503'296, 917'504, 1'835'008, 2 * kSlabMiB, 2'359'296, 5 * kSlabMiB,
                                    9 * kSlabMiB};

struct SlabBlock {
  uint64_t off, size;
  uint8_t tag;
};

bool SomeLineHas(const std::vector<std::string>& lines, const std::string& s) {
  for (const auto& l : lines) {
    if (l.find(s) != std::string::npos) return true;
  }
  return false;
}

void Stamp(Pool& p, const SlabBlock& b) { std::memset(p.Ptr(b.off, b.size), b.tag, b.size); }

bool Intact(Pool& p, const SlabBlock& b) {
  std::vector<uint8_t> expect(std::min<uint64_t>(b.size, 1 << 20), b.tag);
  const uint8_t* bytes = static_cast<const uint8_t*>(p.Ptr(b.off, b.size));
  for (uint64_t at = 0; at < b.size; at += expect.size()) {
    if (std::memcmp(bytes + at, expect.data(), std::min<uint64_t>(expect.size(), b.size - at)) != 0) return false;
  }
  return true;
}

// A fresh pool of one region at `path`, opened as node 0; `*total`: its free chunks at the start.
std::unique_ptr<Pool> FreshPool(const std::string& path, uint64_t size, uint32_t max_nodes, uint64_t* total) {
  PoolCreateOptions co;
  co.size = size;
  co.max_nodes = max_nodes;
  if (!Pool::Create({path}, co).ok()) return nullptr;
  *total = FreeChunks({path});
  return OpenOrNull({path}, 0);
}

// Fills a pool with exact-size blocks of each size in turn until it is full: the bytes held are
// what the slab geometry and the pool's length allow; every block reads back its own stamp;
// freed, every slab gives its chunks back for the next size.
TEST(Slab, EveryModelBlockSizeFillsThePoolWithoutOverlap) {
  testing::TempRegionPath path("slab-fill");
  uint64_t total = 0;
  auto p = FreshPool(path.path(), kSlabRegionBytes, 2, &total);
  ASSERT_TRUE(p);
  alloc::Allocator& a = *p->impl().allocator;
  for (uint64_t size : kBlockSizes) {
    SCOPED_TRACE("block of " + std::to_string(size) + " bytes");
    std::vector<SlabBlock> blocks;
    for (;;) {
      auto off = a.Alloc(size, alloc::Fit::kExact);
      if (!off.ok()) {
        ASSERT_EQ(off.status().code(), StatusCode::kNoSpace) << off.status().ToString();
        break;
      }
      blocks.push_back({off->raw(), size, static_cast<uint8_t>(blocks.size() * 37 + 1)});
      Stamp(*p, blocks.back());
    }
    for (const SlabBlock& b : blocks) ASSERT_TRUE(Intact(*p, b)) << "block at " << b.off << " overwritten";
    // The packing bound: a slab's slots round down, and the pool's last chunks may make a
    // shorter slab. Every size here holds at least 0.9 of the data area (less the chunks the
    // pool's own small objects hold); the bench holds its pool to 0.95.
    const double held = static_cast<double>(blocks.size() * size) / static_cast<double>(a.data_bytes());
    EXPECT_GE(held, 0.9) << blocks.size() << " blocks";
    testing::ExpectNoProblems({path.path()});
    for (const SlabBlock& b : blocks) ASSERT_TRUE(p->Free(b.off).ok());
    a.Trim();
    EXPECT_EQ(FreeChunks({path.path()}), total) << "an emptied slab kept its chunks";
  }
  p.reset();
  testing::ExpectNoProblems({path.path()});
}

// Slots of a five-chunk slab freed by another node go through the owner's ring; when the slab
// empties its chunks go back. A node killed with slabs half full keeps only what it published.
// `sim_seed` != 0: every process behind its own simulated non-coherent cache.
void RemoteFreesAndRecovery(uint64_t sim_seed) {
  testing::TempRegionPath path("slab-life");
  PoolCreateOptions co;
  co.size = kSlabRegionBytes;
  co.max_nodes = 4;
  const std::vector<std::string> paths{path.path()};
  ASSERT_TRUE(Pool::Create(paths, co).ok());
  const uint64_t total = FreeChunks(paths);
  // The victim is forked before this process opens anything: a fork after the pool's threads
  // start can deadlock the child in a lock one of them held (ASan's allocator's, for one), and
  // ThreadSanitizer refuses it.
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t victim = ::fork();
  if (victim == 0) {
    auto p = OpenOrNull(paths, 2, sim_seed ? sim_seed + 2 : 0);
    if (!p) ::_exit(1);
    // Two published blocks (kept by recovery), three left unpublished (reclaimed), in
    // slabs of 2.25 MiB slots and of 0.875 MiB ones.
    for (int i = 0; i < 5; ++i) {
      auto off = p->impl().allocator->Alloc(i % 2 ? 917'504 : 2'359'296, alloc::Fit::kExact);
      if (!off.ok()) ::_exit(2);
      region::NtCopy(p->Ptr(off->raw(), 4096), std::vector<uint8_t>(4096, 0x5a).data(), 4096);
      if (i < 2 && !p->Put("keep-" + std::to_string(i), off->raw(), 4096).ok()) ::_exit(3);
    }
    if (::write(ready[1], "r", 1) != 1) ::_exit(4);
    ::pause();
    ::_exit(0);
  }
  struct KillOnExit {  // an assertion that ends the test early leaves no paused child behind
    pid_t pid;
    ~KillOnExit() {
      if (pid > 0) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
      }
    }
  } guard{victim};
  char c;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ::close(ready[0]);
  ::close(ready[1]);
  auto survivor = OpenOrNull(paths, 0, sim_seed);  // takes over the lock manager when the victim dies
  ASSERT_TRUE(survivor);
  // A live node's slab, freed slot by slot from here: through node 1's ring.
  auto owner = OpenOrNull(paths, 1, sim_seed ? sim_seed + 1 : 0);
  ASSERT_TRUE(owner);
  std::vector<uint64_t> offs;
  for (int i = 0; i < 12; ++i) {
    auto off = owner->impl().allocator->Alloc(2'359'296, alloc::Fit::kExact);
    ASSERT_TRUE(off.ok()) << off.status().ToString();
    offs.push_back(off->raw());
  }
  for (uint64_t off : offs) ASSERT_TRUE(survivor->Free(off).ok());
  owner->impl().allocator->DrainRemoteFrees();
  owner->impl().allocator->Trim();
  for (uint64_t off : offs) EXPECT_FALSE(testing::Allocated(paths, off));
  owner.reset();

  ::kill(victim, SIGKILL);
  int status;
  ::waitpid(victim, &status, 0);
  guard.pid = 0;
  testing::SleepLeases(4);  // the victim's life ends; the survivor's manager recovers it
  auto roots = survivor->impl().roots->List();
  ASSERT_EQ(roots.size(), 2u);
  for (const auto& r : roots) EXPECT_TRUE(testing::Allocated(paths, r.offset)) << r.name;
  testing::ExpectNoProblems(paths);
  // The published blocks are freed as any orphan's slots: then nothing is left.
  for (const auto& r : roots) {
    ASSERT_TRUE(survivor->Free(r.offset).ok());
    ASSERT_TRUE(survivor->Destroy(r.name).ok());
  }
  testing::ExpectEverythingReturned(survivor, paths, total);
}

TEST(Slab, RemoteFreesAndTheRecoveryOfADeadLifeReturnEverySlab) { RemoteFreesAndRecovery(0); }

TEST(Slab, RemoteFreesAndRecoveryUnderTheNonCoherentSimulator) {
  for (uint64_t seed : cxlkv::testing::SimSeeds({5, 23, 71})) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    RemoteFreesAndRecovery(seed);
  }
}

// More slot sizes than a node's class table remembers (odd small sizes, a slab of one chunk
// each): each still allocates and frees, and a size whose entry was given up finds its slab again.
TEST(Slab, MoreSizesThanTheNodeRemembersStillAllocateAndFree) {
  testing::TempRegionPath path("slab-sizes");
  uint64_t total = 0;
  auto p = FreshPool(path.path(), 256 << 20, 2, &total);
  ASSERT_TRUE(p);
  std::vector<SlabBlock> blocks;
  for (int round = 0; round < 2; ++round) {
    for (uint64_t i = 0; i < sync::kLocalSizeClasses + 20; ++i) {
      const uint64_t size = (1 << 10) + i * 64;
      auto off = p->impl().allocator->Alloc(size, alloc::Fit::kExact);
      ASSERT_TRUE(off.ok()) << size << ": " << off.status().ToString();
      blocks.push_back({off->raw(), size, static_cast<uint8_t>(blocks.size() + 3)});
      Stamp(*p, blocks.back());
    }
  }
  for (const SlabBlock& b : blocks) ASSERT_TRUE(Intact(*p, b));
  testing::ExpectNoProblems({path.path()});
  for (const SlabBlock& b : blocks) ASSERT_TRUE(p->Free(b.off).ok());
  p->impl().allocator->Trim();
  EXPECT_EQ(FreeChunks({path.path()}), total);
}

// A slab's owner words are checked: a tail cut off from its head is reported, and a free into
// the slab refused, not applied to some other chunk.
TEST(Slab, CheckReportsABrokenSlabAndFreesRefuseIt) {
  testing::TempRegionPath path("slab-check");
  uint64_t total = 0;
  auto p = FreshPool(path.path(), kSlabRegionBytes, 2, &total);
  ASSERT_TRUE(p);
  std::vector<uint64_t> offs;
  for (int i = 0; i < 3; ++i) {
    auto off = p->impl().allocator->Alloc(2'359'296, alloc::Fit::kExact);
    ASSERT_TRUE(off.ok());
    offs.push_back(off->raw());
  }
  alloc::ChunkTableLayout t(p->impl().regions[0]->impl(), 2);
  auto& m = testing::Meta(*p);
  const uint64_t head = (region::Offset<void>(offs[0]).byte_offset() - t.data_offset()) / t.chunk_bytes();
  const auto hw = alloc::OwnerWord::Decode(m.Fetch(t.owner(head)));
  ASSERT_EQ(hw.kind, alloc::ChunkKind::kHeap);
  ASSERT_EQ(hw.detail, 2'359'296u / 64);
  const auto tail = alloc::OwnerWord::Decode(m.Fetch(t.owner(head + 1)));
  ASSERT_EQ(tail.kind, alloc::ChunkKind::kHeapTail);
  ASSERT_EQ(tail.detail, 1u);
  // The slab's second tail now names a distance that leads nowhere.
  alloc::OwnerWord bad = tail;
  bad.detail = 7;
  m.Publish(t.owner(head + 2), bad.Encode());
  auto problems = testing::CheckProblems({path.path()});
  EXPECT_TRUE(SomeLineHas(problems, "slab header says")) << ::testing::PrintToString(problems);
  EXPECT_TRUE(SomeLineHas(problems, "a slab tail without its head")) << ::testing::PrintToString(problems);
  // The third block starts in that chunk: its free is refused, nothing else changes.
  const uint64_t third_chunk = (region::Offset<void>(offs[2]).byte_offset() - t.data_offset()) / t.chunk_bytes();
  ASSERT_EQ(third_chunk, head + 2);
  EXPECT_FALSE(p->Free(offs[2]).ok());
  EXPECT_TRUE(testing::Allocated({path.path()}, offs[0]));
  m.Publish(t.owner(head + 2), alloc::OwnerWord{alloc::ChunkKind::kHeapTail, tail.node, tail.incarnation, 2}.Encode());
  for (uint64_t off : offs) EXPECT_TRUE(p->Free(off).ok());
  testing::ExpectNoProblems({path.path()});
}

}  // namespace
}  // namespace cxlkv
