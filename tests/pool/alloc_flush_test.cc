// Allocator flushes and invalidates that only a non-coherent host can miss, each shown by a
// scenario under the simulator with its random write-backs off, so that the outcome is the
// protocol's alone (scripts/flush-audit found no test that needed them).
#include <sys/wait.h>
#include <unistd.h>

#include <thread>

#include <gtest/gtest.h>

#include "child.h"
#include "pool_test_util.h"
#include "region/coherence.h"

namespace cxlkv {
namespace {

using testing::OpenOrNull;

constexpr uint64_t kFlushRegionBytes = 48 << 20;

using testing::Child;
using testing::Get;
using testing::Put;

std::unique_ptr<Pool> OpenQuiet(const std::vector<std::string>& paths, uint32_t node, uint64_t seed) {
  auto p = OpenOrNull(paths, node, seed);
  if (p) testing::Meta(*p).simulator()->SetChaos(false);
  return p;
}

// A chunk that held payload (a large object) goes back to the pool with that payload in the
// bytes a heap chunk uses for its slot bitmap. The next owner zeroes the bitmap when it formats
// the chunk as a heap: unless that reaches memory (P1), `check` and recovery on other hosts read
// the old payload as allocation bits beside the new owner's header.
TEST(AllocatorFlush, ANewHeapChunksClearedBitmapReachesMemory) {
  testing::TempRegionPath path("flush-bitmap");
  std::vector<std::string> paths{path.path()};
  PoolCreateOptions co;
  co.size = kFlushRegionBytes;
  co.max_nodes = 4;
  ASSERT_TRUE(Pool::Create(paths, co).ok());
  Child filler = Child::Fork([&](int in, int out) {
    uint64_t go;
    if (!Get(in, &go)) return 1;
    auto p = OpenOrNull(paths, 2);
    if (!p) return 2;
    const uint64_t bytes = 3 << 20;  // a run of whole chunks, first fit: the lowest ones
    auto off = p->Alloc(bytes);
    if (!off.ok()) return 3;
    std::vector<uint8_t> ones(bytes, 0xff);
    region::NtCopy(p->Ptr(*off, bytes), ones.data(), bytes);
    if (!p->Free(*off).ok()) return 4;
    return Put(out, *off) ? 0 : 5;
  });
  Child owner = Child::Fork([&](int in, int out) {
    uint64_t go;
    if (!Get(in, &go)) return 1;
    auto p = OpenQuiet(paths, 1, 41);
    if (!p) return 2;
    auto off = p->Alloc(64);
    if (!off.ok() || !Put(out, *off)) return 3;
    if (!Get(in, &go)) return 4;  // stays alive (its cache with it) until checked
    return p->Free(*off).ok() ? 0 : 5;
  });
  auto manager = OpenOrNull(paths, 0);
  ASSERT_TRUE(manager);
  uint64_t run = 0, heap_object = 0;
  ASSERT_TRUE(filler.Send(1) && filler.Receive(&run));
  EXPECT_EQ(filler.Wait(), 0);
  ASSERT_TRUE(owner.Send(1) && owner.Receive(&heap_object));
  const uint64_t chunk = manager->impl().allocator->chunk_bytes();
  ASSERT_EQ(region::Offset<void>(heap_object).byte_offset() / chunk, region::Offset<void>(run).byte_offset() / chunk)
      << "the heap chunk is not the freed run's first chunk: the scenario did not happen";
  auto regions = pool::AttachAll(paths);
  ASSERT_TRUE(regions.ok());
  auto problems = pool::Check(*regions);
  for (const auto& p : problems) ADD_FAILURE() << p;
  ASSERT_TRUE(owner.Send(1));
  EXPECT_EQ(owner.Wait(), 0);
}

// A node whose search for a run failed keeps the bitmap line it read. If its next search used
// that copy instead of invalidating (P2), it would take chunks another node allocated meanwhile.
TEST(AllocatorFlush, ARunSearchRereadsTheBitmapAnotherNodeChanged) {
  testing::TempRegionPath path("flush-run");
  std::vector<std::string> paths{path.path()};
  PoolCreateOptions co;
  co.size = kFlushRegionBytes;
  co.max_nodes = 4;
  ASSERT_TRUE(Pool::Create(paths, co).ok());
  Child a = Child::Fork([&](int in, int out) {
    uint64_t cmd;
    if (!Get(in, &cmd)) return 1;
    auto p = OpenQuiet(paths, 1, 43);
    if (!p) return 2;
    // Every chunk in one run while the manager's node holds some: fails, after reading every
    // bitmap word.
    if (p->Alloc(p->impl().allocator->data_bytes()).ok()) return 3;
    if (!Put(out, 1) || !Get(in, &cmd)) return 4;
    auto run = p->Alloc(3 << 20);
    if (!run.ok() || !Put(out, *run) || !Get(in, &cmd)) return 5;
    return 0;
  });
  Child b = Child::Fork([&](int in, int out) {
    uint64_t cmd;
    if (!Get(in, &cmd)) return 1;
    auto p = OpenQuiet(paths, 2, 47);
    if (!p) return 2;
    auto run = p->Alloc(3 << 20);
    if (!run.ok() || !Put(out, *run) || !Get(in, &cmd)) return 3;
    return 0;
  });
  auto manager = OpenOrNull(paths, 0);
  ASSERT_TRUE(manager);
  auto held = manager->Alloc(manager->impl().allocator->chunk_bytes());
  ASSERT_TRUE(held.ok()) << held.status().ToString();
  const uint64_t run_bytes = 3 << 20;
  uint64_t v, b_run, a_run;
  ASSERT_TRUE(a.Send(1) && a.Receive(&v));
  ASSERT_TRUE(b.Send(1) && b.Receive(&b_run));
  ASSERT_TRUE(a.Send(1) && a.Receive(&a_run));
  EXPECT_TRUE(a_run + run_bytes <= b_run || b_run + run_bytes <= a_run)
      << "node 1 took chunks node 2 had allocated: its run search read a stale bitmap";
  auto regions = pool::AttachAll(paths);
  ASSERT_TRUE(regions.ok());
  auto problems = pool::Check(*regions);
  for (const auto& p : problems) ADD_FAILURE() << p;
  ASSERT_TRUE(a.Send(1) && b.Send(1));
  EXPECT_EQ(a.Wait(), 0);
  EXPECT_EQ(b.Wait(), 0);
}

}  // namespace
}  // namespace cxlkv
