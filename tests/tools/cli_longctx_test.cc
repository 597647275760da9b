// `cxlkv longctx` and `cxlkv bench longctx` as a user runs them: the long-context decode
// scenario in the engine's process and through a near-memory service over a pool.
#include <filesystem>
#include <map>
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

// The long-context decode scenario at a small size: a row per mode and budget, each with its
// step time, bytes and agreement; bad lists are refused with the option's name.
TEST(Cli, LongContextComparesDenseSparseAndHybrid) {
  auto r = Cli("longctx --contexts 4K --budgets 4,16 --steps 2 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.stdout_only);
  ASSERT_EQ(j["rows"].size(), 6u);  // dense, dense-nm, then sparse and hybrid per budget
  EXPECT_EQ(j["rows"][0]["mode"], "dense");
  EXPECT_EQ(j["rows"][1]["mode"], "dense-nm");
  EXPECT_EQ(j["rows"][1]["tokens_agree"].get<uint32_t>(), 2u) << "every page selected must decode as dense does";
  EXPECT_LT(j["rows"][1]["logits_rel_err_max"].get<double>(), 1e-4);
  for (size_t i = 2; i < 6; ++i) {
    const auto& row = j["rows"][i];
    EXPECT_EQ(row["mode"], i % 2 ? "hybrid" : "sparse");
    EXPECT_EQ(row["budget_tokens"].get<uint32_t>(), i <= 3 ? 1024u : 256u);
    EXPECT_GT(row["step_ms"].get<double>(), 0);
    EXPECT_GT(row["mass_recall_mean"].get<double>(), 0);
    EXPECT_LE(row["mass_recall_mean"].get<double>(), 1.0 + 1e-6);
    // What reaches the engine: a few KiB of q/out/lse (plus the hybrid's recalls), not the KV.
    EXPECT_LT(row["engine_bytes_per_step"].get<double>(), j["rows"][0]["engine_bytes_per_step"].get<double>());
    EXPECT_LE(row["tokens_agree"].get<uint32_t>(), 2u);
  }
  EXPECT_GT(j["rows"][3]["recalled_bytes_per_step"].get<double>(), 0) << "the hybrid recalled nothing";
  auto zero = Cli("longctx --contexts 4K --budgets 0");
  EXPECT_NE(zero.code, 0);
  EXPECT_THAT(zero.out, HasSubstr("--budgets"));
  auto odd = Cli("longctx --contexts 1000");
  EXPECT_NE(odd.code, 0);
  EXPECT_THAT(odd.out, HasSubstr("multiple of 16"));
}

// The same scenario through a near-memory service over a pool holding the context: every page
// there decodes as dense does, and a budget's answers cross as queries, outputs and LSEs only
// (the hybrid's recalls besides). The pool's region is gone after; a region that cannot be
// made is refused with what to do.
TEST(Cli, LongContextDecodesThroughANearMemoryService) {
  cxlkv::testing::TempRegionPath path("cli-longctx-remote");
  auto r = Cli("longctx --contexts 4K --budgets 4,16 --steps 2 --json --remote-path " + path.path());
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.stdout_only);
  ASSERT_EQ(j["rows"].size(), 11u);  // the six local rows, remote-dense, then sparse and hybrid per budget
  const auto& dense = j["rows"][0];
  const auto& remote_dense = j["rows"][6];
  EXPECT_EQ(remote_dense["mode"], "remote-dense");
  EXPECT_EQ(remote_dense["tokens_agree"].get<uint32_t>(), 2u) << "every page at the service must decode as dense does";
  EXPECT_LT(remote_dense["logits_rel_err_max"].get<double>(), 1e-4);
  EXPECT_GT(remote_dense["open_ms"].get<double>(), 0);
  // Every page's KV is read next to the memory; what reaches the engine is a few KiB a step.
  EXPECT_GE(remote_dense["kv_read_bytes_per_step"].get<double>(), dense["kv_read_bytes_per_step"].get<double>());
  EXPECT_LT(remote_dense["engine_bytes_per_step"].get<double>(), 64 << 10);
  for (size_t i = 7; i < 11; ++i) {
    const auto& row = j["rows"][i];
    EXPECT_EQ(row["mode"], i % 2 ? "remote-sparse" : "remote-hybrid");
    EXPECT_EQ(row["budget_tokens"].get<uint32_t>(), i <= 8 ? 1024u : 256u);
    EXPECT_TRUE(row["mass_recall_mean"].is_null()) << "the service's selection is not audited";
    EXPECT_GT(row["speedup_vs_nm_dense"].get<double>(), 0);
    EXPECT_LT(row["kv_read_bytes_per_step"].get<double>(), remote_dense["kv_read_bytes_per_step"].get<double>());
    EXPECT_LT(row["engine_bytes_per_step"].get<double>(), dense["engine_bytes_per_step"].get<double>());
  }
  EXPECT_LT(j["rows"][7]["engine_bytes_per_step"].get<double>(), 64 << 10) << "remote-sparse moved more than q/out/lse";
  EXPECT_EQ(j["rows"][7]["recalled_bytes_per_step"].get<double>(), 0);
  EXPECT_GT(j["rows"][8]["recalled_bytes_per_step"].get<double>(), 0) << "the remote hybrid recalled nothing";
  EXPECT_FALSE(std::filesystem::exists(path.path())) << "the remote rows' region was left behind";
  auto bad = Cli("longctx --contexts 4K --budgets 4 --steps 1 --remote-path /nonexistent-dir/longctx");
  EXPECT_NE(bad.code, 0);
  EXPECT_THAT(bad.out, HasSubstr("remote context's pool"));
}

TEST(Cli, BenchLongctxQuickReportsStepTimesNextToDense) {
  auto r = Cli("bench longctx --quick --json");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.stdout_only);
  EXPECT_EQ(j["suite"], "longctx");
  auto by_name = FiguresByName(j);
  for (const std::string name : {"step_ms/32K/dense-nm", "step_ms/32K/sparse/1_32", "step_ms/32K/hybrid/1_8",
                                 "engine_bytes/32K/sparse/1_32", "mass_kept/32K/sparse/1_8"}) {
    ASSERT_TRUE(by_name.count(name)) << name << " is missing";
    EXPECT_GT(by_name[name]["ratio"].get<double>(), 0) << name;
  }
  EXPECT_EQ(by_name["step_ms/32K/sparse/1_32"]["reference"], "step_ms/32K/dense");
  EXPECT_LT(by_name["engine_bytes/32K/sparse/1_32"]["ratio"].get<double>(), 0.01);
  // Through the near-memory service, next to the same attention in the engine's process (unless
  // /dev/shm had no room for its pool, which the scenario notes).
  if (!j["scenario"]["notes"].empty()) {
    EXPECT_FALSE(by_name.count("step_ms/32K/remote-dense")) << j["scenario"]["notes"].dump();
    return;
  }
  for (const std::string name : {"step_ms/32K/remote-dense", "step_ms/32K/remote-sparse/1_32",
                                 "step_ms/32K/remote-hybrid/1_8", "engine_bytes/32K/remote-sparse/1_32"}) {
    ASSERT_TRUE(by_name.count(name)) << name << " is missing";
    EXPECT_GT(by_name[name]["ratio"].get<double>(), 0) << name;
  }
  EXPECT_EQ(by_name["step_ms/32K/remote-dense"]["reference"], "step_ms/32K/dense-nm");
  EXPECT_EQ(by_name["step_ms/32K/remote-sparse/1_32"]["reference"], "step_ms/32K/sparse/1_32");
  EXPECT_LT(by_name["engine_bytes/32K/remote-sparse/1_32"]["ratio"].get<double>(), 0.01);
}

}  // namespace
