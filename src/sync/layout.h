// What the sync layer keeps in the region: the node table (one line per node), and the global
// lock array: a manager line, the lock-allocation bitmap, one doorbell block per node, and per
// lock and node a request line written only by that node and a grant line written only by the
// lock manager.
//
// Every word here has a single writer at any moment (DESIGN.md rule 4), words written by
// different parties never share a cache line (rule P5 in docs/protocol.md), and everything a
// reader must see consistently is ONE 8-byte word (a node's life, the manager's identity): a
// multi-word record published together can be read torn on another host.
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

// A node's life word: [63:32] incarnation, [31:2] heartbeat (wraps; only its change matters),
// [1:0] state. One aligned word, so no reader sees a new incarnation with an old state.
struct LifeWord {
  uint32_t incarnation = 0;  // > 0 once joined; every new life takes a larger one
  NodeState state = NodeState::kNever;
  uint32_t heartbeat = 0;    // 30 bits

  static constexpr uint32_t kHeartbeatMask = (1u << 30) - 1;
  uint64_t Encode() const {
    return (uint64_t{incarnation} << 32) | (uint64_t{heartbeat & kHeartbeatMask} << 2) |
           (static_cast<uint64_t>(state) & 3);
  }
  static LifeWord Decode(uint64_t w) {
    LifeWord l;
    l.incarnation = static_cast<uint32_t>(w >> 32);
    l.heartbeat = static_cast<uint32_t>(w >> 2) & kHeartbeatMask;
    uint64_t s = w & 3;
    l.state = s <= 2 ? static_cast<NodeState>(s) : NodeState::kNever;  // untrusted: 3 is no state
    return l;
  }
};

// One 64-byte line per node in the node table, written only by that node's processes (one host,
// so they are coherent among themselves; they serialize their beats through a local mutex).
struct NodeLine {
  uint64_t life;       // LifeWord: the only word liveness and recovery rely on
  uint64_t pid;        // of the process that beat last (diagnostics)
  uint64_t lease_ms;   // the lease the node runs with (diagnostics)
  uint64_t flags;      // kNodeMayHostManager: a process of this node can host the lock manager
  uint64_t reserved[4];
};
static_assert(sizeof(NodeLine) == 64);
static_assert(std::is_standard_layout_v<NodeLine>);
static_assert(offsetof(NodeLine, life) == 0);
inline constexpr uint64_t kNodeMayHostManager = 1;

// The manager line (first line of the lock array), written only by the active manager. The
// identity is one word: [63:32] node + 1 (0: none), [31:0] the manager's incarnation.
struct ManagerLine {
  uint64_t holder;
  uint64_t grants;  // grants made by this manager (diagnostics, written with the identity)
  uint64_t reserved[6];
};
static_assert(sizeof(ManagerLine) == 64);
inline uint64_t ManagerHolder(uint32_t node, uint64_t incarnation) {
  return (uint64_t{node + 1} << 32) | static_cast<uint32_t>(incarnation);
}
inline bool ManagerNamed(uint64_t holder) { return (holder >> 32) != 0; }
inline uint32_t ManagerNode(uint64_t holder) { return static_cast<uint32_t>(holder >> 32) - 1; }
inline uint32_t ManagerIncarnation(uint64_t holder) { return static_cast<uint32_t>(holder); }

// Locks the layers use internally; user locks are allocated above these.
inline constexpr uint32_t kLockTableLock = 0;   // guards the allocation bitmap
inline constexpr uint32_t kAllocatorLock = 1;   // guards chunk tables (alloc layer)
inline constexpr uint32_t kObjectStoreLock = 2; // guards the named roots (objstore layer)
inline constexpr uint32_t kReservedLocks = 3;
inline constexpr uint32_t kDefaultMaxLocks = 256;

// A request word: (incarnation << 32) | sequence. Odd sequence = waiting or holding; even = idle.
// The incarnation keeps a restarted node's requests from matching grants made to its past life.
// A grant echoes the request, so the held request word is the hold's fencing token: the
// holder's life and its grant sequence.
inline uint64_t MakeRequest(uint64_t incarnation, uint32_t seq) { return (incarnation << 32) | seq; }
inline uint32_t RequestIncarnation(uint64_t req) { return static_cast<uint32_t>(req >> 32); }
inline bool RequestWants(uint64_t req) { return (req & 1) != 0; }

// Offsets inside the lock array area:
//   manager line | allocation bitmap | doorbell block per node | request + grant line per lock×node
// A node's doorbell block is word 0: a sequence it bumps after every request or release it
// publishes, then the bitmap of the locks it has an odd request for. The manager polls one
// doorbell word per live node when idle (O(live nodes)), and reads request words only of the
// locks a changed doorbell names.
class LockArrayLayout {
 public:
  LockArrayLayout(uint64_t area_offset, uint32_t max_nodes, uint32_t max_locks)
      : base_(area_offset), max_nodes_(max_nodes), max_locks_(max_locks) {}

  static uint64_t BitmapBytes(uint32_t max_locks) { return ((max_locks + 511) / 512) * 64; }
  static uint64_t DoorbellBytes(uint32_t max_locks) {
    return (8 + uint64_t{(max_locks + 63) / 64} * 8 + 63) / 64 * 64;
  }
  static uint64_t Bytes(uint32_t max_nodes, uint32_t max_locks) {
    return 64 + BitmapBytes(max_locks) + uint64_t{max_nodes} * DoorbellBytes(max_locks) +
           uint64_t{max_locks} * max_nodes * 128;
  }

  uint64_t manager_line() const { return base_; }
  uint64_t bitmap_word(uint32_t lock) const { return base_ + 64 + (lock / 64) * 8; }
  uint64_t doorbell(uint32_t node) const {
    return base_ + 64 + BitmapBytes(max_locks_) + uint64_t{node} * DoorbellBytes(max_locks_);
  }
  uint64_t wanted_word(uint32_t node, uint32_t lock) const { return doorbell(node) + 8 + (lock / 64) * 8; }
  uint64_t wanted_bytes() const { return uint64_t{(max_locks_ + 63) / 64} * 8; }
  uint64_t request(uint32_t lock, uint32_t node) const { return slot(lock, node); }
  uint64_t grant(uint32_t lock, uint32_t node) const { return slot(lock, node) + 64; }
  uint32_t max_nodes() const { return max_nodes_; }
  uint32_t max_locks() const { return max_locks_; }

 private:
  uint64_t slot(uint32_t lock, uint32_t node) const {
    return base_ + 64 + BitmapBytes(max_locks_) + uint64_t{max_nodes_} * DoorbellBytes(max_locks_) +
           (uint64_t{lock} * max_nodes_ + node) * 128;
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
