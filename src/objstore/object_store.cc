#include "objstore/object_store.h"

#include <xxhash.h>

#include <cstring>

namespace cxlkv::objstore {

ObjectStore::ObjectStore(Region& region, sync::Node* node) : region_(region), node_(node) {
  if (const auto* area = region.impl().find_area(region::AreaKind::kObjectStore)) {
    base_ = area->offset;
    max_roots_ = static_cast<uint32_t>(area->param);
  }
}

Status ObjectStore::ValidateArea(Region& region) {
  const auto* area = region.impl().find_area(region::AreaKind::kObjectStore);
  if (area == nullptr) return Status::Ok();
  if (area->param < 1 || area->param > (uint64_t{1} << 24) ||
      StoreBytes(static_cast<uint32_t>(area->param)) > area->size) {
    return Corrupted("region " + region.info().path + " area object-store is corrupt: parameter " +
                     std::to_string(area->param) + " roots does not fit its " + std::to_string(area->size) +
                     " bytes: re-create the pool with 'cxlkv init'");
  }
  return Status::Ok();
}

Status ObjectStore::CheckName(std::string_view name) const {
  if (max_roots_ == 0) return InvalidArgument("region has no object store");
  if (name.empty()) return InvalidArgument("a root name cannot be empty");
  if (name.size() > kMaxNameBytes) {
    return InvalidArgument("root name of " + std::to_string(name.size()) + " bytes exceeds the " +
                           std::to_string(kMaxNameBytes) + "-byte limit");
  }
  if (node_ == nullptr) return InvalidArgument("object store opened read-only (no node joined)");
  return Status::Ok();
}

int64_t ObjectStore::FindLocked(std::string_view name, uint64_t hash, int64_t* free_slot) {
  auto& meta = region_.impl().meta();
  *free_slot = -1;
  for (uint32_t probe = 0; probe < max_roots_; ++probe) {
    uint32_t i = static_cast<uint32_t>((hash + probe) % max_roots_);
    uint64_t off = EntryOffset(i);
    meta.Invalidate(off, sizeof(RootEntry));  // P2: written by other nodes
    auto e = meta.ReadStruct<RootEntry>(off);
    if (e.state == 0) {
      if (*free_slot < 0) *free_slot = i;
      return -1;  // an empty slot ends the probe sequence
    }
    if (e.state == 1) {
      if (*free_slot < 0) *free_slot = i;
      continue;
    }
    if (e.name_hash == hash && name == std::string_view(e.name, strnlen(e.name, sizeof e.name))) return i;
  }
  return -1;
}

template <typename Fn>
Status ObjectStore::Locked(std::string_view name, Fn fn) {
  CXLKV_RETURN_IF_ERROR(CheckName(name));
  uint64_t hash = XXH3_64bits(name.data(), name.size());
  CXLKV_ASSIGN_OR_RETURN(auto held, node_->AcquireFor(sync::kObjectStoreLock, node_->lease() * 4));
  (void)held;
  int64_t free_slot;
  int64_t found = FindLocked(name, hash, &free_slot);
  Status s = fn(found, free_slot, hash);
  node_->Release(sync::kObjectStoreLock);
  return s;
}

Status ObjectStore::Put(std::string_view name, uint64_t offset, uint64_t size) {
  if (offset == 0) return InvalidArgument("cannot publish a null offset");
  return Locked(name, [&](int64_t found, int64_t free_slot, uint64_t hash) -> Status {
    if (found >= 0) return AlreadyExists("root '" + std::string(name) + "' already exists; destroy it first");
    if (free_slot < 0) {
      return NoSpace("object store is full (" + std::to_string(max_roots_) + " roots); destroy "
                     "unused roots or re-create the region with more");
    }
    auto& meta = region_.impl().meta();
    uint64_t off = EntryOffset(static_cast<uint32_t>(free_slot));
    RootEntry e{};
    e.state = meta.Load(off);  // unchanged until the commit below
    e.offset = offset;
    e.size = size;
    e.name_hash = hash;
    std::memcpy(e.name, name.data(), name.size());
    meta.WriteStruct(off, e);
    meta.Flush(off, sizeof e);
    meta.Publish(off, 2);  // P4: the entry is visible from this single word on
    return Status::Ok();
  });
}

Result<Root> ObjectStore::Get(std::string_view name) {
  Root root;
  Status s = Locked(name, [&](int64_t found, int64_t, uint64_t) -> Status {
    if (found < 0) return NotFound("no root named '" + std::string(name) + "'");
    auto e = region_.impl().meta().ReadStruct<RootEntry>(EntryOffset(static_cast<uint32_t>(found)));
    root = Root{std::string(name), e.offset, e.size};
    return Status::Ok();
  });
  if (!s.ok()) return s;
  return root;
}

Status ObjectStore::Destroy(std::string_view name) {
  return Locked(name, [&](int64_t found, int64_t, uint64_t) -> Status {
    if (found < 0) return NotFound("no root named '" + std::string(name) + "'");
    region_.impl().meta().Publish(EntryOffset(static_cast<uint32_t>(found)), 1);
    return Status::Ok();
  });
}

std::vector<Root> ObjectStore::List() {
  std::vector<Root> out;
  auto& meta = region_.impl().meta();
  for (uint32_t i = 0; i < max_roots_; ++i) {
    uint64_t off = EntryOffset(i);
    if (meta.Fetch(off) != 2) continue;
    meta.Invalidate(off, sizeof(RootEntry));
    auto e = meta.ReadStruct<RootEntry>(off);
    if (e.state != 2) continue;
    out.push_back(Root{std::string(e.name, strnlen(e.name, sizeof e.name)), e.offset, e.size});
  }
  return out;
}

}  // namespace cxlkv::objstore
