// cxlkvd with capacity tiers, as real processes: a writer on another node puts more
// than the region holds, every block reads back identical through spill and promote, and the
// tiers show in /metrics (checked by promtool), `cxlkv stat` and a clean `cxlkv check`. A
// device path that cannot be used stops the daemon at start with the tier named. The SSD's
// blocks outlive the region: a daemon restarted into a re-created pool serves them.
#include <filesystem>

#include "daemon_harness.h"

namespace cxlkv {
namespace {

using namespace cxlkv::testing;  // the daemon harness

constexpr uint64_t kBlock = 256 << 10;

// `put`: writes `blocks` blocks of one chain. Then looks each up and checks its bytes: every one
// must hit, or, with `expect_hits` >= 0, exactly that many (the others are gone) — each hit
// with the bytes written.
int PutAndReadBack(const std::string& path, uint32_t node, int blocks, bool put = true, int expect_hits = -1) {
  auto pool = testing::OpenOrNull({path}, node);
  CHILD_CHECK(pool != nullptr, "open");
  auto cache = pool->Cache();
  CHILD_CHECK(cache.ok(), "cache");
  KeyNamespace kns;
  kns.model_id = "tier-daemon-test";
  kns.layout.block_size = 1;
  auto ns = (*cache)->Namespace(kns);
  CHILD_CHECK(ns.ok(), "ns: %s", ns.status().ToString().c_str());
  std::vector<int32_t> tokens(blocks);
  for (int i = 0; i < blocks; ++i) tokens[i] = 5000 + i;
  auto keys = KvCache::ChainKeys(*ns, tokens);
  std::vector<uint8_t> data(kBlock), back(kBlock);
  for (size_t i = 0; put && i < keys.size(); ++i) {
    std::fill(data.begin(), data.end(), static_cast<uint8_t>(i * 7 + 1));
    Status s = (*cache)->Put(*ns, keys[i], data.data(), data.size());
    CHILD_CHECK(s.ok(), "put %zu: %s", i, s.ToString().c_str());
  }
  if (expect_hits >= 0) {
    int hits = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      auto hit = (*cache)->Lookup(*ns, {&keys[i], 1});
      CHILD_CHECK(hit.ok(), "lookup %zu: %s", i, hit.status().ToString().c_str());
      if (hit->hit_blocks == 0) continue;
      CHILD_CHECK((*cache)->Read(hit->pins[0], 0, back.data(), back.size()).ok(), "read %zu", i);
      std::fill(data.begin(), data.end(), static_cast<uint8_t>(i * 7 + 1));
      CHILD_CHECK(back == data, "block %zu differs", i);
      (*cache)->Release(hit->pins);
      ++hits;
    }
    CHILD_CHECK(hits == expect_hits, "%d blocks hit, %d expected", hits, expect_hits);
    return 0;
  }
  // Block by block, oldest first: each lookup brings its block in from a tier (or finds it in
  // the region) and the bytes are the ones written.
  for (size_t i = 0; i < keys.size(); ++i) {
    auto hit = (*cache)->Lookup(*ns, {&keys[i], 1});
    CHILD_CHECK(hit.ok() && hit->hit_blocks == 1, "block %zu not hit (present on some tier: %zu)", i,
                static_cast<size_t>(*(*cache)->Exists(*ns, {&keys[i], 1})));
    CHILD_CHECK((*cache)->Read(hit->pins[0], 0, back.data(), back.size()).ok(), "read %zu", i);
    std::fill(data.begin(), data.end(), static_cast<uint8_t>(i * 7 + 1));
    CHILD_CHECK(back == data, "block %zu differs", i);
    (*cache)->Release(hit->pins);
  }
  return 0;
}

// A 48 MiB pool (over anything there before): 160 blocks of 256 KiB outgrow it.
Status CreateTierPool(const std::string& path) {
  PoolCreateOptions co;
  co.size = 48 << 20;
  co.max_nodes = 8;
  co.index_entries = 2048;
  co.overwrite = true;
  return Pool::Create({path}, co);
}

TEST(CxlkvdTiers, SpillAndPromoteThroughTheDaemonShowInMetricsAndStat) {
  TempRegionPath path("cxlkvdtiers");
  ASSERT_TRUE(CreateTierPool(path.path()).ok());
  const std::string dir = std::filesystem::current_path() / ("tier-daemon-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  DaemonProcess d = DaemonProcess::Start(
      path.path(), 0, "--metrics 127.0.0.1:0 --tier dram:8M --tier ssd:" + dir + "/kv.tier:48M --tier-slot 260K");
  const int port = d.MetricsPort();
  ASSERT_GT(port, 0) << d.first_line;
  auto codes = RunForked(1, [&](int) { return PutAndReadBack(path.path(), 3, 160); });  // 40 MiB of blocks
  EXPECT_EQ(codes[0], 0);
  const std::string metrics = Scrape(port);
  std::string report;
  EXPECT_EQ(PromtoolCheck(metrics, &report), 0) << "promtool: " << report;
  EXPECT_GT(SumOf(metrics, "cxlkv_tier_spilled_total"), 0);
  EXPECT_GT(SumOf(metrics, "cxlkv_tier_promoted_total"), 0);
  EXPECT_EQ(SumOf(metrics, "cxlkv_tier_slots", "kind=\"ssd\""), 189);  // 48 MiB / 260 KiB
  EXPECT_EQ(SumOf(metrics, "cxlkv_tier_device_miss_corrupt_total"), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // the status document is republished
  const Output stat = Sh(Cli() + " stat --path " + path.path());
  EXPECT_EQ(stat.code, 0) << stat.out;
  EXPECT_NE(stat.out.find("tiers of node 0"), std::string::npos) << stat.out;
  EXPECT_NE(stat.out.find("ssd[1] " + dir + "/kv.tier"), std::string::npos) << stat.out;
  EXPECT_NE(stat.out.find("capacity tiers: spilled"), std::string::npos) << stat.out;
  const Output check = Sh(Cli() + " check --path " + path.path());
  EXPECT_EQ(check.code, 0) << check.out;
  ::kill(d.pid, SIGTERM);
  EXPECT_EQ(d.Wait(), 0);
  std::filesystem::remove_all(dir);
}

// The region is lost (kill -9 of the daemon, then the pool is created again, as after a host
// reboot with the pool in /dev/shm): the node's next cxlkvd names the SSD's blocks in the new
// region again from the device's catalog and namespace book. Exactly those hit, each with the
// bytes written; `cxlkv stat` and /metrics count them, and the pool checks clean.
TEST(CxlkvdTiers, ADaemonRestartedIntoAReCreatedRegionServesItsSsdBlocks) {
  TempRegionPath path("cxlkvdrestore");
  ASSERT_TRUE(CreateTierPool(path.path()).ok());
  const std::string dir = std::filesystem::current_path() / ("tier-restore-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string tiers = "--metrics 127.0.0.1:0 --tier ssd:" + dir + "/kv.tier:48M --tier-slot 260K";
  {
    DaemonProcess d = DaemonProcess::Start(path.path(), 0, tiers);
    ASSERT_GT(d.MetricsPort(), 0) << d.first_line;
    auto codes = RunForked(1, [&](int) { return PutAndReadBack(path.path(), 3, 160); });  // 40 MiB of blocks
    ASSERT_EQ(codes[0], 0);
    ASSERT_GT(SumOf(Scrape(d.MetricsPort()), "cxlkv_tier_spilled_total"), 0);
  }  // killed with -9
  ASSERT_TRUE(CreateTierPool(path.path()).ok());  // the region is lost: a new one, empty
  DaemonProcess d = DaemonProcess::Start(path.path(), 0, tiers);
  const int port = d.MetricsPort();
  ASSERT_GT(port, 0) << d.first_line;
  const std::string metrics = Scrape(port);
  const auto restored = static_cast<int64_t>(SumOf(metrics, "cxlkv_tier_restored_total"));
  EXPECT_GT(restored, 0) << metrics;
  EXPECT_EQ(SumOf(metrics, "cxlkv_tier_restore_skipped_total"), 0) << metrics;
  auto codes = RunForked(1, [&](int) { return PutAndReadBack(path.path(), 3, 160, false, static_cast<int>(restored)); });
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(SumOf(Scrape(port), "cxlkv_tier_device_miss_corrupt_total"), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // the status document is republished
  const Output stat = Sh(Cli() + " stat --path " + path.path());
  EXPECT_NE(stat.out.find("restored " + std::to_string(restored)), std::string::npos) << stat.out;
  const Output check = Sh(Cli() + " check --path " + path.path());
  EXPECT_EQ(check.code, 0) << check.out;
  ::kill(d.pid, SIGTERM);
  EXPECT_EQ(d.Wait(), 0);
  std::filesystem::remove_all(dir);
}

TEST(CxlkvdTiers, AnUnusableDevicePathStopsTheDaemonAtStartNamingTheTier) {
  TempRegionPath path("cxlkvdbadtier");
  MakePool(path.path());
  const Output missing = Sh(DaemonBinary() + " --path " + path.path() + " --node 0 --tier ssd:/nonexistent-dir/kv.tier:1G");
  EXPECT_EQ(missing.code, 1) << missing.out;
  EXPECT_NE(missing.out.find("tier 0 (ssd)"), std::string::npos) << missing.out;
  EXPECT_NE(missing.out.find("create the directory"), std::string::npos) << missing.out;
  const Output malformed = Sh(DaemonBinary() + " --path " + path.path() + " --node 0 --tier ssd:1G");
  EXPECT_EQ(malformed.code, 1) << malformed.out;
  EXPECT_NE(malformed.out.find("expected dram:SIZE"), std::string::npos) << malformed.out;
}

// The line after a daemon's first one that contains `what` (its tier lines follow the first).
std::string NextLineWith(DaemonProcess& d, const std::string& what) {
  char line[1024];
  for (int i = 0; i < 8 && std::fgets(line, sizeof line, d.out); ++i) {
    if (std::string(line).find(what) != std::string::npos) return line;
  }
  return "";
}

// `cxlkv init --tier` records the pool's default tiers; every node's cxlkvd started without
// --tier serves them, "%n" giving each node a file of its own, and --no-tiers opts out. `cxlkv
// stat` shows them and `cxlkv check` passes. Without "%n", two daemons of one host would share
// one file: the second is refused by name. A malformed tier, or tiers on central metadata, fail
// init before anything is created.
TEST(CxlkvdTiers, TheDefaultTiersOfCxlkvInitServeEveryNodeWithAFileOfItsOwn) {
  TempRegionPath path("cxlkvddefaults");
  const std::string dir = std::filesystem::current_path() / ("tier-defaults-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string init_cmd = Cli() + " init --path " + path.path() + " --size 96M --nodes 8 --force --tier-slot 260K";
  const Output init = Sh(init_cmd + " --tier dram:4M --tier ssd:" + dir + "/kv-%n.tier:16M");
  ASSERT_EQ(init.code, 0) << init.out;
  EXPECT_NE(init.out.find("default tiers of every node's cxlkvd: dram:4M, ssd:" + dir + "/kv-%n.tier:16M"),
            std::string::npos) << init.out;
  {
    DaemonProcess d0 = DaemonProcess::Start(path.path(), 0);
    ASSERT_NE(d0.first_line.find("running"), std::string::npos) << d0.first_line;
    EXPECT_NE(NextLineWith(d0, "kv-0.tier").find("the pool's default"), std::string::npos);
    DaemonProcess d1 = DaemonProcess::Start(path.path(), 1);
    ASSERT_NE(d1.first_line.find("running"), std::string::npos) << d1.first_line;
    EXPECT_NE(NextLineWith(d1, "kv-1.tier").find("the pool's default"), std::string::npos);
    DaemonProcess d2 = DaemonProcess::Start(path.path(), 2, "--no-tiers");
    ASSERT_NE(d2.first_line.find("running"), std::string::npos) << d2.first_line;
    EXPECT_TRUE(std::filesystem::exists(dir + "/kv-0.tier"));
    EXPECT_TRUE(std::filesystem::exists(dir + "/kv-1.tier"));
    EXPECT_FALSE(std::filesystem::exists(dir + "/kv-2.tier")) << "--no-tiers still opened the pool's default";
    Output stat;
    for (int i = 0; i < 50; ++i) {  // each daemon publishes its tiers' status document
      stat = Sh(Cli() + " stat --path " + path.path());
      if (stat.out.find("tiers of node 0") != std::string::npos && stat.out.find("tiers of node 1") != std::string::npos) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    EXPECT_NE(stat.out.find("default tiers of every node's cxlkvd (cxlkv init --tier): dram:4M"), std::string::npos)
        << stat.out;
    EXPECT_NE(stat.out.find("tiers of node 1"), std::string::npos) << stat.out;
    EXPECT_EQ(stat.out.find("tiers of node 2"), std::string::npos) << stat.out;
    const Output check = Sh(Cli() + " check --path " + path.path());
    EXPECT_EQ(check.code, 0) << check.out;
    for (DaemonProcess* d : {&d0, &d1, &d2}) {
      ::kill(d->pid, SIGTERM);
      EXPECT_EQ(d->Wait(), 0);
    }
  }
  // One file for every node of a host: the second daemon is refused, naming the file.
  ASSERT_EQ(Sh(init_cmd + " --tier ssd:" + dir + "/shared.tier:16M").code, 0);
  {
    DaemonProcess d0 = DaemonProcess::Start(path.path(), 0);
    ASSERT_NE(d0.first_line.find("running"), std::string::npos) << d0.first_line;
    const Output second = Sh(DaemonBinary() + " --path " + path.path() + " --node 1");
    EXPECT_EQ(second.code, 1) << second.out;
    EXPECT_NE(second.out.find(dir + "/shared.tier is in use by another process"), std::string::npos) << second.out;
    ::kill(d0.pid, SIGTERM);
    EXPECT_EQ(d0.Wait(), 0);
  }
  TempRegionPath other("cxlkvddefaults-bad");
  const Output bad = Sh(Cli() + " init --path " + other.path() + " --size 64M --tier ssd:" + dir + "/x.tier");
  EXPECT_NE(bad.code, 0) << bad.out;
  EXPECT_NE(bad.out.find("no path or no size"), std::string::npos) << bad.out;
  const Output central = Sh(Cli() + " init --path " + other.path() + " --size 64M --metadata central --tier dram:4M");
  EXPECT_NE(central.code, 0) << central.out;
  EXPECT_NE(central.out.find("decentralized metadata"), std::string::npos) << central.out;
  EXPECT_FALSE(std::filesystem::exists(other.path())) << "a refused init created the region";
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace cxlkv
