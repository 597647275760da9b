// Workload generators, Poisson arrivals, JSONL traces and summaries (see workload.h).
#include "serve/workload.h"
#include "serve/workload_random.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <set>
#include <system_error>
#include <unordered_map>
#include <utility>

namespace cxlkv::serve {
namespace {

using namespace workload_internal;  // NOLINT: the generators' own helpers

// `tokens / scale`, rounded; saturates far above any limit so huge values stay comparable.
uint64_t Scaled(double tokens, double scale) {
  const double v = tokens / scale;
  if (!(v < 1e15)) return static_cast<uint64_t>(1e15);
  return static_cast<uint64_t>(std::llround(std::max(v, 0.0)));
}

uint32_t ClampOutput(uint64_t n, uint32_t cap) {
  return static_cast<uint32_t>(std::clamp<uint64_t>(n, 1, cap));
}


Status ValidateCommon(const WorkloadOptions& o) {
  if (o.vocab_size < 2 || o.vocab_size > (1u << 31)) {
    return InvalidArgument("vocab_size " + Num(o.vocab_size) + " is outside [2, 2^31]");
  }
  if (!(o.scale > 0) || !std::isfinite(o.scale)) {
    return InvalidArgument("scale must be a finite number > 0 (lengths are divided by it), got " +
                           std::to_string(o.scale));
  }
  if (o.max_prompt_tokens < kMinPromptTokens) {
    return InvalidArgument("max_prompt_tokens " + Num(o.max_prompt_tokens) + " is below the " +
                           Num(kMinPromptTokens) + "-token minimum prompt");
  }
  if (o.max_new_tokens_cap == 0) return InvalidArgument("max_new_tokens_cap must be >= 1");
  return Status::Ok();
}

Status RequirePositive(uint32_t v, const char* field) {
  if (v == 0) return InvalidArgument(std::string(field) + " must be >= 1");
  return Status::Ok();
}

Status CheckCount(uint64_t n, const char* what) {
  if (n > kMaxWorkloadRequests) {
    return InvalidArgument(std::string(what) + " = " + Num(n) + " requests, more than the " +
                           Num(kMaxWorkloadRequests) + " a workload may hold");
  }
  return Status::Ok();
}

// ---- kTract --------------------------------------------------------------------------------

// TraCT Table 1 (papers/001 §5.1): all three sets share input and output lengths.
constexpr double kTractInputMean = 4449, kTractInputSd = 2424;
constexpr double kTractOutputMean = 215, kTractOutputSd = 263;
struct TractSet {
  char name;
  double unique_mean, unique_sd;
};
constexpr TractSet kTractSets[] = {{'A', 1073, 1549}, {'B', 1215, 1693}, {'C', 1631, 2027}};

Result<std::vector<Request>> GenerateTract(const WorkloadOptions& o) {
  CXLKV_RETURN_IF_ERROR(RequirePositive(o.requests, "requests"));
  CXLKV_RETURN_IF_ERROR(RequirePositive(o.tract_prefixes, "tract_prefixes"));
  CXLKV_RETURN_IF_ERROR(CheckCount(o.requests, "requests"));
  const TractSet* set = nullptr;
  for (const TractSet& s : kTractSets) {
    if (s.name == o.tract_set || s.name == o.tract_set - 'a' + 'A') set = &s;
  }
  if (set == nullptr) {
    return InvalidArgument("tract_set must be 'A', 'B' or 'C' (TraCT Table 1's workloads), got '" +
                           std::string(1, o.tract_set) + "'");
  }
  // unique: 0 w.p. 1-q, else Exponential(mu); mean q*mu and variance q(2-q)mu^2 match Table 1.
  const double ratio = set->unique_sd / set->unique_mean;
  const double q = 2.0 / (1.0 + ratio * ratio);
  const double mu = set->unique_mean / q;
  // context: independent of unique, so input = context + unique has Table 1's mean and sd.
  const double ctx_mean = kTractInputMean - set->unique_mean;
  const double ctx_sd = std::sqrt(kTractInputSd * kTractInputSd - set->unique_sd * set->unique_sd);

  const uint64_t max_prompt = o.max_prompt_tokens;
  // Shared prefix sequences, made on first use; one token longer than the longest prompt so the
  // first unique token can always be chosen to differ from the next prefix token.
  std::unordered_map<uint64_t, std::vector<int32_t>> prefixes;
  Rng rng(StreamSeed(o.seed, Stream::kMain, 0));
  std::vector<Request> out;
  out.reserve(o.requests);
  for (uint64_t i = 0; i < o.requests; ++i) {
    const uint64_t g = rng.Below(o.tract_prefixes);
    const double context = rng.LogNormal(ctx_mean, ctx_sd);
    const double unique = rng.Uniform() < q ? rng.Exponential(mu) : 0.0;
    const double output = rng.LogNormal(kTractOutputMean, kTractOutputSd);

    uint64_t c = Scaled(context, o.scale);
    uint64_t u = Scaled(unique, o.scale);
    if (c + u < kMinPromptTokens) u = kMinPromptTokens - c;
    if (c + u > max_prompt) {  // cut at the end
      c = std::min(c, max_prompt);
      u = max_prompt - c;
    }

    Request r;
    r.id = i;
    r.max_new_tokens = ClampOutput(Scaled(output, o.scale), o.max_new_tokens_cap);
    r.prompt.reserve(c + u);
    if (c > 0) {
      std::vector<int32_t>& p = prefixes[g];
      if (p.empty()) {
        Rng prng(StreamSeed(o.seed, Stream::kPrefix, g));
        prng.AppendTokens(o.vocab_size, max_prompt + 1, p);
      }
      r.prompt.assign(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(c));
      if (u > 0) r.prompt.push_back(rng.TokenOtherThan(o.vocab_size, p[c]));
      r.group = "prefix-" + Num(g);
    } else if (u > 0) {
      r.prompt.push_back(rng.Token(o.vocab_size));
    }
    rng.AppendTokens(o.vocab_size, c + u - r.prompt.size(), r.prompt);
    out.push_back(std::move(r));
  }
  return out;
}

// ---- kDocQa --------------------------------------------------------------------------------

Result<std::vector<Request>> GenerateDocQa(const WorkloadOptions& o) {
  CXLKV_RETURN_IF_ERROR(RequirePositive(o.documents, "documents"));
  CXLKV_RETURN_IF_ERROR(RequirePositive(o.passes, "passes"));
  CXLKV_RETURN_IF_ERROR(RequirePositive(o.doc_tokens, "doc_tokens"));
  CXLKV_RETURN_IF_ERROR(RequirePositive(o.question_tokens, "question_tokens"));
  CXLKV_RETURN_IF_ERROR(RequirePositive(o.answer_tokens, "answer_tokens"));
  const uint64_t n = uint64_t{o.documents} * o.passes;
  CXLKV_RETURN_IF_ERROR(CheckCount(n, "documents x passes"));
  const uint64_t doc_len = std::max<uint64_t>(1, Scaled(o.doc_tokens, o.scale));
  uint64_t q_len = std::max<uint64_t>(1, Scaled(o.question_tokens, o.scale));
  if (doc_len + q_len < kMinPromptTokens) q_len = kMinPromptTokens - doc_len;
  if (doc_len + q_len > o.max_prompt_tokens) {
    return InvalidArgument("docqa prompts of " + Num(doc_len) + " document + " + Num(q_len) +
                           " question tokens (after scale) exceed max_prompt_tokens " +
                           Num(o.max_prompt_tokens) +
                           ": raise scale or max_prompt_tokens, or lower doc_tokens");
  }
  const uint32_t answer = ClampOutput(Scaled(o.answer_tokens, o.scale), o.max_new_tokens_cap);

  std::vector<std::vector<int32_t>> docs(o.documents);
  for (uint64_t d = 0; d < o.documents; ++d) {
    Rng drng(StreamSeed(o.seed, Stream::kDocument, d));
    drng.AppendTokens(o.vocab_size, doc_len, docs[d]);
  }
  Rng rng(StreamSeed(o.seed, Stream::kMain, 0));
  std::vector<uint32_t> order(o.documents);
  std::vector<Request> out;
  out.reserve(n);
  for (uint64_t pass = 0; pass < o.passes; ++pass) {
    std::iota(order.begin(), order.end(), 0u);
    for (uint64_t i = order.size() - 1; i > 0; --i) {  // Fisher–Yates
      std::swap(order[i], order[rng.Below(i + 1)]);
    }
    for (uint32_t d : order) {
      Request r;
      r.id = out.size();
      r.prompt.reserve(doc_len + q_len);
      r.prompt = docs[d];
      rng.AppendTokens(o.vocab_size, q_len, r.prompt);
      r.max_new_tokens = answer;
      r.group = "doc-" + Num(d);
      out.push_back(std::move(r));
    }
  }
  return out;
}

// ---- kChat ---------------------------------------------------------------------------------

Result<std::vector<Request>> GenerateChat(const WorkloadOptions& o) {
  CXLKV_RETURN_IF_ERROR(RequirePositive(o.sessions, "sessions"));
  CXLKV_RETURN_IF_ERROR(RequirePositive(o.turns, "turns"));
  CXLKV_RETURN_IF_ERROR(RequirePositive(o.user_tokens, "user_tokens"));
  CXLKV_RETURN_IF_ERROR(RequirePositive(o.answer_tokens, "answer_tokens"));
  const uint64_t n = uint64_t{o.sessions} * o.turns;
  CXLKV_RETURN_IF_ERROR(CheckCount(n, "sessions x turns"));
  const uint64_t user = std::max<uint64_t>(kMinPromptTokens, Scaled(o.user_tokens, o.scale));
  const uint32_t answer = ClampOutput(Scaled(o.answer_tokens, o.scale), o.max_new_tokens_cap);
  const uint64_t last_prompt = o.turns * user + (o.turns - 1) * uint64_t{answer};
  if (last_prompt > o.max_prompt_tokens) {
    return InvalidArgument("chat's last turn would have a " + Num(last_prompt) +
                           "-token prompt (after scale), more than max_prompt_tokens " +
                           Num(o.max_prompt_tokens) +
                           ": lower turns or user_tokens, or raise scale or max_prompt_tokens");
  }

  std::vector<std::vector<int32_t>> history(o.sessions);
  Rng rng(StreamSeed(o.seed, Stream::kMain, 0));
  std::vector<Request> out;
  out.reserve(n);
  for (uint64_t t = 0; t < o.turns; ++t) {
    for (uint64_t s = 0; s < o.sessions; ++s) {
      Request r;
      r.id = out.size();
      r.prompt.reserve(history[s].size() + user);
      r.prompt = history[s];
      rng.AppendTokens(o.vocab_size, user, r.prompt);
      r.max_new_tokens = answer;
      r.group = "session-" + Num(s);
      // The next turn's history: this prompt + a placeholder answer (see workload.h).
      history[s] = r.prompt;
      rng.AppendTokens(o.vocab_size, answer, history[s]);
      out.push_back(std::move(r));
    }
  }
  return out;
}

}  // namespace

Result<std::vector<Request>> GenerateWorkload(const WorkloadOptions& o) {
  CXLKV_RETURN_IF_ERROR(ValidateCommon(o));
  switch (o.kind) {
    case WorkloadKind::kTract:
      return GenerateTract(o);
    case WorkloadKind::kDocQa:
      return GenerateDocQa(o);
    case WorkloadKind::kChat:
      return GenerateChat(o);
  }
  return InvalidArgument("unknown workload kind " + Num(static_cast<uint64_t>(o.kind)));
}

Result<WorkloadKind> ParseWorkloadKind(std::string_view name) {
  for (WorkloadKind k : {WorkloadKind::kTract, WorkloadKind::kDocQa, WorkloadKind::kChat}) {
    if (name == WorkloadKindName(k)) return k;
  }
  return InvalidArgument("unknown workload '" + std::string(name) +
                         "': valid names are tract, docqa, chat");
}

std::string_view WorkloadKindName(WorkloadKind k) {
  switch (k) {
    case WorkloadKind::kTract:
      return "tract";
    case WorkloadKind::kDocQa:
      return "docqa";
    case WorkloadKind::kChat:
      return "chat";
  }
  return "unknown";
}

Status AssignPoissonArrivals(std::vector<Request>& requests, double qps, uint64_t seed) {
  if (!(qps > 0) || !std::isfinite(qps)) {
    return InvalidArgument("qps must be a finite number > 0, got " + std::to_string(qps));
  }
  Rng rng(StreamSeed(seed, Stream::kArrival, 0));
  double t = 0;
  for (Request& r : requests) {
    t += rng.Exponential(1.0 / qps);
    r.arrival_s = t;
  }
  return Status::Ok();
}

WorkloadSummary Summarize(std::span<const Request> requests) {
  WorkloadSummary s;
  s.requests = requests.size();
  if (requests.empty()) return s;
  for (const Request& r : requests) {
    s.prompt_tokens += r.prompt.size();
    s.max_new_tokens += r.max_new_tokens;
  }
  const double n = static_cast<double>(requests.size());
  s.mean_prompt = static_cast<double>(s.prompt_tokens) / n;
  s.mean_output = static_cast<double>(s.max_new_tokens) / n;
  double var = 0;
  for (const Request& r : requests) {
    const double d = static_cast<double>(r.prompt.size()) - s.mean_prompt;
    var += d * d;
  }
  s.sd_prompt = std::sqrt(var / n);

  // Among a set of sequences, the longest common prefix with a query is attained at one of the
  // query's neighbours in lexicographic order.
  using Seq = std::span<const int32_t>;
  auto less = [](Seq a, Seq b) {
    return std::lexicographical_compare(a.begin(), a.end(), b.begin(), b.end());
  };
  auto lcp = [](Seq a, Seq b) -> uint64_t {
    return static_cast<uint64_t>(std::mismatch(a.begin(), a.end(), b.begin(), b.end()).first -
                                 a.begin());
  };
  std::set<Seq, decltype(less)> seen(less);
  for (const Request& r : requests) {
    const Seq p(r.prompt);
    uint64_t best = 0;
    auto it = seen.lower_bound(p);
    if (it != seen.end()) best = lcp(p, *it);
    if (it != seen.begin()) best = std::max(best, lcp(p, *std::prev(it)));
    s.shared_prefix_tokens_upper_bound += best;
    seen.insert(p);
  }
  return s;
}

}  // namespace cxlkv::serve
