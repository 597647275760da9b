// Workload generators, Poisson arrivals, JSONL traces and summaries (see workload.h).
#include "serve/workload.h"

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

constexpr double kPi = 3.14159265358979323846;

// Independent random streams: each purpose draws from its own mt19937_64, seeded from
// (seed, stream, index), so e.g. a document's tokens do not depend on how many questions came
// before it.
enum class Stream : uint64_t {
  kMain = 1,      // per-request draws of the generators, in request order
  kPrefix,        // kTract's shared prefix sequences, index = prefix number
  kDocument,      // kDocQa's documents, index = document number
  kArrival,       // Poisson gaps
  kTraceGroup,    // a trace's prefix_group sequences, index = hash of the group name
  kTraceRequest,  // a synthetic trace request's own tokens, index = request id
};

// SplitMix64's finalizer: a bijective 64-bit mix.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t StreamSeed(uint64_t seed, Stream stream, uint64_t index) {
  return Mix(Mix(seed ^ Mix(static_cast<uint64_t>(stream))) ^ index);
}

// FNV-1a over the bytes of `s`: portable, unlike std::hash.
uint64_t Fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

// mt19937_64 (whose output the standard fixes) plus distributions written out here, since
// <random>'s distributions are implementation-defined.
class Rng {
 public:
  explicit Rng(uint64_t seed) : g_(seed) {}

  // Uniform in [0, 1), 53 random bits.
  double Uniform() { return static_cast<double>(g_() >> 11) * 0x1.0p-53; }

  // Uniform in [0, n), unbiased: rejects the lowest 2^64 mod n values. REQUIRES: n >= 1.
  uint64_t Below(uint64_t n) {
    const uint64_t threshold = (0 - n) % n;
    for (;;) {
      const uint64_t r = g_();
      if (r >= threshold) return r % n;
    }
  }

  // Standard normal by Box–Muller (cosine branch only).
  double Normal() {
    const double u1 = 1.0 - Uniform();  // (0, 1]: log(u1) is finite
    const double u2 = Uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * kPi * u2);
  }

  double Exponential(double mean) { return -mean * std::log(1.0 - Uniform()); }

  // Log-normal with the given mean and standard deviation (moment-matched). REQUIRES: mean > 0.
  double LogNormal(double mean, double sd) {
    const double s2 = std::log1p((sd * sd) / (mean * mean));
    return std::exp(std::log(mean) - s2 / 2 + std::sqrt(s2) * Normal());
  }

  int32_t Token(uint32_t vocab) { return static_cast<int32_t>(Below(vocab)); }

  // A token other than `avoid`, uniform over the rest. REQUIRES: vocab >= 2.
  int32_t TokenOtherThan(uint32_t vocab, int32_t avoid) {
    const auto t = static_cast<int32_t>(Below(vocab - 1));
    return t >= avoid ? t + 1 : t;
  }

  void AppendTokens(uint32_t vocab, uint64_t n, std::vector<int32_t>& out) {
    for (uint64_t i = 0; i < n; ++i) out.push_back(Token(vocab));
  }

 private:
  std::mt19937_64 g_;
};

// `tokens / scale`, rounded; saturates far above any limit so huge values stay comparable.
uint64_t Scaled(double tokens, double scale) {
  const double v = tokens / scale;
  if (!(v < 1e15)) return static_cast<uint64_t>(1e15);
  return static_cast<uint64_t>(std::llround(std::max(v, 0.0)));
}

uint32_t ClampOutput(uint64_t n, uint32_t cap) {
  return static_cast<uint32_t>(std::clamp<uint64_t>(n, 1, cap));
}

std::string Num(uint64_t v) { return std::to_string(v); }

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

// ---- Traces --------------------------------------------------------------------------------

using Json = nlohmann::json;

constexpr const char* kTraceKeys[] = {"prompt",        "prompt_tokens",  "prefix_group",
                                      "prefix_tokens", "max_new_tokens", "arrival_s",
                                      "group"};

Result<std::string> ReadWholeFile(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    const int e = errno;
    const std::string why = std::generic_category().message(e);
    if (e == ENOENT || e == ENOTDIR) return NotFound("trace " + path + " does not exist");
    if (e == EACCES || e == EPERM) return PermissionDenied("trace " + path + ": " + why);
    return IoError("cannot open trace " + path + ": " + why);
  }
  std::string text;
  char buf[1 << 16];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, got);
  const bool failed = std::ferror(f) != 0;
  const int e = errno;
  std::fclose(f);
  if (failed) {
    return IoError("cannot read trace " + path + ": " + std::generic_category().message(e));
  }
  return text;
}

// An integer field in [lo, hi].
Result<int64_t> IntField(const Json& v, const std::string& key, int64_t lo, int64_t hi) {
  const std::string range = " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  if (v.is_number_unsigned()) {
    const auto x = v.get<uint64_t>();
    if (x < static_cast<uint64_t>(lo) || x > static_cast<uint64_t>(hi)) {
      return InvalidArgument("\"" + key + "\" " + std::to_string(x) + range);
    }
    return static_cast<int64_t>(x);
  }
  if (v.is_number_integer()) {
    const auto x = v.get<int64_t>();
    if (x < lo || x > hi) return InvalidArgument("\"" + key + "\" " + std::to_string(x) + range);
    return x;
  }
  return InvalidArgument("\"" + key + "\" must be an integer, got " + v.type_name());
}

Result<std::string> StringField(const Json& v, const std::string& key) {
  if (!v.is_string()) {
    return InvalidArgument("\"" + key + "\" must be a string, got " + v.type_name());
  }
  return v.get<std::string>();
}

// A trace's prefix_group sequences, extended on demand; a stream's prefix is the same however
// far it has been extended, so a group's first M tokens do not depend on the other lines.
class GroupSequences {
 public:
  GroupSequences(uint32_t vocab, uint64_t seed) : vocab_(vocab), seed_(seed) {}

  // The first `n` tokens of `group`'s sequence.
  const std::vector<int32_t>& Get(const std::string& group, uint64_t n) {
    auto it = groups_.find(group);
    if (it == groups_.end()) {
      it = groups_
               .emplace(group, Entry{Rng(StreamSeed(seed_, Stream::kTraceGroup, Fnv1a(group))), {}})
               .first;
    }
    Entry& e = it->second;
    if (e.tokens.size() < n) e.rng.AppendTokens(vocab_, n - e.tokens.size(), e.tokens);
    return e.tokens;
  }

 private:
  struct Entry {
    Rng rng;
    std::vector<int32_t> tokens;
  };
  uint32_t vocab_;
  uint64_t seed_;
  std::unordered_map<std::string, Entry> groups_;
};

// Parses one trace line's object into `r` (whose id is set). Errors say what, not where.
Status ParseTraceRequest(const Json& j, uint32_t vocab, uint64_t seed, GroupSequences& groups,
                         Request& r) {
  if (!j.is_object()) {
    return InvalidArgument(std::string("expected a JSON object, got ") + j.type_name());
  }
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (std::find_if(std::begin(kTraceKeys), std::end(kTraceKeys),
                     [&](const char* k) { return it.key() == k; }) == std::end(kTraceKeys)) {
      return InvalidArgument("unknown key \"" + it.key() +
                             "\" (expected prompt or prompt_tokens, prefix_group, prefix_tokens, "
                             "max_new_tokens, arrival_s, group)");
    }
  }
  const auto prompt = j.find("prompt");
  const auto prompt_tokens = j.find("prompt_tokens");
  const auto prefix_group = j.find("prefix_group");
  const auto prefix_tokens = j.find("prefix_tokens");
  const auto max_new = j.find("max_new_tokens");
  const auto arrival = j.find("arrival_s");
  const auto group = j.find("group");
  if (max_new == j.end()) return InvalidArgument("missing \"max_new_tokens\"");
  CXLKV_ASSIGN_OR_RETURN(
      int64_t m, IntField(*max_new, "max_new_tokens", 1, std::numeric_limits<uint32_t>::max()));
  r.max_new_tokens = static_cast<uint32_t>(m);
  if (arrival != j.end()) {
    if (!arrival->is_number() || !std::isfinite(arrival->get<double>()) ||
        arrival->get<double>() < 0) {
      return InvalidArgument("\"arrival_s\" must be a number >= 0, got " +
                             arrival->dump(-1, ' ', false, Json::error_handler_t::replace));
    }
    r.arrival_s = arrival->get<double>();
  }
  if (group != j.end()) {
    CXLKV_ASSIGN_OR_RETURN(r.group, StringField(*group, "group"));
  }

  if (prompt != j.end()) {
    if (prompt_tokens != j.end() || prefix_group != j.end() || prefix_tokens != j.end()) {
      return InvalidArgument(
          "\"prompt\" excludes the synthetic form (prompt_tokens, prefix_group, prefix_tokens)");
    }
    if (!prompt->is_array()) {
      return InvalidArgument(std::string("\"prompt\" must be an array of token ids, got ") +
                             prompt->type_name());
    }
    if (prompt->empty() || prompt->size() > kMaxTracePromptTokens) {
      return InvalidArgument("\"prompt\" has " + Num(prompt->size()) + " tokens, outside [1, " +
                             Num(kMaxTracePromptTokens) + "]");
    }
    r.prompt.reserve(prompt->size());
    for (size_t i = 0; i < prompt->size(); ++i) {
      const std::string key = "prompt[" + Num(i) + "]";
      CXLKV_ASSIGN_OR_RETURN(int64_t t, IntField((*prompt)[i], key, 0, int64_t{vocab} - 1));
      r.prompt.push_back(static_cast<int32_t>(t));
    }
    return Status::Ok();
  }

  if (prompt_tokens == j.end()) {
    return InvalidArgument("missing \"prompt\" (token ids) or \"prompt_tokens\" (a length)");
  }
  CXLKV_ASSIGN_OR_RETURN(int64_t n,
                         IntField(*prompt_tokens, "prompt_tokens", 1, kMaxTracePromptTokens));
  if ((prefix_group == j.end()) != (prefix_tokens == j.end())) {
    return InvalidArgument("\"prefix_group\" and \"prefix_tokens\" come together");
  }
  Rng rng(StreamSeed(seed, Stream::kTraceRequest, r.id));
  r.prompt.reserve(static_cast<size_t>(n));
  if (prefix_group != j.end()) {
    CXLKV_ASSIGN_OR_RETURN(std::string name, StringField(*prefix_group, "prefix_group"));
    CXLKV_ASSIGN_OR_RETURN(int64_t m, IntField(*prefix_tokens, "prefix_tokens", 0, n));
    // One more token than shared, so the request's own part starts with a different token and
    // the group shares exactly min(M) tokens.
    const std::vector<int32_t>& seq = groups.Get(name, static_cast<uint64_t>(m) + 1);
    r.prompt.assign(seq.begin(), seq.begin() + m);
    if (m < n) r.prompt.push_back(rng.TokenOtherThan(vocab, seq[static_cast<size_t>(m)]));
    if (group == j.end()) r.group = std::move(name);
  }
  rng.AppendTokens(vocab, static_cast<uint64_t>(n) - r.prompt.size(), r.prompt);
  return Status::Ok();
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

Result<std::vector<Request>> LoadTrace(const std::string& path, uint32_t vocab_size,
                                       uint64_t seed) {
  if (vocab_size < 2 || vocab_size > (1u << 31)) {
    return InvalidArgument("vocab_size " + Num(vocab_size) + " is outside [2, 2^31]");
  }
  CXLKV_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(path));
  GroupSequences groups(vocab_size, seed);
  std::vector<Request> out;
  uint64_t line_no = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    const size_t first = line.find_first_not_of(" \t");
    if (first == std::string_view::npos || line[first] == '#') continue;

    const std::string where = "trace " + path + " line " + Num(line_no) + ": ";
    Json j;
    try {
      j = Json::parse(line);
    } catch (const Json::exception& e) {  // parse_error; nothing else escapes parse
      return InvalidArgument(where + "malformed JSON (" + e.what() + ")");
    }
    Request r;
    r.id = out.size();
    Status s = ParseTraceRequest(j, vocab_size, seed, groups, r);
    if (!s.ok()) return InvalidArgument(where + s.message());
    out.push_back(std::move(r));
  }
  if (out.empty()) return InvalidArgument("trace " + path + " holds no request");
  return out;
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
