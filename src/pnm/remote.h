// The calling side of the near-memory attention service (service_protocol.h; docs/pnm.md,
// "Engines in cxlkvd"): a decode worker's way to run attention where the KV lives.
//
//   auto nm = pnm::NearMemoryClient::Open(pool, node);            // that node's cxlkvd
//   auto ctx = (*nm)->OpenContext(ns, num_heads, prompt_keys);    // pins the blocks there
//   pnm::NearMemoryClient::Job job{.context = *ctx, .layer = l, .q = q, .budget_tokens = 2048, .out = &partial};
//   (*nm)->Attend({&job, 1});                                      // q in; out and lse back
//   ... merge `partial` with the engine's own tokens by LSE (pnm::MergeInto) ...
//   (*nm)->Close({&*ctx, 1});
//
// A context is leased by the daemon: use it (Attend) or Renew it more often than the lease the
// open returned, or it is closed and the next request gets kNotFound (then open it again).
// Requests of a batch are packed into as few RPC requests as the slots hold and pipelined.
//
// One client per process and node: a process has one channel per service (its process slot's).
// Thread-safety: all methods are thread-safe (the RPC client serializes its ring).
#ifndef CXLKV_SRC_PNM_REMOTE_H_
#define CXLKV_SRC_PNM_REMOTE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <utility>

#include "cxlkv/cache.h"
#include "cxlkv/pool.h"
#include "cxlkv/status.h"
#include "pnm/attend.h"
#include "pnm/service_protocol.h"
#include "rpc/client.h"

namespace cxlkv::pnm {

// One KV head's answer to a split attend: what the engine needs to attend its held part and to
// step its held set (steady selection, steady.h) — not the whole ranking.
struct HeldStep {
  uint32_t selected = 0;          // pages in the head's selection, held ones included
  std::vector<uint32_t> stayed;   // the held pages still selected, ascending
  std::vector<uint32_t> recall;   // the best selected pages not held, at most capacity − stayed, ascending
};

class NearMemoryClient {
 public:
  // Opens the channel to node `node`'s service. Errors: kNotFound (that node's cxlkvd does not
  // serve near-memory attention: start it with --pnm-threads), those of RpcClient::Open.
  static Result<std::unique_ptr<NearMemoryClient>> Open(Pool& pool, uint32_t node,
                                                        const rpc::RpcClientOptions& options = {});

  struct Opened {
    uint64_t context = 0;
    uint32_t lease_ms = 0;
    ExtendAnswer totals;  // over every batch of keys: pages, digests found, built, stored
  };
  // Opens a context over the blocks `keys` (in token order, full pages) of namespace `ns`, for a
  // model of `num_heads` query heads. Errors: kNotFound (a key is not in the pool: the message
  // names the page), kInvalidArgument (a layout near-memory attention cannot read), kNoSpace
  // (too many contexts open there), kUnavailable (no daemon answers), kLeaseExpired (this
  // node's lease did not come back within the timeout after a pause).
  Result<Opened> OpenContext(const KeyNamespace& ns, uint32_t num_heads, std::span<const BlockKey> keys);
  // Appends blocks to an open context (a decode that filled another page and stored it).
  Result<ExtendAnswer> Extend(uint64_t context, std::span<const BlockKey> keys);

  struct Job {
    uint64_t context = 0;
    uint32_t layer = 0;
    const float* q = nullptr;     // [heads][head_dim] of the context's model
    uint32_t budget_tokens = 0;   // 0: every page (dense); else top-K pages under this budget
    uint16_t sink_pages = 1;
    uint16_t recent_pages = 1;
    float scale = 0;              // 0: 1/sqrt(head_dim)
    Partial* out = nullptr;       // the attention over the context's tokens, with its lse
    uint32_t pages_attended = 0;  // summed over KV heads
    Status status;                // this job's outcome
    // AttendSplit only: per KV head, the context pages the engine holds, strictly ascending
    // (the daemon leaves them out of `out`); how many it holds at most per KV head; and where
    // each KV head's HeldStep goes.
    std::span<const std::vector<uint32_t>> held;
    uint32_t hold_capacity = 0;
    std::vector<HeldStep>* steps = nullptr;
  };
  // Runs the jobs at the daemon, each answer awaited up to the options' timeout. Returns the
  // first job's error, or a transport error (then no job has an answer). Jobs of contexts this
  // client did not open are refused locally.
  Status Attend(std::span<Job> jobs);
  // The hybrid's step (PNM §3.3): as Attend with a budget, but `out` covers only the selected
  // pages the job's `held` does not list, and `steps` gets per KV head the held pages still
  // selected and the best selected pages to recall into the room left (steady selection), so
  // the engine attends its held selected pages itself, merges by LSE, and steps its held set.
  // Errors: Attend's, and kInvalidArgument for a job without a budget or `steps`, or held lists
  // not one per KV head or not strictly ascending.
  Status AttendSplit(std::span<Job> jobs);
  // Keeps idle contexts open; returns how many the daemon still had.
  Result<uint32_t> Renew(std::span<const uint64_t> contexts);
  Status Close(std::span<const uint64_t> contexts);

  // This node's life, once its lease is surely valid (waiting up to the options' timeout):
  // kLeaseExpired if it does not become so. A reader of pool blocks it pinned under one life
  // compares: a changed life means the node was declared dead meanwhile (paused past its
  // lease) and its pins were recovered, so what it read since may be another block's bytes.
  Result<uint64_t> CurrentLife() const;

  // Payload bytes sent and received by Attend (queries in; outputs and lse back).
  uint64_t link_bytes() const { return link_bytes_.load(); }
  uint32_t node() const { return node_; }

 private:
  NearMemoryClient(Pool& pool, std::unique_ptr<rpc::RpcClient> rpc, uint32_t node, std::chrono::milliseconds timeout)
      : pool_(pool), rpc_(std::move(rpc)), node_(node), timeout_(timeout) {}
  Status RunJobs(std::span<Job> jobs, bool split);

  Pool& pool_;
  std::unique_ptr<rpc::RpcClient> rpc_;
  uint32_t node_ = 0;
  std::chrono::milliseconds timeout_;  // each answer's deadline (RpcClientOptions::timeout)
  std::mutex mu_;
  struct OpenContextInfo {
    uint64_t pages = 0;
    std::pair<uint32_t, uint32_t> shape;  // query heads, head_dim
    uint32_t kv_heads = 0;
    uint32_t page_tokens = 0;
  };
  std::map<uint64_t, OpenContextInfo> contexts_;
  std::atomic<uint64_t> link_bytes_{0};
};

}  // namespace cxlkv::pnm

#endif  // CXLKV_SRC_PNM_REMOTE_H_
