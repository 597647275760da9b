// The near-memory attention service's requests (PNM §3.2; docs/pnm.md, "Engines in
// cxlkvd"): one opcode table and one binary encoding shared by the service (daemon/pnm_service.h)
// and its client (pnm/remote.h), fuzzed with the other decoders (fuzz/frame_fuzz.cc).
//
// Each node's cxlkvd may serve "pnm-<node>": attention next to the memory that holds the KV.
// A decode worker opens a context — a sequence of pool blocks (pages) of one KV namespace — by
// their keys; the daemon pins the blocks and builds (or finds in the pool) their page digests.
// Per decode step only the query goes in and the output and log-sum-exp come back, whatever
// the context's length. A context is leased: one the client neither uses nor renews for the
// lease is closed by the daemon (a crashed or paused client's pins do not stay forever).
//
// Encoding: little-endian fixed-width fields, meta::WireWriter/WireReader (meta/protocol.h).
// Every decoder checks counts against the bytes: a request is a stranger's.
//   kPnmOpen     namespace (model, extra key, layout), u32 query heads, u64 the client node's life
//                -> u64 context, u32 lease ms
//   kPnmExtend   u64 context, u64 first page, key batch (u32 count, keys) -> ExtendAnswer
//   kPnmAttend   u32 jobs, per job: u64 context, u32 layer, u32 budget tokens (0: every page),
//                u16 sink pages, u16 recent pages, f32 scale (0: 1/sqrt(head_dim)), u32 q floats,
//                the floats -> per job: u32 status code, u32 pages attended, then the output
//                ([heads][head_dim] f32) and the lse ([heads] f32) if ok, else u16 length and
//                the error's message
//   kPnmAttendSplit  as kPnmAttend (a budget is required), each job followed by u32 hold
//                capacity (pages per KV head), u32 KV heads, per head the pages the engine holds
//                as an ascending page list -> per job as kPnmAttend's answer, for the selected
//                pages the engine does not hold, followed per KV head by u32 pages selected, the
//                held pages still selected as bits (u32 count, then (count + 7) / 8 bytes, bit i of
//                byte i / 8 for the request's i-th page, spare bits 0) and the pages to recall as
//                an ascending page list: the best selected pages not held, at most the capacity
//                left. The hybrid (§3.3): the engine attends its held selected pages and steps
//                its held set (steady selection, steady.h) without the whole ranking crossing.
//   ascending page list: u32 count, then per page a LEB128 varint (shortest form): the first
//                page, then each page minus the one before minus 1 — about a byte per page of
//                a budget's selection, so a 1M-token context's hybrid fits a slot (4 bytes per
//                page did not at 1/8)
//   kPnmRenew    u32 count, u64 contexts -> u32 how many were renewed
//   kPnmClose    u32 count, u64 contexts -> nothing (kNotFound naming the first one not open)
#ifndef CXLKV_SRC_PNM_SERVICE_PROTOCOL_H_
#define CXLKV_SRC_PNM_SERVICE_PROTOCOL_H_

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cxlkv/cache.h"
#include "cxlkv/status.h"
#include "meta/protocol.h"
#include "pnm/attend.h"
#include "rpc/area.h"

namespace cxlkv::pnm {

enum PnmOp : uint32_t {
  kPnmOpen = 1,    // not idempotent: makes a context
  kPnmExtend = 2,  // not idempotent: pins blocks (a repeat is refused by its first page)
  kPnmAttend = 3,  // idempotent: reads only
  kPnmRenew = 4,   // idempotent
  kPnmClose = 5,   // idempotent: closing a closed context is kNotFound, which clients ignore
  kPnmAttendSplit = 6,  // idempotent: reads only
};

std::string PnmServiceName(uint32_t node);

// Slots sized for one layer's query of a large model (32 heads × 128 × 4 bytes = 16 KiB) with
// room, or several small ones; a context's keys go in batches of kMaxExtendKeys. The area is
// nodes × clients × depth × (request + response) of the region: 8 MiB for 16 nodes.
inline rpc::RpcGeometry PnmGeometry() {
  return {.clients_per_node = 4, .depth = 2, .request_bytes = 32 << 10, .response_bytes = 32 << 10};
}
inline constexpr size_t kMaxExtendKeys = 1024;
inline constexpr size_t kMaxJobMessage = 160;  // bytes of a failed job's message in an answer
inline constexpr uint32_t kMaxQueryHeads = 256;

struct OpenRequest {
  KeyNamespace ns;          // the KV's namespace (pool block format 1, K and V)
  uint32_t num_heads = 0;   // query heads: a multiple of ns.layout.num_kv_heads
  uint64_t client_life = 0; // the client's node incarnation: the context ends with that life
};
struct OpenAnswer {
  uint64_t context = 0;
  uint32_t lease_ms = 0;  // idle time after which the daemon closes the context
};

struct ExtendRequest {
  uint64_t context = 0;
  uint64_t first_page = 0;  // must equal the context's page count (a repeat is refused)
  std::vector<BlockKey> keys;
};
struct ExtendAnswer {
  uint64_t pages = 0;           // the context's pages now
  uint64_t digests_found = 0;   // of this batch: digests read from the pool
  uint64_t digests_built = 0;   // built from the keys (and stored in the pool when it had room)
  uint64_t digests_stored = 0;  // of those built, stored for the next reader
};

struct AttendJobRequest {
  uint64_t context = 0;
  uint32_t layer = 0;
  uint32_t budget_tokens = 0;  // 0: every page (dense)
  uint16_t sink_pages = 1;
  uint16_t recent_pages = 1;
  float scale = 0;
  std::vector<float> q;  // [heads][head_dim]
  // kPnmAttendSplit: per KV head, the pages the engine holds, ascending (attended there, not
  // here), and how many pages it holds at most per KV head (the answer's recalls fill the rest).
  std::vector<std::vector<uint32_t>> held;
  uint32_t hold_capacity = 0;
};
// kPnmAttendSplit's answer for one KV head: what the engine needs to attend its part and step
// its held set, instead of the whole ranking.
struct SplitHeadAnswer {
  uint32_t selected = 0;         // pages in the head's selection, held ones included
  std::vector<uint8_t> stays;    // per held page of the request, in its order: 1 if still selected
  std::vector<uint32_t> recall;  // the best selected pages not held, at most capacity − stayed; ascending
};
struct AttendJobAnswer {
  Status status;
  uint32_t pages_attended = 0;
  Partial partial;  // ok only
  // kPnmAttendSplit, ok only: one per KV head.
  std::vector<SplitHeadAnswer> heads;
};
std::vector<uint8_t> EncodeOpen(const OpenRequest& r);
Result<OpenRequest> DecodeOpen(std::span<const uint8_t> in);
std::vector<uint8_t> EncodeOpenAnswer(const OpenAnswer& a);
Result<OpenAnswer> DecodeOpenAnswer(std::span<const uint8_t> in);

std::vector<uint8_t> EncodeExtend(const ExtendRequest& r);
Result<ExtendRequest> DecodeExtend(std::span<const uint8_t> in);
std::vector<uint8_t> EncodeExtendAnswer(const ExtendAnswer& a);
Result<ExtendAnswer> DecodeExtendAnswer(std::span<const uint8_t> in);

// Bytes one job takes in a request, and in an answer when it succeeds (a failure takes less).
size_t AttendJobRequestBytes(size_t q_floats);
size_t AttendJobAnswerBytes(uint32_t heads, uint32_t head_dim);
void EncodeAttend(std::span<const AttendJobRequest> jobs, std::vector<uint8_t>& out);
Result<std::vector<AttendJobRequest>> DecodeAttend(std::span<const uint8_t> in);
// The answer to a batch: one record per job, appended in job order.
void PutJobOk(meta::WireWriter& w, uint32_t pages_attended, const Partial& p);
void PutJobError(meta::WireWriter& w, const Status& s);
// `shapes` (heads, head_dim) per job: an answer's shapes are the caller's own contexts'.
Result<std::vector<AttendJobAnswer>> DecodeAttendAnswer(std::span<const uint8_t> in,
                                                        std::span<const std::pair<uint32_t, uint32_t>> shapes);

// kPnmAttendSplit. The bytes a job's capacity and held lists take in a request (exact).
size_t HeldListsBytes(std::span<const std::vector<uint32_t>> held);
// Empty when every list is strictly ascending; else which list is not (the encoding needs it).
std::string UnorderedHeldList(std::span<const std::vector<uint32_t>> held);
// The most bytes a split answer's per-head part takes for a job (its held lists and capacity
// read) over a context of `pages` pages of `page_tokens` tokens and `kv_heads` KV heads: each
// head's selection is the budget's pages plus the forced ones, or every page when those cover
// the context. Client and daemon size slots by it.
size_t SplitAnswerBytesBound(const AttendJobRequest& j, uint32_t kv_heads, uint64_t pages, uint32_t page_tokens);
// The answer's part for one KV head: `ranked` is its selection best first, `held` the request's
// list for it (ascending), `capacity` the request's.
SplitHeadAnswer SplitHeadOf(std::span<const uint32_t> ranked, std::span<const uint32_t> held, uint32_t capacity);
void EncodeAttendSplit(std::span<const AttendJobRequest> jobs, std::vector<uint8_t>& out);
// Refuses more than kMaxQueryHeads lists in a job (a context has at most as many KV heads).
Result<std::vector<AttendJobRequest>> DecodeAttendSplit(std::span<const uint8_t> in);
// An answer's job that succeeded: PutJobOk's record, then one SplitHeadAnswer per KV head.
void PutSplitJobOk(meta::WireWriter& w, uint32_t pages_attended, const Partial& p,
                   std::span<const SplitHeadAnswer> heads);
// `kv_heads` per job: the heads an answer must carry for it.
Result<std::vector<AttendJobAnswer>> DecodeAttendSplitAnswer(std::span<const uint8_t> in,
                                                             std::span<const std::pair<uint32_t, uint32_t>> shapes,
                                                             std::span<const uint32_t> kv_heads);

std::vector<uint8_t> EncodeContexts(std::span<const uint64_t> contexts);
Result<std::vector<uint64_t>> DecodeContexts(std::span<const uint8_t> in);

}  // namespace cxlkv::pnm

#endif  // CXLKV_SRC_PNM_SERVICE_PROTOCOL_H_
