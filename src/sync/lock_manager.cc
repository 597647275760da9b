// The lock manager (TraCT §3.3): grants W→L to one live node at a time per lock, round-robin
// among waiters so no node starves. It runs in the heartbeat owner of the lowest-numbered live
// node; when that node dies, the next one takes over after the lease. All of its state that
// matters is in the region (grant words), so a new manager needs nothing from the old one.
//
// Safety rests on the lease: a manager that is paused longer than a lease and then resumes
// could grant alongside its successor. It re-checks its election every beat, and leases are
// seconds while a scan is microseconds; docs/protocol.md states the assumption.
#include <algorithm>

#include "region/coherence.h"
#include "sync/node.h"

namespace cxlkv::sync {

void Node::ResetGrantsOf(uint32_t node) {
  // The manager is the single writer of grant words: a dead node's grants go back to 0, so a
  // hold it died in is released ("slots in W or L of a dead node are reset").
  for (uint32_t k = 0; k < layout_.max_locks(); ++k) meta().Publish(layout_.grant(k, node), 0);
}

void Node::ManagerLoop() {
  ManagerLine line{};
  line.node_plus_one = options_.node_id + 1;
  line.incarnation = local_->header().incarnation.load();
  meta().WriteStruct(layout_.manager_line(), line);
  meta().Flush(layout_.manager_line(), sizeof line);
  int idle = 0;
  while (manager_running_.load() && !stop_.load()) {
    if (ManagerScan()) {
      idle = 0;
      // Waiters exist: poll again soon, but yield so holders on this core make progress.
      for (int i = 0; i < 16; ++i) region::CpuRelax();
      std::this_thread::yield();
    } else {
      ++idle;
      if (idle < 64) {
        std::this_thread::yield();
      } else {
        int shift = std::min(idle - 64, 6);
        std::this_thread::sleep_for(std::chrono::microseconds(15 << shift));  // up to ~1 ms
      }
    }
  }
}

bool Node::ManagerScan() {
  // Scratch reused across scans: this runs thousands of times a second while anyone waits.
  std::vector<bool>& live = scan_live_;
  std::vector<uint32_t>& inc = scan_inc_;
  std::vector<uint64_t>& req = scan_req_;
  live.assign(max_nodes_, false);
  inc.assign(max_nodes_, 0);
  {
    std::lock_guard<std::mutex> lock(view_mu_);
    for (uint32_t j = 0; j < max_nodes_; ++j) {
      live[j] = observed_[j].view.live;
      inc[j] = static_cast<uint32_t>(observed_[j].view.incarnation);
    }
  }
  bool waiters = false;
  uint64_t bitmap = 0;
  for (uint32_t k = 0; k < layout_.max_locks(); ++k) {
    if (k % 64 == 0) bitmap = meta().Fetch(layout_.bitmap_word(k));
    bool allocated = k < kReservedLocks || (bitmap & (uint64_t{1} << (k % 64)));
    if (!allocated) {
      if (k % 64 == 63 || bitmap == 0) k |= 63;  // skip the rest of an empty word
      continue;
    }
    int holder = -1;
    uint32_t want_count = 0;
    req.assign(max_nodes_, 0);
    for (uint32_t j = 0; j < max_nodes_; ++j) {
      if (!live[j]) continue;
      uint64_t r = meta().Fetch(layout_.request(k, j));  // P2: node j wrote it
      if (!RequestWants(r) || RequestIncarnation(r) != inc[j]) continue;
      if (meta().Fetch(layout_.grant(k, j)) == r) {
        holder = static_cast<int>(j);
        continue;
      }
      req[j] = r;
      ++want_count;
    }
    if (holder >= 0 || want_count == 0) {
      waiters |= want_count > 0;
      continue;
    }
    waiters = true;
    for (uint32_t step = 1; step <= max_nodes_; ++step) {
      uint32_t j = (last_granted_[k] + step) % max_nodes_;
      if (req[j] == 0) continue;
      meta().Publish(layout_.grant(k, j), req[j]);  // W→L: the grant is the request echoed
      last_granted_[k] = j;
      break;
    }
  }
  return waiters;
}

}  // namespace cxlkv::sync
