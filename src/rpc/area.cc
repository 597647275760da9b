#include "rpc/area.h"

#include <xxhash.h>

#include <algorithm>
#include <vector>

#include "pool/pool_internal.h"
#include "region/offset.h"
#include "region/region_internal.h"

namespace cxlkv::rpc {
namespace {

// Line 0 of the area. Written once, before the root that names the area is published.
struct AreaHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t max_nodes;
  uint32_t clients_per_node;
  uint32_t depth;
  uint32_t request_bytes;
  uint32_t response_bytes;
  uint32_t lock;
  uint32_t reserved;
  uint64_t area_bytes;
  uint64_t checksum;  // xxh3-64 of every byte before it
};
static_assert(sizeof(AreaHeader) == 56);
static_assert(sizeof(AreaHeader) <= kLine);
static_assert(std::is_standard_layout_v<AreaHeader> && std::is_trivially_copyable_v<AreaHeader>);

uint64_t HeaderChecksum(const AreaHeader& h) { return XXH3_64bits(&h, offsetof(AreaHeader, checksum)); }

// Limits that keep every offset computed from the header inside 64 bits and the area sane.
constexpr uint32_t kMaxClientsPerNode = 64;  // sync::kLocalProcessSlots
constexpr uint32_t kMaxDepth = 1024;
constexpr uint32_t kMaxSlotBytes = 1u << 20;

bool ValidServiceName(std::string_view s) {
  if (s.empty() || s.size() > 40) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
  });
}

}  // namespace

Status ValidateGeometry(const RpcGeometry& g, uint32_t max_nodes) {
  if (g.clients_per_node < 1 || g.clients_per_node > kMaxClientsPerNode) {
    return InvalidArgument("RPC clients per node must be 1.." + std::to_string(kMaxClientsPerNode) + ", not " +
                           std::to_string(g.clients_per_node));
  }
  if (g.depth < 1 || g.depth > kMaxDepth) {
    return InvalidArgument("RPC queue depth must be 1.." + std::to_string(kMaxDepth) + ", not " + std::to_string(g.depth));
  }
  for (auto [name, v] : {std::pair{"request", g.request_bytes}, std::pair{"response", g.response_bytes}}) {
    if (v < kLine || v > kMaxSlotBytes || v % kLine != 0) {
      return InvalidArgument(std::string("RPC ") + name + " slot bytes must be a multiple of 64 in 64.." +
                             std::to_string(kMaxSlotBytes) + ", not " + std::to_string(v));
    }
  }
  if (max_nodes < 1 || max_nodes > 255) return InvalidArgument("RPC area for " + std::to_string(max_nodes) + " nodes");
  return Status::Ok();
}

uint64_t AreaBytes(const RpcGeometry& g, uint32_t max_nodes) {
  const uint64_t slots = uint64_t{max_nodes} * g.clients_per_node * g.depth;
  return (2 + uint64_t{max_nodes}) * kLine + slots * (uint64_t{g.request_bytes} + g.response_bytes);
}

std::string RpcArea::RootName(std::string_view service) { return "cxlkv.rpc." + std::string(service); }

Result<std::unique_ptr<RpcArea>> RpcArea::Open(Pool& pool, std::string_view service) {
  if (!ValidServiceName(service)) {
    return InvalidArgument("RPC service name '" + std::string(service) + "' must be 1..40 of [a-z0-9_-]");
  }
  auto root = pool.Get(RootName(service));
  if (!root.ok()) {
    if (root.status().code() == StatusCode::kNotFound) {
      return NotFound("this pool has no RPC service '" + std::string(service) + "': start its server (cxlkvd) first");
    }
    return root.status();
  }
  return Attach(pool, service, root->offset, root->size);
}

Result<std::unique_ptr<RpcArea>> RpcArea::OpenOrCreate(Pool& pool, std::string_view service,
                                                       const RpcGeometry& geometry) {
  auto existing = Open(pool, service);
  if (existing.ok() || existing.status().code() != StatusCode::kNotFound) return existing;
  const uint32_t max_nodes = pool.impl().regions[0]->info().max_nodes;
  CXLKV_RETURN_IF_ERROR(ValidateGeometry(geometry, max_nodes));
  const uint64_t bytes = AreaBytes(geometry, max_nodes);
  auto off = pool.Alloc(bytes);
  if (!off.ok()) {
    return Status(off.status().code(), "RPC area of service '" + std::string(service) + "' (" +
                                           std::to_string(bytes) + " bytes): " + off.status().message() +
                                           ": make the pool larger or the geometry smaller");
  }
  auto lock = pool.AllocateLock();
  if (!lock.ok()) {
    (void)pool.Free(*off);
    return lock.status();
  }
  const region::Offset<void> at(*off);
  region::MetaAccess& meta = pool.impl().regions[at.region_index()]->impl().meta();
  const uint64_t base = at.byte_offset();
  // Fresh memory may hold an earlier object's bytes: every word is zeroed and flushed before
  // the root makes the area reachable (rule P4).
  std::vector<uint8_t> zeros(64 << 10, 0);
  for (uint64_t done = 0; done < bytes; done += zeros.size()) {
    const uint64_t n = std::min<uint64_t>(zeros.size(), bytes - done);
    meta.Write(base + done, zeros.data(), n);
    meta.Flush(base + done, n);
  }
  AreaHeader h{};
  h.magic = kRpcMagic;
  h.version = kRpcVersion;
  h.max_nodes = max_nodes;
  h.clients_per_node = geometry.clients_per_node;
  h.depth = geometry.depth;
  h.request_bytes = geometry.request_bytes;
  h.response_bytes = geometry.response_bytes;
  h.lock = *lock;
  h.area_bytes = bytes;
  h.checksum = HeaderChecksum(h);
  meta.WriteStruct(base, h);
  meta.Flush(base, sizeof h);
  Status put = pool.Put(RootName(service), *off, bytes);
  if (!put.ok()) {
    (void)pool.FreeLock(*lock);
    (void)pool.Free(*off);
    // Another process created it first: use theirs.
    if (put.code() == StatusCode::kAlreadyExists) return Open(pool, service);
    return put;
  }
  return Attach(pool, service, *off, bytes);
}

Result<std::unique_ptr<RpcArea>> RpcArea::Attach(Pool& pool, std::string_view service, uint64_t raw_offset,
                                                 uint64_t size) {
  const std::string what = "RPC area of service '" + std::string(service) + "'";
  const region::Offset<void> at(raw_offset);
  auto& regions = pool.impl().regions;
  if (at.is_null() || at.region_index() >= regions.size()) {
    return Corrupted(what + ": its root names offset " + std::to_string(raw_offset) +
                     ", outside the pool: destroy the root '" + RootName(service) + "' and restart the server");
  }
  region::MetaAccess& meta = regions[at.region_index()]->impl().meta();
  const uint64_t base = at.byte_offset();
  if (base % kLine != 0 || base >= meta.size() || size > meta.size() - base || size < 2 * kLine) {
    return Corrupted(what + ": its root names " + std::to_string(size) + " bytes at " + std::to_string(base) +
                     ", not inside region " + std::to_string(at.region_index()) + " or misaligned");
  }
  meta.Invalidate(base, sizeof(AreaHeader));
  const auto h = meta.ReadStruct<AreaHeader>(base);
  if (h.magic != kRpcMagic) return Corrupted(what + ": bad magic (not an RPC area)");
  if (h.version != kRpcVersion) {
    return VersionMismatch(what + " has version " + std::to_string(h.version) + ", this build speaks " +
                           std::to_string(kRpcVersion) + ": stop every server, destroy the root '" +
                           RootName(service) + "' and restart them");
  }
  if (h.checksum != HeaderChecksum(h)) return Corrupted(what + ": header checksum mismatch");
  RpcGeometry g{h.clients_per_node, h.depth, h.request_bytes, h.response_bytes};
  Status valid = ValidateGeometry(g, h.max_nodes);
  if (!valid.ok()) return Corrupted(what + ": " + valid.message());
  if (h.max_nodes != regions[0]->info().max_nodes) {
    return Corrupted(what + " was made for " + std::to_string(h.max_nodes) + " nodes, the pool has " +
                     std::to_string(regions[0]->info().max_nodes));
  }
  if (h.area_bytes != AreaBytes(g, h.max_nodes) || h.area_bytes > size) {
    return Corrupted(what + ": its geometry needs " + std::to_string(AreaBytes(g, h.max_nodes)) +
                     " bytes, its header says " + std::to_string(h.area_bytes) + " and its root " + std::to_string(size));
  }
  if (h.lock < sync::kReservedLocks || h.lock >= pool.impl().node->max_locks()) {
    return Corrupted(what + ": its server lock " + std::to_string(h.lock) + " is not a user lock of this pool");
  }
  auto area = std::unique_ptr<RpcArea>(new RpcArea());
  area->service_ = std::string(service);
  area->geometry_ = g;
  area->max_nodes_ = h.max_nodes;
  area->lock_ = h.lock;
  area->meta_ = &meta;
  area->base_ = base;
  area->slots_ = base + (2 + uint64_t{h.max_nodes}) * kLine;
  return area;
}

}  // namespace cxlkv::rpc
