// cxlkv init / info: create and inspect regions.
#include <ctime>
#include <memory>
#include <string>

#include "cache/index.h"
#include "commands.h"
#include "pool/status_doc.h"
#include "tier/pool_tiers.h"
#include "util/units.h"

namespace cxlkv::cli {
namespace {

std::string IsoTime(uint64_t unix_ns) {
  std::time_t t = static_cast<std::time_t>(unix_ns / 1000000000ull);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace

std::vector<std::string> SplitPaths(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    size_t comma = list.find(',', start);
    if (comma == std::string::npos) comma = list.size();
    if (comma > start) out.push_back(list.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

nlohmann::json RegionInfoJson(const RegionInfo& info) {
  nlohmann::json j;
  j["path"] = info.path;
  j["backend"] = std::string(BackendKindName(info.backend));
  j["coherence"] = std::string(CoherenceModeName(info.coherence));
  j["layout_version"] = info.layout_version;
  j["region_size"] = info.region_size;
  j["max_nodes"] = info.max_nodes;
  j["chunk_bytes"] = info.chunk_bytes;
  j["numa_node"] = info.numa_node;
  j["created_unix_ns"] = info.created_unix_ns;
  j["created"] = IsoTime(info.created_unix_ns);
  j["region_id"] = info.region_id;
  j["checksum"] = util::Hex64(info.checksum);
  j["areas"] = nlohmann::json::array();
  for (const AreaInfo& a : info.areas) {
    j["areas"].push_back({{"name", a.name}, {"offset", a.offset}, {"size", a.size}, {"param", a.param}});
  }
  return j;
}

void PrintRegionInfo(const RegionInfo& info, std::FILE* out) {
  std::fprintf(out, "region          %s\n", info.path.c_str());
  std::fprintf(out, "backend         %s\n", std::string(BackendKindName(info.backend)).c_str());
  std::fprintf(out, "coherence       %s\n", std::string(CoherenceModeName(info.coherence)).c_str());
  std::fprintf(out, "layout version  %u\n", info.layout_version);
  std::fprintf(out, "size            %s (%llu bytes)\n", util::FormatBytes(info.region_size).c_str(),
               static_cast<unsigned long long>(info.region_size));
  std::fprintf(out, "max nodes       %u\n", info.max_nodes);
  std::fprintf(out, "chunk size      %s\n", util::FormatBytes(info.chunk_bytes).c_str());
  std::fprintf(out, "numa node       %s\n",
               info.numa_node < 0 ? "not bound" : std::to_string(info.numa_node).c_str());
  std::fprintf(out, "created         %s\n", IsoTime(info.created_unix_ns).c_str());
  std::fprintf(out, "region id       %s\n", info.region_id.c_str());
  std::fprintf(out, "checksum        %s (xxh3-64, verified)\n", util::Hex64(info.checksum).c_str());
  std::fprintf(out, "areas:\n");
  for (const AreaInfo& a : info.areas) {
    std::fprintf(out, "  %-14s offset %-14s size %s\n", a.name.c_str(), util::Hex64(a.offset).c_str(),
                 util::FormatBytes(a.size).c_str());
  }
}

void AddRegionCommands(CLI::App& app, CommandResult& result) {
  struct InitArgs {
    std::string path, size;
    uint32_t nodes = 16;
    uint32_t locks = 256;
    uint32_t roots = 1024;
    int numa = -1;
    bool force = false;
    uint64_t index_entries = 0;
    uint32_t index_stripes = 0;
    std::string cache_capacity;
    uint32_t high = 95, low = 85;
    bool checksum = false, no_index = false;
    std::string metadata = "decentralized";
    std::vector<std::string> tiers;
    std::string tier_slot;
  };
  auto init_args = std::make_shared<InitArgs>();
  CLI::App* init = app.add_subcommand("init", "Create and format a region (shm/hugetlbfs file or /dev/daxX.Y)");
  init->add_option("--path", init_args->path, "Region path(s), comma-separated for a pool of several devices: /dev/shm/NAME, a hugetlbfs file, or /dev/daxX.Y")
      ->required();
  init->add_option("--size", init_args->size, "Region size, e.g. 1G, 512M (files; devdax uses the device size)");
  init->add_option("--nodes", init_args->nodes, "Most nodes (hosts) that may attach")
      ->check(CLI::Range(1u, kMaxNodes))
      ->capture_default_str();
  init->add_option("--numa", init_args->numa, "Bind the region's memory to this NUMA node (CXL memory in system-ram mode)");
  init->add_flag("--force", init_args->force, "Replace an existing region at the path");
  init->add_option("--locks", init_args->locks, "Global locks")->check(CLI::Range(4u, 65536u))->capture_default_str();
  init->add_option("--roots", init_args->roots, "Named roots the object store holds")->check(CLI::Range(1u, 1u << 24))->capture_default_str();
  init->add_option("--index-entries", init_args->index_entries,
                   "Prefix-index slots (0: one per 16 KiB of data, 1 Ki..4 Mi)")->capture_default_str();
  init->add_option("--index-stripes", init_args->index_stripes, "Lock stripes of the index (0: up to 32)")
      ->check(CLI::Range(0u, 4096u))->capture_default_str();
  init->add_option("--cache-capacity", init_args->cache_capacity, "Payload budget of the KV cache, e.g. 8G (default: all data)");
  init->add_option("--high-watermark", init_args->high, "Evict above this % of the capacity")->check(CLI::Range(1u, 100u))->capture_default_str();
  init->add_option("--low-watermark", init_args->low, "...down to this %")->check(CLI::Range(0u, 100u))->capture_default_str();
  init->add_flag("--checksum", init_args->checksum, "Keep an xxh3 checksum per block, verified on whole-block reads");
  init->add_flag("--no-index", init_args->no_index, "A pool without the prefix KV cache");
  init->add_option("--metadata", init_args->metadata,
                   "Who writes the prefix index: decentralized (every node, under stripe locks: TraCT) or central "
                   "(one metadata service over the shared-memory RPC: Beluga)")
      ->check(CLI::IsMember({"decentralized", "central"}))
      ->capture_default_str();
  init->add_option("--tier", init_args->tiers,
                   "A default capacity tier of every node's cxlkvd, repeatable: dram:SIZE[:numa=N] or ssd:PATH:SIZE[:catalog=DIR] "
                   "(%n in PATH: the node id, e.g. ssd:/data/kv-%n.tier:64G); a cxlkvd's own --tier overrides");
  init->add_option("--tier-slot", init_args->tier_slot, "The largest tier slot of those tiers, header included (default 2M+4K)");
  init->callback([init_args, &result] {
    tier::PoolTierConfig tiers;
    tiers.specs = init_args->tiers;
    if (!init_args->tiers.empty()) {
      if (!init_args->tier_slot.empty()) {
        auto slot = util::ParseByteSize(init_args->tier_slot);
        if (!slot.ok()) {
          result.status = InvalidArgument("--tier-slot: " + slot.status().message());
          return;
        }
        tiers.slot_bytes = *slot;
      }
      result.status = tier::ValidatePoolTierConfig(tiers);
      if (result.status.ok() && init_args->metadata == "central") {
        result.status = InvalidArgument("capacity tiers need decentralized metadata for now (docs/tiers.md): "
                                        "drop --tier or --metadata central");
      }
      if (!result.status.ok()) return;  // before anything is created
    }
    PoolCreateOptions opts;
    if (!init_args->cache_capacity.empty()) {
      auto cap = util::ParseByteSize(init_args->cache_capacity);
      if (!cap.ok()) {
        result.status = cap.status();
        return;
      }
      opts.cache_capacity = *cap;
    }
    opts.index = !init_args->no_index;
    opts.index_entries = init_args->index_entries;
    opts.index_stripes = init_args->index_stripes;
    opts.high_watermark_pct = init_args->high;
    opts.low_watermark_pct = init_args->low;
    opts.checksum = init_args->checksum;
    opts.metadata = init_args->metadata == "central" ? MetadataMode::kCentral : MetadataMode::kDecentralized;
    if (!init_args->size.empty()) {
      auto size = util::ParseByteSize(init_args->size);
      if (!size.ok()) {
        result.status = size.status();
        return;
      }
      opts.size = *size;
    }
    opts.max_nodes = init_args->nodes;
    opts.numa_node = init_args->numa;
    opts.overwrite = init_args->force;
    opts.max_locks = init_args->locks;
    opts.max_roots = init_args->roots;
    auto paths = SplitPaths(init_args->path);
    result.status = Pool::Create(paths, opts);
    if (!result.status.ok()) return;
    for (const auto& p : paths) {
      auto region = Region::Attach(p);
      if (!region.ok()) {
        result.status = region.status();
        return;
      }
      std::printf("created %s: %s, %u nodes, layout version %u, region id %s\n", p.c_str(),
                  util::FormatBytes((*region)->info().region_size).c_str(),
                  (*region)->info().max_nodes, (*region)->info().layout_version,
                  (*region)->info().region_id.c_str());
    }
    if (!tiers.specs.empty()) {
      // Recorded in the pool (its status document "pool-tiers"), by a short visit as node 0.
      PoolOpenOptions po;
      po.recovers = false;
      po.prefault = false;
      auto pool = Pool::Open(paths, po);
      result.status = pool.ok() ? pool::PublishStatus(**pool, tier::kPoolTiersDoc, tier::PoolTierConfigJson(tiers))
                                : pool.status();
      if (!result.status.ok()) {
        result.status = Status(result.status.code(), "the pool was created but its tiers were not recorded: " +
                                                         result.status.message() + " (re-run with --force)");
        return;
      }
      std::string list;
      for (const auto& s : tiers.specs) list += (list.empty() ? "" : ", ") + s;
      std::printf("default tiers of every node's cxlkvd: %s\n", list.c_str());
    }
  });

  struct InfoArgs {
    std::string path;
    bool json = false;
  };
  auto info_args = std::make_shared<InfoArgs>();
  CLI::App* info = app.add_subcommand("info", "Print a region's superblock and area table");
  info->add_option("--path", info_args->path, "Region path")->required();
  info->add_flag("--json", info_args->json, "Print JSON instead of text");
  info->callback([info_args, &result] {
    auto region = Region::Attach(info_args->path);
    if (!region.ok()) {
      result.status = region.status();
      return;
    }
    // The index (first region of a pool only) says who writes it.
    auto layout = cache::ReadLayout(**region);
    const char* metadata = !layout.ok() ? nullptr : (layout->h.flags & cache::kFlagCentral) ? "central" : "decentralized";
    if (info_args->json) {
      nlohmann::json j = RegionInfoJson((*region)->info());
      j["metadata"] = metadata == nullptr ? nlohmann::json() : nlohmann::json(metadata);
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      PrintRegionInfo((*region)->info(), stdout);
      if (metadata != nullptr) std::printf("metadata        %s\n", metadata);
    }
  });
}

}  // namespace cxlkv::cli
