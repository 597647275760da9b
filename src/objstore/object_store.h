// Named roots (TraCT §3.5, §4.1): a fixed open-addressing table in the region mapping a name to
// the offset and size of an object. Only a few roots are published by name (the prefix index,
// a model's block table); everything inside them links by offsets.
//
// Every change is made under sync::kObjectStoreLock, and becomes visible by one word: an entry's
// state is written last, after its name, offset and size are flushed (rule P4). A writer that
// dies mid-put leaves a slot whose state is still empty or deleted: nothing torn is visible.
//
// Thread-safety: all methods are thread-safe.
#ifndef CXLKV_SRC_OBJSTORE_OBJECT_STORE_H_
#define CXLKV_SRC_OBJSTORE_OBJECT_STORE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "region/offset.h"
#include "sync/node.h"

namespace cxlkv::objstore {

inline constexpr size_t kMaxNameBytes = 63;
inline constexpr uint32_t kDefaultMaxRoots = 1024;

struct RootEntry {
  uint64_t state;     // 0 empty, 1 deleted (tombstone), 2 live
  uint64_t offset;    // raw region::Offset of the object
  uint64_t size;
  uint64_t name_hash; // xxh3 of the name, to skip most name compares
  char name[kMaxNameBytes + 1];
  uint64_t reserved[4];
};
static_assert(sizeof(RootEntry) == 128);
static_assert(offsetof(RootEntry, state) == 0);

struct Root {
  std::string name;
  uint64_t offset = 0;  // raw offset
  uint64_t size = 0;
};

inline uint64_t StoreBytes(uint32_t max_roots) { return uint64_t{max_roots} * sizeof(RootEntry); }

class ObjectStore {
 public:
  // Checks the object-store area's parameter (root count) against its size, at attach.
  // Errors: kCorrupted naming the area and the value. A region without the area is fine.
  static Status ValidateArea(Region& region);

  // Read-only use (listing) needs no node; put/get/destroy take the object-store lock.
  // REQUIRES: ValidateArea(region) passed.
  ObjectStore(Region& region, sync::Node* node);

  // Errors: kInvalidArgument (empty name, longer than kMaxNameBytes, null offset),
  // kAlreadyExists (the name is taken: destroy it first), kNoSpace (table full).
  Status Put(std::string_view name, uint64_t offset, uint64_t size);
  // Errors: kNotFound.
  Result<Root> Get(std::string_view name);
  // Removes the name (not the object). Errors: kNotFound.
  Status Destroy(std::string_view name);
  // Every live root (a snapshot, no lock: for stat, check and recovery's reachability).
  std::vector<Root> List();
  uint32_t capacity() const { return max_roots_; }

 private:
  Status CheckName(std::string_view name) const;
  uint64_t EntryOffset(uint32_t i) const { return base_ + uint64_t{i} * sizeof(RootEntry); }
  // REQUIRES: lock held. Index of the live entry named `name`, or -1; *free_slot gets the first
  // reusable slot on the probe path (or -1).
  int64_t FindLocked(std::string_view name, uint64_t hash, int64_t* free_slot);
  // Checks the name, takes the object-store lock, probes for `name`, runs
  // fn(found_index_or_-1, first_reusable_slot_or_-1, name_hash) and releases the lock.
  template <typename Fn>
  Status Locked(std::string_view name, Fn fn);

  Region& region_;
  sync::Node* node_;
  uint64_t base_ = 0;
  uint32_t max_roots_ = 0;
};

}  // namespace cxlkv::objstore

#endif  // CXLKV_SRC_OBJSTORE_OBJECT_STORE_H_
