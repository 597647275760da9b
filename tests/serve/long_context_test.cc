// The long-context scenario's remote rows when their pool cannot hold the context: asked for
// (longctx --remote), the run fails saying so; optional (the demo, bench longctx), the context's
// remote rows are skipped with a note and the in-process rows stand. No region is left behind.
#include "serve/long_context.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "test_region.h"

namespace cxlkv::serve {
namespace {

LongContextOptions SmallRun(const std::string& region) {
  LongContextOptions o;
  o.model_config = {{"name", "tiny-llama"}};
  o.context_tokens = {4096};  // 8 MiB of KV
  o.budget_divisors = {4};
  o.decode_steps = 1;
  o.remote_region = region;
  o.remote_region_bytes = 4 << 20;
  return o;
}

TEST(LongContextRemote, APoolTooSmallForTheContextFailsTheRunOrSkipsItsRowsWithANote) {
  testing::TempRegionPath path("longctx-small");
  auto refused = RunLongContextDecode(SmallRun(path.path()));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(refused.status().message().find("cannot hold"), std::string::npos) << refused.status().ToString();

  LongContextOptions optional = SmallRun(path.path());
  optional.remote_optional = true;
  auto skipped = RunLongContextDecode(optional);
  ASSERT_TRUE(skipped.ok()) << skipped.status().ToString();
  ASSERT_EQ(skipped->rows.size(), 4u);  // dense, dense-nm, sparse, hybrid: no remote-*
  for (const LongContextRow& row : skipped->rows) EXPECT_EQ(row.mode.rfind("remote-", 0), std::string::npos);
  ASSERT_EQ(skipped->notes.size(), 1u);
  EXPECT_NE(skipped->notes[0].find("no remote rows at 4K tokens"), std::string::npos) << skipped->notes[0];
  EXPECT_FALSE(std::filesystem::exists(path.path()));
}

}  // namespace
}  // namespace cxlkv::serve
