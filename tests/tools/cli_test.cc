// The `cxlkv` binary as a user runs it: exit codes, one-line errors, JSON that parses.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "test_region.h"

namespace {

using ::cxlkv::testing::Cli;
using ::cxlkv::testing::FiguresByName;
using ::testing::HasSubstr;

TEST(Cli, InitThenInfoJson) {
  cxlkv::testing::TempRegionPath path("cli");
  auto init = Cli("init --path " + path.path() + " --size 32M --nodes 4");
  ASSERT_EQ(init.code, 0) << init.out;
  EXPECT_THAT(init.out, HasSubstr("created"));
  auto info = Cli("info --path " + path.path() + " --json");
  ASSERT_EQ(info.code, 0) << info.out;
  auto j = nlohmann::json::parse(info.stdout_only);
  EXPECT_EQ(j["region_size"].get<uint64_t>(), uint64_t{32} << 20);
  EXPECT_EQ(j["max_nodes"].get<int>(), 4);
  EXPECT_EQ(j["layout_version"].get<uint32_t>(), cxlkv::kLayoutVersion);
  EXPECT_EQ(j["backend"].get<std::string>(), "shm-file");
  EXPECT_FALSE(j["areas"].empty());
  auto text = Cli("info --path " + path.path());
  EXPECT_EQ(text.code, 0);
  EXPECT_THAT(text.out, HasSubstr("region id"));
}

TEST(Cli, ErrorsAreOneLineAndNonZero) {
  cxlkv::testing::TempRegionPath path("clierr");
  auto missing = Cli("info --path " + path.path());
  EXPECT_NE(missing.code, 0);
  EXPECT_THAT(missing.out, HasSubstr("cxlkv init"));
  EXPECT_EQ(std::count(missing.out.begin(), missing.out.end(), '\n'), 1) << missing.out;

  auto bad_size = Cli("init --path " + path.path() + " --size twelve");
  EXPECT_NE(bad_size.code, 0);
  EXPECT_EQ(std::count(bad_size.out.begin(), bad_size.out.end(), '\n'), 1) << bad_size.out;

  auto no_size = Cli("init --path " + path.path());
  EXPECT_NE(no_size.code, 0);
  EXPECT_THAT(no_size.out, HasSubstr("--size"));

  auto unknown = Cli("frobnicate");
  EXPECT_EQ(unknown.code, 2);

  ASSERT_EQ(Cli("init --path " + path.path() + " --size 16M").code, 0);
  auto twice = Cli("init --path " + path.path() + " --size 16M");
  EXPECT_NE(twice.code, 0);
  EXPECT_THAT(twice.out, HasSubstr("--force"));
  EXPECT_EQ(Cli("init --path " + path.path() + " --size 16M --force").code, 0);
}

TEST(Cli, BenchRegionQuickProducesRatios) {
  auto r = Cli("bench region --json --quick");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.stdout_only);
  EXPECT_EQ(j["suite"], "region");
  int with_ratio = 0;
  for (const auto& fig : j["results"]) {
    EXPECT_GT(fig["median"].get<double>(), 0) << fig.dump();
    if (!fig["reference"].get<std::string>().empty()) {
      EXPECT_GT(fig["ratio"].get<double>(), 0) << fig.dump();
      ++with_ratio;
    }
  }
  EXPECT_GE(with_ratio, 5);
  auto unknown = Cli("bench nosuch");
  EXPECT_NE(unknown.code, 0);
  EXPECT_THAT(unknown.out, HasSubstr("known suites"));
}

TEST(Cli, PutGetEvictStatCheck) {
  cxlkv::testing::TempRegionPath path("cli-cache");
  const std::string p = " --path " + path.path();
  ASSERT_EQ(Cli("init" + p + " --size 64M --nodes 4").code, 0);
  std::string data = "/tmp/cxlkv-cli-data-" + std::to_string(::getpid());
  std::string out = data + ".out";
  {
    FILE* f = std::fopen(data.c_str(), "wb");
    for (int i = 0; i < 300000; ++i) std::fputc((i * 131) & 0xff, f);
    std::fclose(f);
  }
  auto put = Cli("put" + p + " --node 1 --key doc-1 --data " + data);
  ASSERT_EQ(put.code, 0) << put.out;
  auto get = Cli("get" + p + " --node 2 --key doc-1 --out " + out);
  ASSERT_EQ(get.code, 0) << get.out;
  EXPECT_EQ(std::system(("cmp -s " + data + " " + out).c_str()), 0) << "bytes differ";
  auto missing = Cli("get" + p + " --key nope --out " + out);
  EXPECT_EQ(missing.code, 2) << missing.out;
  EXPECT_THAT(missing.out, HasSubstr("not cached"));
  auto again = Cli("put" + p + " --key doc-1 --data " + data);
  EXPECT_EQ(again.code, 1);
  EXPECT_THAT(again.out, HasSubstr("already cached"));
  auto huge = Cli("put" + p + " --key big --data /dev/null");
  EXPECT_NE(huge.code, 0);
  EXPECT_THAT(huge.out, HasSubstr("empty"));
  auto no_file = Cli("put" + p + " --key x --data /nonexistent/file");
  EXPECT_THAT(no_file.out, HasSubstr("cannot open data file"));
  auto stat = Cli("stat" + p + " --json --watch-ms 50");
  ASSERT_EQ(stat.code, 0) << stat.out;
  auto j = nlohmann::json::parse(stat.stdout_only);
  EXPECT_EQ(j["cache"]["states"]["ready"].get<int>(), 1);
  EXPECT_EQ(j["cache"]["totals"]["lookups"].get<int>(), 2);
  EXPECT_EQ(j["cache"]["totals"]["hit_blocks"].get<int>(), 1);
  EXPECT_EQ(j["cache"]["per_node"]["1"]["inserts"].get<int>(), 1);
  auto text = Cli("stat" + p + " --watch-ms 50");
  EXPECT_THAT(text.out, HasSubstr("1 of 2 blocks hit (50.0%)"));
  auto check = Cli("check" + p + " --watch-ms 50");
  EXPECT_EQ(check.code, 0) << check.out;
  auto neither = Cli("evict" + p);
  EXPECT_NE(neither.code, 0);
  EXPECT_THAT(neither.out, HasSubstr("--key STRING or --all"));
  EXPECT_EQ(Cli("evict" + p + " --key doc-1").code, 0);
  EXPECT_EQ(Cli("get" + p + " --key doc-1 --out " + out).code, 2);
  EXPECT_EQ(Cli("evict" + p + " --all").code, 0);
  EXPECT_EQ(Cli("check" + p + " --watch-ms 50").code, 0);
  ::unlink(data.c_str());
  ::unlink(out.c_str());
}

TEST(Cli, BenchCacheQuickReportsRatiosAndThePeer) {
  auto r = Cli("bench cache --json --quick");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.stdout_only);
  EXPECT_EQ(j["suite"], "cache");
  std::set<std::string> names;
  for (const auto& fig : j["results"]) {
    names.insert(fig["name"].get<std::string>());
    EXPECT_GT(fig["median"].get<double>(), 0) << fig.dump();
  }
  for (const char* want : {"lookup/chain1", "lookup/chain16", "lookup/chain256", "put/2MiB", "get/2MiB"}) {
    EXPECT_TRUE(names.count(want)) << want;
  }
  // The peer runs where redis-server is installed (scripts/setup installs it).
  if (!j.contains("peer_skipped")) {
    EXPECT_TRUE(names.count("get_vs_redis/2MiB"));
  }
}

// The racks suite: cross-rack fetches of 2 MiB blocks over the rack link, next to ucx_perftest
// on the same transport (scripts/setup installs ucx-utils), and directory lookups next to etcd
// range requests; every fetch moved its blocks.
TEST(Cli, BenchRacksQuickReportsFetchesNextToUcxPerftest) {
  auto r = Cli("bench racks --json --quick");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.stdout_only);
  EXPECT_EQ(j["suite"], "racks");
  std::set<std::string> names;
  for (const auto& fig : j["results"]) {
    names.insert(fig["name"].get<std::string>());
    if (fig["name"] != "ucx_perftest_am_bw/2MiB" || !j.contains("reference_skipped")) {
      EXPECT_GT(fig["median"].get<double>(), 0) << fig.dump();
    }
  }
  EXPECT_TRUE(names.count("fetch/2MiB/batch16"));
  EXPECT_TRUE(names.count("fetch/2MiB/batch1"));
  EXPECT_TRUE(names.count("directory_lookup/16"));
  EXPECT_FALSE(j.contains("reference_skipped")) << j["reference_skipped"];
  EXPECT_FALSE(j.contains("etcd_skipped")) << j["etcd_skipped"];  // scripts/setup installs etcd-server
  // Warm-up plus two repetitions of one 16-block fetch and sixteen 1-block fetches.
  EXPECT_EQ(j["holder"]["blocks_sent"].get<uint64_t>(), 16u + 2 * (16u + 16u));
  EXPECT_EQ(j["holder"]["send_failures"].get<uint64_t>(), 0u);
}

// The capacity suite: KV bytes held next to the data area they could fill, for each size
// run and the mix; what is held never exceeds the data area, and something is held.
TEST(Cli, BenchCapacityQuickReportsKvHeldNextToTheDataArea) {
  auto r = Cli("bench capacity --json --quick");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.stdout_only);
  EXPECT_EQ(j["suite"], "capacity");
  std::set<std::string> held;
  for (const auto& fig : j["results"]) {
    const std::string name = fig["name"].get<std::string>();
    if (name.rfind("high_watermark/", 0) == 0) {
      EXPECT_GT(fig["median"].get<double>(), 0.0) << fig.dump();
    }
    if (name.rfind("kv_held/", 0) != 0) continue;
    held.insert(name);
    EXPECT_EQ(fig["reference"].get<std::string>(), "data_area/" + name.substr(8));
    EXPECT_GT(fig["ratio"].get<double>(), 0.0) << fig.dump();
    EXPECT_LE(fig["ratio"].get<double>(), 1.0) << fig.dump();
  }
  for (const char* want : {"kv_held/20KiB", "kv_held/qwen2.5-7b_0.875MiB", "kv_held/qwen3-8b_2.25MiB",
                           "kv_held/mix_qwen2.5-7b+llama-3.2-3b+qwen3-8b"}) {
    EXPECT_TRUE(held.count(want)) << want;
  }
}

// The trace suite: a small trace of conversations that come back with their prefixes (written
// here in the Mooncake format) is replayed at both block shapes; the pool's hit rate sits next
// to the exact-size LRU's and never beats it by more than rounding. A missing or malformed
// trace is refused with what to pass.
TEST(Cli, BenchTraceReplaysATraceNextToAnExactLruSimulation) {
  cxlkv::testing::TempRegionPath trace("cli-trace");
  {
    std::ofstream out(trace.path());
    // Four conversations at a time, three turns each, interleaved: turn t of a conversation
    // sends the shared system prompt (block 0), its earlier turns' blocks and three new ones.
    for (int i = 0; i < 240; ++i) {
      const int conversation = i / 12 * 4 + i % 4, turn = i % 12 / 4;
      out << "{\"timestamp\": " << i << ", \"hash_ids\": [0";
      for (int k = 0; k < 3 * (turn + 1); ++k) out << ", " << 1 + conversation * 100 + k;
      out << "]}\n";
    }
  }
  auto r = Cli("bench trace --json --quick --trace " + trace.path());
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.stdout_only);
  EXPECT_EQ(j["suite"], "trace");
  EXPECT_EQ(j["requests"].get<uint64_t>(), 240u);
  std::set<std::string> names;
  for (const auto& fig : j["results"]) {
    const std::string name = fig["name"].get<std::string>();
    names.insert(name);
    if (name.rfind("hit_rate/", 0) != 0) continue;
    EXPECT_GT(fig["median"].get<double>(), 0.05) << fig.dump();  // the turns come back: hits
    EXPECT_GT(fig["ratio"].get<double>(), 0.5) << fig.dump();
    EXPECT_LE(fig["ratio"].get<double>(), 1.01) << fig.dump();
  }
  EXPECT_TRUE(names.count("hit_rate/llama-3.1-8b_2MiB"));
  EXPECT_TRUE(names.count("hit_rate/qwen2.5-7b_0.875MiB"));
  auto none = Cli("bench trace --quick");
  EXPECT_NE(none.code, 0);
  EXPECT_THAT(none.out, ::testing::HasSubstr("--trace FILE"));
  {
    std::ofstream bad(trace.path());
    bad << "{\"hash_ids\": [1, 2]}\nnot json\n";
  }
  auto malformed = Cli("bench trace --quick --trace " + trace.path());
  EXPECT_NE(malformed.code, 0);
  EXPECT_THAT(malformed.out, ::testing::HasSubstr("line 2"));
}

TEST(Cli, BenchRpcQuickReportsTheRoundTripNextToItsLimits) {
  auto r = Cli("bench rpc --json --quick");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.stdout_only);
  EXPECT_EQ(j["suite"], "rpc");
  std::set<std::string> names;
  for (const auto& fig : j["results"]) {
    names.insert(fig["name"].get<std::string>());
    EXPECT_GT(fig["median"].get<double>(), 0) << fig.dump();
  }
  for (const char* want : {"line_pingpong/2proc", "rpc_64B_qd1", "tcp_loopback_64B_qd1", "rpc_vs_tcp_latency",
                           "rpc_64B_qd128"}) {
    EXPECT_TRUE(names.count(want)) << want;
  }
  // The machine block carries the two limits, measured in the same run.
  EXPECT_GT(j["machine"]["line_pingpong_ns"].get<double>(), 0) << j["machine"].dump();
  EXPECT_GT(j["machine"]["nt_copy_gbps"].get<double>(), 0) << j["machine"].dump();
  // A figure with a goal carries it and its verdict as data; one without has nulls.
  auto by_name = FiguresByName(j);
  EXPECT_EQ(by_name["rpc_64B_qd1"]["goal"], nlohmann::json({{"ratio_max", 2.0}}));
  EXPECT_TRUE(by_name["rpc_64B_qd1"]["met"].is_boolean()) << by_name["rpc_64B_qd1"].dump();
  EXPECT_EQ(by_name["rpc_64B_qd128"]["goal"], nlohmann::json({{"median_min", 4.0}}));
  EXPECT_TRUE(by_name["rpc_64B_qd128"]["met"].is_boolean());
  EXPECT_TRUE(by_name["tcp_loopback_64B_qd1"]["goal"].is_null());
  EXPECT_TRUE(by_name["tcp_loopback_64B_qd1"]["met"].is_null());
}

TEST(Cli, BenchTierQuickReportsTheSsdTierNextToFio) {
  auto r = Cli("bench tier --json --quick");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.stdout_only);
  EXPECT_EQ(j["suite"], "tier");
  auto by_name = FiguresByName(j);
  for (const char* want : {"ssd_write/256KiB/qd1", "ssd_read/256KiB/qd32", "ssd_read/2MiB/qd32",
                           "vs_file_per_object/read/256KiB", "crc_cost/ssd_read/256KiB", "combined/256KiB"}) {
    ASSERT_TRUE(by_name.count(want)) << want;
    EXPECT_GT(by_name[want]["median"].get<double>(), 0) << want;
  }
  // fio is installed by scripts/setup: the SSD figures stand next to it, with a ratio.
  if (j["fio"].get<std::string>().rfind("fio (", 0) == 0) {
    EXPECT_EQ(by_name["ssd_read/256KiB/qd32"]["reference"], "fio_read/256KiB/qd32");
    EXPECT_GT(by_name["ssd_read/256KiB/qd32"]["ratio"].get<double>(), 0);
  }
  EXPECT_TRUE(by_name.count("tier_file_cached")) << "the page-cache figure is missing";
}

TEST(Cli, DemoComparesFourConfigurationsWithIdenticalTokens) {
  cxlkv::testing::TempRegionPath path("cli-demo");
  const std::string out = path.path() + "-out";
  const std::string tier_dir = path.path() + "-tiers";
  std::filesystem::create_directories(tier_dir);
#if defined(CXLKV_TSAN)
  // The long-context attention scenario is `cxlkv longctx`'s, which the LongContext tests run
  // under ThreadSanitizer too; in the demo it is 32K tokens of numeric kernels, which the TSan
  // preset leaves out for the same reason as the kernels' own tests.
  constexpr bool long_attention = false;
#else
  constexpr bool long_attention = true;
#endif
  auto r = Cli("demo --quick --path " + path.path() + " --size 64M --long-size 16M --tier-dir " + tier_dir +
               " --out " + out + (long_attention ? "" : " --no-long-attention"));
  ASSERT_EQ(r.code, 0) << r.out;
  // Four KV configurations; the shared pool runs in both metadata modes (five runs in all).
  EXPECT_THAT(r.out, HasSubstr("identical across all 5 configurations, request by request: yes"));
  EXPECT_THAT(r.out, HasSubstr("(d) cxlkv shared pool"));
  EXPECT_THAT(r.out, HasSubstr("(e) cxlkv pool, central metadata"));
  EXPECT_THAT(r.out, HasSubstr("central metadata vs decentralized"));
  std::ifstream f(out + "/e2e.json");
  ASSERT_TRUE(f.good());
  auto j = nlohmann::json::parse(f);
  EXPECT_TRUE(j["tokens_identical"].get<bool>());
  ASSERT_EQ(j["configurations"].size(), 5u);
  EXPECT_EQ(j["configurations"][3]["metadata"], "decentralized");
  EXPECT_EQ(j["configurations"][4]["metadata"], "central");
  // Cache-hit TTFT: over the second pass's requests, below the mean where the pool hits.
  EXPECT_GT(j["configurations"][3]["ttft_seen_ms"]["requests"].get<size_t>(), 0u);
  EXPECT_GT(j["configurations"][4]["second_half_hit_rate"].get<double>(), 0.5);
  // The shared pool hits the documents of the second pass; no reuse hits nothing.
  EXPECT_EQ(j["configurations"][0]["hit_rate"].get<double>(), 0.0);
  // (Requests of the second pass that overlap the first pass's writes of their document miss.)
  EXPECT_GT(j["configurations"][3]["second_half_hit_rate"].get<double>(), 0.5);
  EXPECT_GE(j["configurations"][3]["second_half_hit_rate"].get<double>(),
            j["configurations"][1]["second_half_hit_rate"].get<double>());

  // The long-context scenario: its KV outgrows the region. Without tiers the second pass loses
  // what LRU evicted; with them the region spilled to node DRAM and SSD and promoted it back.
  EXPECT_THAT(r.out, HasSubstr("(f) cxlkv pool + DRAM/SSD tiers"));
  EXPECT_THAT(r.out, HasSubstr("generated tokens identical with and without tiers, request by request: yes"));
  const auto& lc = j["long_context"];
  ASSERT_EQ(lc["configurations"].size(), 2u) << lc.dump();
  EXPECT_GT(lc["kv_working_set_bytes"].get<uint64_t>(), lc["region_bytes"].get<uint64_t>() / 2);
  const auto& plain = lc["configurations"][0];
  const auto& tiered = lc["configurations"][1];
  EXPECT_FALSE(plain["tiered"].get<bool>());
  EXPECT_TRUE(tiered["tiered"].get<bool>());
  EXPECT_GT(tiered["tiers"]["spilled"].get<uint64_t>(), 0u);
  EXPECT_GT(tiered["tiers"]["promoted"].get<uint64_t>(), 0u);
  EXPECT_GT(tiered["hit_rate_by_tier"]["dram"].get<double>() + tiered["hit_rate_by_tier"]["ssd"].get<double>(), 0);
  EXPECT_EQ(plain["hit_rate_by_tier"]["dram"].get<double>() + plain["hit_rate_by_tier"]["ssd"].get<double>(), 0);
  // One request at a time over more KV than the region holds is LRU's worst case, the same on
  // every run: the pool alone keeps few of the first pass's documents; with tiers eviction is a
  // spill and the second pass hits all but each question's own blocks (97%).
  EXPECT_GE(tiered["second_half_hit_rate"].get<double>(), 0.9) << "tiered " << tiered.dump();
  EXPECT_GT(tiered["second_half_hit_rate"].get<double>(), plain["second_half_hit_rate"].get<double>() + 0.3)
      << "tiered " << tiered.dump() << "\nplain " << plain.dump();
  EXPECT_TRUE(lc["tokens_identical"].get<bool>());
  // Last, the long-context attention scenario: dense, then sparse and hybrid per budget, in the
  // engine's process and through a near-memory service over a pool (whose region is removed).
  if (long_attention) {
    EXPECT_THAT(r.out, HasSubstr("dense vs near-memory sparse vs hybrid attention"));
    // A /dev/shm without room for the pool skips the remote rows with a note (LongContextRemote).
    const auto& la = j["long_attention"];
    if (la["notes"].empty()) {
      ASSERT_EQ(la["rows"].size(), 11u) << la.dump();
      EXPECT_EQ(la["rows"][6]["mode"], "remote-dense");
      EXPECT_EQ(la["rows"][6]["tokens_agree"], la["rows"][6]["steps"]);
    } else {
      ASSERT_EQ(la["rows"].size(), 6u) << la.dump();
      EXPECT_NE(la["notes"][0].get<std::string>().find("no remote rows"), std::string::npos) << la.dump();
    }
  } else {
    EXPECT_FALSE(j.contains("long_attention"));
  }
  EXPECT_FALSE(std::filesystem::exists(path.path() + "-longctx"));
  // The SSD tier's file and catalog were removed with the region.
  EXPECT_TRUE(std::filesystem::is_empty(tier_dir));
  std::filesystem::remove_all(tier_dir);
  std::filesystem::remove_all(out);
}

// A doc-QA workload served by 2 prefill + 1 decode processes; returns the parsed JSON.
nlohmann::json ServeDocQa(const std::string& region, const std::string& extra, int* code = nullptr, int documents = 5) {
  auto r = Cli("serve --path " + region + " --size 128M --prefill 2 --decode 1 --documents " +
               std::to_string(documents) + " --doc-tokens 4096"
               " --answer-tokens 48 --json " + extra);
  if (code) *code = r.code;
  if (r.code != 0) {
    ADD_FAILURE() << r.out;
    return {};
  }
  return nlohmann::json::parse(r.stdout_only);
}

// The same serving run on a pool with central metadata: the workers' index operations go to
// the metadata service (hosted by a worker: no daemon here), the second pass still hits.
TEST(Cli, ServeOnACentralMetadataPoolHitsTheSecondPass) {
  cxlkv::testing::TempRegionPath path("cli-serve-central");
  auto j = ServeDocQa(path.path(), "--concurrency 1 --metadata central");
  ASSERT_TRUE(j.contains("pass_hit_rates"));
  ASSERT_EQ(j["pass_hit_rates"].size(), 2u);
  EXPECT_GE(j["pass_hit_rates"][1].get<double>(), 0.90);
  auto info = Cli("info --path " + path.path() + " --json");
  ASSERT_EQ(info.code, 0) << info.out;
  EXPECT_EQ(nlohmann::json::parse(info.stdout_only)["metadata"], "central");
}

TEST(Cli, ServeSecondPassOfRepeatedDocumentsHits) {
  cxlkv::testing::TempRegionPath path("cli-serve");
  auto j = ServeDocQa(path.path(), "--concurrency 1");
  ASSERT_TRUE(j.contains("pass_hit_rates"));
  ASSERT_EQ(j["pass_hit_rates"].size(), 2u);
  EXPECT_EQ(j["pass_hit_rates"][0].get<double>(), 0.0);
  EXPECT_GE(j["pass_hit_rates"][1].get<double>(), 0.90);
  for (const auto& q : j["requests"]) EXPECT_EQ(q["tokens"].size(), 6u);  // 48 / scale 8
  EXPECT_EQ(Cli("check --path " + path.path() + " --watch-ms 50").code, 0);
}

// A working set beyond a 16 MiB region with tiers behind it, served twice: hits on capacity
// tiers promoted (the default), then streamed straight into the engines (--capacity-read
// stream), which promotes nothing. Both generate the same tokens and hit the second pass.
TEST(Cli, ServeStreamsCapacityHitsIntoTheEngineWithoutPromoting) {
  nlohmann::json runs[2];
  const char* modes[2] = {"promote", "stream"};
  for (int m = 0; m < 2; ++m) {
    cxlkv::testing::TempRegionPath path(std::string("cli-serve-") + modes[m]);
    const std::string ssd = path.path() + ".tier";
    auto r = Cli("serve --path " + path.path() + " --size 16M --documents 6 --doc-tokens 8192 --scale 8 "
                 "--answer-tokens 32 --concurrency 2 --json --tier dram:4M --tier ssd:" + ssd + ":64M --capacity-read " +
                 modes[m]);
    ASSERT_EQ(r.code, 0) << r.out;
    runs[m] = nlohmann::json::parse(r.stdout_only);
    for (const std::string& f : {ssd, ssd + ".catalog", ssd + ".catalog.1", ssd + ".log", ssd + ".namespaces"}) {
      ::unlink(f.c_str());
    }
    EXPECT_GT(runs[m]["tiers"]["spilled"].get<uint64_t>(), 0u) << modes[m];
    // 0.97 on an idle machine. The bar is what the tiers must deliver, not a timing: the region
    // alone serves about a sixth of the second pass (hit_rate_by_tier), so 0.5 needs the tiers'
    // hits, while a load that makes reserves drop blocks for a while (0.81 seen once under
    // ctest -j2) does not fail it.
    EXPECT_GE(runs[m]["pass_hit_rates"][1].get<double>(), 0.5) << modes[m];
    EXPECT_GT(runs[m]["hit_rate_by_tier"]["dram"].get<double>() + runs[m]["hit_rate_by_tier"]["ssd"].get<double>(), 0)
        << modes[m];
  }
  EXPECT_GT(runs[0]["tiers"]["promoted"].get<uint64_t>(), 0u);
  EXPECT_EQ(runs[1]["tiers"]["promoted"].get<uint64_t>(), 0u);
  EXPECT_GT(runs[1]["tiers"]["read_out"].get<uint64_t>(), 0u);
  ASSERT_EQ(runs[0]["requests"].size(), runs[1]["requests"].size());
  for (size_t i = 0; i < runs[0]["requests"].size(); ++i) {
    EXPECT_EQ(runs[0]["requests"][i]["tokens"], runs[1]["requests"][i]["tokens"]) << "request " << i;
  }
  EXPECT_NE(Cli("serve --path /dev/shm/x --capacity-read sometimes").code, 0);
}

TEST(Cli, ServeSurvivesKillNineOfAPrefillWorker) {
  cxlkv::testing::TempRegionPath clean("cli-serve-clean"), path("cli-serve-kill");
  auto reference = ServeDocQa(clean.path(), "--concurrency 2");
  auto j = ServeDocQa(path.path(), "--concurrency 2 --lease-ms 500 --kill-prefill-after 3");
  ASSERT_TRUE(j.contains("requests") && reference.contains("requests"));
  EXPECT_EQ(j["workers_killed"].get<int>(), 1);
  ASSERT_EQ(j["requests"].size(), reference["requests"].size());
  int after_kill_on_survivor = 0;
  for (size_t i = 0; i < j["requests"].size(); ++i) {
    // Every request completed, with the tokens of the run nobody killed.
    EXPECT_EQ(j["requests"][i]["tokens"], reference["requests"][i]["tokens"]) << i;
    after_kill_on_survivor += j["requests"][i]["prefill_worker"].get<int>() == 1;
  }
  EXPECT_GT(after_kill_on_survivor, 0);
  auto check = Cli("check --path " + path.path() + " --watch-ms 50");
  EXPECT_EQ(check.code, 0) << check.out;
}

TEST(Cli, ServeOpenLoopTraceShapedWorkloadWithPrefixAffinity) {
  cxlkv::testing::TempRegionPath path("cli-serve-open");
  auto r = Cli("serve --path " + path.path() + " --size 128M --workload tract --requests 12 --scale 16"
               " --qps 40 --policy prefix-affinity --json");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.stdout_only);
  EXPECT_EQ(j["policy"], "prefix-affinity");
  ASSERT_EQ(j["requests"].size(), 12u);
  for (const auto& q : j["requests"]) EXPECT_GE(q["tokens"].size(), 1u);
  // Table 1's requests share a few system prefixes: later ones reuse earlier ones' blocks.
  EXPECT_GT(j["hit_rate"].get<double>(), 0.0);
  EXPECT_EQ(Cli("check --path " + path.path() + " --watch-ms 50").code, 0);
}

// Decode workers attending through near-memory sparse attention (and the hybrid): with a budget
// that covers every document the tokens are dense decoding's; with a small one they still come
// out, one per step; a mode that does not exist is refused before anything starts.
TEST(Cli, ServeDecodesWithSparseAndHybridAttention) {
  std::vector<std::vector<nlohmann::json>> tokens;
  std::vector<double> share;
  for (const std::string extra : {"", "--attention sparse --attention-budget 4096",
                                  "--attention hybrid --attention-budget 64"}) {
    cxlkv::testing::TempRegionPath path("cli-serve-sparse");
    auto j = ServeDocQa(path.path(), "--concurrency 1 " + extra, nullptr, 2);
    ASSERT_TRUE(j.contains("requests")) << extra;
    share.push_back(j["attention"]["selected_page_share"].get<double>());
    if (!extra.empty()) {
      EXPECT_GT(j["attention"]["layer_steps"].get<uint64_t>(), 0u) << extra;
    }
    tokens.emplace_back();
    for (const auto& q : j["requests"]) {
      EXPECT_EQ(q["tokens"].size(), 6u) << extra;
      tokens.back().push_back(q["tokens"]);
    }
  }
  EXPECT_EQ(tokens[0], tokens[1]) << "a budget covering the context must decode as dense does";
  EXPECT_EQ(share[1], 1.0);
  EXPECT_LT(share[2], 0.5) << "64 tokens of a 512-token document";
  auto bad = Cli("serve --path /dev/shm/x --attention fast");
  EXPECT_NE(bad.code, 0);
  EXPECT_THAT(bad.out, HasSubstr("dense, sparse, hybrid"));
}

// Remote attention: the decode worker leaves the prompt's blocks in the pool and the router's
// node attends them next to the memory. A budget covering the documents decodes as dense does,
// with none of the prompt loaded into the decode engine; a KV mode without the pool is refused.
TEST(Cli, ServeDecodesWithThePromptAttendedNextToTheMemory) {
  std::vector<nlohmann::json> runs;
  for (const std::string extra : {"", "--attention remote --attention-budget 8192",
                                  "--attention remote --attention-budget 64",
                                  "--attention remote-hybrid --attention-budget 64"}) {
    cxlkv::testing::TempRegionPath path("cli-serve-remote");
    runs.push_back(ServeDocQa(path.path(), "--concurrency 1 " + extra, nullptr, 2));
    ASSERT_TRUE(runs.back().contains("requests")) << extra;
  }
  const auto tokens_of = [](const nlohmann::json& j) {
    std::vector<nlohmann::json> t;
    for (const auto& q : j["requests"]) t.push_back(q["tokens"]);
    return t;
  };
  EXPECT_EQ(tokens_of(runs[0]), tokens_of(runs[1])) << "a budget covering the context must decode as dense does";
  const auto& dense = runs[0]["attention"];
  const auto& covering = runs[1]["attention"];
  const auto& sparse = runs[2]["attention"];
  EXPECT_GT(covering["remote_prompt_tokens"].get<uint64_t>(), 0u);
  EXPECT_EQ(covering["remote_fallbacks"].get<uint32_t>(), 0u);
  EXPECT_EQ(covering["selected_page_share"].get<double>(), 1.0);
  // The decode engine loaded at most the prompts' partial blocks, dense loaded every block.
  EXPECT_LT(covering["decode_bytes_loaded"].get<uint64_t>() * 8, dense["decode_bytes_loaded"].get<uint64_t>());
  // Per layer step a few KiB crossed; the daemon read the KV.
  EXPECT_LT(covering["link_bytes_per_layer_step"].get<double>(), 8192);
  EXPECT_GT(covering["kv_bytes_per_layer_step"].get<double>(), 16 * covering["link_bytes_per_layer_step"].get<double>());
  EXPECT_LT(sparse["selected_page_share"].get<double>(), 0.5) << "64 tokens of each prompt at the daemon";
  // The hybrid against the daemon: the same selections, its held pages attended in the engine.
  const auto& hybrid = runs[3]["attention"];
  EXPECT_EQ(tokens_of(runs[3]), tokens_of(runs[2])) << "the remote hybrid must decode as remote sparse does";
  EXPECT_EQ(hybrid["selected_page_share"], sparse["selected_page_share"]);
  EXPECT_EQ(hybrid["remote_fallbacks"].get<uint32_t>(), 0u);
  cxlkv::testing::TempRegionPath path("cli-serve-remote-tcp");
  auto bad = Cli("serve --path " + path.path() + " --attention remote --mode tcp");
  EXPECT_NE(bad.code, 0);
  EXPECT_THAT(bad.out, HasSubstr("--mode pool"));
}

TEST(Cli, ServeRejectsBadInputClearly) {
  cxlkv::testing::TempRegionPath path("cli-serve-bad");
  auto zero = Cli("serve --path " + path.path() + " --size 64M --prefill 0");
  EXPECT_NE(zero.code, 0);
  EXPECT_THAT(zero.out, HasSubstr("at least one prefill and one decode worker"));
  const std::string trace = path.path() + ".jsonl";
  std::ofstream(trace) << "{\"prompt\": [1, 2, 3], \"max_new_tokens\": 2}\n{\"prompt\": [1, 2,\n";
  auto bad_trace = Cli("serve --path " + path.path() + " --size 64M --trace " + trace);
  EXPECT_NE(bad_trace.code, 0);
  EXPECT_THAT(bad_trace.out, HasSubstr("line 2"));
  // The region holds tiny-llama's KV in the default layout; a config of the same name with
  // other KV heads must be refused, not mixed in.
  int code = 0;
  ServeDocQa(path.path(), "--concurrency 1", &code, 1);
  ASSERT_EQ(code, 0);
  const std::string config = path.path() + ".json";
  std::ofstream(config) << "{\"name\": \"tiny-llama\", \"num_kv_heads\": 4}";
  auto mismatch = Cli("serve --path " + path.path() + " --model-config " + config + " --documents 1");
  EXPECT_NE(mismatch.code, 0);
  EXPECT_THAT(mismatch.out, HasSubstr("version-mismatch"));
  std::filesystem::remove(trace);
  std::filesystem::remove(config);
}

// The near-memory attention suite: every figure positive and named next to the reference it was
// measured against in the same run. Beyond that only what does not depend on the machine's
// speed: the link carries the query and outputs, far less than recalling the selected pages, and
// steady-token selection recalls less than ArkVale-style replacement on the drifting trace.
TEST(Cli, BenchPnmQuickReportsEachFigureNextToItsReference) {
#if defined(CXLKV_TSAN)
  // Its 1 GiB arena takes about 7 GB under ThreadSanitizer's shadow, beside whatever test runs in
  // parallel; the suite's threads (AttendPool) are covered by pnm_test there.
  GTEST_SKIP() << "the bench's arena is too large for ThreadSanitizer's shadow beside a parallel test";
#endif
  auto r = Cli("bench pnm --quick --json");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.stdout_only);
  EXPECT_EQ(j["suite"], "pnm");
  auto by_name = FiguresByName(j);
  for (const auto& f : j["results"]) EXPECT_GT(f["median"].get<double>(), 0) << f.dump();
  const std::map<std::string, std::string> reference = {
      {"attend_bw/32K", "memory_read_bw"},
      {"speedup/128K/1_32", "byte_limit/128K/1_32"},
      {"score_bw/128K/1_32", "memory_read_bw"},
      {"speedup/128K/1_32/head_major", "byte_limit/128K/1_32/head_major"},
      {"page_read_bw/128K", "memory_read_bw"},
      {"sparse_attend_bw/128K/1_32/head_major", "page_read_bw/128K"},
      {"attend_bw_2engines/32K", "attend_bw_1engine/32K"},
      {"link_KiB/128K/1_32", "recall_KiB/128K/1_32"},
      {"recall_KiB_per_step/steady/32K", "recall_KiB_per_step/arkvale/32K"}};
  for (const auto& [name, ref] : reference) {
    ASSERT_TRUE(by_name.count(name)) << name << " is missing";
    EXPECT_EQ(by_name[name]["reference"], ref) << name;
    EXPECT_GT(by_name[name]["ratio"].get<double>(), 0) << name;
  }
  EXPECT_LT(by_name["link_KiB/128K/1_32"]["ratio"].get<double>(), 0.01);
  EXPECT_LT(by_name["recall_KiB_per_step/steady/32K"]["ratio"].get<double>(), 1.0);
}

TEST(Cli, BenchE2eQuickComparesThePoolWithEachBaseline) {
  auto r = Cli("bench e2e --json --quick");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.stdout_only);
  std::set<std::string> names;
  for (const auto& fig : j["results"]) names.insert(fig["name"].get<std::string>());
  for (const char* want : {"ttft_mean/pool_vs_recompute", "ttft_mean/pool_vs_private", "ttft_mean/pool_vs_tcp"}) {
    EXPECT_TRUE(names.count(want)) << want;
  }
  EXPECT_TRUE(j["comparison"]["tokens_identical"].get<bool>());
}

TEST(Cli, BenchTransferQuickReportsBothShapes) {
  auto r = Cli("bench transfer --json --quick");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.stdout_only);
  std::set<std::string> names;
  for (const auto& fig : j["results"]) {
    names.insert(fig["name"].get<std::string>());
    EXPECT_GT(fig["median"].get<double>(), 0) << fig.dump();
  }
  for (const char* want : {"gather_write/llama8b", "scatter_read/llama8b", "gather_write/qwen32b",
                           "scatter_read/qwen32b", "gather_vs_naive/qwen32b"}) {
    EXPECT_TRUE(names.count(want)) << want;
  }
}

}  // namespace
