// JSONL traces of requests (see workload.h, LoadTrace).
#include <cerrno>
#include <cstdio>
#include <string>
#include <system_error>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "serve/workload.h"
#include "serve/workload_random.h"

namespace cxlkv::serve {
namespace {

using namespace workload_internal;  // NOLINT: the generators' own helpers

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

}  // namespace cxlkv::serve
