// The near-memory attention client (remote.h).
#include "pnm/remote.h"

#include <algorithm>
#include <deque>
#include <thread>

#include "pool/pool_internal.h"
#include "sync/node.h"

namespace cxlkv::pnm {

namespace {

// A split answer's heads as the job's HeldSteps, checked: the answer comes from shared memory
// and its pages index the engine's per-page state, so a bit per held page, recalls inside the
// context, not held and within the room the held set has.
Status HeldStepsOf(size_t j, const NearMemoryClient::Job& job, uint64_t context_pages,
                   std::span<const SplitHeadAnswer> heads) {
  auto bad = [&](size_t h, const std::string& why) {
    return Corrupted("pnm split attend answer: job " + std::to_string(j) + ", KV head " + std::to_string(h) + ": " + why);
  };
  std::vector<HeldStep>& steps = *job.steps;
  steps.resize(heads.size());
  for (size_t h = 0; h < heads.size(); ++h) {
    const SplitHeadAnswer& a = heads[h];
    const std::vector<uint32_t>& held = job.held[h];
    if (a.stays.size() != held.size()) {
      return bad(h, std::to_string(a.stays.size()) + " bits for " + std::to_string(held.size()) + " held pages");
    }
    HeldStep& s = steps[h];
    s.selected = a.selected;
    s.stayed.clear();
    for (size_t i = 0; i < held.size(); ++i) {
      if (a.stays[i]) s.stayed.push_back(held[i]);
    }
    const size_t room = job.hold_capacity > s.stayed.size() ? job.hold_capacity - s.stayed.size() : 0;
    if (a.recall.size() > room || s.stayed.size() + a.recall.size() > a.selected) {
      return bad(h, std::to_string(a.recall.size()) + " recalls for room " + std::to_string(room) + " and " +
                        std::to_string(a.selected) + " pages selected");
    }
    for (uint32_t p : a.recall) {  // ascending by the encoding
      if (p >= context_pages || std::binary_search(held.begin(), held.end(), p)) {
        return bad(h, "recalls page " + std::to_string(p) + ", past a context of " + std::to_string(context_pages) +
                          " pages or held already");
      }
    }
    s.recall = a.recall;
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<NearMemoryClient>> NearMemoryClient::Open(Pool& pool, uint32_t node,
                                                                  const rpc::RpcClientOptions& options) {
  auto rpc = rpc::RpcClient::Open(pool, PnmServiceName(node), options);
  if (!rpc.ok()) {
    if (rpc.status().code() == StatusCode::kNotFound) {
      return NotFound("node " + std::to_string(node) + " serves no near-memory attention: start its cxlkvd with "
                      "--pnm-threads N");
    }
    return rpc.status();
  }
  return std::unique_ptr<NearMemoryClient>(new NearMemoryClient(pool, std::move(*rpc), node, options.timeout));
}

Result<uint64_t> NearMemoryClient::CurrentLife() const {
  const sync::Node& node = *pool_.impl().node;
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  for (;;) {
    const uint64_t life = node.incarnation();
    Status fenced = node.Fence("open a near-memory context", life);
    if (fenced.ok()) return life;
    if (std::chrono::steady_clock::now() >= deadline) return fenced;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

Result<NearMemoryClient::Opened> NearMemoryClient::OpenContext(const KeyNamespace& ns, uint32_t num_heads,
                                                               std::span<const BlockKey> keys) {
  // This node's life now: the daemon ends the context with it. After a pause past the lease the
  // life this process last knew may already be over, and a context opened under it would be
  // closed at the daemon's next sweep: wait (bounded) for the heartbeat to start the new life,
  // which the fence then vouches for.
  CXLKV_ASSIGN_OR_RETURN(const uint64_t life, CurrentLife());
  const OpenRequest request{ns, num_heads, life};
  CXLKV_ASSIGN_OR_RETURN(std::vector<uint8_t> answer, rpc_->Call(kPnmOpen, EncodeOpen(request)));
  CXLKV_ASSIGN_OR_RETURN(OpenAnswer a, DecodeOpenAnswer(answer));
  Opened o;
  o.context = a.context;
  o.lease_ms = a.lease_ms;
  {
    std::lock_guard<std::mutex> lock(mu_);
    contexts_[a.context] = {0, {num_heads, ns.layout.head_size}, ns.layout.num_kv_heads, ns.layout.block_size};
  }
  if (!keys.empty()) {
    auto e = Extend(a.context, keys);
    if (!e.ok()) {
      (void)Close({&o.context, 1});
      return e.status();
    }
    o.totals = *e;
  }
  return o;
}

Result<ExtendAnswer> NearMemoryClient::Extend(uint64_t context, std::span<const BlockKey> keys) {
  uint64_t first = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = contexts_.find(context);
    if (it == contexts_.end()) return NotFound("context " + std::to_string(context) + " was not opened by this client");
    first = it->second.pages;
  }
  ExtendAnswer totals;
  for (size_t at = 0; at < keys.size(); at += kMaxExtendKeys) {
    ExtendRequest r;
    r.context = context;
    r.first_page = first;
    const auto batch = keys.subspan(at, std::min(kMaxExtendKeys, keys.size() - at));
    r.keys.assign(batch.begin(), batch.end());
    CXLKV_ASSIGN_OR_RETURN(std::vector<uint8_t> answer, rpc_->Call(kPnmExtend, EncodeExtend(r)));
    CXLKV_ASSIGN_OR_RETURN(ExtendAnswer a, DecodeExtendAnswer(answer));
    if (a.pages != first + batch.size()) {
      return Corrupted("extend answer: the context has " + std::to_string(a.pages) + " pages, expected " +
                       std::to_string(first + batch.size()));
    }
    first = a.pages;
    totals.pages = a.pages;
    totals.digests_found += a.digests_found;
    totals.digests_built += a.digests_built;
    totals.digests_stored += a.digests_stored;
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = contexts_.find(context); it != contexts_.end()) it->second.pages = first;
  }
  return totals;
}

Status NearMemoryClient::Attend(std::span<Job> jobs) { return RunJobs(jobs, false); }

Status NearMemoryClient::AttendSplit(std::span<Job> jobs) { return RunJobs(jobs, true); }

Status NearMemoryClient::RunJobs(std::span<Job> jobs, bool split) {
  std::vector<std::pair<uint32_t, uint32_t>> shapes(jobs.size());
  std::vector<uint32_t> kv_heads(jobs.size());
  std::vector<size_t> split_bytes(jobs.size(), 0);  // a split answer's per-head part, at most
  std::vector<uint64_t> context_pages(jobs.size(), 0);
  std::vector<AttendJobRequest> requests(jobs.size());  // each job as it goes on the wire
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < jobs.size(); ++i) {
      auto it = contexts_.find(jobs[i].context);
      if (it == contexts_.end() || jobs[i].q == nullptr || jobs[i].out == nullptr) {
        return InvalidArgument("attend job " + std::to_string(i) +
                               ": a context this client did not open, or no query or output");
      }
      const OpenContextInfo& info = it->second;
      shapes[i] = info.shape;
      kv_heads[i] = info.kv_heads;
      context_pages[i] = info.pages;
      AttendJobRequest& e = requests[i];
      e.context = jobs[i].context;
      e.layer = jobs[i].layer;
      e.budget_tokens = jobs[i].budget_tokens;
      e.sink_pages = jobs[i].sink_pages;
      e.recent_pages = jobs[i].recent_pages;
      e.scale = jobs[i].scale;
      e.q.assign(jobs[i].q, jobs[i].q + size_t{info.shape.first} * info.shape.second);
      if (!split) continue;
      if (jobs[i].budget_tokens == 0 || jobs[i].steps == nullptr || jobs[i].held.size() != info.kv_heads) {
        return InvalidArgument("split attend job " + std::to_string(i) + ": needs a budget, a place for the steps and " +
                               std::to_string(info.kv_heads) + " held-page lists (one per KV head), got " +
                               std::to_string(jobs[i].held.size()));
      }
      if (std::string why = UnorderedHeldList(jobs[i].held); !why.empty()) {
        return InvalidArgument("split attend job " + std::to_string(i) + ": " + why);
      }
      e.held.assign(jobs[i].held.begin(), jobs[i].held.end());
      e.hold_capacity = jobs[i].hold_capacity;
      split_bytes[i] = SplitAnswerBytesBound(e, info.kv_heads, info.pages, info.page_tokens);
    }
  }
  // Pack consecutive jobs while the request and its answer fit their slots.
  struct Batch {
    size_t begin, end;
    std::vector<uint8_t> request;
    rpc::RpcClient::Ticket ticket = 0;
  };
  std::vector<Batch> batches;
  const uint64_t req_cap = rpc_->request_capacity(), ans_cap = rpc_->response_capacity();
  for (size_t i = 0; i < jobs.size();) {
    size_t req = 4, ans = 0, j = i;
    while (j < jobs.size()) {
      const size_t r = AttendJobRequestBytes(requests[j].q.size()) + (split ? HeldListsBytes(requests[j].held) : 0);
      const size_t a = std::max(AttendJobAnswerBytes(shapes[j].first, shapes[j].second) + split_bytes[j],
                                10 + kMaxJobMessage);
      if (j > i && (req + r > req_cap || ans + a > ans_cap)) break;
      req += r;
      ans += a;
      ++j;
    }
    if (req > req_cap || ans > ans_cap) {
      return InvalidArgument("one query of " + std::to_string(shapes[i].first) + " heads" +
                             (split ? " with its held pages and what stays and is recalled" : "") + " does not fit a request slot (" +
                             std::to_string(req) + " and " + std::to_string(ans) + " bytes; slots hold " +
                             std::to_string(req_cap) + " and " + std::to_string(ans_cap) + ")" +
                             (split ? ": a smaller budget or fewer held pages" : ""));
    }
    const std::span<const AttendJobRequest> encoded = std::span(requests).subspan(i, j - i);
    Batch b{i, j, {}, 0};
    if (split) {
      EncodeAttendSplit(encoded, b.request);
    } else {
      EncodeAttend(encoded, b.request);
    }
    batches.push_back(std::move(b));
    i = j;
  }
  // Pipelined: submit while the ring has room, then take answers oldest first.
  std::vector<uint8_t> answer(ans_cap);
  std::deque<size_t> in_flight;
  size_t next = 0;
  Status first;
  const auto deadline_of = [this] { return rpc::RpcClient::Clock::now() + timeout_; };
  while (next < batches.size() || !in_flight.empty()) {
    while (next < batches.size()) {
      auto t = rpc_->Submit(split ? kPnmAttendSplit : kPnmAttend, batches[next].request);
      if (!t.ok()) {
        if (t.status().code() == StatusCode::kBusy && !in_flight.empty()) break;
        for (size_t k : in_flight) rpc_->Abandon(batches[k].ticket);
        return t.status();
      }
      batches[next].ticket = *t;
      link_bytes_.fetch_add(batches[next].request.size());
      in_flight.push_back(next++);
    }
    const size_t k = in_flight.front();
    in_flight.pop_front();
    Batch& b = batches[k];
    auto n = rpc_->Wait(b.ticket, answer, deadline_of());
    if (!n.ok()) {
      for (size_t other : in_flight) rpc_->Abandon(batches[other].ticket);
      return n.status();
    }
    link_bytes_.fetch_add(*n);
    const auto got = std::span<const uint8_t>(answer).first(*n);
    const auto batch_shapes = std::span<const std::pair<uint32_t, uint32_t>>(shapes).subspan(b.begin, b.end - b.begin);
    auto decoded = split ? DecodeAttendSplitAnswer(got, batch_shapes,
                                                   std::span<const uint32_t>(kv_heads).subspan(b.begin, b.end - b.begin))
                         : DecodeAttendAnswer(got, batch_shapes);
    if (!decoded.ok()) {
      for (size_t other : in_flight) rpc_->Abandon(batches[other].ticket);
      return decoded.status();
    }
    for (size_t j = b.begin; j < b.end; ++j) {
      AttendJobAnswer& a = (*decoded)[j - b.begin];
      jobs[j].status = a.status;
      jobs[j].pages_attended = a.pages_attended;
      if (a.status.ok()) {
        *jobs[j].out = std::move(a.partial);
        if (split) {
          Status checked = HeldStepsOf(j, jobs[j], context_pages[j], a.heads);
          if (!checked.ok()) {
            for (size_t other : in_flight) rpc_->Abandon(batches[other].ticket);
            return checked;
          }
        }
      } else if (first.ok()) {
        first = a.status;
      }
    }
  }
  return first;
}

Result<uint32_t> NearMemoryClient::Renew(std::span<const uint64_t> contexts) {
  CXLKV_ASSIGN_OR_RETURN(std::vector<uint8_t> answer, rpc_->Call(kPnmRenew, EncodeContexts(contexts)));
  if (answer.size() != 4) return Corrupted("pnm renew answer of " + std::to_string(answer.size()) + " bytes, expected 4");
  uint32_t n = 0;
  std::memcpy(&n, answer.data(), 4);
  return n;
}

Status NearMemoryClient::Close(std::span<const uint64_t> contexts) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (uint64_t c : contexts) contexts_.erase(c);
  }
  return rpc_->Call(kPnmClose, EncodeContexts(contexts)).status();
}

}  // namespace cxlkv::pnm
