#include "pnm/service_protocol.h"

#include <algorithm>
#include <cstdint>
#include <functional>
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

// LEB128, shortest form: 7 bits a byte, low first, the high bit set on every byte but the last.
size_t VarintBytes(uint32_t v) {
  size_t n = 1;
  for (; v >= 0x80; v >>= 7) ++n;
  return n;
}

void PutVarint(meta::WireWriter& w, uint32_t v) {
  for (; v >= 0x80; v >>= 7) w.Put(static_cast<uint8_t>((v & 0x7f) | 0x80));
  w.Put(static_cast<uint8_t>(v));
}

// Refuses a value past 32 bits and a longer form than needed (a last byte of 0 after others),
// so every list has one encoding.
bool GetVarint(meta::WireReader& r, uint32_t* v) {
  uint64_t value = 0;
  for (int shift = 0; shift < 35; shift += 7) {
    uint8_t b = 0;
    if (!r.Get(&b)) return false;
    value |= uint64_t{b & 0x7fu} << shift;
    if ((b & 0x80) == 0) {
      if (b == 0 && shift > 0) return false;
      if (value > UINT32_MAX) return false;
      *v = static_cast<uint32_t>(value);
      return true;
    }
  }
  return false;
}

// An ascending page list (service_protocol.h): the first page, then each gap minus 1.
size_t AscendingBytes(std::span<const uint32_t> pages) {
  size_t bytes = 4;
  for (size_t i = 0; i < pages.size(); ++i) bytes += VarintBytes(i == 0 ? pages[0] : pages[i] - pages[i - 1] - 1);
  return bytes;
}

// REQUIRES: `pages` strictly ascending.
void PutAscending(meta::WireWriter& w, std::span<const uint32_t> pages) {
  w.Put(static_cast<uint32_t>(pages.size()));
  for (size_t i = 0; i < pages.size(); ++i) PutVarint(w, i == 0 ? pages[0] : pages[i] - pages[i - 1] - 1);
}

// Every count checked against the bytes left (a page takes at least one) before it is allocated;
// a list that would pass page 2^32 - 1 is refused.
bool GetAscending(meta::WireReader& r, std::vector<uint32_t>* out) {
  uint32_t n = 0;
  if (!r.Get(&n) || n > r.remaining()) return false;
  out->resize(n);
  uint64_t next = 0;  // the least the next page may be
  for (uint32_t i = 0; i < n; ++i) {
    uint32_t v = 0;
    if (!GetVarint(r, &v)) return false;
    const uint64_t page = next + v;
    if (page > UINT32_MAX) return false;
    (*out)[i] = static_cast<uint32_t>(page);
    next = page + 1;
  }
  return true;
}

// The most bytes an ascending list of `n` pages below `limit` takes: a byte per page, and one
// more per page for each 7 bits its value needs past the first 7 — values that sum to below
// `limit`, so at most limit / 128 of them need two bytes, limit / 2^14 three, and so on.
size_t AscendingBytesBound(uint64_t n, uint64_t limit) {
  return static_cast<size_t>(4 + n + limit / (1u << 7) + limit / (1u << 14) + limit / (1u << 21) + limit / (1u << 28));
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

size_t HeldListsBytes(std::span<const std::vector<uint32_t>> held) {
  size_t bytes = 8;  // the capacity and the list count
  for (const auto& list : held) bytes += AscendingBytes(list);
  return bytes;
}

std::string UnorderedHeldList(std::span<const std::vector<uint32_t>> held) {
  for (size_t h = 0; h < held.size(); ++h) {
    if (std::adjacent_find(held[h].begin(), held[h].end(), std::greater_equal<>()) != held[h].end()) {
      return "the held pages of KV head " + std::to_string(h) + " are not strictly ascending";
    }
  }
  return {};
}

size_t SplitAnswerBytesBound(const AttendJobRequest& j, uint32_t kv_heads, uint64_t pages, uint32_t page_tokens) {
  const uint64_t most =
      std::min<uint64_t>(pages, uint64_t{j.budget_tokens} / std::max<uint32_t>(page_tokens, 1) + 1 + j.sink_pages +
                                    j.recent_pages);
  size_t bytes = 0;
  for (uint32_t h = 0; h < kv_heads; ++h) {
    const uint64_t held = h < j.held.size() ? j.held[h].size() : 0;
    bytes += 4 + 4 + (held + 7) / 8 + AscendingBytesBound(std::min<uint64_t>(most, j.hold_capacity), pages);
  }
  return bytes;
}

SplitHeadAnswer SplitHeadOf(std::span<const uint32_t> ranked, std::span<const uint32_t> held, uint32_t capacity) {
  SplitHeadAnswer a;
  a.selected = static_cast<uint32_t>(ranked.size());
  std::vector<uint32_t> selected(ranked.begin(), ranked.end());
  std::sort(selected.begin(), selected.end());
  a.stays.resize(held.size());
  uint32_t stayed = 0;
  for (size_t i = 0; i < held.size(); ++i) {
    a.stays[i] = std::binary_search(selected.begin(), selected.end(), held[i]) ? 1 : 0;
    stayed += a.stays[i];
  }
  // The best selected pages the engine lacks, as many as its held set has room for after the
  // pages that left it: what steady selection recalls (steady.h).
  const uint32_t room = capacity > stayed ? capacity - stayed : 0;
  for (uint32_t page : ranked) {
    if (a.recall.size() == room) break;
    if (!std::binary_search(held.begin(), held.end(), page)) a.recall.push_back(page);
  }
  std::sort(a.recall.begin(), a.recall.end());
  return a;
}

void EncodeAttendSplit(std::span<const AttendJobRequest> jobs, std::vector<uint8_t>& out) {
  size_t bytes = 4;
  for (const auto& j : jobs) bytes += AttendJobRequestBytes(j.q.size()) + HeldListsBytes(j.held);
  out.resize(bytes);
  meta::WireWriter w(out);
  w.Put(static_cast<uint32_t>(jobs.size()));
  for (const auto& j : jobs) {
    PutJobFields(w, j);
    w.Put(j.hold_capacity);
    w.Put(static_cast<uint32_t>(j.held.size()));
    for (const auto& list : j.held) PutAscending(w, list);
  }
}

Result<std::vector<AttendJobRequest>> DecodeAttendSplit(std::span<const uint8_t> in) {
  meta::WireReader r(in);
  uint32_t count = 0;
  if (!r.Get(&count) || count == 0 || count > r.remaining() / (AttendJobRequestBytes(0) + 8)) {
    return Malformed("split attend", in.size(), "the job count must be at least 1 and fit the request");
  }
  std::vector<AttendJobRequest> jobs(count);
  for (uint32_t i = 0; i < count; ++i) {
    AttendJobRequest& j = jobs[i];
    uint32_t lists = 0;
    bool ok = GetJobFields(r, &j) && r.Get(&j.hold_capacity) && r.Get(&lists) && lists <= kMaxQueryHeads &&
              lists <= r.remaining() / 4;
    if (ok) j.held.resize(lists);
    for (uint32_t h = 0; ok && h < lists; ++h) ok = GetAscending(r, &j.held[h]);
    if (!ok) {
      return Malformed("split attend", in.size(),
                       "job " + std::to_string(i) + " runs past the end, holds more than " +
                           std::to_string(kMaxQueryHeads) + " page lists, or a list's pages pass 2^32 or are not "
                           "in the shortest form");
    }
  }
  if (!r.done()) return Malformed("split attend", in.size(), std::to_string(r.remaining()) + " bytes after the last job");
  return jobs;
}

void PutSplitJobOk(meta::WireWriter& w, uint32_t pages_attended, const Partial& p,
                   std::span<const SplitHeadAnswer> heads) {
  PutJobOk(w, pages_attended, p);
  for (const SplitHeadAnswer& h : heads) {
    w.Put(h.selected);
    w.Put(static_cast<uint32_t>(h.stays.size()));
    for (size_t i = 0; i < h.stays.size(); i += 8) {
      uint8_t bits = 0;
      for (size_t b = 0; b < 8 && i + b < h.stays.size(); ++b) bits |= static_cast<uint8_t>((h.stays[i + b] ? 1 : 0) << b);
      w.Put(bits);
    }
    PutAscending(w, h.recall);
  }
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
    if (kv_heads[i] > r.remaining() / 12) {
      return Corrupted("pnm split attend answer: job " + std::to_string(i) + " is cut short before its " +
                       std::to_string(kv_heads[i]) + " KV heads");
    }
    out[i].heads.resize(kv_heads[i]);
    for (uint32_t h = 0; h < kv_heads[i]; ++h) {
      SplitHeadAnswer& a = out[i].heads[h];
      uint32_t bits = 0;
      bool good = r.Get(&a.selected) && r.Get(&bits) && (uint64_t{bits} + 7) / 8 <= r.remaining();
      if (good) a.stays.resize(bits);
      for (uint32_t b = 0; good && b < bits; b += 8) {
        uint8_t byte = 0;
        good = r.Get(&byte);
        const uint32_t used = std::min<uint32_t>(8, bits - b);
        if (used < 8 && (byte >> used) != 0) good = false;  // spare bits must be 0: one encoding
        for (uint32_t k = 0; good && k < used; ++k) a.stays[b + k] = (byte >> k) & 1;
      }
      if (!good || !GetAscending(r, &a.recall)) {
        return Corrupted("pnm split attend answer: job " + std::to_string(i) + "'s KV head " + std::to_string(h) +
                         " is cut short or malformed");
      }
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
