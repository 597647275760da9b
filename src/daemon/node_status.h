// A daemon's view of the pool's nodes as the statuses the inspection code takes: shared by the
// admin service's stat answer and /metrics.
#ifndef CXLKV_SRC_DAEMON_NODE_STATUS_H_
#define CXLKV_SRC_DAEMON_NODE_STATUS_H_

#include <vector>

#include "cache/inspect.h"
#include "sync/node.h"

namespace cxlkv::daemon {

inline std::vector<cache::NodeStatus> NodeStatuses(const std::vector<sync::NodeView>& views) {
  std::vector<cache::NodeStatus> out;
  out.reserve(views.size());
  for (const sync::NodeView& v : views) {
    out.push_back(v.incarnation == 0                  ? cache::NodeStatus::kNever
                  : v.state == sync::NodeState::kLeft ? cache::NodeStatus::kLeft
                  : v.live                            ? cache::NodeStatus::kLive
                                                      : cache::NodeStatus::kSilent);
  }
  return out;
}

}  // namespace cxlkv::daemon

#endif  // CXLKV_SRC_DAEMON_NODE_STATUS_H_
