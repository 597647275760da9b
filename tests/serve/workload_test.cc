// Workload generators: TraCT Table 1 shapes, document QA passes, chat histories, Poisson
// arrivals, determinism, JSONL traces (happy path, synthetic prefixes, every refusal), summaries.
#include "serve/workload.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <numeric>
#include <string>
#include <vector>

namespace cxlkv::serve {
namespace {

using ::testing::HasSubstr;

std::vector<Request> GenerateOrDie(const WorkloadOptions& o) {
  auto r = GenerateWorkload(o);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(r).value() : std::vector<Request>{};
}

WorkloadOptions Tract(uint32_t requests, uint64_t seed, char set = 'A') {
  WorkloadOptions o;
  o.kind = WorkloadKind::kTract;
  o.requests = requests;
  o.seed = seed;
  o.tract_set = set;
  return o;
}

double Mean(const std::vector<double>& v) {
  return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}
double Sd(const std::vector<double>& v) {
  const double m = Mean(v);
  double s = 0;
  for (double x : v) s += (x - m) * (x - m);
  return std::sqrt(s / static_cast<double>(v.size()));
}

size_t Lcp(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  return static_cast<size_t>(std::mismatch(a.begin(), a.end(), b.begin(), b.end()).first -
                             a.begin());
}

bool StartsWith(const std::vector<int32_t>& v, const std::vector<int32_t>& prefix) {
  return v.size() >= prefix.size() && std::equal(prefix.begin(), prefix.end(), v.begin());
}

// Dynamo's "unique prompt length", token-granular: what is left of a prompt after its longest
// common prefix with any other request of the set.
std::vector<double> UniqueLengths(const std::vector<Request>& rs) {
  std::vector<size_t> idx(rs.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(),
            [&](size_t a, size_t b) { return rs[a].prompt < rs[b].prompt; });
  std::vector<double> out(rs.size());
  for (size_t k = 0; k < idx.size(); ++k) {
    size_t best = 0;
    if (k > 0) best = std::max(best, Lcp(rs[idx[k]].prompt, rs[idx[k - 1]].prompt));
    if (k + 1 < idx.size()) best = std::max(best, Lcp(rs[idx[k]].prompt, rs[idx[k + 1]].prompt));
    out[idx[k]] = static_cast<double>(rs[idx[k]].prompt.size() - best);
  }
  return out;
}

void ExpectTokensBelow(const std::vector<Request>& rs, uint32_t vocab) {
  for (const Request& r : rs) {
    for (int32_t t : r.prompt) {
      ASSERT_GE(t, 0) << "request " << r.id;
      ASSERT_LT(t, static_cast<int32_t>(vocab)) << "request " << r.id;
    }
  }
}

// ---- kTract --------------------------------------------------------------------------------

TEST(TractWorkload, PromptAndOutputLengthsFollowTable1Scaled) {
  // 2000 requests: the output law (log-normal, sd > mean) has a heavy tail, so its sample sd
  // needs many draws; at 200k requests all four figures land within 1% of Table 1.
  for (uint64_t seed : {1, 2, 3}) {
    WorkloadOptions o = Tract(2000, seed);
    o.max_new_tokens_cap = 100000;  // look at the unclamped output law
    const auto rs = GenerateOrDie(o);
    ASSERT_EQ(rs.size(), 2000u);
    std::vector<double> in, out;
    for (size_t i = 0; i < rs.size(); ++i) {
      EXPECT_EQ(rs[i].id, i);
      in.push_back(static_cast<double>(rs[i].prompt.size()));
      out.push_back(rs[i].max_new_tokens);
    }
    SCOPED_TRACE("seed " + std::to_string(seed));
    EXPECT_NEAR(Mean(in), 4449 / 8.0, 0.06 * 4449 / 8.0);
    EXPECT_NEAR(Sd(in), 2424 / 8.0, 0.12 * 2424 / 8.0);
    EXPECT_NEAR(Mean(out), 215 / 8.0, 0.10 * 215 / 8.0);
    EXPECT_NEAR(Sd(out), 263 / 8.0, 0.40 * 263 / 8.0);
  }
}

TEST(TractWorkload, UniqueLengthGrowsFromSetAToSetCAsInTable1) {
  // Table 1's unique means, scaled by 8: A 134, B 152, C 204. Measured the way Dynamo's analyzer
  // does (what no other request shares), which can only exceed the model's unique draw.
  std::map<char, double> measured;
  for (char set : {'A', 'B', 'C'}) {
    std::vector<double> all;
    for (uint64_t seed : {11, 12}) {
      const auto u = UniqueLengths(GenerateOrDie(Tract(1000, seed, set)));
      all.insert(all.end(), u.begin(), u.end());
    }
    measured[set] = Mean(all);
  }
  EXPECT_NEAR(measured['A'], 1073 / 8.0, 0.15 * 1073 / 8.0);
  EXPECT_NEAR(measured['B'], 1215 / 8.0, 0.15 * 1215 / 8.0);
  EXPECT_NEAR(measured['C'], 1631 / 8.0, 0.15 * 1631 / 8.0);
  EXPECT_LT(measured['A'], measured['C']);
}

TEST(TractWorkload, RequestsOfAGroupShareExactlyTheirShorterContext) {
  const auto rs = GenerateOrDie(Tract(200, 5));
  std::map<std::string, int> per_group;
  int fully_unique = 0;
  for (const Request& r : rs) {
    if (r.group.empty()) {
      ++fully_unique;
    } else {
      ++per_group[r.group];
      EXPECT_THAT(r.group, ::testing::StartsWith("prefix-"));
    }
  }
  EXPECT_EQ(per_group.size(), 4u);  // tract_prefixes default
  EXPECT_LT(fully_unique, 20);
  // Requests of different groups share (by chance) at most a couple of tokens; requests of one
  // group share a long prefix on average.
  uint64_t same = 0, same_pairs = 0;
  for (size_t i = 0; i < rs.size(); ++i) {
    for (size_t j = i + 1; j < rs.size(); ++j) {
      const size_t l = Lcp(rs[i].prompt, rs[j].prompt);
      if (rs[i].group != rs[j].group || rs[i].group.empty()) {
        EXPECT_LE(l, 2u) << i << " " << j;
      } else {
        same += l;
        ++same_pairs;
      }
    }
  }
  EXPECT_GT(static_cast<double>(same) / static_cast<double>(same_pairs), 100.0);
}

TEST(TractWorkload, ClampsPromptAndOutputLengths) {
  WorkloadOptions o = Tract(300, 7);
  o.max_prompt_tokens = 300;
  o.max_new_tokens_cap = 8;
  const auto rs = GenerateOrDie(o);
  size_t at_prompt_cap = 0, at_output_cap = 0;
  for (const Request& r : rs) {
    EXPECT_GE(r.prompt.size(), kMinPromptTokens);
    EXPECT_LE(r.prompt.size(), 300u);
    EXPECT_GE(r.max_new_tokens, 1u);
    EXPECT_LE(r.max_new_tokens, 8u);
    at_prompt_cap += r.prompt.size() == 300;
    at_output_cap += r.max_new_tokens == 8;
  }
  EXPECT_GT(at_prompt_cap, 0u);
  EXPECT_GT(at_output_cap, 0u);
  // Scaled down hard, prompts hit the 16-token floor.
  o.scale = 1000;
  for (const Request& r : GenerateOrDie(o)) EXPECT_GE(r.prompt.size(), kMinPromptTokens);
}

// ---- kDocQa --------------------------------------------------------------------------------

TEST(DocQaWorkload, LaterPassesRepeatTheDocumentWithNewQuestions) {
  WorkloadOptions o;  // kDocQa defaults: 8 documents x 2 passes, 6144/8 doc, 256/8 question
  const auto rs = GenerateOrDie(o);
  ASSERT_EQ(rs.size(), 16u);
  const size_t doc_len = 6144 / 8, q_len = 256 / 8;
  std::map<std::string, const Request*> first;
  for (size_t i = 0; i < rs.size(); ++i) {
    const Request& r = rs[i];
    EXPECT_EQ(r.id, i);
    ASSERT_EQ(r.prompt.size(), doc_len + q_len);
    EXPECT_EQ(r.max_new_tokens, 64u / 8);
    ASSERT_THAT(r.group, ::testing::StartsWith("doc-"));
    if (i < 8) {
      EXPECT_TRUE(first.emplace(r.group, &r).second) << "document twice in pass 1: " << r.group;
      continue;
    }
    ASSERT_TRUE(first.count(r.group)) << r.group;
    const Request& f = *first[r.group];
    EXPECT_TRUE(std::equal(f.prompt.begin(), f.prompt.begin() + doc_len, r.prompt.begin()));
    EXPECT_FALSE(std::equal(f.prompt.begin() + doc_len, f.prompt.end(), r.prompt.begin() + doc_len))
        << "question repeated for " << r.group;
  }
  EXPECT_EQ(first.size(), 8u);
  // Distinct documents are distinct token sequences.
  for (const auto& [g1, r1] : first) {
    for (const auto& [g2, r2] : first) {
      if (g1 < g2) {
        EXPECT_LT(Lcp(r1->prompt, r2->prompt), 4u) << g1 << " " << g2;
      }
    }
  }
}

TEST(DocQaWorkload, PassOrderIsShuffledBySeed) {
  auto order = [](uint64_t seed) {
    WorkloadOptions o;
    o.documents = 16;
    o.passes = 3;
    o.seed = seed;
    std::vector<std::string> groups;
    for (const Request& r : GenerateOrDie(o)) groups.push_back(r.group);
    return groups;
  };
  const auto a = order(1), b = order(2);
  ASSERT_EQ(a.size(), 48u);
  EXPECT_NE(a, b);
  // Within a seed the three passes are (almost surely) different permutations.
  EXPECT_FALSE(std::equal(a.begin(), a.begin() + 16, a.begin() + 16));
  for (int pass = 0; pass < 3; ++pass) {
    std::vector<std::string> p(a.begin() + pass * 16, a.begin() + pass * 16 + 16);
    std::sort(p.begin(), p.end());
    EXPECT_EQ(std::unique(p.begin(), p.end()), p.end()) << "pass " << pass;
  }
}

// ---- kChat ---------------------------------------------------------------------------------

TEST(ChatWorkload, EachTurnExtendsThePreviousPromptAndAnswer) {
  WorkloadOptions o;
  o.kind = WorkloadKind::kChat;
  o.sessions = 3;
  o.turns = 5;
  const auto rs = GenerateOrDie(o);
  ASSERT_EQ(rs.size(), 15u);
  const size_t user = 512 / 8, answer = 64 / 8;
  for (size_t i = 0; i < rs.size(); ++i) {
    EXPECT_EQ(rs[i].group, "session-" + std::to_string(i % 3));  // interleaved
    EXPECT_EQ(rs[i].max_new_tokens, answer);
    if (i < 3) {
      EXPECT_EQ(rs[i].prompt.size(), user);
      continue;
    }
    const Request& prev = rs[i - 3];
    EXPECT_TRUE(StartsWith(rs[i].prompt, prev.prompt)) << "turn of request " << i;
    EXPECT_EQ(rs[i].prompt.size(), prev.prompt.size() + answer + user);
  }
  EXPECT_LT(Lcp(rs[0].prompt, rs[1].prompt), 4u);  // sessions are distinct
}

TEST(ChatWorkload, RefusesAConversationLongerThanMaxPrompt) {
  WorkloadOptions o;
  o.kind = WorkloadKind::kChat;
  o.turns = 100;
  auto r = GenerateWorkload(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("max_prompt_tokens"));
}

// ---- All kinds -----------------------------------------------------------------------------

TEST(Workload, SameOptionsGiveIdenticalRequestsAndSeedsDiffer) {
  for (WorkloadKind k : {WorkloadKind::kTract, WorkloadKind::kDocQa, WorkloadKind::kChat}) {
    SCOPED_TRACE(std::string(WorkloadKindName(k)));
    WorkloadOptions o;
    o.kind = k;
    o.seed = 42;
    const auto a = GenerateOrDie(o), b = GenerateOrDie(o);
    ASSERT_FALSE(a.empty());
    EXPECT_EQ(a, b);
    o.seed = 43;
    const auto c = GenerateOrDie(o);
    EXPECT_NE(a, c);
  }
}

TEST(Workload, GoldenTokensPinTheGeneratorAcrossBuilds) {
  // Changing the generator (or a platform whose mt19937_64 or formulas differ) changes these.
  const auto rs = GenerateOrDie(Tract(3, 1));
  ASSERT_EQ(rs.size(), 3u);
  std::string got;
  for (const Request& r : rs) {
    got += std::to_string(r.prompt.size()) + "/" + std::to_string(r.max_new_tokens) + "/" +
           std::to_string(r.prompt[0]) + "/" + r.group + " ";
  }
  EXPECT_EQ(got, "374/5/680/prefix-2 365/61/2752/prefix-0 507/22/1988/prefix-1 ");
}

TEST(Workload, EveryTokenIsBelowVocab) {
  for (WorkloadKind k : {WorkloadKind::kTract, WorkloadKind::kDocQa, WorkloadKind::kChat}) {
    WorkloadOptions o;
    o.kind = k;
    o.vocab_size = 7;
    ExpectTokensBelow(GenerateOrDie(o), 7);
  }
}

TEST(Workload, RefusesInvalidOptions) {
  auto refused = [](WorkloadOptions o, const std::string& what) {
    auto r = GenerateWorkload(o);
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(r.status().message(), HasSubstr(what));
  };
  WorkloadOptions o = Tract(0, 1);
  refused(o, "requests");
  o = Tract(8, 1);
  o.vocab_size = 0;
  refused(o, "vocab_size");
  o.vocab_size = 1;
  refused(o, "vocab_size");
  o = Tract(8, 1);
  o.scale = 0;
  refused(o, "scale");
  o.scale = -1;
  refused(o, "scale");
  o.scale = std::nan("");
  refused(o, "scale");
  o = Tract(8, 1);
  o.max_prompt_tokens = 8;
  refused(o, "max_prompt_tokens");
  o = Tract(8, 1);
  o.max_new_tokens_cap = 0;
  refused(o, "max_new_tokens_cap");
  o = Tract(8, 1, 'D');
  refused(o, "tract_set");
  o = Tract(8, 1);
  o.tract_prefixes = 0;
  refused(o, "tract_prefixes");
  o = WorkloadOptions{};
  o.documents = 0;
  refused(o, "documents");
  o = WorkloadOptions{};
  o.passes = 0;
  refused(o, "passes");
  o = WorkloadOptions{};
  o.doc_tokens = 100000;
  refused(o, "max_prompt_tokens");
  o = WorkloadOptions{};
  o.kind = WorkloadKind::kChat;
  o.sessions = 0;
  refused(o, "sessions");
}

TEST(Workload, KindNamesRoundTripAndUnknownNamesListTheValidOnes) {
  for (WorkloadKind k : {WorkloadKind::kTract, WorkloadKind::kDocQa, WorkloadKind::kChat}) {
    auto p = ParseWorkloadKind(WorkloadKindName(k));
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(*p, k);
  }
  auto bad = ParseWorkloadKind("lveval");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("tract, docqa, chat"));
}

// ---- Poisson arrivals ----------------------------------------------------------------------

TEST(PoissonArrivals, GapsAreExponentialWithMeanOneOverQps) {
  std::vector<Request> rs(20000);
  ASSERT_TRUE(AssignPoissonArrivals(rs, 4.0, 9).ok());
  std::vector<double> gaps;
  double prev = 0;
  for (const Request& r : rs) {
    ASSERT_GT(r.arrival_s, prev);
    gaps.push_back(r.arrival_s - prev);
    prev = r.arrival_s;
  }
  EXPECT_NEAR(Mean(gaps), 0.25, 0.25 * 0.03);
  EXPECT_NEAR(Sd(gaps), 0.25, 0.25 * 0.05);  // exponential: sd = mean
  std::vector<Request> again(20000);
  ASSERT_TRUE(AssignPoissonArrivals(again, 4.0, 9).ok());
  EXPECT_EQ(rs, again);
  ASSERT_TRUE(AssignPoissonArrivals(again, 4.0, 10).ok());
  EXPECT_NE(rs, again);
}

TEST(PoissonArrivals, RefusesNonPositiveQpsAndChangesNothing) {
  std::vector<Request> rs(3);
  for (double qps : {0.0, -1.0, std::nan(""), HUGE_VAL}) {
    Status s = AssignPoissonArrivals(rs, qps, 1);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << qps;
  }
  for (const Request& r : rs) EXPECT_EQ(r.arrival_s, 0);
}

// ---- Traces --------------------------------------------------------------------------------

class TempTrace {
 public:
  explicit TempTrace(const std::string& text) {
    std::string tmpl = ::testing::TempDir() + "cxlkv_trace_XXXXXX";
    const int fd = mkstemp(tmpl.data());
    EXPECT_GE(fd, 0);
    path_ = tmpl;
    EXPECT_EQ(write(fd, text.data(), text.size()), static_cast<ssize_t>(text.size()));
    close(fd);
  }
  ~TempTrace() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(Trace, LoadsExplicitAndSyntheticRequestsSkippingBlankAndCommentLines) {
  TempTrace t(
      "# a comment\n"
      "\n"
      "{\"prompt\": [1, 2, 3], \"max_new_tokens\": 4, \"arrival_s\": 0.5, \"group\": \"g\"}\r\n"
      "   # indented comment\n"
      "{\"prompt\": [9], \"max_new_tokens\": 1}\n"
      "{\"prompt_tokens\": 10, \"max_new_tokens\": 2, \"arrival_s\": 1}\n"
      "{\"prompt_tokens\": 20, \"prefix_group\": \"sys\", \"prefix_tokens\": 12, "
      "\"max_new_tokens\": 3}");  // no final newline
  auto r = LoadTrace(t.path(), 100, 1);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const auto& rs = *r;
  ASSERT_EQ(rs.size(), 4u);
  for (size_t i = 0; i < rs.size(); ++i) EXPECT_EQ(rs[i].id, i);
  EXPECT_EQ(rs[0].prompt, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(rs[0].max_new_tokens, 4u);
  EXPECT_EQ(rs[0].arrival_s, 0.5);
  EXPECT_EQ(rs[0].group, "g");
  EXPECT_EQ(rs[1].prompt, (std::vector<int32_t>{9}));
  EXPECT_EQ(rs[1].arrival_s, 0);
  EXPECT_EQ(rs[1].group, "");
  EXPECT_EQ(rs[2].prompt.size(), 10u);
  EXPECT_EQ(rs[2].arrival_s, 1.0);
  EXPECT_EQ(rs[3].prompt.size(), 20u);
  EXPECT_EQ(rs[3].group, "sys");
  EXPECT_EQ(rs[3].max_new_tokens, 3u);
  ExpectTokensBelow(rs, 100);
}

TEST(Trace, SyntheticRequestsOfAPrefixGroupShareExactlyTheirShorterPrefix) {
  TempTrace t(
      "{\"prompt_tokens\": 100, \"prefix_group\": \"a\", \"prefix_tokens\": 40, "
      "\"max_new_tokens\": 1}\n"
      "{\"prompt_tokens\": 100, \"prefix_group\": \"a\", \"prefix_tokens\": 60, "
      "\"max_new_tokens\": 1}\n"
      "{\"prompt_tokens\": 60, \"prefix_group\": \"a\", \"prefix_tokens\": 60, "
      "\"max_new_tokens\": 1, \"group\": \"override\"}\n"
      "{\"prompt_tokens\": 100, \"prefix_group\": \"b\", \"prefix_tokens\": 60, "
      "\"max_new_tokens\": 1}\n"
      "{\"prompt_tokens\": 100, \"max_new_tokens\": 1}\n");
  auto r = LoadTrace(t.path(), 4096, 7);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const auto& rs = *r;
  ASSERT_EQ(rs.size(), 5u);
  EXPECT_EQ(Lcp(rs[0].prompt, rs[1].prompt), 40u);
  EXPECT_EQ(Lcp(rs[1].prompt, rs[2].prompt), 60u);  // rs[2] is all prefix
  EXPECT_EQ(rs[2].group, "override");
  EXPECT_LT(Lcp(rs[1].prompt, rs[3].prompt), 4u);  // another group
  EXPECT_LT(Lcp(rs[0].prompt, rs[4].prompt), 4u);  // no group
  // The group's tokens come from the name and the seed: same seed → same, other seed → other.
  auto again = LoadTrace(t.path(), 4096, 7);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(rs, *again);
  auto other = LoadTrace(t.path(), 4096, 8);
  ASSERT_TRUE(other.ok());
  EXPECT_LT(Lcp(rs[0].prompt, (*other)[0].prompt), 4u);
}

TEST(Trace, MissingFileIsNotFound) {
  auto r = LoadTrace(::testing::TempDir() + "no_such_trace.jsonl", 100, 1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
}

TEST(Trace, EachMalformedLineIsRefusedWithItsLineNumber) {
  const std::string ok = "{\"prompt\": [1], \"max_new_tokens\": 1}\n";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"prompt\": [1], \"max_new_tokens\": 1", "malformed JSON"},
      {"[1, 2]", "expected a JSON object"},
      {"{\"prompt\": [1]}", "missing \"max_new_tokens\""},
      {"{\"prompt\": [1], \"max_new_tokens\": 0}", "\"max_new_tokens\" 0 is outside"},
      {"{\"prompt\": [1], \"max_new_tokens\": 1.5}", "must be an integer"},
      {"{\"prompt\": [1], \"max_new_tokens\": \"3\"}", "must be an integer"},
      {"{\"prompt\": \"hello\", \"max_new_tokens\": 1}", "must be an array"},
      {"{\"prompt\": [], \"max_new_tokens\": 1}", "\"prompt\" has 0 tokens"},
      {"{\"prompt\": [1, \"x\"], \"max_new_tokens\": 1}", "prompt[1]"},
      {"{\"prompt\": [1, 100], \"max_new_tokens\": 1}", "prompt[1]\" 100 is outside"},
      {"{\"prompt\": [-1], \"max_new_tokens\": 1}", "prompt[0]\" -1 is outside"},
      {"{\"prompt\": [1], \"max_new_tokens\": 1, \"temperature\": 0}", "unknown key"},
      {"{\"prompt\": [1], \"max_new_tokens\": 1, \"arrival_s\": -2}", "arrival_s"},
      {"{\"prompt\": [1], \"max_new_tokens\": 1, \"group\": 3}", "\"group\" must be a string"},
      {"{\"max_new_tokens\": 1}", "missing \"prompt\""},
      {"{\"prompt\": [1], \"prompt_tokens\": 5, \"max_new_tokens\": 1}", "excludes"},
      {"{\"prompt_tokens\": 5, \"prefix_group\": \"g\", \"prefix_tokens\": 6, "
       "\"max_new_tokens\": 1}",
       "\"prefix_tokens\" 6 is outside"},
      {"{\"prompt_tokens\": 5, \"prefix_group\": \"g\", \"max_new_tokens\": 1}", "together"},
      {"{\"prompt_tokens\": 99999999999, \"max_new_tokens\": 1}", "\"prompt_tokens\""},
  };
  for (const auto& [line, what] : cases) {
    TempTrace t("# header\n" + ok + "\n" + line + "\n" + ok);
    auto r = LoadTrace(t.path(), 100, 1);
    ASSERT_FALSE(r.ok()) << line;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << line;
    EXPECT_THAT(r.status().message(), HasSubstr("trace " + t.path() + " line 4: ")) << line;
    EXPECT_THAT(r.status().message(), HasSubstr(what)) << line;
  }
}

TEST(Trace, EmptyTraceIsRefused) {
  TempTrace t("# only a comment\n\n");
  auto r = LoadTrace(t.path(), 100, 1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

// ---- Summaries -----------------------------------------------------------------------------

TEST(Summary, CountsLengthsAndTheLongestPrefixSharedWithAnEarlierRequest) {
  std::vector<Request> rs(5);
  rs[0].prompt = {1, 2, 3, 4};
  rs[1].prompt = {1, 2, 3, 9};  // shares 3 with rs[0]
  rs[2].prompt = {1, 2, 5};     // shares 2
  rs[3].prompt = {7};           // shares 0
  rs[4].prompt = {1, 2, 3, 4};  // shares 4 (a repeat)
  for (size_t i = 0; i < rs.size(); ++i) rs[i].max_new_tokens = static_cast<uint32_t>(i + 1);
  const WorkloadSummary s = Summarize(rs);
  EXPECT_EQ(s.requests, 5u);
  EXPECT_EQ(s.prompt_tokens, 16u);
  EXPECT_EQ(s.max_new_tokens, 15u);
  EXPECT_DOUBLE_EQ(s.mean_prompt, 16.0 / 5);
  EXPECT_DOUBLE_EQ(s.mean_output, 3.0);
  EXPECT_NEAR(s.sd_prompt, std::sqrt((3 * 0.64 + 0.04 + 4.84) / 5), 1e-12);
  EXPECT_EQ(s.shared_prefix_tokens_upper_bound, 3u + 2 + 0 + 4);

  EXPECT_EQ(Summarize({}).requests, 0u);
  // docqa: the second pass shares whole documents.
  WorkloadOptions o;
  const WorkloadSummary d = Summarize(GenerateOrDie(o));
  EXPECT_GE(d.shared_prefix_tokens_upper_bound, 8u * (6144 / 8));
  EXPECT_LT(d.shared_prefix_tokens_upper_bound, 8u * (6144 / 8) + 8 * 4);
}

}  // namespace
}  // namespace cxlkv::serve
