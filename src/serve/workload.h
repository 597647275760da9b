// Workloads for the end-to-end serving demo: synthetic request sets shaped after the papers'
// evaluations, Poisson (open-loop) arrivals, and JSONL traces.
//
// Every generator is deterministic: the same options (seed included) give byte-identical request
// sets on any build. Randomness comes from std::mt19937_64 only (its output is specified by the
// standard); uniform integers, normal, exponential and log-normal draws are derived from its raw
// 64-bit output by the formulas in workload_random.h, never by <random>'s distributions (whose
// output is implementation-defined). libm's log/exp/cos may differ in the last bit between C libraries;
// rounding to whole token counts absorbs that in practice.
//
// Lengths. The papers' prompts (thousands of tokens) are too long for the demo's CPU reference
// engine, so every length in the options is divided by WorkloadOptions::scale (default 8) and
// rounded before it is used; prompts are then clamped to [kMinPromptTokens, max_prompt_tokens]
// and output lengths to [1, max_new_tokens_cap]. A figure from a run at scale 8 therefore
// describes a workload with 1/8 of the paper's token counts, and should say so.
//
// kTract — our reading of TraCT Table 1 (papers/001, §5.1). The three synthetic sets A, B, C were
// made by Dynamo's data generator and share input length 4449 (sd 2424) and output length 215
// (sd 263); they differ only in "unique" length: 1073 (1549), 1215 (1693), 1631 (2027). In
// Dynamo's prefix analyzer, which produced those columns, a request's prompt is context +
// unique: the context is the part made of blocks that also occur in some other request of the
// set (the shared prefix: system prompt, few-shot examples, an earlier turn), the unique part is
// the rest (input_length - context; 0 when every block recurs). The paper: "larger unique
// lengths correspond to fewer shared prefixes and lower expected cache hit rates". Dynamo's
// synthesizer samples the context as a path in a radix tree of shared prefixes and appends a
// user prompt whose length is sampled independently ("the synthesizer does not capture the
// correlation between context length and prompt length"). We model exactly that:
//   prompt    = the first `context` tokens of one of `tract_prefixes` shared prefix sequences
//               (uniformly chosen; group "prefix-<g>") + `unique` fresh tokens;
//   unique    ~ 0 with probability 1 - q, else Exponential(mean mu): a zero-inflated exponential,
//               the simplest non-negative law whose sd can exceed its mean; q = 2/(1 + (sd/mean)^2)
//               and mu = mean/q match Table 1's mean and sd exactly (A: q = 0.65, mu = 1655);
//   context   ~ log-normal with mean 4449 - unique_mean and variance 2424^2 - unique_sd^2, so
//               that input = context + unique has Table 1's input mean and sd (A: 3376, 1865);
//   output    ~ log-normal with mean 215, sd 263 (a normal with sd > mean would put a fifth of
//               its mass below zero; the log-normal keeps the mean without a spike at 1).
// After scaling: a prompt shorter than kMinPromptTokens gets more unique tokens; a longer one than
// max_prompt_tokens is cut at its end. The first unique token always differs from the prefix
// sequence's token at that position, so a request shares exactly `context` tokens with its group.
// Unique tokens are random, so two requests share them only by chance (under one block).
//
// kDocQa — long-document QA (Beluga Table 5's second run, TraCT's shared documents):
// documents × passes requests; pass-major, documents shuffled within each pass; request =
// document tokens + fresh question tokens; group "doc-<d>". The first pass fills a cache, later
// passes hit the whole document.
//
// kChat — multi-turn chat: sessions × turns requests, interleaved (request i is turn i/sessions of
// session i%sessions; group "session-<s>"). Turn t's prompt = turn t-1's prompt + turn t-1's
// answer + a fresh user message. The generator cannot know what the model will answer, so the
// "answer" is placeholder tokens of length max_new_tokens drawn from the seed; a server that
// appends its real answer to the history would see different tokens there.
//
// Thread-safety: free functions over values; no shared state.
#ifndef CXLKV_SRC_SERVE_WORKLOAD_H_
#define CXLKV_SRC_SERVE_WORKLOAD_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cxlkv/status.h"

namespace cxlkv::serve {

// No generated prompt is shorter than this.
inline constexpr uint32_t kMinPromptTokens = 16;
// LoadTrace refuses longer prompts (before allocating a synthetic one).
inline constexpr uint32_t kMaxTracePromptTokens = 1u << 20;
// GenerateWorkload refuses to make more requests than this.
inline constexpr uint64_t kMaxWorkloadRequests = 1u << 20;

struct Request {
  uint64_t id = 0;              // 0..n-1 in generation (or trace) order
  std::vector<int32_t> prompt;  // token ids in [0, vocab_size)
  uint32_t max_new_tokens = 1;  // >= 1
  double arrival_s = 0;         // open-loop arrival offset from start; 0 for closed-loop
  std::string group;            // what it shares a prefix with: "doc-3", "session-7",
                                // "prefix-1" ("" = nothing)

  friend bool operator==(const Request&, const Request&) = default;
};

enum class WorkloadKind { kTract, kDocQa, kChat };

struct WorkloadOptions {
  // Default kDocQa.
  WorkloadKind kind = WorkloadKind::kDocQa;
  // Number of requests for kTract (default 32; must be >= 1). kDocQa makes documents × passes
  // and kChat sessions × turns requests, and ignore this field.
  uint32_t requests = 32;
  // Default 1. Same options and seed → byte-identical requests.
  uint64_t seed = 1;
  // Token ids are drawn from [0, vocab_size). Default 4096; must be in [2, 2^31].
  uint32_t vocab_size = 4096;
  // Every length below (and TraCT's) is divided by this before use. Default 8 (a 2-core CPU
  // engine cannot prefill TraCT's 4449-token prompts in reasonable time); must be > 0.
  double scale = 8.0;
  // Clamp of prompt lengths after scaling (default 4096; must be >= kMinPromptTokens). kTract
  // cuts longer prompts; kDocQa and kChat refuse options that would exceed it.
  uint32_t max_prompt_tokens = 4096;
  // Clamp of output lengths after scaling (default 64; must be >= 1).
  uint32_t max_new_tokens_cap = 64;

  // kTract: which Table 1 set: 'A' (default), 'B' or 'C' (unique length 1073, 1215, 1631).
  char tract_set = 'A';
  // kTract: number of distinct shared prefixes (system prompts / few-shot sets). Default 4.
  uint32_t tract_prefixes = 4;

  // kDocQa: `documents` documents of `doc_tokens` tokens (before scale); each request = one
  // document + a fresh question of `question_tokens`, answered in `answer_tokens`; `passes`
  // passes over the same documents. Defaults 8, 6144, 256, 2, 64.
  uint32_t documents = 8;
  uint32_t doc_tokens = 6144;
  uint32_t question_tokens = 256;
  uint32_t passes = 2;
  uint32_t answer_tokens = 64;  // also kChat's answer length

  // kChat: `sessions` sessions of `turns` turns with `user_tokens`-token user messages (before
  // scale). Defaults 4, 4, 512.
  uint32_t sessions = 4;
  uint32_t turns = 4;
  uint32_t user_tokens = 512;
};

// Generates the request set `o` describes (see the top of this file).
// Returns kInvalidArgument, naming the field, for: zero requests (kTract), documents, passes,
// sessions, turns or token counts; vocab_size outside [2, 2^31]; scale <= 0 or not finite;
// max_prompt_tokens < kMinPromptTokens; max_new_tokens_cap 0; tract_set not A/B/C; a kDocQa or
// kChat prompt longer than max_prompt_tokens; more than kMaxWorkloadRequests requests.
Result<std::vector<Request>> GenerateWorkload(const WorkloadOptions& o);

// "tract" | "docqa" | "chat"; otherwise kInvalidArgument listing the valid names.
Result<WorkloadKind> ParseWorkloadKind(std::string_view name);
std::string_view WorkloadKindName(WorkloadKind k);

// Open loop: sets arrival_s of requests[i], in order, to the i+1-th event of a Poisson process of
// rate `qps` started at 0 (exponential gaps of mean 1/qps drawn from `seed`). Returns
// kInvalidArgument, changing nothing, if qps <= 0 or not finite.
Status AssignPoissonArrivals(std::vector<Request>& requests, double qps, uint64_t seed);

// Loads a JSONL trace, one request per line:
//   {"prompt": [ints...], "max_new_tokens": N, "arrival_s": x, "group": "g"}
// ("arrival_s", a number >= 0, and "group", a string, are optional), or the synthetic form
//   {"prompt_tokens": N, "prefix_group": "g", "prefix_tokens": M, "max_new_tokens": N, ...}
// with M <= N: requests naming the same prefix_group share exactly their first min(M) tokens,
// generated from the group name and `seed`; the other tokens are drawn from `seed` and the
// request's id. prefix_group and prefix_tokens come together or not at all; "group" defaults to
// prefix_group. Blank lines and lines whose first non-blank character is '#' are skipped; ids
// count the requests, 0..n-1. Errors: kNotFound if `path` does not exist (kPermissionDenied /
// kIoError for other failures to read it); kInvalidArgument "trace <path> line <n>: <what>" for
// malformed JSON, a non-object, a missing or mistyped field, a token outside [0, vocab_size),
// max_new_tokens 0, an unknown key, a prompt of 0 or more than kMaxTracePromptTokens tokens; and
// kInvalidArgument if the trace holds no request or vocab_size is outside [2, 2^31].
Result<std::vector<Request>> LoadTrace(const std::string& path, uint32_t vocab_size, uint64_t seed);

struct WorkloadSummary {
  uint64_t requests = 0;
  uint64_t prompt_tokens = 0;   // sum over requests
  uint64_t max_new_tokens = 0;  // sum over requests
  double mean_prompt = 0;
  double sd_prompt = 0;    // population standard deviation
  double mean_output = 0;  // mean max_new_tokens
  // Sum over requests, in order, of the longest common prefix (in tokens) with any earlier
  // request: what an infinite, token-granular prefix cache could reuse. Block granularity and
  // eviction only lower it.
  uint64_t shared_prefix_tokens_upper_bound = 0;
};

WorkloadSummary Summarize(std::span<const Request> requests);

}  // namespace cxlkv::serve

#endif  // CXLKV_SRC_SERVE_WORKLOAD_H_
