// The SSD tier's restart catalog: puts and frees survive a restart; a torn tail,
// a bit flip in the log or a checkpoint, an out-of-range slot or a repeated sequence is dropped,
// never a crash and never an entry that was not written; a crash at every step of a checkpoint
// replays to the same map; ENOSPC leaves the map unchanged. Files go under testing::TempDir().
#include "tier/catalog.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "fault_io_platform.h"

namespace cxlkv::tier {
namespace {

using testing::Fault;
using testing::FaultIoPlatform;
using Model = std::map<uint64_t, CatalogEntry>;

constexpr uint64_t kSlots = 64;

// A directory under testing::TempDir() (on this VM: the root disk), removed at the end.
class CatalogDir {
 public:
  CatalogDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ("cxlkv-catalog-" + std::to_string(::getpid()) + "-" + info->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  ~CatalogDir() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string base() const { return (dir_ / "tier").string(); }
  std::string dir() const { return dir_.string(); }

 private:
  std::filesystem::path dir_;
};

// Counts the calls that change files; when the budget runs out the process "dies": that call
// (and every later one) fails, the crashing write optionally landing half its bytes first.
// sync=false makes fdatasync free (these tests check replay logic, not the drive).
class CrashIoPlatform : public IoPlatform {
 public:
  int64_t budget = -1;  // mutating calls still allowed; -1: no limit
  bool torn = false;
  bool sync = false;

  int Open(const std::string& path, int flags, mode_t mode) override {
    if ((flags & O_TRUNC) && !Step()) return -EIO;
    return IoPlatform::Open(path, flags, mode);
  }
  ssize_t Pwrite(int fd, const void* buf, size_t len, uint64_t offset) override {
    const bool first_failure = budget == 0 && !dead_;
    if (Step()) return IoPlatform::Pwrite(fd, buf, len, offset);
    if (torn && first_failure) (void)IoPlatform::Pwrite(fd, buf, len / 2, offset);
    return -EIO;
  }
  int Fdatasync(int fd) override {
    if (!Step()) return -EIO;
    return sync ? IoPlatform::Fdatasync(fd) : 0;
  }

 private:
  bool Step() {
    if (budget < 0) return true;
    if (budget == 0) {
      dead_ = true;
      return false;
    }
    --budget;
    return true;
  }
  bool dead_ = false;  // the crash happened: nothing more lands
};

CatalogEntry Entry(uint64_t slot, uint64_t generation = 1) {
  return CatalogEntry{slot, BlockKey{0x1000 + slot * 7, 0xfeed0000 + generation}, 42, generation,
                      uint32_t(4096 + slot), 2, uint16_t(slot & 3)};
}
CatalogRecord Put(uint64_t slot, uint64_t generation = 1) { return {CatalogOp::kPut, Entry(slot, generation)}; }
CatalogRecord Free(uint64_t slot) {
  CatalogRecord r{CatalogOp::kFree, {}};
  r.entry.slot = slot;
  return r;
}

void ApplyTo(Model& m, std::span<const CatalogRecord> rs) {
  for (const auto& r : rs) {
    if (r.op == CatalogOp::kPut) {
      m[r.entry.slot] = r.entry;
    } else {
      m.erase(r.entry.slot);
    }
  }
}

Model LiveOf(const Catalog& c) {
  Model m;
  for (const auto& e : c.Live()) m[e.slot] = e;
  return m;
}

std::unique_ptr<Catalog> MustOpen(IoPlatform& io, const std::string& base, uint64_t slots = kSlots,
                                  CatalogOptions o = {}) {
  auto c = Catalog::Open(io, base, slots, o);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::move(c).value() : nullptr;
}

std::string ReadBytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}
void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// The three files of a catalog, saved and put back (Open rewrites them).
struct Files {
  std::string c0, c1, log;
  static Files Save(const std::string& base) {
    return {ReadBytes(Catalog::CheckpointPath(base, 0)), ReadBytes(Catalog::CheckpointPath(base, 1)),
            ReadBytes(Catalog::LogPath(base))};
  }
  void Restore(const std::string& base) const {
    WriteBytes(Catalog::CheckpointPath(base, 0), c0);
    WriteBytes(Catalog::CheckpointPath(base, 1), c1);
    WriteBytes(Catalog::LogPath(base), log);
  }
};

// A mix of puts, frees and reuses (a new generation in a freed slot), from a fixed seed.
std::vector<std::vector<CatalogRecord>> RandomBatches(uint64_t seed, int batches, uint64_t slots = kSlots) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<CatalogRecord>> out(batches);
  std::vector<uint64_t> gen(slots, 0);
  for (auto& b : out) {
    for (int n = 1 + rng() % 5; n > 0; --n) {
      uint64_t s = rng() % slots;
      b.push_back(rng() % 4 == 0 ? Free(s) : Put(s, ++gen[s]));
    }
  }
  return out;
}

TEST(Catalog, FirstOpenIsEmptyAndCreatesItsFiles) {
  CatalogDir d;
  auto c = MustOpen(IoPlatform::Default(), d.base());
  ASSERT_TRUE(c);
  EXPECT_EQ(c->live_count(), 0u);
  EXPECT_TRUE(c->Live().empty());
  EXPECT_EQ(c->replay_stats().dropped_records, 0u);
  EXPECT_FALSE(c->replay_stats().started_empty);
  EXPECT_TRUE(c->replay_stats().message.empty()) << c->replay_stats().message;
  EXPECT_TRUE(std::filesystem::exists(Catalog::CheckpointPath(d.base(), 0)));
  EXPECT_EQ(std::filesystem::file_size(Catalog::LogPath(d.base())), kCatalogRecordBytes);  // the base record
}

TEST(Catalog, PutsAndFreesSurviveReopen) {
  CatalogDir d;
  Model model;
  uint64_t records = 0;
  {
    auto c = MustOpen(IoPlatform::Default(), d.base());
    ASSERT_TRUE(c);
    for (const auto& b : RandomBatches(1, 40)) {
      ASSERT_TRUE(c->Append(b).ok());
      ApplyTo(model, b);
      records += b.size();
      ASSERT_EQ(LiveOf(*c), model);
    }
    CatalogEntry e;
    for (uint64_t s = 0; s < kSlots; ++s) EXPECT_EQ(c->Find(s, &e), model.count(s) == 1) << s;
  }  // destroyed without a checkpoint: the disk holds what a kill -9 leaves
  auto c = MustOpen(IoPlatform::Default(), d.base());
  ASSERT_TRUE(c);
  EXPECT_EQ(LiveOf(*c), model);
  EXPECT_EQ(c->replay_stats().log_records, records);
  EXPECT_EQ(c->replay_stats().dropped_records, 0u);
  EXPECT_GT(c->replay_stats().replay_seconds, 0);
  c.reset();
  c = MustOpen(IoPlatform::Default(), d.base());  // now from Open's own checkpoint
  EXPECT_EQ(LiveOf(*c), model);
  EXPECT_EQ(c->replay_stats().checkpoint_entries, model.size());
  EXPECT_EQ(c->replay_stats().log_records, 0u);
}

TEST(Catalog, CheckpointThenAppendsReplaysBoth) {
  CatalogDir d;
  Model model;
  auto batches = RandomBatches(2, 30);
  {
    auto c = MustOpen(IoPlatform::Default(), d.base());
    ASSERT_TRUE(c);
    for (int i = 0; i < 30; ++i) {
      ASSERT_TRUE(c->Append(batches[i]).ok());
      ApplyTo(model, batches[i]);
      if (i == 19) {
        ASSERT_TRUE(c->Checkpoint().ok());
      }
    }
  }
  size_t after = 0;
  for (int i = 20; i < 30; ++i) after += batches[i].size();
  auto c = MustOpen(IoPlatform::Default(), d.base());
  ASSERT_TRUE(c);
  EXPECT_EQ(LiveOf(*c), model);
  EXPECT_EQ(c->replay_stats().log_records, after);
  EXPECT_EQ(c->replay_stats().covered_records, 0u);
  EXPECT_GT(c->replay_stats().checkpoint_sequence, 0u);
}

TEST(Catalog, AutomaticCheckpointWhenTheLogExceedsItsLimit) {
  CatalogDir d;
  CatalogOptions o;
  o.log_limit_bytes = 20 * kCatalogRecordBytes;
  Model model;
  {
    auto c = MustOpen(IoPlatform::Default(), d.base(), kSlots, o);
    ASSERT_TRUE(c);
    for (const auto& b : RandomBatches(3, 60)) {
      ASSERT_TRUE(c->Append(b).ok());
      ApplyTo(model, b);
      EXPECT_LT(c->log_bytes(), o.log_limit_bytes);
    }
    EXPECT_TRUE(c->last_checkpoint_status().ok());
  }
  EXPECT_LT(std::filesystem::file_size(Catalog::LogPath(d.base())), o.log_limit_bytes);
  auto c = MustOpen(IoPlatform::Default(), d.base());
  ASSERT_TRUE(c);
  EXPECT_EQ(LiveOf(*c), model);
  EXPECT_GT(c->replay_stats().checkpoint_sequence, 0u);
}

TEST(Catalog, InvalidRecordIsRefusedAndNothingWritten) {
  CatalogDir d;
  auto c = MustOpen(IoPlatform::Default(), d.base());
  ASSERT_TRUE(c);
  std::vector<CatalogRecord> b = {Put(1), Put(kSlots)};
  Status s = c->Append(b);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_EQ(c->live_count(), 0u);
  EXPECT_EQ(c->log_bytes(), kCatalogRecordBytes);
}

TEST(Catalog, NoSpaceOnAppendLeavesTheMapUnchanged) {
  CatalogDir d;
  FaultIoPlatform p;
  Model model;
  {
    auto c = MustOpen(p, d.base());
    ASSERT_TRUE(c);
    std::vector<CatalogRecord> ok1 = {Put(1), Put(2)};
    ASSERT_TRUE(c->Append(ok1).ok());
    ApplyTo(model, ok1);
    // Nothing written; then 100 bytes (one whole record) before ENOSPC; then 128 bytes and the
    // blanking write refused too, so two whole records of the failed batch stay in the file.
    std::vector<std::deque<Fault>> scripts = {
        {Fault{-ENOSPC}}, {Fault{0, 100}, Fault{-ENOSPC}}, {Fault{0, 128}, Fault{-EDQUOT}, Fault{-EIO}}};
    uint64_t slot = 10;
    for (auto& script : scripts) {
      p.write_faults = script;
      std::vector<CatalogRecord> failed = {Put(slot), Put(slot + 1), Free(1)};
      Status s = c->Append(failed);
      EXPECT_EQ(s.code(), StatusCode::kNoSpace) << s.ToString();
      EXPECT_NE(s.message().find(Catalog::LogPath(d.base())), std::string::npos) << s.message();
      EXPECT_EQ(LiveOf(*c), model);
      EXPECT_TRUE(p.write_faults.empty());
      std::vector<CatalogRecord> next = {Put(slot + 2)};
      ASSERT_TRUE(c->Append(next).ok());
      ApplyTo(model, next);
      slot += 10;
    }
    EXPECT_EQ(LiveOf(*c), model);
  }
  auto c = MustOpen(IoPlatform::Default(), d.base());
  ASSERT_TRUE(c);
  EXPECT_EQ(LiveOf(*c), model);
  // The third script's second record is still there, behind a record with a larger sequence
  // (the second script's blanked bytes were written over by the third).
  EXPECT_EQ(c->replay_stats().dropped_records, 1u) << c->replay_stats().message;
}

TEST(Catalog, FdatasyncFailureOnAppendIsAnError) {
  CatalogDir d;
  FaultIoPlatform p;
  auto c = MustOpen(p, d.base());
  ASSERT_TRUE(c);
  p.fdatasync_error = -EIO;
  std::vector<CatalogRecord> b = {Put(5)};
  Status s = c->Append(b);
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s.ToString();
  EXPECT_EQ(c->live_count(), 0u);
  p.fdatasync_error = 0;
  ASSERT_TRUE(c->Append(b).ok());
  EXPECT_EQ(c->live_count(), 1u);
}

TEST(Catalog, UnwritablePathFailsOpenNamingThePath) {
  CatalogDir d;
  std::string missing = d.dir() + "/no-such-dir/tier";
  auto c = Catalog::Open(IoPlatform::Default(), missing, kSlots);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound) << c.status().ToString();
  EXPECT_NE(c.status().message().find(missing), std::string::npos) << c.status().message();
  EXPECT_NE(c.status().message().find("create it"), std::string::npos) << c.status().message();

  FaultIoPlatform p;
  p.open_error = -EACCES;
  c = Catalog::Open(p, d.base(), kSlots);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kPermissionDenied) << c.status().ToString();
  EXPECT_NE(c.status().message().find(d.base()), std::string::npos) << c.status().message();

  FaultIoPlatform full;
  full.write_faults = {Fault{-ENOSPC}};
  c = Catalog::Open(full, d.base(), kSlots);
  EXPECT_EQ(c.status().code(), StatusCode::kNoSpace) << c.status().ToString();
}

TEST(CatalogCrash, TornLastRecordAtEveryByteIsAbsentAndEarlierOnesPresent) {
  CatalogDir d;
  CrashIoPlatform io;
  Model before;
  auto batches = RandomBatches(4, 12);
  {
    auto c = MustOpen(io, d.base());
    ASSERT_TRUE(c);
    for (auto& b : batches) ASSERT_TRUE(c->Append(b).ok());
    std::vector<CatalogRecord> last = {Put(63, 99)};
    for (auto& b : batches) ApplyTo(before, b);
    ASSERT_TRUE(c->Append(last).ok());
  }
  Files files = Files::Save(d.base());
  const size_t end = files.log.size();
  for (size_t cut = end - kCatalogRecordBytes; cut < end; ++cut) {
    Files f = files;
    f.log.resize(cut);
    f.Restore(d.base());
    auto c = MustOpen(io, d.base());
    ASSERT_TRUE(c);
    EXPECT_EQ(LiveOf(*c), before) << "log cut at " << cut;
    EXPECT_EQ(c->replay_stats().dropped_records, cut % kCatalogRecordBytes ? 1u : 0u) << cut;
  }
}

TEST(CatalogCrash, CrashAtEveryStepOfCheckpointReplaysToTheSameMap) {
  CatalogDir d;
  for (bool torn : {false, true}) {
    for (int64_t k = 0;; ++k) {
      std::filesystem::remove_all(d.dir());
      std::filesystem::create_directories(d.dir());
      CrashIoPlatform io;
      io.torn = torn;
      Model model;
      auto c = MustOpen(io, d.base());
      ASSERT_TRUE(c);
      auto batches = RandomBatches(5 + k, 8);
      for (int i = 0; i < 8; ++i) {
        ASSERT_TRUE(c->Append(batches[i]).ok());
        ApplyTo(model, batches[i]);
        if (i == 2 || i == 5) {
          // Both copies hold entries: a torn write over the older one fails its entries' CRC.
          ASSERT_TRUE(c->Checkpoint().ok());
        }
      }
      io.budget = k;
      const bool finished = c->Checkpoint().ok();
      c.reset();  // the process dies here
      auto r = MustOpen(IoPlatform::Default(), d.base());
      ASSERT_TRUE(r);
      EXPECT_EQ(LiveOf(*r), model) << "crash after " << k << " steps, torn=" << torn << ": "
                                   << r->replay_stats().message;
      EXPECT_FALSE(r->replay_stats().started_empty);
      if (finished) break;
      ASSERT_LT(k, 50);
    }
  }
}

TEST(CatalogCrash, CrashAtEveryStepOfOpenReplaysToTheSameMap) {
  CatalogDir d;
  Model model;
  {
    auto c = MustOpen(IoPlatform::Default(), d.base());
    ASSERT_TRUE(c);
    for (const auto& b : RandomBatches(6, 10)) {
      ASSERT_TRUE(c->Append(b).ok());
      ApplyTo(model, b);
    }
  }
  Files files = Files::Save(d.base());
  for (int64_t k = 0;; ++k) {
    files.Restore(d.base());
    CrashIoPlatform io;
    io.budget = k;
    io.torn = true;
    auto c = Catalog::Open(io, d.base(), kSlots);
    const bool finished = c.ok();
    auto r = MustOpen(IoPlatform::Default(), d.base());
    ASSERT_TRUE(r);
    EXPECT_EQ(LiveOf(*r), model) << "crash after " << k << " steps: " << r->replay_stats().message;
    if (finished) break;
    ASSERT_LT(k, 50);
  }
}

TEST(CatalogCrash, CrashDuringAppendReplaysAPrefixOfTheBatch) {
  CatalogDir d;
  for (int64_t k : {0, 1}) {
    std::filesystem::remove_all(d.dir());
    std::filesystem::create_directories(d.dir());
    CrashIoPlatform io;
    io.torn = true;
    Model model;
    auto c = MustOpen(io, d.base());
    ASSERT_TRUE(c);
    std::vector<CatalogRecord> first = {Put(1), Put(2), Put(3)};
    ASSERT_TRUE(c->Append(first).ok());
    ApplyTo(model, first);
    std::vector<CatalogRecord> batch = {Free(1), Put(4), Put(5), Put(6)};
    io.budget = k;  // 0: dies in the write (half of it lands); 1: dies in the fdatasync
    EXPECT_FALSE(c->Append(batch).ok());
    c.reset();
    auto r = MustOpen(IoPlatform::Default(), d.base());
    ASSERT_TRUE(r);
    Model got = LiveOf(*r);
    bool prefix = false;
    Model m = model;
    for (size_t n = 0; n <= batch.size() && !prefix; ++n) {
      if (n > 0) ApplyTo(m, std::span(batch).subspan(n - 1, 1));
      prefix = got == m;
    }
    EXPECT_TRUE(prefix) << "k=" << k << ": " << got.size() << " live";
  }
}

// Log: base record, then 12 records. Flipping any bit of record i drops record i only.
TEST(CatalogCorruption, EveryBitFlipOfOneLogRecordDropsExactlyThatRecord) {
  CatalogDir d;
  CrashIoPlatform io;
  std::vector<CatalogRecord> records = {Put(1), Put(2), Put(3),    Free(2), Put(4),    Put(2, 2),
                                        Put(5), Free(1), Put(1, 2), Put(6), Free(6), Put(7)};
  {
    auto c = MustOpen(io, d.base());
    ASSERT_TRUE(c);
    for (size_t i = 0; i < records.size(); i += 3) ASSERT_TRUE(c->Append(std::span(records).subspan(i, 3)).ok());
  }
  Files files = Files::Save(d.base());
  ASSERT_EQ(files.log.size(), (1 + records.size()) * kCatalogRecordBytes);
  for (size_t victim : {size_t{0}, size_t{3}, size_t{7}, records.size() - 1}) {
    Model expect;
    for (size_t i = 0; i < records.size(); ++i) {
      if (i != victim) ApplyTo(expect, std::span(records).subspan(i, 1));
    }
    for (size_t bit = 0; bit < kCatalogRecordBytes * 8; ++bit) {
      Files f = files;
      f.log[(1 + victim) * kCatalogRecordBytes + bit / 8] ^= char(1 << (bit % 8));
      f.Restore(d.base());
      auto c = MustOpen(io, d.base());
      ASSERT_TRUE(c);
      ASSERT_EQ(LiveOf(*c), expect) << "record " << victim << " bit " << bit;
      ASSERT_EQ(c->replay_stats().dropped_records, 1u) << "record " << victim << " bit " << bit;
      ASSERT_EQ(c->replay_stats().log_records, records.size() - 1);
    }
  }
}

TEST(CatalogCorruption, BitFlipInTheLogBaseRecordKeepsTheRecords) {
  CatalogDir d;
  CrashIoPlatform io;
  Model model;
  std::vector<CatalogRecord> b = {Put(1), Put(2), Free(1)};
  {
    auto c = MustOpen(io, d.base());
    ASSERT_TRUE(c);
    ASSERT_TRUE(c->Append(b).ok());
    ApplyTo(model, b);
  }
  Files files = Files::Save(d.base());
  for (size_t bit = 0; bit < kCatalogRecordBytes * 8; ++bit) {
    Files f = files;
    f.log[bit / 8] ^= char(1 << (bit % 8));
    f.Restore(d.base());
    auto c = MustOpen(io, d.base());
    ASSERT_TRUE(c);
    ASSERT_EQ(LiveOf(*c), model) << bit;  // the first record follows the checkpoint: provably linked
    ASSERT_EQ(c->replay_stats().dropped_records, 1u);
  }
}

// Every bit of the checkpoint in use: the copy is dropped, the log follows it, so nothing can be
// proven current — the result is empty, and never an entry that was not written.
TEST(CatalogCorruption, EveryBitFlipInTheCheckpointNeverInventsAnEntry) {
  CatalogDir d;
  CrashIoPlatform io;
  std::vector<CatalogRecord> written = {Put(1), Put(2), Put(3), Put(4), Put(5), Put(6), Put(10), Free(2)};
  {
    auto c = MustOpen(io, d.base());
    ASSERT_TRUE(c);
    ASSERT_TRUE(c->Append(std::span(written).subspan(0, 6)).ok());
    ASSERT_TRUE(c->Checkpoint().ok());  // copy 1: 6 entries
    ASSERT_TRUE(c->Append(std::span(written).subspan(6)).ok());
  }
  Files files = Files::Save(d.base());
  ASSERT_EQ(files.c1.size(), 7 * kCatalogRecordBytes);
  for (size_t bit = 0; bit < files.c1.size() * 8; ++bit) {
    Files f = files;
    f.c1[bit / 8] ^= char(1 << (bit % 8));
    f.Restore(d.base());
    auto c = MustOpen(io, d.base());
    ASSERT_TRUE(c) << bit;
    for (const auto& e : c->Live()) {
      bool was_written = false;
      for (const auto& w : written) was_written |= w.op == CatalogOp::kPut && w.entry == e;
      ASSERT_TRUE(was_written) << "bit " << bit << " produced slot " << e.slot;
    }
    ASSERT_EQ(c->replay_stats().checkpoint_copies_dropped, 1u) << bit;
    ASSERT_TRUE(c->replay_stats().started_empty) << bit;
    ASSERT_EQ(c->live_count(), 0u) << bit;
  }
}

TEST(CatalogCorruption, CorruptNewestCheckpointFallsBackOnlyWhenTheLogLinks) {
  CatalogDir d;
  Model model;
  {
    auto c = MustOpen(IoPlatform::Default(), d.base());
    ASSERT_TRUE(c);
    std::vector<CatalogRecord> b = {Put(1), Put(2), Put(3)};
    ASSERT_TRUE(c->Append(b).ok());
    ASSERT_TRUE(c->Checkpoint().ok());  // copy 1, the log follows it
    ApplyTo(model, b);
  }
  Files files = Files::Save(d.base());
  // The older copy rots: nothing is lost.
  Files f = files;
  f.c0[20] ^= 4;
  f.Restore(d.base());
  auto c = MustOpen(IoPlatform::Default(), d.base());
  ASSERT_TRUE(c);
  EXPECT_EQ(LiveOf(*c), model);
  EXPECT_FALSE(c->replay_stats().started_empty);
  c.reset();
  // The newest rots: the older copy is a past state the log does not continue: start empty.
  f = files;
  f.c1[kCatalogRecordBytes + 20] ^= 4;
  f.Restore(d.base());
  c = MustOpen(IoPlatform::Default(), d.base());
  ASSERT_TRUE(c);
  EXPECT_EQ(c->live_count(), 0u);
  EXPECT_TRUE(c->replay_stats().started_empty);
  EXPECT_NE(c->replay_stats().message.find("starts empty"), std::string::npos) << c->replay_stats().message;
  c.reset();
  // The state written by that Open is durable: the next one agrees without dropping anything.
  c = MustOpen(IoPlatform::Default(), d.base());
  ASSERT_TRUE(c);
  EXPECT_EQ(c->live_count(), 0u);
  EXPECT_FALSE(c->replay_stats().started_empty) << c->replay_stats().message;
}

// A log emptied by a checkpoint's restart vouches only for a checkpoint that is intact: with the
// newest copy's header rotten, the older one may be a past state.
TEST(CatalogCorruption, EmptyLogCannotVouchForAnOlderCheckpoint) {
  CatalogDir d;
  {
    auto c = MustOpen(IoPlatform::Default(), d.base());
    ASSERT_TRUE(c);
    std::vector<CatalogRecord> a = {Put(1), Put(2)}, b = {Free(1), Put(3)};
    ASSERT_TRUE(c->Append(a).ok());
    ASSERT_TRUE(c->Checkpoint().ok());  // copy 1: {1, 2}
    ASSERT_TRUE(c->Append(b).ok());
    ASSERT_TRUE(c->Checkpoint().ok());  // copy 0: {2, 3}
  }
  Files files = Files::Save(d.base());
  files.log.clear();  // as a crash right after the restart's truncation leaves it
  files.Restore(d.base());
  auto c = MustOpen(IoPlatform::Default(), d.base());
  ASSERT_TRUE(c);
  Model both_intact = {{2, Entry(2)}, {3, Entry(3)}};
  EXPECT_EQ(LiveOf(*c), both_intact) << c->replay_stats().message;
  c.reset();
  files.c0[8] ^= 1;  // the newest copy's header
  files.Restore(d.base());
  c = MustOpen(IoPlatform::Default(), d.base());
  ASSERT_TRUE(c);
  EXPECT_EQ(c->live_count(), 0u);
  EXPECT_TRUE(c->replay_stats().started_empty);
  EXPECT_EQ(c->replay_stats().checkpoint_copies_dropped, 1u);
}

TEST(CatalogCorruption, OutOfRangeSlotsAreDropped) {
  CatalogDir d;
  {
    auto c = MustOpen(IoPlatform::Default(), d.base());
    ASSERT_TRUE(c);
    std::vector<CatalogRecord> b = {Put(10), Put(52), Put(60)};
    ASSERT_TRUE(c->Append(b).ok());
    ASSERT_TRUE(c->Checkpoint().ok());
    std::vector<CatalogRecord> more = {Put(55), Put(11)};
    ASSERT_TRUE(c->Append(more).ok());
  }
  auto c = MustOpen(IoPlatform::Default(), d.base(), 52);  // the device shrank
  Model expect = {{10, Entry(10)}, {11, Entry(11)}};
  EXPECT_EQ(LiveOf(*c), expect);
  EXPECT_EQ(c->replay_stats().dropped_records, 3u) << c->replay_stats().message;
}

TEST(CatalogCorruption, RepeatedSequenceIsDropped) {
  CatalogDir d;
  {
    auto c = MustOpen(IoPlatform::Default(), d.base());
    ASSERT_TRUE(c);
    std::vector<CatalogRecord> a = {Put(1)}, b = {Free(1)};
    ASSERT_TRUE(c->Append(a).ok());
    ASSERT_TRUE(c->Append(b).ok());
  }
  // Replaying the put again (its sequence is not above the free's) would resurrect slot 1.
  std::string log = ReadBytes(Catalog::LogPath(d.base()));
  log += log.substr(kCatalogRecordBytes, kCatalogRecordBytes);
  WriteBytes(Catalog::LogPath(d.base()), log);
  auto c = MustOpen(IoPlatform::Default(), d.base());
  ASSERT_TRUE(c);
  EXPECT_EQ(c->live_count(), 0u);
  EXPECT_EQ(c->replay_stats().dropped_records, 1u);
}

// Recovery time per million blocks (printed, not asserted), as `cxlkv bench tier` reports it.
TEST(CatalogBench, ReplayCostPerMillionRecords) {
  CatalogDir d;
  auto cost = MeasureReplayCost(IoPlatform::Default(), d.base(), 1'000'000);
  ASSERT_TRUE(cost.ok()) << cost.status().ToString();
  std::printf("catalog replay of %llu records, seconds per million: log %.3f warm / %.3f cold, "
              "checkpoint %.3f warm / %.3f cold; checkpoint write %.3f\n",
              static_cast<unsigned long long>(cost->records), cost->log_warm_s_per_million,
              cost->log_cold_s_per_million, cost->checkpoint_warm_s_per_million,
              cost->checkpoint_cold_s_per_million, cost->checkpoint_write_s_per_million);
  EXPECT_GT(cost->log_warm_s_per_million, 0);
  EXPECT_FALSE(std::filesystem::exists(Catalog::LogPath(d.base())));
}

}  // namespace
}  // namespace cxlkv::tier
