// What the sync layer keeps in the region: the node table (one line per node) and the global
// lock array (a manager line, the lock-allocation bitmap, and per lock and node a request line
// written only by that node and a grant line written only by the lock manager).
//
// Every word here has a single writer at any moment (DESIGN.md rule 4), and words written by
// different parties never share a cache line (rule P5 in docs/protocol.md).
#ifndef CXLKV_SRC_SYNC_LAYOUT_H_
#define CXLKV_SRC_SYNC_LAYOUT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "region/superblock.h"

namespace cxlkv::sync {

// Node line states.
enum class NodeState : uint64_t { kNever = 0, kLive = 1, kLeft = 2 };

// One 64-byte line per node in the node table, written only by that node (its heartbeat owner).
struct NodeLine {
  uint64_t incarnation;  // > 0 once joined; grows each time the node restarts after a lease
  uint64_t state;        // NodeState
  uint64_t heartbeat;    // advanced every beat; a node whose heartbeat stands still a lease is dead
  uint64_t pid;          // of the heartbeat owner (diagnostics)
  uint64_t lease_ms;     // the lease the node runs with (diagnostics)
  uint64_t reserved[3];
};
static_assert(sizeof(NodeLine) == 64);
static_assert(std::is_standard_layout_v<NodeLine>);
static_assert(offsetof(NodeLine, heartbeat) == 16);

// The manager line (first line of the lock array), written only by the active manager.
struct ManagerLine {
  uint64_t node_plus_one;  // 0: none yet
  uint64_t incarnation;
  uint64_t grants;         // grants made by this manager (diagnostics)
  uint64_t reserved[5];
};
static_assert(sizeof(ManagerLine) == 64);

// Locks the layers use internally; user locks are allocated above these.
inline constexpr uint32_t kLockTableLock = 0;   // guards the allocation bitmap
inline constexpr uint32_t kAllocatorLock = 1;   // guards chunk tables (alloc layer)
inline constexpr uint32_t kObjectStoreLock = 2; // guards the named roots (objstore layer)
inline constexpr uint32_t kReservedLocks = 3;
inline constexpr uint32_t kDefaultMaxLocks = 256;

// A request word: (incarnation << 32) | sequence. Odd sequence = waiting or holding; even = idle.
// The incarnation keeps a restarted node's requests from matching grants made to its past life.
inline uint64_t MakeRequest(uint64_t incarnation, uint32_t seq) { return (incarnation << 32) | seq; }
inline uint32_t RequestIncarnation(uint64_t req) { return static_cast<uint32_t>(req >> 32); }
inline bool RequestWants(uint64_t req) { return (req & 1) != 0; }

// Offsets inside the lock array area.
class LockArrayLayout {
 public:
  LockArrayLayout(uint64_t area_offset, uint32_t max_nodes, uint32_t max_locks)
      : base_(area_offset), max_nodes_(max_nodes), max_locks_(max_locks) {}

  static uint64_t BitmapBytes(uint32_t max_locks) { return ((max_locks + 511) / 512) * 64; }
  static uint64_t Bytes(uint32_t max_nodes, uint32_t max_locks) {
    return 64 + BitmapBytes(max_locks) + uint64_t{max_locks} * max_nodes * 128;
  }

  uint64_t manager_line() const { return base_; }
  uint64_t bitmap_word(uint32_t lock) const { return base_ + 64 + (lock / 64) * 8; }
  uint64_t request(uint32_t lock, uint32_t node) const { return slot(lock, node); }
  uint64_t grant(uint32_t lock, uint32_t node) const { return slot(lock, node) + 64; }
  uint32_t max_nodes() const { return max_nodes_; }
  uint32_t max_locks() const { return max_locks_; }

 private:
  uint64_t slot(uint32_t lock, uint32_t node) const {
    return base_ + 64 + BitmapBytes(max_locks_) + (uint64_t{lock} * max_nodes_ + node) * 128;
  }
  uint64_t base_;
  uint32_t max_nodes_;
  uint32_t max_locks_;
};

// Checks a lock-array area's parameter (its lock count) against its size, at attach: every lock
// number below the parameter is then safe to index with. The message names the area, the value
// and what to do.
inline Status ValidateLockArea(const region::AreaDesc& a, uint32_t max_nodes, const std::string& path) {
  if (a.param <= kReservedLocks || a.param > (uint64_t{1} << 20) ||
      LockArrayLayout::Bytes(max_nodes, static_cast<uint32_t>(a.param)) > a.size) {
    return Corrupted("region " + path + " area lock-array is corrupt: parameter " + std::to_string(a.param) +
                     " locks does not fit its " + std::to_string(a.size) + " bytes for " +
                     std::to_string(max_nodes) + " nodes: re-create the pool with 'cxlkv init'");
  }
  return Status::Ok();
}

}  // namespace cxlkv::sync

#endif  // CXLKV_SRC_SYNC_LAYOUT_H_
