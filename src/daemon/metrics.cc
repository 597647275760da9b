// The daemon's /metrics: the Prometheus text exposition format (version 0.0.4). Every family
// has HELP and TYPE lines once, then its samples; counters end in _total; histograms have
// cumulative _bucket{le=...} samples ending at +Inf, then _sum and _count. The figures come
// from the region (the same numbers `cxlkv stat` reads without a daemon) and from this
// daemon's own counters.
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "daemon/daemon.h"
#include "daemon/node_status.h"
#include "meta/service.h"
#include "pool/pool_internal.h"
#include "util/histogram.h"

namespace cxlkv::daemon {
namespace {

class Exposition {
 public:
  void Family(const std::string& name, const char* type, const char* help) {
    out_ += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  }
  void Sample(const std::string& name, const std::string& labels, double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    out_ += name + (labels.empty() ? "" : "{" + labels + "}") + " " + buf + "\n";
  }
  void Sample(const std::string& name, const std::string& labels, uint64_t v) {
    out_ += name + (labels.empty() ? "" : "{" + labels + "}") + " " + std::to_string(v) + "\n";
  }
  void Histogram(const std::string& name, const char* help, const util::LatencyHistogram::Snapshot& s) {
    Family(name, "histogram", help);
    HistogramSamples(name, "", s);
  }
  // One labelled series of a histogram family already announced (`labels` without braces).
  void HistogramSamples(const std::string& name, const std::string& labels, const util::LatencyHistogram::Snapshot& s) {
    const std::string prefix = labels.empty() ? "" : labels + ",";
    uint64_t cumulative = 0;
    for (size_t b = 0; b < util::LatencyHistogram::kBoundsSeconds.size(); ++b) {
      cumulative += s.buckets[b];
      char le[32];
      std::snprintf(le, sizeof le, "%g", util::LatencyHistogram::kBoundsSeconds[b]);
      Sample(name + "_bucket", prefix + "le=\"" + le + "\"", cumulative);
    }
    cumulative += s.buckets.back();
    Sample(name + "_bucket", prefix + "le=\"+Inf\"", cumulative);
    Sample(name + "_sum", labels, s.sum_seconds);
    Sample(name + "_count", labels, cumulative);
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

std::string Label(const char* k, const std::string& v) {
  std::string escaped;
  for (char c : v) {
    if (c == '\\' || c == '"') escaped += '\\';
    if (c == '\n') {
      escaped += "\\n";
      continue;
    }
    escaped += c;
  }
  return std::string(k) + "=\"" + escaped + "\"";
}

uint64_t U(const nlohmann::json& j) { return j.is_number_unsigned() ? j.get<uint64_t>() : 0; }

}  // namespace

std::string Daemon::RenderMetrics() {
  Exposition e;
  auto& impl = pool_->impl();
  sync::Node& node = *impl.node;
  const std::string me = Label("node", std::to_string(options_.node_id));

  e.Family("cxlkv_daemon_info", "gauge", "This cxlkvd: its node and pool (value 1).");
  e.Sample("cxlkv_daemon_info", me + "," + Label("pool_id", impl.regions[0]->info().pool_id) + "," +
                                    Label("pid", std::to_string(::getpid())),
           uint64_t{1});
  e.Family("cxlkv_daemon_uptime_seconds", "gauge", "Seconds since this cxlkvd started.");
  e.Sample("cxlkv_daemon_uptime_seconds", "",
           std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count());

  // Liveness as this daemon observes it (heartbeats within a lease).
  const auto views = node.Nodes();
  const std::vector<cache::NodeStatus> statuses = NodeStatuses(views);
  e.Family("cxlkv_node_live", "gauge", "1 when the node's heartbeat moved within its lease, as this daemon sees it.");
  for (const sync::NodeView& v : views) {
    if (v.incarnation != 0) e.Sample("cxlkv_node_live", Label("node", std::to_string(v.id)), uint64_t{v.live ? 1u : 0u});
  }
  e.Family("cxlkv_node_incarnation", "gauge", "The node's current life (bumped by every restart or lease lapse).");
  for (const sync::NodeView& v : views) {
    if (v.incarnation != 0) e.Sample("cxlkv_node_incarnation", Label("node", std::to_string(v.id)), v.incarnation);
  }
  e.Family("cxlkv_recovered_lives_total", "counter", "Ended lives of nodes whose leftovers this daemon recovered.");
  e.Sample("cxlkv_recovered_lives_total", "", node.lives_recovered());
  e.Histogram("cxlkv_lock_wait_seconds", "Time this daemon's global lock acquisitions waited for their grant.",
              node.lock_wait().Read());

  nlohmann::json stat = pool::Stat(impl.regions, statuses);
  e.Family("cxlkv_lock_manager_node", "gauge", "The node running the lock manager (-1: none).");
  e.Sample("cxlkv_lock_manager_node", "",
           stat["lock_manager"].is_null() ? -1.0 : static_cast<double>(U(stat["lock_manager"]["node"])));
  e.Family("cxlkv_pool_allocated_bytes", "gauge", "Bytes allocated in the pool's data areas.");
  e.Sample("cxlkv_pool_allocated_bytes", "", U(stat["allocated_bytes"]));
  e.Family("cxlkv_pool_chunks", "gauge", "Chunks of each region by use.");
  for (size_t i = 0; i < stat["regions"].size(); ++i) {
    const auto& r = stat["regions"][i];
    for (const char* kind : {"free", "heap", "large", "orphan_heap", "leased"}) {
      e.Sample("cxlkv_pool_chunks", Label("region", std::to_string(i)) + "," + Label("use", kind), U(r[kind]));
    }
  }
  const nlohmann::json& cache = stat["cache"];
  if (!cache.is_null()) {
    e.Family("cxlkv_cache_entries", "gauge", "Prefix index entries by state.");
    for (const auto& [state, n] : cache["states"].items()) e.Sample("cxlkv_cache_entries", Label("state", state), U(n));
    e.Family("cxlkv_cache_used_bytes", "gauge", "Payload bytes of live entries (WRITING, READY, EVICTING).");
    e.Sample("cxlkv_cache_used_bytes", "", U(cache["used_bytes"]));
    e.Family("cxlkv_cache_capacity_bytes", "gauge", "The cache's payload budget.");
    e.Sample("cxlkv_cache_capacity_bytes", "", U(cache["capacity_bytes"]));
    e.Family("cxlkv_cache_tier_bytes", "gauge", "Payload bytes of live entries per tier (0: the shared region).");
    for (const auto& [tier, t] : cache["tiers"].items()) e.Sample("cxlkv_cache_tier_bytes", Label("tier", tier), U(t["bytes"]));
    // The per-node counters every process publishes in the region; hit blocks over lookup
    // blocks and lookups with a hit over lookups are the hit rates.
    std::map<std::string, std::vector<std::pair<std::string, uint64_t>>> counters;
    std::vector<std::pair<std::string, uint64_t>> pins;
    for (const auto& [n, row] : cache["per_node"].items()) {
      for (const auto& [k, v] : row.items()) {
        if (k == "status" || k == "ready_bytes_written") continue;
        if (k == "pins") {
          pins.emplace_back(n, U(v));
          continue;
        }
        counters[k].emplace_back(n, U(v));
      }
    }
    for (const auto& [k, rows] : counters) {
      const std::string name = "cxlkv_cache_" + k + "_total";
      e.Family(name, "counter", ("Prefix cache counter '" + k + "' per node, as published in the region.").c_str());
      for (const auto& [n, v] : rows) e.Sample(name, Label("node", n), v);
    }
    e.Family("cxlkv_cache_pins", "gauge", "Pins held per node (blocks being read).");
    for (const auto& [n, v] : pins) e.Sample("cxlkv_cache_pins", Label("node", n), v);
  }
  // The node's capacity tiers (docs/tiers.md).
  if (tiers_) {
    const nlohmann::json t = tiers_->Stats();
    const std::pair<const char*, const char*> gauges[] = {
        {"slots", "Largest slots (--tier-slot) each capacity device of this node holds."},
        {"used_slots", "Slots of each capacity device holding a block."},
        {"capacity_bytes", "Bytes of each capacity device of this node."},
        {"used_bytes", "Bytes of each capacity device in slots holding a block (each block's size, header and padding included)."},
        {"bandwidth_bytes_per_second", "Each device's measured read bandwidth (placement weights, Algorithm 1)."},
    };
    for (const auto& [key, help] : gauges) {
      const std::string name = std::string("cxlkv_tier_") + key;
      e.Family(name, "gauge", help);
      for (const auto& d : t["devices"]) {
        e.Sample(name, Label("device", std::to_string(U(d["index"]))) + "," + Label("kind", d["kind"].get<std::string>()),
                 U(d[key]));
      }
    }
    const std::pair<const char*, const char*> device_counters[] = {
        {"writes", "Blocks written to each device."},          {"reads", "Blocks read back from each device."},
        {"write_errors", "Failed block writes per device."},   {"read_errors", "Failed block reads per device."},
        {"miss_empty", "Reads that found an empty slot."},     {"miss_corrupt", "Reads that failed the CRC or a header check."},
        {"miss_stale", "Reads that found another block or generation (a reused slot)."},
    };
    for (const auto& [key, help] : device_counters) {
      const std::string name = std::string("cxlkv_tier_device_") + key + "_total";
      e.Family(name, "counter", help);
      for (const auto& d : t["devices"]) {
        e.Sample(name, Label("device", std::to_string(U(d["index"]))) + "," + Label("kind", d["kind"].get<std::string>()),
                 U(d[key]));
      }
    }
    const std::pair<const char*, const char*> store_counters[] = {
        {"spilled", "Blocks this node moved from the region to its devices."},
        {"spill_failed", "Blocks a spill could not write (device error, no slot)."},
        {"promoted", "Blocks this node brought back into the region for a lookup."},
        {"promote_missed", "Blocks a promote could not bring in (invalid slot, region full, entry changed)."},
        {"dropped_full", "Blocks dropped to make room on a full device."},
        {"dropped_lost", "Entries dropped because their bytes were gone (invalid slot, an ended process's DRAM)."},
        {"freed_orphan_slots", "Device slots freed because no entry named them any more."},
        {"adopted", "SSD blocks the index named at start and the catalog proved current."},
        {"restored", "SSD blocks no entry named at start (e.g. a re-created region) named again."},
        {"restore_skipped", "SSD blocks no entry named at start that could not be named again (freed)."},
    };
    for (const auto& [key, help] : store_counters) {
      const std::string name = std::string("cxlkv_tier_") + key + "_total";
      e.Family(name, "counter", help);
      e.Sample(name, "", U(t[key]));
    }
  }
  // The TCP front (docs/rpc.md): refused counts peers that never authenticated (TLS).
  if (tcp_) {
    const rpc::TcpFrontStats s = tcp_->stats();
    const std::tuple<const char*, const char*, uint64_t> tcp_counters[] = {
        {"cxlkv_tcp_connections_total", "Connections the TCP front accepted.", s.connections},
        {"cxlkv_tcp_frames_total", "Requests the TCP front answered (errors included).", s.frames},
        {"cxlkv_tcp_errors_total", "Error frames the TCP front sent.", s.errors},
        {"cxlkv_tcp_dropped_total", "Connections dropped for a malformed stream or unread answers.", s.dropped},
        {"cxlkv_tcp_refused_total", "Connections closed before they authenticated (no valid TLS client certificate).",
         s.refused},
    };
    for (const auto& [name, help, v] : tcp_counters) {
      e.Family(name, "counter", help);
      e.Sample(name, "", v);
    }
  }
  // Near-memory attention engines (docs/pnm.md).
  if (pnm_) {
    const NearMemoryServiceStats p = pnm_->stats();
    const std::tuple<const char*, const char*, uint64_t> gauges[] = {
        {"cxlkv_pnm_contexts_open", "Near-memory contexts open (their blocks pinned).", p.contexts_open},
        {"cxlkv_pnm_pages_pinned", "Pool blocks pinned by open near-memory contexts.", p.pages_pinned},
        {"cxlkv_pnm_bytes_pinned", "Bytes of those blocks.", p.bytes_pinned},
    };
    for (const auto& [name, help, v] : gauges) {
      e.Family(name, "gauge", help);
      e.Sample(name, "", v);
    }
    e.Family("cxlkv_pnm_numa_node", "gauge", "The NUMA node the near-memory engine threads run on (-1: not bound).");
    e.Sample("cxlkv_pnm_numa_node", "", static_cast<double>(p.numa_node));
    const std::tuple<const char*, const char*, uint64_t> counters[] = {
        {"cxlkv_pnm_contexts_opened_total", "Near-memory contexts opened.", p.contexts_opened},
        {"cxlkv_pnm_contexts_expired_total", "Contexts closed by their lease, their client node's death, or this node's life ending.", p.contexts_expired},
        {"cxlkv_pnm_attend_jobs_total", "Attention requests (one layer of one sequence) answered.", p.attend_jobs},
        {"cxlkv_pnm_attend_errors_total", "Attention requests answered with an error.", p.attend_errors},
        {"cxlkv_pnm_pages_attended_total", "Pages attended, summed over KV heads.", p.pages_attended},
        {"cxlkv_pnm_kv_read_bytes_total", "KV bytes the near-memory attention read.", p.kv_bytes_read},
        {"cxlkv_pnm_link_bytes_total", "Query, output and lse bytes that crossed the link.", p.link_bytes},
        {"cxlkv_pnm_digests_found_total", "Page digests read from the pool.", p.digests_found},
        {"cxlkv_pnm_digests_built_total", "Page digests built from the keys.", p.digests_built},
        {"cxlkv_pnm_digests_stored_total", "Built digests stored in the pool for the next opener.", p.digests_stored},
    };
    for (const auto& [name, help, v] : counters) {
      e.Family(name, "counter", help);
      e.Sample(name, "", v);
    }
    // Per engine (one per memory node of the pool's regions): whether the work is spread.
    const std::tuple<const char*, const char*> per_engine[] = {
        {"cxlkv_pnm_engine_jobs_total", "Attention jobs, or their parts on one memory node, an engine ran."},
        {"cxlkv_pnm_engine_pages_attended_total", "Pages an engine attended, summed over KV heads."},
    };
    for (size_t k = 0; k < 2; ++k) {
      const auto& [name, help] = per_engine[k];
      e.Family(name, "counter", help);
      for (size_t i = 0; i < p.engines.size(); ++i) {
        const NodeEngineStats& n = p.engines[i];
        e.Sample(name, Label("engine", std::to_string(i)) + "," + Label("numa_node", std::to_string(n.numa_node)),
                 k == 0 ? n.jobs : n.pages_attended);
      }
    }
  }
  // Every RPC service this daemon serves or stands by for: admin, and meta on a central pool.
  std::vector<const rpc::RpcServer*> servers;
  if (admin_) servers.push_back(admin_.get());
  if (tier_service_) servers.push_back(tier_service_.get());
  if (pnm_) servers.push_back(&pnm_->server());
  const meta::MetaService* meta_service = meta::ServiceOf(*pool_);
  if (meta_service != nullptr) servers.push_back(&meta_service->server());
  using Field = uint64_t rpc::RpcServerStats::*;
  const std::pair<const char*, std::pair<Field, const char*>> counters[] = {
      {"cxlkv_rpc_requests_total", {&rpc::RpcServerStats::requests, "RPC requests this daemon answered."}},
      {"cxlkv_rpc_errors_total", {&rpc::RpcServerStats::errors, "RPC requests answered with an error."}},
      {"cxlkv_rpc_takeovers_total", {&rpc::RpcServerStats::takeovers, "Terms of the RPC service this daemon began."}},
      {"cxlkv_rpc_unknown_outcome_total",
       {&rpc::RpcServerStats::unknown_outcome, "Requests a predecessor accepted, answered 'outcome unknown' at takeover."}},
  };
  if (!servers.empty()) {
    e.Family("cxlkv_rpc_serving", "gauge", "1 while this daemon serves the RPC service (0: standing by).");
    for (const rpc::RpcServer* srv : servers) {
      e.Sample("cxlkv_rpc_serving", Label("service", srv->area().service()), uint64_t{srv->stats().serving ? 1u : 0u});
    }
    for (const auto& [name, field] : counters) {
      e.Family(name, "counter", field.second);
      for (const rpc::RpcServer* srv : servers) e.Sample(name, Label("service", srv->area().service()), srv->stats().*field.first);
    }
    e.Family("cxlkv_rpc_service_seconds", "histogram", "From the poll that found an RPC request to the publish of its answer.");
    for (const rpc::RpcServer* srv : servers) {
      e.HistogramSamples("cxlkv_rpc_service_seconds", Label("service", srv->area().service()), srv->service_time().Read());
    }
  }
  if (meta_service != nullptr) {
    const meta::MetaServiceStats m = meta_service->stats();
    e.Family("cxlkv_meta_sweeps_total", "counter", "Sweeps of the central index for dead writers and pins, by this daemon.");
    e.Sample("cxlkv_meta_sweeps_total", "", m.sweeps);
    e.Family("cxlkv_meta_reclaimed_total", "counter", "WRITING entries of ended lives or dead processes this daemon dropped.");
    e.Sample("cxlkv_meta_reclaimed_total", "", m.reclaimed);
  }
  return e.Take();
}

}  // namespace cxlkv::daemon
