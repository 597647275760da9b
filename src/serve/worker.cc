#include "serve/worker.h"

#include <cstdio>
#include <deque>

#include "cxlkv/pool.h"
#include "engine/config.h"
#include "engine/weights.h"
#include "serve/channel.h"
#include "serve/tcp_handoff.h"

namespace cxlkv::serve {

namespace {

std::vector<std::string> SplitComma(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t c = s.find(',', start);
    out.push_back(s.substr(start, c - start));
    if (c == std::string::npos) return out;
    start = c + 1;
  }
}

constexpr int kTcpHandoffTimeoutMs = 60000;

// Everything a worker holds while it serves.
struct WorkerState {
  std::unique_ptr<Pool> pool;
  std::unique_ptr<engine::Model> model;
  std::unique_ptr<engine::PagedKvCache> engine_cache;
  std::unique_ptr<KvConnector> connector;
  std::unique_ptr<TcpHandoffServer> tcp_server;
  TcpHandoffClient tcp_client;
  std::unique_ptr<PreparedPrefill> prefetched;  // the next queued prefill, already loading
};

Status Setup(const WorkerOptions& o, WorkerState& w) {
  CXLKV_ASSIGN_OR_RETURN(auto config, engine::ModelConfig::FromJson(o.model_config));
  CXLKV_ASSIGN_OR_RETURN(auto weights, o.weights.empty() ? engine::Weights::Random(config)
                                                          : engine::Weights::LoadSafetensors(config, o.weights));
  w.model = std::make_unique<engine::Model>(config, std::move(weights));
  CXLKV_RETURN_IF_ERROR(w.model->status());
  w.engine_cache = std::make_unique<engine::PagedKvCache>(config, o.engine_blocks);
  PoolOpenOptions po;
  po.node_id = o.node_id;
  po.lease_ms = o.lease_ms;
  CXLKV_ASSIGN_OR_RETURN(w.pool, Pool::Open(SplitComma(o.region), po));
  CXLKV_ASSIGN_OR_RETURN(KvCache * cache, w.pool->Cache());
  KeyNamespace ns;
  ns.model_id = config.name;
  ns.layout = w.engine_cache->Layout().Signature();
  // kVersionMismatch here: the region holds this model's KV in another layout.
  CXLKV_ASSIGN_OR_RETURN(auto handle, cache->Namespace(ns));
  w.connector = std::make_unique<KvConnector>(o.mode, *w.model, *w.engine_cache, *cache, handle, o.run_id,
                                              o.private_cache_bytes);
  w.connector->SetStreamCapacity(o.stream_capacity);
  if (IsRemoteAttention(o.attention)) {
    // The prompt's KV stays in the pool; the router's node (0) attends it next to the memory.
    if (o.mode != KvMode::kPool) return InvalidArgument("remote attention needs KV mode pool (the prompt's blocks in the pool)");
    if (o.role == WorkerRole::kDecode) {
      CXLKV_ASSIGN_OR_RETURN(auto client, pnm::NearMemoryClient::Open(*w.pool, 0));
      engine::RemoteAttentionOptions ro;
      ro.budget_tokens = o.attention_budget;
      if (o.attention == kRemoteHybridAttention) {  // half the budget's pages held, as the in-process hybrid
        ro.held_pages = std::max<uint32_t>(1, o.attention_budget / w.engine_cache->block_size() / 2);
      }
      CXLKV_ASSIGN_OR_RETURN(auto remote, engine::RemoteDecodeAttention::Create(
                                              config, w.engine_cache->block_size(), *client, ns, ro, cache));
      w.connector->SetRemoteAttention(std::move(client), std::move(remote));
    }
  } else {
    CXLKV_ASSIGN_OR_RETURN(engine::AttentionMode attention, engine::ParseAttentionMode(o.attention));
    if (attention != engine::AttentionMode::kDense) {
      engine::SparseAttentionOptions so;
      so.mode = attention;
      so.select.budget_tokens = o.attention_budget;
      CXLKV_ASSIGN_OR_RETURN(auto sparse,
                             engine::SparseDecodeAttention::Create(config, w.engine_cache->block_size(), so));
      w.connector->SetDecodeAttention(std::move(sparse));
    }
  }
  if (o.role == WorkerRole::kDecode && o.mode == KvMode::kTcp) {
    CXLKV_ASSIGN_OR_RETURN(w.tcp_server, TcpHandoffServer::Start());
  }
  return Status::Ok();
}

bool IsPrefill(const nlohmann::json& m) { return m.is_object() && m.value("type", "") == "prefill"; }

// `next`: the message queued behind `m`, if any. A prefill's lookup and prefix load start for
// the next queued prefill before this one computes (async prefetch): its load overlaps this
// compute instead of delaying its own start.
Result<nlohmann::json> Handle(const WorkerOptions& o, WorkerState& w, const nlohmann::json& m,
                              const nlohmann::json* next) {
  const uint64_t id = m.at("id").get<uint64_t>();
  const auto prompt = m.at("prompt").get<std::vector<int32_t>>();
  if (m.at("type") == "prefill") {
    std::unique_ptr<PreparedPrefill> prepared;
    if (w.prefetched && w.prefetched->request_id() == id) {
      prepared = std::move(w.prefetched);
    } else {
      w.prefetched.reset();
      CXLKV_ASSIGN_OR_RETURN(prepared, w.connector->Prepare(id, prompt, /*await_in_flight=*/true));
    }
    if (next && IsPrefill(*next)) {
      // Best effort: a prefetch that cannot start (no engine blocks free) is done at its turn.
      auto p = w.connector->Prepare(next->at("id").get<uint64_t>(), next->at("prompt").get<std::vector<int32_t>>(),
                                    /*await_in_flight=*/false);
      if (p.ok()) w.prefetched = std::move(*p);
    }
    CXLKV_ASSIGN_OR_RETURN(auto r, w.connector->Prefill(*prepared));
    if (o.mode == KvMode::kTcp) {
      CXLKV_RETURN_IF_ERROR(w.tcp_client.Send(m.at("decode_port").get<uint16_t>(), id, r.tcp_payload));
    }
    return nlohmann::json{{"type", "prefilled"}, {"id", id},          {"first_token", r.first_token},
                          {"stats", KvStatsToJson(r.stats)},          {"ns", NowNs()}};
  }
  std::vector<uint8_t> payload;
  if (o.mode == KvMode::kTcp) {
    CXLKV_ASSIGN_OR_RETURN(payload, w.tcp_server->Take(id, kTcpHandoffTimeoutMs));
  }
  CXLKV_ASSIGN_OR_RETURN(auto r, w.connector->Decode(id, prompt, m.at("first_token").get<int32_t>(),
                                                    m.at("max_new").get<uint32_t>(), &payload));
  return nlohmann::json{{"type", "done"}, {"id", id}, {"tokens", r.tokens}, {"first_ns", r.first_token_ns},
                        {"stats", KvStatsToJson(r.stats)}, {"ns", NowNs()}};
}

}  // namespace

nlohmann::json KvStatsToJson(const KvStats& s) {
  return {{"prompt_tokens", s.prompt_tokens}, {"prompt_blocks", s.prompt_blocks},  {"hit_blocks", s.hit_blocks},
          {"computed_tokens", s.computed_tokens}, {"bytes_loaded", s.bytes_loaded}, {"bytes_stored", s.bytes_stored},
          {"hit_from_mem", s.hit_from_mem}, {"hit_from_ssd", s.hit_from_ssd}, {"wait_ms", s.wait_ms},
          {"blocks_not_stored", s.blocks_not_stored}, {"attention_layer_steps", s.attention_layer_steps},
          {"attention_selected_pages", s.attention_selected_pages},
          {"attention_context_pages", s.attention_context_pages}, {"attention_link_bytes", s.attention_link_bytes},
          {"attention_kv_bytes", s.attention_kv_bytes}, {"attention_remote_tokens", s.attention_remote_tokens},
          {"attention_remote_fallbacks", s.attention_remote_fallbacks}};
}

KvStats KvStatsFromJson(const nlohmann::json& j) {
  KvStats s;
  s.prompt_tokens = j.value("prompt_tokens", 0u);
  s.prompt_blocks = j.value("prompt_blocks", 0u);
  s.hit_blocks = j.value("hit_blocks", 0u);
  s.hit_from_mem = j.value("hit_from_mem", 0u);
  s.hit_from_ssd = j.value("hit_from_ssd", 0u);
  s.blocks_not_stored = j.value("blocks_not_stored", 0u);
  s.computed_tokens = j.value("computed_tokens", 0u);
  s.bytes_loaded = j.value("bytes_loaded", uint64_t{0});
  s.bytes_stored = j.value("bytes_stored", uint64_t{0});
  s.wait_ms = j.value("wait_ms", 0.0);
  s.attention_layer_steps = j.value("attention_layer_steps", uint64_t{0});
  s.attention_selected_pages = j.value("attention_selected_pages", uint64_t{0});
  s.attention_context_pages = j.value("attention_context_pages", uint64_t{0});
  s.attention_link_bytes = j.value("attention_link_bytes", uint64_t{0});
  s.attention_kv_bytes = j.value("attention_kv_bytes", uint64_t{0});
  s.attention_remote_tokens = j.value("attention_remote_tokens", uint64_t{0});
  s.attention_remote_fallbacks = j.value("attention_remote_fallbacks", uint32_t{0});
  return s;
}

nlohmann::json WorkerOptionsToJson(const WorkerOptions& o) {
  return {{"role", o.role == WorkerRole::kPrefill ? "prefill" : "decode"},
          {"index", o.index},
          {"region", o.region},
          {"node_id", o.node_id},
          {"lease_ms", o.lease_ms},
          {"mode", KvModeName(o.mode)},
          {"model_config", o.model_config},
          {"weights", o.weights},
          {"run_id", o.run_id},
          {"engine_blocks", o.engine_blocks},
          {"private_cache_bytes", o.private_cache_bytes},
          {"stream_capacity", o.stream_capacity},
          {"attention", o.attention},
          {"attention_budget", o.attention_budget},
          {"channel_fd", o.channel_fd}};
}

Result<WorkerOptions> WorkerOptionsFromJson(const nlohmann::json& j) {
  WorkerOptions o;
  try {
    o.role = j.at("role") == "prefill" ? WorkerRole::kPrefill : WorkerRole::kDecode;
    o.index = j.at("index");
    o.region = j.at("region");
    o.node_id = j.at("node_id");
    o.lease_ms = j.at("lease_ms");
    CXLKV_ASSIGN_OR_RETURN(o.mode, ParseKvMode(j.at("mode").get<std::string>()));
    o.model_config = j.at("model_config");
    o.weights = j.at("weights");
    o.run_id = j.at("run_id");
    o.engine_blocks = j.at("engine_blocks");
    o.private_cache_bytes = j.at("private_cache_bytes");
    o.stream_capacity = j.value("stream_capacity", false);
    o.attention = j.value("attention", std::string("dense"));
    o.attention_budget = j.value("attention_budget", uint32_t{2048});
    o.channel_fd = j.at("channel_fd");
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgument(std::string("serve-worker: malformed options: ") + e.what());
  }
  return o;
}

int RunWorker(const WorkerOptions& o) {
  Channel channel(o.channel_fd);
  WorkerState w;
  if (Status s = Setup(o, w); !s.ok()) {
    (void)channel.Send({{"type", "fatal"}, {"message", s.ToString()}});
    return 1;
  }
  if (!channel.Send({{"type", "ready"}, {"port", w.tcp_server ? w.tcp_server->port() : 0}}).ok()) return 1;
  std::deque<nlohmann::json> inbox;
  for (;;) {
    // Take everything already sent, so the request queued behind this one is known.
    for (bool wait = inbox.empty();; wait = false) {
      auto m = channel.Receive(wait ? -1 : 0);
      if (!m.ok()) return inbox.empty() ? 1 : 0;  // the router is gone: nothing to answer to
      if (!m->has_value()) break;
      inbox.push_back(std::move(**m));
    }
    const nlohmann::json msg = std::move(inbox.front());
    inbox.pop_front();
    if (msg.value("type", "") == "exit") return 0;
    Result<nlohmann::json> reply = InvalidArgument("malformed request");
    try {
      reply = Handle(o, w, msg, inbox.empty() ? nullptr : &inbox.front());
    } catch (const nlohmann::json::exception& e) {
      reply = InvalidArgument(std::string("malformed request: ") + e.what());
    }
    nlohmann::json out = reply.ok() ? *reply
                                    : nlohmann::json{{"type", "error"},
                                                     {"id", msg.value("id", uint64_t{0})},
                                                     {"message", reply.status().ToString()}};
    out["attempt"] = msg.value("attempt", 0u);  // the router tells a stale answer by it
    if (!channel.Send(out).ok()) return 1;
  }
}

}  // namespace cxlkv::serve
