#include "pnm/service_protocol.h"

#include <algorithm>
#include <cstring>

namespace cxlkv::pnm {
namespace {

constexpr uint32_t kMaxStatusCode = static_cast<uint32_t>(StatusCode::kUnavailable);

Status Malformed(const char* what, size_t bytes, const std::string& why) {
  return InvalidArgument(std::string("malformed pnm ") + what + " of " + std::to_string(bytes) + " bytes: " + why +
                         " (see src/pnm/service_protocol.h for the encoding)");
}

template <typename T>
std::vector<uint8_t> Encoded(size_t bytes, const T& fill) {
  std::vector<uint8_t> out(bytes);
  meta::WireWriter w(out);
  fill(w);
  out.resize(w.size());
  return out;
}

bool GetFloats(meta::WireReader& r, size_t n, std::vector<float>* out) {
  if (n > r.remaining() / sizeof(float)) return false;
  out->resize(n);
  return r.Bytes(out->data(), n * sizeof(float));
}

void PutPageLists(meta::WireWriter& w, std::span<const std::span<const uint32_t>> lists) {
  w.Put(static_cast<uint32_t>(lists.size()));
  for (const auto& list : lists) {
    w.Put(static_cast<uint32_t>(list.size()));
    w.Bytes(list.data(), list.size() * sizeof(uint32_t));
  }
}

// At most `max_lists` lists; every count checked against the bytes left before it is allocated.
bool GetPageLists(meta::WireReader& r, uint32_t max_lists, std::vector<std::vector<uint32_t>>* out) {
  uint32_t lists = 0;
  if (!r.Get(&lists) || lists > max_lists || lists > r.remaining() / 4) return false;
  out->resize(lists);
  for (auto& list : *out) {
    uint32_t n = 0;
    if (!r.Get(&n) || n > r.remaining() / sizeof(uint32_t)) return false;
    list.resize(n);
    if (!r.Bytes(list.data(), size_t{n} * sizeof(uint32_t))) return false;
  }
  return true;
}

std::vector<std::span<const uint32_t>> Spans(const std::vector<std::vector<uint32_t>>& lists) {
  return {lists.begin(), lists.end()};
}

void PutJobFields(meta::WireWriter& w, const AttendJobRequest& j) {
  w.Put(j.context);
  w.Put(j.layer);
  w.Put(j.budget_tokens);
  w.Put(j.sink_pages);
  w.Put(j.recent_pages);
  w.Put(j.scale);
  w.Put(static_cast<uint32_t>(j.q.size()));
  w.Bytes(j.q.data(), j.q.size() * sizeof(float));
}

bool GetJobFields(meta::WireReader& r, AttendJobRequest* j) {
  uint32_t floats = 0;
  return r.Get(&j->context) && r.Get(&j->layer) && r.Get(&j->budget_tokens) && r.Get(&j->sink_pages) &&
         r.Get(&j->recent_pages) && r.Get(&j->scale) && r.Get(&floats) && GetFloats(r, floats, &j->q);
}

// The status, pages and partial of one answer's job; false if cut short. A failed job's status
// goes to a->status, and `*ok` says whether the job succeeded.
Status GetJobAnswer(meta::WireReader& r, size_t i, size_t jobs, std::pair<uint32_t, uint32_t> shape,
                    AttendJobAnswer* a, bool* ok) {
  uint32_t code = 0;
  *ok = false;
  if (!r.Get(&code) || !r.Get(&a->pages_attended) || code > kMaxStatusCode) {
    return Corrupted("pnm attend answer: job " + std::to_string(i) + " of " + std::to_string(jobs) +
                     " is cut short or has an unknown status");
  }
  if (code != 0) {
    std::string message;
    if (!r.Text(&message, kMaxJobMessage)) return Corrupted("pnm attend answer: job " + std::to_string(i) + "'s message is cut short");
    a->status = Status(static_cast<StatusCode>(code), "near-memory attention: " + message);
    return Status::Ok();
  }
  const auto [heads, dim] = shape;
  a->partial.num_heads = heads;
  a->partial.head_dim = dim;
  if (!GetFloats(r, size_t{heads} * dim, &a->partial.out) || !GetFloats(r, heads, &a->partial.lse)) {
    return Corrupted("pnm attend answer: job " + std::to_string(i) + "'s output is cut short");
  }
  *ok = true;
  return Status::Ok();
}

}  // namespace

std::string PnmServiceName(uint32_t node) { return "pnm-" + std::to_string(node); }

std::vector<uint8_t> EncodeOpen(const OpenRequest& r) {
  return Encoded(600, [&](meta::WireWriter& w) {
    meta::PutNamespace(w, r.ns);
    w.Put(r.num_heads);
    w.Put(r.client_life);
  });
}

Result<OpenRequest> DecodeOpen(std::span<const uint8_t> in) {
  meta::WireReader r(in);
  OpenRequest out;
  if (!meta::GetNamespace(r, &out.ns) || !r.Get(&out.num_heads) || !r.Get(&out.client_life) || !r.done()) {
    return Malformed("open", in.size(), "expected a namespace, a u32 head count and a u64 life");
  }
  return out;
}

std::vector<uint8_t> EncodeOpenAnswer(const OpenAnswer& a) {
  return Encoded(12, [&](meta::WireWriter& w) {
    w.Put(a.context);
    w.Put(a.lease_ms);
  });
}

Result<OpenAnswer> DecodeOpenAnswer(std::span<const uint8_t> in) {
  meta::WireReader r(in);
  OpenAnswer a;
  if (!r.Get(&a.context) || !r.Get(&a.lease_ms) || !r.done()) return Corrupted("pnm open answer of " + std::to_string(in.size()) + " bytes, expected 12");
  return a;
}

std::vector<uint8_t> EncodeExtend(const ExtendRequest& r) {
  return Encoded(20 + r.keys.size() * meta::kKeyBytes, [&](meta::WireWriter& w) {
    w.Put(r.context);
    w.Put(r.first_page);
    meta::PutKeys(w, r.keys);
  });
}

Result<ExtendRequest> DecodeExtend(std::span<const uint8_t> in) {
  meta::WireReader r(in);
  ExtendRequest out;
  if (!r.Get(&out.context) || !r.Get(&out.first_page) || !meta::GetKeys(r, &out.keys)) {
    return Malformed("extend", in.size(), "expected a context, a first page and a key batch that fills the rest");
  }
  if (out.keys.empty() || out.keys.size() > kMaxExtendKeys) {
    return Malformed("extend", in.size(), "a batch holds 1.." + std::to_string(kMaxExtendKeys) + " keys");
  }
  return out;
}

std::vector<uint8_t> EncodeExtendAnswer(const ExtendAnswer& a) {
  return Encoded(32, [&](meta::WireWriter& w) {
    w.Put(a.pages);
    w.Put(a.digests_found);
    w.Put(a.digests_built);
    w.Put(a.digests_stored);
  });
}

Result<ExtendAnswer> DecodeExtendAnswer(std::span<const uint8_t> in) {
  meta::WireReader r(in);
  ExtendAnswer a;
  if (!r.Get(&a.pages) || !r.Get(&a.digests_found) || !r.Get(&a.digests_built) || !r.Get(&a.digests_stored) ||
      !r.done()) {
    return Corrupted("pnm extend answer of " + std::to_string(in.size()) + " bytes, expected 32");
  }
  return a;
}

size_t AttendJobRequestBytes(size_t q_floats) { return 8 + 4 + 4 + 2 + 2 + 4 + 4 + q_floats * sizeof(float); }
size_t AttendJobAnswerBytes(uint32_t heads, uint32_t head_dim) {
  return 4 + 4 + (size_t{heads} * head_dim + heads) * sizeof(float);
}

void EncodeAttend(std::span<const AttendJobRequest> jobs, std::vector<uint8_t>& out) {
  size_t bytes = 4;
  for (const auto& j : jobs) bytes += AttendJobRequestBytes(j.q.size());
  out.resize(bytes);
  meta::WireWriter w(out);
  w.Put(static_cast<uint32_t>(jobs.size()));
  for (const auto& j : jobs) PutJobFields(w, j);
}

Result<std::vector<AttendJobRequest>> DecodeAttend(std::span<const uint8_t> in) {
  meta::WireReader r(in);
  uint32_t count = 0;
  // Every job takes at least its fixed fields: a count the bytes cannot hold is refused before
  // anything is allocated for it.
  if (!r.Get(&count) || count == 0 || count > r.remaining() / AttendJobRequestBytes(0)) {
    return Malformed("attend", in.size(), "the job count must be at least 1 and fit the request");
  }
  std::vector<AttendJobRequest> jobs(count);
  for (uint32_t i = 0; i < count; ++i) {
    if (!GetJobFields(r, &jobs[i])) return Malformed("attend", in.size(), "job " + std::to_string(i) + " runs past the end");
  }
  if (!r.done()) return Malformed("attend", in.size(), std::to_string(r.remaining()) + " bytes after the last job");
  return jobs;
}

void PutJobOk(meta::WireWriter& w, uint32_t pages_attended, const Partial& p) {
  w.Put(uint32_t{0});
  w.Put(pages_attended);
  w.Bytes(p.out.data(), p.out.size() * sizeof(float));
  w.Bytes(p.lse.data(), p.lse.size() * sizeof(float));
}

void PutJobError(meta::WireWriter& w, const Status& s) {
  w.Put(static_cast<uint32_t>(s.code()));
  w.Put(uint32_t{0});
  w.Text(s.message(), kMaxJobMessage);
}

Result<std::vector<AttendJobAnswer>> DecodeAttendAnswer(std::span<const uint8_t> in,
                                                        std::span<const std::pair<uint32_t, uint32_t>> shapes) {
  meta::WireReader r(in);
  std::vector<AttendJobAnswer> out(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    bool ok = false;
    CXLKV_RETURN_IF_ERROR(GetJobAnswer(r, i, shapes.size(), shapes[i], &out[i], &ok));
  }
  if (!r.done()) return Corrupted("pnm attend answer: " + std::to_string(r.remaining()) + " bytes after the last job");
  return out;
}

size_t PageListsBytes(std::span<const std::vector<uint32_t>> lists) {
  size_t bytes = 4;
  for (const auto& list : lists) bytes += 4 + list.size() * sizeof(uint32_t);
  return bytes;
}

size_t SplitRanksBytesBound(const AttendJobRequest& j, uint32_t kv_heads, uint64_t pages, uint32_t page_tokens) {
  const uint64_t most =
      std::min<uint64_t>(pages, uint64_t{j.budget_tokens} / std::max<uint32_t>(page_tokens, 1) + 1 + j.sink_pages +
                                    j.recent_pages);
  return 4 + size_t{kv_heads} * (4 + most * sizeof(uint32_t));
}

void EncodeAttendSplit(std::span<const AttendJobRequest> jobs, std::vector<uint8_t>& out) {
  size_t bytes = 4;
  for (const auto& j : jobs) bytes += AttendJobRequestBytes(j.q.size()) + PageListsBytes(j.held);
  out.resize(bytes);
  meta::WireWriter w(out);
  w.Put(static_cast<uint32_t>(jobs.size()));
  for (const auto& j : jobs) {
    PutJobFields(w, j);
    PutPageLists(w, Spans(j.held));
  }
}

Result<std::vector<AttendJobRequest>> DecodeAttendSplit(std::span<const uint8_t> in) {
  meta::WireReader r(in);
  uint32_t count = 0;
  if (!r.Get(&count) || count == 0 || count > r.remaining() / (AttendJobRequestBytes(0) + 4)) {
    return Malformed("split attend", in.size(), "the job count must be at least 1 and fit the request");
  }
  std::vector<AttendJobRequest> jobs(count);
  for (uint32_t i = 0; i < count; ++i) {
    if (!GetJobFields(r, &jobs[i]) || !GetPageLists(r, kMaxQueryHeads, &jobs[i].held)) {
      return Malformed("split attend", in.size(),
                       "job " + std::to_string(i) + " runs past the end or holds more than " +
                           std::to_string(kMaxQueryHeads) + " page lists");
    }
  }
  if (!r.done()) return Malformed("split attend", in.size(), std::to_string(r.remaining()) + " bytes after the last job");
  return jobs;
}

void PutSplitJobOk(meta::WireWriter& w, uint32_t pages_attended, const Partial& p,
                   std::span<const std::span<const uint32_t>> ranked) {
  PutJobOk(w, pages_attended, p);
  PutPageLists(w, ranked);
}

Result<std::vector<AttendJobAnswer>> DecodeAttendSplitAnswer(std::span<const uint8_t> in,
                                                             std::span<const std::pair<uint32_t, uint32_t>> shapes,
                                                             std::span<const uint32_t> kv_heads) {
  meta::WireReader r(in);
  std::vector<AttendJobAnswer> out(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    bool ok = false;
    CXLKV_RETURN_IF_ERROR(GetJobAnswer(r, i, shapes.size(), shapes[i], &out[i], &ok));
    if (!ok) continue;
    if (!GetPageLists(r, kv_heads[i], &out[i].ranked) || out[i].ranked.size() != kv_heads[i]) {
      return Corrupted("pnm split attend answer: job " + std::to_string(i) + "'s selection is cut short or not " +
                       std::to_string(kv_heads[i]) + " lists");
    }
  }
  if (!r.done()) return Corrupted("pnm split attend answer: " + std::to_string(r.remaining()) + " bytes after the last job");
  return out;
}

std::vector<uint8_t> EncodeContexts(std::span<const uint64_t> contexts) {
  return Encoded(4 + contexts.size() * 8, [&](meta::WireWriter& w) {
    w.Put(static_cast<uint32_t>(contexts.size()));
    for (uint64_t c : contexts) w.Put(c);
  });
}

Result<std::vector<uint64_t>> DecodeContexts(std::span<const uint8_t> in) {
  meta::WireReader r(in);
  uint32_t n = 0;
  if (!r.Count(&n, 8)) return Malformed("context list", in.size(), "a u32 count must be followed by that many u64");
  std::vector<uint64_t> out(n);
  for (uint64_t& c : out) r.Get(&c);
  return out;
}

}  // namespace cxlkv::pnm
