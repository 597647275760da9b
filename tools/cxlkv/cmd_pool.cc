// cxlkv stat / check: inspect a pool without joining it.
#include <algorithm>
#include <memory>
#include <string>

#include "commands.h"
#include "pool/pool_internal.h"
#include "pool/status_doc.h"
#include "tier/pool_tiers.h"
#include "util/units.h"

namespace cxlkv::cli {

namespace {

unsigned long long U(const nlohmann::json& v) { return v.is_number() ? v.get<unsigned long long>() : 0; }

void PrintCacheStat(const nlohmann::json& c) {
  if (c.is_null()) {
    std::printf("prefix cache: none (pool made with --no-index)\n");
    return;
  }
  const auto& st = c["states"];
  std::printf("prefix cache: %llu slots in %llu stripes; ready %llu, writing %llu, evicting %llu, "
              "tombstone %llu, empty %llu; %s of payload\n",
              U(c["entries"]), U(c["stripes"]), U(st["ready"]), U(st["writing"]), U(st["evicting"]),
              U(st["tombstone"]), U(st["empty"]), util::FormatBytes(U(c["used_bytes"])).c_str());
  const auto& t = c["totals"];
  std::printf("  lookups %llu: %llu of %llu blocks hit (%.1f%%), %llu tokens; %llu lookups hit nothing\n",
              U(t["lookups"]), U(t["hit_blocks"]), U(t["lookup_blocks"]),
              100.0 * c["hit_rate"]["blocks"].get<double>(), U(t["hit_tokens"]), U(t["zero_hit_lookups"]));
  std::printf("  inserts %llu (%s), duplicates %llu, busy %llu, aborts %llu, evictions %llu (%s), "
              "reclaimed %llu, full %llu\n",
              U(t["inserts"]), util::FormatBytes(U(t["insert_bytes"])).c_str(), U(t["duplicates"]), U(t["busy"]),
              U(t["aborts"]), U(t["evictions"]), util::FormatBytes(U(t["evicted_bytes"])).c_str(),
              U(t["reclaimed"]), U(t["full_errors"]));
  static const char* const kTierNames[] = {"region", "node DRAM", "SSD"};
  for (auto& [tier, v] : c["tiers"].items()) {
    const int t = std::atoi(tier.c_str());
    std::printf("  tier %s (%s): %llu blocks, %s\n", tier.c_str(), t >= 0 && t <= 2 ? kTierNames[t] : "unknown",
                U(v["entries"]), util::FormatBytes(U(v["bytes"])).c_str());
  }
  if (U(t["spills"]) + U(t["promotes"]) + U(t["capacity_hits"]) + U(t["capacity_misses"]) + U(t["tier_drops"]) != 0) {
    const uint64_t asked = U(t["capacity_hits"]) + U(t["capacity_misses"]);
    std::printf("  capacity tiers: spilled %llu (%s), promoted %llu (%s); lookups met %llu blocks there and "
                "brought in %llu (%.1f%%); dropped %llu\n",
                U(t["spills"]), util::FormatBytes(U(t["spilled_bytes"])).c_str(), U(t["promotes"]),
                util::FormatBytes(U(t["promoted_bytes"])).c_str(), static_cast<unsigned long long>(asked),
                U(t["capacity_hits"]), asked ? 100.0 * static_cast<double>(U(t["capacity_hits"])) / asked : 0.0,
                U(t["tier_drops"]));
    // Hit rates per tier: of the blocks lookups asked for, where the hits were served from.
    const uint64_t looked = U(t["lookup_blocks"]), hits = U(t["hit_blocks"]);
    const uint64_t ssd = std::min(U(t["capacity_hits_ssd"]), U(t["capacity_hits"]));
    const uint64_t mem = U(t["capacity_hits"]) - ssd, region = hits - std::min(hits, mem + ssd);
    auto pct = [looked](uint64_t n) { return looked ? 100.0 * static_cast<double>(n) / static_cast<double>(looked) : 0.0; };
    std::printf("  hits by tier (of %llu blocks looked up): region %llu (%.1f%%), node DRAM %llu (%.1f%%), "
                "SSD %llu (%.1f%%)\n", static_cast<unsigned long long>(looked), static_cast<unsigned long long>(region),
                pct(region), static_cast<unsigned long long>(mem), pct(mem), static_cast<unsigned long long>(ssd), pct(ssd));
  }
  for (auto& [node, v] : c["per_node"].items()) {
    std::printf("  node %-3s %-6s lookups %llu hit %llu/%llu blocks, inserts %llu, evictions %llu, pins %llu, "
                "ready bytes written %s\n",
                node.c_str(), v["status"].get<std::string>().c_str(), U(v["lookups"]), U(v["hit_blocks"]),
                U(v["lookup_blocks"]), U(v["inserts"]), U(v["evictions"]), U(v["pins"]),
                util::FormatBytes(U(v["ready_bytes_written"])).c_str());
  }
  for (const auto& ns : c["namespaces"]) {
    std::printf("  namespace %llu: model '%s'%s, %llu-token blocks of %s\n", U(ns["id"]),
                ns["model"].get<std::string>().c_str(),
                ns["extra"].get<std::string>().empty() ? "" : (" [" + ns["extra"].get<std::string>() + "]").c_str(),
                U(ns["block_tokens"]), U(ns["block_bytes"]) ? util::FormatBytes(U(ns["block_bytes"])).c_str() : "any size");
  }
}

// What each node's cxlkvd published of its capacity devices (pool/status_doc.h).
void PrintTierStatus(const nlohmann::json& status) {
  if (!status.is_object()) return;
  auto defaults = tier::FindPoolTierConfig(status);
  if (!defaults.ok()) {
    std::printf("default tiers: %s\n", defaults.status().message().c_str());
  } else if (*defaults) {
    std::string list;
    for (const auto& s : (*defaults)->specs) list += (list.empty() ? "" : ", ") + s;
    std::printf("default tiers of every node's cxlkvd (cxlkv init --tier): %s\n", list.c_str());
  }
  for (auto& [name, doc] : status.items()) {
    if (name.rfind("tier-", 0) != 0) continue;
    if (doc.contains("unreadable")) {
      std::printf("tiers of %s: unreadable (%s)\n", name.c_str(), doc["unreadable"].dump().c_str());
      continue;
    }
    std::printf("tiers of node %llu: spilled %llu, promoted %llu (missed %llu), dropped %llu full + %llu lost; "
                "at start: adopted %llu, restored %llu, freed %llu\n",
                U(doc["node"]), U(doc["spilled"]), U(doc["promoted"]), U(doc["promote_missed"]),
                U(doc["dropped_full"]), U(doc["dropped_lost"]), U(doc["adopted"]), U(doc["restored"]),
                U(doc["restore_skipped"]));
    if (doc["worker_placement"].is_string()) std::printf("  %s\n", doc["worker_placement"].get<std::string>().c_str());
    if (!doc["devices"].is_array()) continue;
    for (const auto& d : doc["devices"]) {
      std::printf("  %s\n    %llu of %llu slots used; read %llu, written %llu; misses: empty %llu, corrupt %llu, stale %llu\n",
                  d["describe"].is_string() ? d["describe"].get<std::string>().c_str() : "?", U(d["used_slots"]),
                  U(d["slots"]), U(d["reads"]), U(d["writes"]), U(d["miss_empty"]), U(d["miss_corrupt"]),
                  U(d["miss_stale"]));
    }
  }
}

}  // namespace

void AddPoolCommands(CLI::App& app, CommandResult& result) {
  struct Args {
    std::string path;
    bool json = false;
    uint32_t watch_ms = 300;
  };
  auto stat_args = std::make_shared<Args>();
  CLI::App* stat = app.add_subcommand("stat", "Nodes, lock manager, chunks per region and node, named roots");
  stat->add_option("--path", stat_args->path, "Region path(s) of the pool, comma-separated")->required();
  stat->add_flag("--json", stat_args->json, "Print JSON");
  stat->add_option("--watch-ms", stat_args->watch_ms, "How long to watch heartbeats to tell live from silent")
      ->capture_default_str();
  stat->callback([stat_args, &result] {
    auto regions = pool::AttachAll(SplitPaths(stat_args->path));
    if (!regions.ok()) {
      result.status = regions.status();
      return;
    }
    auto j = pool::Stat(*regions, stat_args->watch_ms);
    if (stat_args->json) {
      std::printf("%s\n", j.dump(2).c_str());
      return;
    }
    std::printf("nodes:\n");
    for (const auto& n : j["nodes"]) {
      std::printf("  node %-3d %-7s incarnation %llu heartbeat %llu pid %llu\n", n["id"].get<int>(),
                  n["state"].get<std::string>().c_str(), n["incarnation"].get<unsigned long long>(),
                  n["heartbeat"].get<unsigned long long>(), n["pid"].get<unsigned long long>());
    }
    std::printf("lock manager: %s\n", j["lock_manager"].is_null() ? "none yet"
                : ("node " + std::to_string(j["lock_manager"]["node"].get<int>())).c_str());
    std::printf("locks: %d allocated of %d (+%d internal)\n", j["locks"]["allocated"].get<int>(),
                j["locks"]["max"].get<int>() - j["locks"]["internal"].get<int>(), j["locks"]["internal"].get<int>());
    for (const auto& r : j["regions"]) {
      std::printf("region %s: %llu chunks of %s: %llu free, %llu leased, %llu heap, %llu large, %llu orphan; per node %s\n",
                  r["path"].get<std::string>().c_str(), r["chunks"].get<unsigned long long>(),
                  util::FormatBytes(r["chunk_bytes"].get<uint64_t>()).c_str(),
                  r["free"].get<unsigned long long>(), r["leased"].get<unsigned long long>(),
                  r["heap"].get<unsigned long long>(),
                  r["large"].get<unsigned long long>(), r["orphan_heap"].get<unsigned long long>(),
                  r["per_node"].dump().c_str());
    }
    std::printf("roots: %zu\n", j["roots"].size());
    for (const auto& r : j["roots"]) {
      std::printf("  %-40s offset %s size %llu\n", r["name"].get<std::string>().c_str(),
                  util::Hex64(r["offset"].get<uint64_t>()).c_str(), r["size"].get<unsigned long long>());
    }
    PrintCacheStat(j["cache"]);
    PrintTierStatus(j["status"]);
  });

  auto check_args = std::make_shared<Args>();
  CLI::App* check = app.add_subcommand("check", "Verify the allocator's invariants; non-zero exit with a report when broken");
  check->add_option("--path", check_args->path, "Region path(s) of the pool, comma-separated")->required();
  check->add_option("--watch-ms", check_args->watch_ms, "How long to watch heartbeats to tell live from dead nodes")
      ->capture_default_str();
  check->callback([check_args, &result] {
    auto regions = pool::AttachAll(SplitPaths(check_args->path));
    if (!regions.ok()) {
      result.status = regions.status();
      return;
    }
    auto problems = pool::Check(*regions, check_args->watch_ms);
    // The default tiers every cxlkvd would serve must read back valid (cxlkv init --tier).
    if (auto tiers = tier::FindPoolTierConfig(pool::ReadStatusDocs(*regions)); !tiers.ok()) {
      problems.push_back(tiers.status().message());
    }
    for (const auto& p : problems) std::printf("problem: %s\n", p.c_str());
    if (!problems.empty()) {
      result.status = Corrupted(std::to_string(problems.size()) + " invariant(s) violated (listed above)");
      return;
    }
    std::printf("ok: chunk tables, heap headers, roots and the prefix index are consistent\n");
  });
}

}  // namespace cxlkv::cli
