// cxlkv stat / check: inspect a pool without joining it.
#include <memory>
#include <string>

#include "commands.h"
#include "pool/pool_internal.h"
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
  for (auto& [tier, v] : c["tiers"].items()) {
    std::printf("  tier %s: %llu entries, %s\n", tier.c_str(), U(v["entries"]), util::FormatBytes(U(v["bytes"])).c_str());
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
    for (const auto& p : problems) std::printf("problem: %s\n", p.c_str());
    if (!problems.empty()) {
      result.status = Corrupted(std::to_string(problems.size()) + " invariant(s) violated (listed above)");
      return;
    }
    std::printf("ok: chunk tables, heap headers, roots and the prefix index are consistent\n");
  });
}

}  // namespace cxlkv::cli
