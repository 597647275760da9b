// The node-local tier: state shared by the processes of one node (one host) in local DRAM — a
// small file in /dev/shm named after the region id and node id, holding process-shared robust
// mutexes. Every process holds a shared flock on the file while attached; the last one to leave
// removes it, and a joiner removes files nobody holds (left behind by kill -9). A process that dies holding one does not wedge its node: the next locker gets
// EOWNERDEAD, learns that the holder died, and takes over (TraCT §3.3's local_lock, made robust).
//
// Thread- and process-safety: everything here is meant for concurrent use by the processes of
// one node; the atomics are plain CPU atomics (one host is coherent).
#ifndef CXLKV_SRC_SYNC_LOCAL_NODE_H_
#define CXLKV_SRC_SYNC_LOCAL_NODE_H_

#include <pthread.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "cxlkv/status.h"
#include "sync/host_file.h"

namespace cxlkv::sync {

// Slot sizes whose current slab a node remembers (alloc layer): the rounded heap's 13 classes
// and a namespace block size or more each; past that, a size's partly used slab is found by
// scanning the owner words.
inline constexpr uint32_t kLocalSizeClasses = 48;

struct alignas(64) LocalLock {
  pthread_mutex_t mu;           // the local tier of lock k
  std::atomic<uint32_t> seq;    // last request sequence this node published for lock k
};

// One attached process of the node. Its index (the process slot) names it in writer words of
// the cache layer, so that what a dead process left half-done is found while its node lives on.
// The slot's robust mutex is held by the process's beat thread while it is attached: when the
// process dies, the mutex turns owner-dead, which a surviving process's scan detects.
inline constexpr uint32_t kLocalProcessSlots = 64;
// kSlotLeaving: attached still, but past its last allocation (Node::LeavingLast).
enum ProcessSlotState : uint32_t { kSlotFree = 0, kSlotUsed = 1, kSlotRecovering = 2, kSlotLeaving = 3 };
struct alignas(64) LocalProcess {
  pthread_mutex_t mu;
  std::atomic<uint32_t> state;  // a ProcessSlotState
  std::atomic<int64_t> pid;     // diagnostics
};

// Heap state of the node's allocator (alloc layer), kept here so every process of the node
// allocates from the same per-node heap.
struct LocalHeapClass {
  std::atomic<uint64_t> slot_bytes;     // the slot size this entry is for; 0 = unused
  std::atomic<uint64_t> current_chunk;  // global chunk id + 1 of the slab's head; 0 = none
  std::atomic<uint64_t> cursor;         // slot to start searching from
};

// The remote-free entries a drainer of this node took out of one incoming ring (alloc layer):
// written before the ring's head moves past them, and `next` moves past each entry before it is
// applied. A drainer killed in between leaves them here, and the next drainer of the node, once
// it sees the ring's head at `tail`, applies the rest: at most the one entry being applied when
// it died is lost, and none is applied twice. Guarded by drain_mu.
inline constexpr uint32_t kLocalDrainClaimEntries = 256;
struct LocalDrainClaim {
  uint64_t incarnation;  // the node life that claimed them
  uint64_t tail;         // the head the drainer published for the ring (the claim is valid once it is there)
  uint32_t freer;        // the ring: this node's incoming ring from node `freer`
  uint32_t count;        // entries claimed; 0: nothing pending
  uint32_t next;         // the first entry not yet started
  uint32_t reserved;
  uint64_t offsets[kLocalDrainClaimEntries];
};

struct LocalHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t max_locks;
  std::atomic<uint64_t> incarnation;     // this node's current life (0: not joined yet)
  std::atomic<int64_t> last_beat_ns;     // CLOCK_MONOTONIC when the last published beat began
  std::atomic<uint64_t> heartbeat;       // the node's heartbeat counter
  std::atomic<uint32_t> attached;        // processes attached (diagnostics: kill -9 leaks one)
  alignas(64) pthread_mutex_t beat_mu;     // serializes beats; held for microseconds, try-locked
  alignas(64) pthread_mutex_t manager_mu;  // held for life by the process that may host the manager
  alignas(64) pthread_mutex_t heap_mu;     // guards the node heap (alloc layer)
  alignas(64) pthread_mutex_t inbox_mu;    // guards this node's outgoing remote-free rings
  alignas(64) pthread_mutex_t drain_mu;    // one drainer of this node's incoming rings at a time:
                                           // two would apply the same entries twice
  alignas(64) LocalDrainClaim drain_claim;  // guarded by drain_mu
  LocalHeapClass heap[kLocalSizeClasses];
  LocalProcess processes[kLocalProcessSlots];
};

// Locks `mu`; returns true when the previous owner died holding it (state may need repair;
// the mutex is made consistent before returning).
bool LockRobust(pthread_mutex_t* mu);
// Try-lock: 0 = got it, 1 = got it and the previous owner died, -1 = busy.
int TryLockRobust(pthread_mutex_t* mu);

class LocalNode {
 public:
  // Opens (creating on first use) the local file of `node` for the region `region_id`, and holds
  // a shared flock on it for as long as this object lives.
  static Result<std::unique_ptr<LocalNode>> Open(const std::string& region_id, uint32_t node,
                                                 uint32_t max_locks);
  // Drops this process's claim; the last process of the node removes the file.
  ~LocalNode() = default;
  // True when this process was the last one of the node: nobody else holds the file. Call
  // before destruction to publish "left"; the file is removed by the destructor then.
  bool LastUser();
  // Removes node-local files of any region that no process uses any more (a process killed
  // with -9 cannot remove its own). Safe against concurrent joiners (they re-open).
  static void SweepUnused(const std::string& except);
  LocalNode(const LocalNode&) = delete;
  LocalNode& operator=(const LocalNode&) = delete;

  LocalHeader& header() { return *header_; }
  LocalLock& lock(uint32_t k) { return locks_[k]; }
  bool created() const { return file_.created(); }        // this process made the file
  bool first_user() const { return file_.first_user(); }  // no other process held it when we opened it
  const std::string& path() const { return file_.path(); }

  static std::string PathFor(const std::string& region_id, uint32_t node);

 private:
  explicit LocalNode(HostFile file);
  HostFile file_;  // the last holder removes it at destruction
  LocalHeader* header_ = nullptr;
  LocalLock* locks_ = nullptr;
};

}  // namespace cxlkv::sync

#endif  // CXLKV_SRC_SYNC_LOCAL_NODE_H_
