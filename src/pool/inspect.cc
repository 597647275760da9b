// Read-only views of a pool for `cxlkv stat` and `cxlkv check`; nothing here takes a lock.
#include <thread>

#include "cache/inspect.h"
#include "pool/pool_internal.h"
#include "pool/status_doc.h"
#include "region/region_internal.h"
#include "sync/layout.h"
#include "sync/node.h"
#include "util/units.h"

namespace cxlkv::pool {
namespace {

std::vector<sync::NodeView> ReadNodeLines(Region& r) {
  auto& meta = r.impl().meta();
  const auto* area = r.impl().find_area(region::AreaKind::kNodeTable);
  std::vector<sync::NodeView> lines(r.info().max_nodes);
  for (uint32_t j = 0; j < lines.size(); ++j) lines[j] = sync::ReadNodeLine(meta, area->offset, j);
  return lines;
}

// Liveness from two readings of the node lines `watch_ms` apart.
std::vector<cache::NodeStatus> Statuses(const std::vector<sync::NodeView>& before,
                                        const std::vector<sync::NodeView>& after) {
  std::vector<cache::NodeStatus> out(after.size(), cache::NodeStatus::kNever);
  for (size_t n = 0; n < after.size(); ++n) {
    if (after[n].incarnation == 0) continue;
    out[n] = after[n].state == sync::NodeState::kLeft ? cache::NodeStatus::kLeft
             : after[n].heartbeat != before[n].heartbeat || after[n].incarnation != before[n].incarnation
                 ? cache::NodeStatus::kLive
                 : cache::NodeStatus::kSilent;
  }
  return out;
}

std::vector<Region*> Raw(std::vector<std::unique_ptr<Region>>& regions) {
  std::vector<Region*> raw;
  for (auto& r : regions) raw.push_back(r.get());
  return raw;
}

}  // namespace

nlohmann::json Stat(std::vector<std::unique_ptr<Region>>& regions, uint32_t watch_ms) {
  auto before = ReadNodeLines(*regions[0]);
  std::this_thread::sleep_for(std::chrono::milliseconds(watch_ms));
  return Stat(regions, Statuses(before, ReadNodeLines(*regions[0])));
}

nlohmann::json Stat(std::vector<std::unique_ptr<Region>>& regions, const std::vector<cache::NodeStatus>& statuses) {
  Region& first = *regions[0];
  uint32_t max_nodes = first.info().max_nodes;
  auto after = ReadNodeLines(first);
  nlohmann::json j;
  j["nodes"] = nlohmann::json::array();
  static const char* const kState[] = {"never", "live", "silent", "left"};
  for (uint32_t n = 0; n < max_nodes; ++n) {
    const auto& l = after[n];
    if (l.incarnation == 0) continue;
    const cache::NodeStatus st = n < statuses.size() ? statuses[n] : cache::NodeStatus::kSilent;
    j["nodes"].push_back({{"id", n}, {"state", kState[static_cast<int>(st)]}, {"incarnation", l.incarnation},
                          {"heartbeat", l.heartbeat}, {"pid", l.pid}, {"may_host_manager", l.may_host}});
  }
  const auto* locks = first.impl().find_area(region::AreaKind::kLockArray);
  sync::LockArrayLayout layout(locks->offset, max_nodes, static_cast<uint32_t>(locks->param));
  auto& meta = first.impl().meta();
  meta.Invalidate(layout.manager_line(), 64);
  uint64_t holder = meta.Load(layout.manager_line());
  j["lock_manager"] = !sync::ManagerNamed(holder) ? nlohmann::json(nullptr)
                                                  : nlohmann::json{{"node", sync::ManagerNode(holder)},
                                                                   {"incarnation", sync::ManagerIncarnation(holder)}};
  uint32_t allocated = 0;
  for (uint32_t k = sync::kReservedLocks; k < layout.max_locks(); ++k) {
    allocated += (meta.Fetch(layout.bitmap_word(k)) >> (k % 64)) & 1;
  }
  j["locks"] = {{"max", layout.max_locks()}, {"internal", sync::kReservedLocks}, {"allocated", allocated}};
  j["regions"] = nlohmann::json::array();
  for (size_t i = 0; i < regions.size(); ++i) {
    auto u = alloc::InspectChunks(*regions[i], max_nodes);
    nlohmann::json per_node = nlohmann::json::object();
    for (uint32_t n = 0; n < max_nodes; ++n) {
      if (u.per_node[n]) per_node[std::to_string(n)] = u.per_node[n];
    }
    j["regions"].push_back({{"path", regions[i]->info().path}, {"chunk_bytes", regions[i]->info().chunk_bytes},
                            {"chunks", u.chunks}, {"free", u.free}, {"heap", u.heap},
                            {"large", u.large}, {"orphan_heap", u.orphan}, {"leased", u.leased}, {"allocated_bytes", u.allocated_bytes},
                            {"per_node", per_node}});
  }
  objstore::ObjectStore store(first, nullptr);
  j["roots"] = nlohmann::json::array();
  for (const auto& r : store.List()) {
    // Names are read from the region: printable only, or the JSON dump would throw.
    j["roots"].push_back({{"name", util::PrintableName(r.name.data(), r.name.size())},
                          {"offset", r.offset}, {"size", r.size}});
  }
  j["status"] = ReadStatusDocs(regions);  // what daemons publish of themselves (their tiers)
  j["cache"] = cache::Stat(first, statuses);
  uint64_t allocated_bytes = 0;
  for (const auto& r : j["regions"]) allocated_bytes += r["allocated_bytes"].get<uint64_t>();
  j["allocated_bytes"] = allocated_bytes;
  return j;
}

std::vector<std::string> Check(std::vector<std::unique_ptr<Region>>& regions, uint32_t watch_ms) {
  std::vector<std::string> problems;
  auto before = ReadNodeLines(*regions[0]);
  std::this_thread::sleep_for(std::chrono::milliseconds(watch_ms));
  auto after = ReadNodeLines(*regions[0]);
  uint32_t max_nodes = regions[0]->info().max_nodes;
  for (size_t i = 0; i < regions.size(); ++i) {
    alloc::CheckChunks(*regions[i], static_cast<uint32_t>(i), max_nodes, problems);
  }
  objstore::ObjectStore store(*regions[0], nullptr);
  std::vector<uint64_t> roots;
  for (const auto& r : store.List()) roots.push_back(r.offset);
  cache::Check(Raw(regions), Statuses(before, after), roots, problems);
  for (const auto& r : store.List()) {
    region::Offset<void> off(r.offset);
    if (off.region_index() >= regions.size() ||
        !alloc::IsAllocated(*regions[off.region_index()], off.byte_offset(), max_nodes)) {
      problems.push_back("root '" + util::PrintableName(r.name.data(), r.name.size()) + "' points at unallocated space (offset " +
                         std::to_string(r.offset) + ")");
    }
  }
  return problems;
}

}  // namespace cxlkv::pool
