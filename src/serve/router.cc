#include "serve/router.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <chrono>
#include <deque>
#include <memory>
#include <random>
#include <thread>
#include <unordered_set>

#include "cxlkv/pool.h"
#include "daemon/pnm_service.h"
#include "engine/config.h"
#include "serve/channel.h"
#include "serve/worker.h"
#include "tier/slot_format.h"
#include "tier/tier_service.h"
#include "tier/tier_store.h"

namespace cxlkv::serve {

namespace {

constexpr uint32_t kBlockTokens = 16;       // the engine's block size: what prefix affinity hashes
constexpr uint32_t kAffinityLoadMargin = 2;  // prefix affinity yields to load beyond this

struct Worker {
  WorkerRole role;
  uint32_t index;
  pid_t pid = -1;
  std::unique_ptr<Channel> channel;
  bool ready = false;
  bool alive = true;
  uint16_t port = 0;
  uint32_t in_flight = 0;
  std::unordered_set<uint64_t> seen_blocks;  // prefix affinity: chained block hashes sent here
  std::string Name() const {
    return std::string(role == WorkerRole::kPrefill ? "prefill" : "decode") + " worker " + std::to_string(index);
  }
};

enum class Stage { kWaiting, kQueued, kPrefill, kDecode, kDone };

struct Flight {
  Stage stage = Stage::kWaiting;
  std::vector<uint64_t> chain;  // prefix affinity: the prompt's block hashes, computed once
  int32_t first_token = -1;
  uint32_t attempt = 0;  // bumped at every (re)dispatch: answers to an older attempt are stale
};

// Chained 64-bit hashes of the prompt's full blocks (the router's own view of prefixes).
std::vector<uint64_t> BlockChain(const std::vector<int32_t>& prompt) {
  std::vector<uint64_t> out;
  uint64_t h = 0;
  for (size_t b = 0; b + kBlockTokens <= prompt.size(); b += kBlockTokens) {
    h = XXH3_64bits_withSeed(prompt.data() + b, kBlockTokens * sizeof(int32_t), h);
    out.push_back(h);
  }
  return out;
}

class Router {
 public:
  Router(const ServeOptions& o, const std::vector<Request>& requests) : o_(o), requests_(requests) {}

  Result<ServeRun> Run();

 private:
  Status Spawn(WorkerRole role, uint32_t index, uint32_t node, uint64_t run_id, uint32_t engine_blocks);
  Status AwaitReady();
  Status Pump(int timeout_ms);
  Status OnMessage(Worker& w, const nlohmann::json& m);
  Status OnWorkerLost(Worker& w, const std::string& why);
  Status Dispatch();
  Status SendPrefill(size_t r);
  Status SendDecode(size_t r);
  Worker* PickPrefill(size_t r);
  Worker* PickDecode();
  void Admit();
  void MaybeKill();
  void Shutdown();
  void KillAll();  // on a failed run: no worker outlives the router

  const ServeOptions& o_;
  const std::vector<Request>& requests_;
  std::string worker_exe_;
  std::vector<std::unique_ptr<Worker>> workers_;  // prefill first, then decode
  std::vector<Flight> flights_;
  std::vector<RequestRecord> records_;
  std::deque<size_t> queue_;  // admitted, waiting for a prefill worker
  size_t next_ = 0;           // next request to admit
  size_t done_ = 0;
  size_t in_system_ = 0;
  int64_t start_ns_ = 0;
  uint32_t killed_ = 0;
  uint32_t retries_ = 0;
  bool kill_done_ = false;
};

Status Router::Spawn(WorkerRole role, uint32_t index, uint32_t node, uint64_t run_id, uint32_t engine_blocks) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return IoError("socketpair failed");
  WorkerOptions wo;
  wo.role = role;
  wo.index = index;
  wo.region = o_.region;
  wo.node_id = node;
  wo.lease_ms = o_.lease_ms;
  wo.mode = o_.mode;
  wo.model_config = o_.model_config;
  wo.weights = o_.weights;
  wo.run_id = run_id;
  wo.engine_blocks = engine_blocks;
  wo.private_cache_bytes = o_.private_cache_bytes;
  wo.stream_capacity = o_.stream_capacity;
  wo.attention = o_.attention;
  wo.attention_budget = o_.attention_budget;
  wo.channel_fd = 3;
  const std::string args = WorkerOptionsToJson(wo).dump();
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) return IoError("fork failed");
  if (pid == 0) {
    ::dup2(sv[1], 3);  // the channel; dup2 clears close-on-exec on the copy
    ::execl(worker_exe_.c_str(), "cxlkv", "serve-worker", "--options", args.c_str(), static_cast<char*>(nullptr));
    std::fprintf(stderr, "serve: cannot run %s: %s\n", worker_exe_.c_str(), std::strerror(errno));
    ::_exit(127);
  }
  ::close(sv[1]);
  auto w = std::make_unique<Worker>();
  w->role = role;
  w->index = index;
  w->pid = pid;
  w->channel = std::make_unique<Channel>(sv[0]);
  workers_.push_back(std::move(w));
  return Status::Ok();
}

Status Router::AwaitReady() {
  for (auto& w : workers_) {
    auto m = w->channel->Receive(120000);
    if (!m.ok()) return Internal(w->Name() + " exited during start-up (" + m.status().message() + ")");
    if (!m->has_value()) return Status(StatusCode::kTimeout, w->Name() + " did not start within 120 s");
    const auto& msg = **m;
    if (msg.value("type", "") == "fatal") {
      return Status(StatusCode::kInvalidArgument, w->Name() + " cannot serve: " + msg.value("message", ""));
    }
    w->ready = true;
    w->port = msg.value("port", uint16_t{0});
  }
  return Status::Ok();
}

Worker* Router::PickPrefill(size_t r) {
  Worker* least = nullptr;
  for (auto& w : workers_) {
    if (w->role != WorkerRole::kPrefill || !w->alive || w->in_flight >= o_.max_per_worker) continue;
    if (!least || w->in_flight < least->in_flight) least = w.get();
  }
  if (!least || o_.policy == RoutePolicy::kLeastLoaded) return least;
  if (flights_[r].chain.empty()) flights_[r].chain = BlockChain(requests_[r].prompt);
  const auto& chain = flights_[r].chain;
  Worker* best = nullptr;
  size_t best_match = 0;
  for (auto& w : workers_) {
    if (w->role != WorkerRole::kPrefill || !w->alive || w->in_flight >= o_.max_per_worker) continue;
    size_t match = 0;
    while (match < chain.size() && w->seen_blocks.count(chain[match])) ++match;
    if (match > best_match) {
      best = w.get();
      best_match = match;
    }
  }
  if (!best || best->in_flight > least->in_flight + kAffinityLoadMargin) return least;
  return best;
}

Worker* Router::PickDecode() {
  Worker* least = nullptr;
  for (auto& w : workers_) {
    if (w->role == WorkerRole::kDecode && w->alive && (!least || w->in_flight < least->in_flight)) least = w.get();
  }
  return least;
}

Status Router::SendPrefill(size_t r) {
  Worker* p = PickPrefill(r);
  if (!p) return Status::Ok();  // all busy: stays queued
  Worker* d = PickDecode();
  if (!d) return Internal("no decode worker is left alive");
  queue_.pop_front();
  RequestRecord& rec = records_[r];
  rec.prefill_worker = static_cast<int>(p->index);
  rec.decode_worker = static_cast<int>(d->index);
  flights_[r].stage = Stage::kPrefill;
  ++p->in_flight;
  ++d->in_flight;
  if (o_.policy == RoutePolicy::kPrefixAffinity) {
    for (uint64_t h : flights_[r].chain) p->seen_blocks.insert(h);
  }
  ++flights_[r].attempt;
  nlohmann::json m = {{"type", "prefill"},
                      {"id", r},
                      {"attempt", flights_[r].attempt},
                      {"prompt", requests_[r].prompt},
                      {"decode_port", d->port}};
  if (!p->channel->Send(m).ok()) return OnWorkerLost(*p, "its channel closed");
  return Status::Ok();
}

Status Router::SendDecode(size_t r) {
  RequestRecord& rec = records_[r];
  Worker& d = *workers_[o_.prefill + rec.decode_worker];
  flights_[r].stage = Stage::kDecode;
  nlohmann::json m = {{"type", "decode"},
                      {"id", r},
                      {"attempt", flights_[r].attempt},
                      {"prompt", requests_[r].prompt},
                      {"first_token", flights_[r].first_token},
                      {"max_new", requests_[r].max_new_tokens}};
  if (!d.channel->Send(m).ok()) return OnWorkerLost(d, "its channel closed");
  return Status::Ok();
}

Status Router::Dispatch() {
  while (!queue_.empty()) {
    const size_t before = queue_.size();
    CXLKV_RETURN_IF_ERROR(SendPrefill(queue_.front()));
    if (queue_.size() == before) break;  // every prefill worker is full
  }
  return Status::Ok();
}

void Router::Admit() {
  const int64_t now = NowNs();
  while (next_ < requests_.size()) {
    if (o_.open_loop) {
      if (start_ns_ + static_cast<int64_t>(requests_[next_].arrival_s * 1e9) > now) break;
    } else if (in_system_ >= o_.concurrency) {
      break;
    }
    records_[next_].arrival_ns = o_.open_loop ? start_ns_ + static_cast<int64_t>(requests_[next_].arrival_s * 1e9) : now;
    flights_[next_].stage = Stage::kQueued;
    queue_.push_back(next_++);
    ++in_system_;
  }
}

Status Router::OnMessage(Worker& w, const nlohmann::json& m) {
  const std::string type = m.value("type", "");
  const size_t id = m.value("id", size_t{0});
  if (type != "fatal" && id < flights_.size() && m.value("attempt", 0u) != flights_[id].attempt) {
    // An answer (or failure) of an attempt the router gave up on when another worker died:
    // this worker is free of it now; the request runs again elsewhere.
    if (w.in_flight > 0) --w.in_flight;
    return Status::Ok();
  }
  if (type == "error" || type == "fatal") {
    return Internal(w.Name() + " failed request " + std::to_string(m.value("id", uint64_t{0})) + ": " +
                    m.value("message", ""));
  }
  const size_t r = m.at("id").get<size_t>();
  if (r >= records_.size()) return Internal(w.Name() + " answered an unknown request " + std::to_string(r));
  RequestRecord& rec = records_[r];
  if (type == "prefilled" && flights_[r].stage == Stage::kPrefill) {
    --w.in_flight;
    rec.prefilled_ns = m.at("ns").get<int64_t>();
    rec.prefill = KvStatsFromJson(m.at("stats"));
    flights_[r].first_token = m.at("first_token").get<int32_t>();
    return SendDecode(r);
  }
  if (type == "done" && flights_[r].stage == Stage::kDecode) {
    --w.in_flight;
    rec.tokens = m.at("tokens").get<std::vector<int32_t>>();
    rec.first_ns = m.at("first_ns").get<int64_t>();
    rec.done_ns = m.at("ns").get<int64_t>();
    rec.decode = KvStatsFromJson(m.at("stats"));
    flights_[r].stage = Stage::kDone;
    ++done_;
    --in_system_;
    if (o_.progress) o_.progress(done_, requests_.size());
    return Status::Ok();
  }
  return Status::Ok();  // a late answer for a request already moved elsewhere
}

Status Router::OnWorkerLost(Worker& w, const std::string& why) {
  if (!w.alive) return Status::Ok();
  w.alive = false;
  ::kill(w.pid, SIGKILL);
  ::waitpid(w.pid, nullptr, 0);
  std::fprintf(stderr, "\nserve: %s (pid %d) is gone (%s): retrying its requests elsewhere\n", w.Name().c_str(),
               static_cast<int>(w.pid), why.c_str());
  for (size_t r = 0; r < records_.size(); ++r) {
    RequestRecord& rec = records_[r];
    const Stage s = flights_[r].stage;
    if (s != Stage::kPrefill && s != Stage::kDecode) continue;
    const bool on_prefill = w.role == WorkerRole::kPrefill && rec.prefill_worker == static_cast<int>(w.index) &&
                            s == Stage::kPrefill;
    const bool on_decode = w.role == WorkerRole::kDecode && rec.decode_worker == static_cast<int>(w.index);
    if (!on_prefill && !on_decode) continue;
    // Give back the decode slot and start over from the prefill: its KV (pool blocks or a TCP
    // payload) may have gone with the worker; what reached the pool is reused. A live prefill
    // worker still computing this request keeps its slot until its (stale) answer comes.
    if (on_prefill) --workers_[o_.prefill + rec.decode_worker]->in_flight;
    flights_[r].stage = Stage::kQueued;
    ++rec.retries;
    ++retries_;
    queue_.push_front(r);
  }
  bool prefill_left = false, decode_left = false;
  for (auto& x : workers_) {
    prefill_left |= x->alive && x->role == WorkerRole::kPrefill;
    decode_left |= x->alive && x->role == WorkerRole::kDecode;
  }
  if (!prefill_left || !decode_left) {
    return Internal("no " + std::string(prefill_left ? "decode" : "prefill") + " worker is left alive (the last, " +
                    w.Name() + ", is gone: " + why + ")");
  }
  return Status::Ok();
}

void Router::MaybeKill() {
  if (kill_done_ || o_.kill_prefill_after < 0 || done_ < static_cast<size_t>(o_.kill_prefill_after)) return;
  kill_done_ = true;
  Worker& victim = *workers_[0];
  std::fprintf(stderr, "\nserve: fault injection: kill -9 %s (pid %d)\n", victim.Name().c_str(),
               static_cast<int>(victim.pid));
  ::kill(victim.pid, SIGKILL);
  ++killed_;
}

Status Router::Pump(int timeout_ms) {
  std::vector<pollfd> fds;
  std::vector<Worker*> who;
  for (auto& w : workers_) {
    if (!w->alive) continue;
    fds.push_back({w->channel->fd(), POLLIN, 0});
    who.push_back(w.get());
  }
  int r = ::poll(fds.data(), fds.size(), timeout_ms);
  if (r < 0 && errno != EINTR) return IoError("router poll failed");
  for (size_t i = 0; i < fds.size(); ++i) {
    if (fds[i].revents == 0) continue;
    Worker& w = *who[i];
    for (bool first = true; first || w.channel->HasBuffered(); first = false) {
      auto m = w.channel->Receive(0);
      if (!m.ok()) {
        if (w.role == WorkerRole::kPrefill && kill_done_ && w.index == 0) {
          CXLKV_RETURN_IF_ERROR(OnWorkerLost(w, "killed by fault injection"));
        } else {
          CXLKV_RETURN_IF_ERROR(OnWorkerLost(w, m.status().message()));
        }
        break;
      }
      if (!m->has_value()) break;
      try {
        CXLKV_RETURN_IF_ERROR(OnMessage(w, **m));
      } catch (const nlohmann::json::exception& e) {
        return Internal(w.Name() + " sent a malformed message: " + e.what());
      }
    }
  }
  return Status::Ok();
}

void Router::KillAll() {
  for (auto& w : workers_) {
    if (!w->alive) continue;
    ::kill(w->pid, SIGKILL);
    ::waitpid(w->pid, nullptr, 0);
    w->alive = false;
  }
}

void Router::Shutdown() {
  for (auto& w : workers_) {
    if (w->alive) (void)w->channel->Send({{"type", "exit"}});
  }
  for (auto& w : workers_) {
    if (w->alive) ::waitpid(w->pid, nullptr, 0);
  }
}

// `configured`, or the binary this process runs (the cxlkv CLI starts its own workers).
Result<std::string> WorkerExecutable(const std::string& configured) {
  if (!configured.empty()) return configured;
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return IoError("serve: cannot find this binary (/proc/self/exe) to start workers: set worker_exe");
  return std::string(buf, static_cast<size_t>(n));
}

Result<ServeRun> Router::Run() {
  if (o_.prefill == 0 || o_.decode == 0) {
    return InvalidArgument("serve needs at least one prefill and one decode worker (got " +
                           std::to_string(o_.prefill) + " and " + std::to_string(o_.decode) + ")");
  }
  if (requests_.empty()) return InvalidArgument("serve: the workload has no requests");
  if (!o_.open_loop && o_.concurrency == 0) return InvalidArgument("serve: closed loop needs a concurrency >= 1");
  CXLKV_ASSIGN_OR_RETURN(worker_exe_, WorkerExecutable(o_.worker_exe));
  // The router is node 0: it lives throughout, manages the pool and recovers dead workers.
  PoolOpenOptions po;
  po.node_id = 0;
  po.lease_ms = o_.lease_ms;
  std::vector<std::string> paths;
  for (size_t s = 0, c;; s = c + 1) {
    c = o_.region.find(',', s);
    paths.push_back(o_.region.substr(s, c - s));
    if (c == std::string::npos) break;
  }
  CXLKV_ASSIGN_OR_RETURN(auto pool, Pool::Open(paths, po));
  CXLKV_RETURN_IF_ERROR(pool->Cache().status());
  // The tiers this node serves, as its cxlkvd would: destroyed before the pool (declared after).
  std::unique_ptr<tier::TierStore> tiers;
  std::unique_ptr<rpc::RpcServer> tier_service;
  if (!o_.tiers.empty()) {
    CXLKV_ASSIGN_OR_RETURN(auto model, engine::ModelConfig::FromJson(o_.model_config));
    tier::TierStoreOptions to;
    for (const std::string& text : o_.tiers) {
      CXLKV_ASSIGN_OR_RETURN(tier::TierSpec spec, tier::ParseTierSpec(text));
      to.tiers.push_back(spec);
    }
    const uint64_t block = model.KvBytesPerToken() * kBlockTokens + tier::kSlotHeaderBytes;
    to.slot_bytes = std::max<uint64_t>(8192, (block + 4095) / 4096 * 4096);
    to.log_placement = false;  // the serve progress display owns stderr
    CXLKV_ASSIGN_OR_RETURN(tiers, tier::TierStore::Open(*pool, to));
    CXLKV_ASSIGN_OR_RETURN(tier_service, tier::StartTierService(*pool, *tiers));
  }

  // Remote attention: this node attends the prompts' pool blocks next to the memory, as its
  // cxlkvd --pnm-threads would (destroyed before the pool, declared after it).
  std::unique_ptr<daemon::NearMemoryService> pnm_service;
  if (IsRemoteAttention(o_.attention)) {
    if (o_.mode != KvMode::kPool) {
      return InvalidArgument("--attention " + o_.attention + " needs --mode pool: the prompts' blocks must be in the pool");
    }
    daemon::NearMemoryServiceOptions no;
    no.threads = 1;
    no.context_lease_ms = std::max<uint32_t>(4 * o_.lease_ms, 2000);
    CXLKV_ASSIGN_OR_RETURN(pnm_service, daemon::NearMemoryService::Start(*pool, no));
  }

  uint32_t engine_blocks = o_.engine_blocks;
  if (engine_blocks == 0) {
    uint64_t longest = 0;
    for (const auto& q : requests_) longest = std::max<uint64_t>(longest, q.prompt.size() + q.max_new_tokens);
    engine_blocks = static_cast<uint32_t>(2 * (longest + kBlockTokens - 1) / kBlockTokens + 2);
  }
  const uint64_t run_id = std::random_device{}() * 0x100000001ull ^ static_cast<uint64_t>(NowNs());
  Status spawned;
  for (uint32_t i = 0; i < o_.prefill && spawned.ok(); ++i) {
    spawned = Spawn(WorkerRole::kPrefill, i, 1 + i, run_id, engine_blocks);
  }
  for (uint32_t i = 0; i < o_.decode && spawned.ok(); ++i) {
    spawned = Spawn(WorkerRole::kDecode, i, 1 + o_.prefill + i, run_id, engine_blocks);
  }
  if (spawned.ok()) spawned = AwaitReady();
  if (!spawned.ok()) {
    KillAll();
    return spawned;
  }
  flights_.assign(requests_.size(), Flight{});
  records_.resize(requests_.size());
  for (size_t r = 0; r < requests_.size(); ++r) {
    records_[r].id = requests_[r].id;
    records_[r].group = requests_[r].group;
    records_[r].prompt_tokens = static_cast<uint32_t>(requests_[r].prompt.size());
  }
  start_ns_ = NowNs();
  Status s;
  while (s.ok() && done_ < requests_.size()) {
    Admit();
    s = Dispatch();
    if (!s.ok()) break;
    int timeout = 100;
    if (o_.open_loop && next_ < requests_.size()) {
      const int64_t due = start_ns_ + static_cast<int64_t>(requests_[next_].arrival_s * 1e9) - NowNs();
      timeout = static_cast<int>(std::clamp<int64_t>(due / 1000000, 0, 100));
    }
    s = Pump(timeout);
    MaybeKill();
  }
  const double wall_s = static_cast<double>(NowNs() - start_ns_) / 1e9;
  if (!s.ok()) {
    KillAll();  // a failed run does not wait for workers that may be mid-request
    return s;
  }
  Shutdown();
  if (killed_ > 0) {
    // The dead worker's node is recovered by this node's manager once its lease runs out.
    std::this_thread::sleep_for(std::chrono::milliseconds(4 * o_.lease_ms));
  }
  ServeRun run;
  run.mode = std::string(KvModeName(o_.mode));
  run.policy = std::string(RoutePolicyName(o_.policy));
  run.prefill = o_.prefill;
  run.decode = o_.decode;
  run.records = std::move(records_);
  run.wall_s = wall_s;
  run.workers_killed = killed_;
  run.retries = retries_;
  if (tiers) run.tiers = tiers->Stats();
  return run;
}

}  // namespace

Result<RoutePolicy> ParseRoutePolicy(std::string_view name) {
  if (name == "least-loaded") return RoutePolicy::kLeastLoaded;
  if (name == "prefix-affinity") return RoutePolicy::kPrefixAffinity;
  return InvalidArgument("unknown routing policy '" + std::string(name) + "': use least-loaded or prefix-affinity");
}

std::string_view RoutePolicyName(RoutePolicy p) {
  return p == RoutePolicy::kLeastLoaded ? "least-loaded" : "prefix-affinity";
}

Result<ServeRun> Serve(const ServeOptions& options, const std::vector<Request>& requests) {
  Router router(options, requests);
  return router.Run();
}

}  // namespace cxlkv::serve
