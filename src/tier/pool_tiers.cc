// The pool's default capacity tiers (pool_tiers.h).
#include "tier/pool_tiers.h"

#include "tier/tier_store.h"

namespace cxlkv::tier {

Status ValidatePoolTierConfig(const PoolTierConfig& config) {
  if (config.specs.empty()) return InvalidArgument("no tier given: name at least one (--tier dram:8G, --tier ssd:PATH:64G)");
  for (const std::string& text : config.specs) CXLKV_RETURN_IF_ERROR(ParseTierSpec(text).status());
  if (config.slot_bytes != 0 && (config.slot_bytes < 8192 || config.slot_bytes % 4096 != 0)) {
    return InvalidArgument("tier slot size " + std::to_string(config.slot_bytes) +
                           " must be a multiple of 4 KiB, at least 8 KiB");
  }
  return Status::Ok();
}

nlohmann::json PoolTierConfigJson(const PoolTierConfig& config) {
  return {{"tiers", config.specs}, {"slot_bytes", config.slot_bytes}};
}

Result<std::optional<PoolTierConfig>> FindPoolTierConfig(const nlohmann::json& status_docs) {
  if (!status_docs.is_object() || !status_docs.contains(kPoolTiersDoc)) return std::optional<PoolTierConfig>();
  const nlohmann::json& doc = status_docs[kPoolTiersDoc];
  auto bad = [](const std::string& why) {
    return Corrupted("the pool's tier configuration (cxlkv init --tier) " + why +
                     ": give cxlkvd its tiers with --tier (or --no-tiers), or re-create the pool");
  };
  if (doc.contains("unreadable")) return bad("is unreadable: " + doc["unreadable"].dump());
  if (!doc.is_object() || !doc.contains("tiers") || !doc["tiers"].is_array() || !doc.contains("slot_bytes") ||
      !doc["slot_bytes"].is_number_unsigned()) {
    return bad("is not of the expected shape");
  }
  PoolTierConfig config;
  for (const auto& t : doc["tiers"]) {
    if (!t.is_string()) return bad("holds a tier that is not text");
    config.specs.push_back(t.get<std::string>());
  }
  config.slot_bytes = doc["slot_bytes"].get<uint64_t>();
  if (Status s = ValidatePoolTierConfig(config); !s.ok()) return bad("is invalid: " + s.message());
  return std::optional<PoolTierConfig>(std::move(config));
}

std::vector<std::string> SpecsForNode(const PoolTierConfig& config, uint32_t node) {
  std::vector<std::string> out;
  for (std::string spec : config.specs) {
    for (size_t at = spec.find("%n"); at != std::string::npos; at = spec.find("%n", at)) {
      spec.replace(at, 2, std::to_string(node));
    }
    out.push_back(std::move(spec));
  }
  return out;
}

}  // namespace cxlkv::tier
