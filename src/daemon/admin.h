// The pool's admin service over the shared-memory RPC: one table of request types shared by
// the daemon that serves it and the clients (the CLI's `cxlkv ping`). Served by one cxlkvd of
// the pool at a time; the others stand by and take over (docs/rpc.md).
#ifndef CXLKV_SRC_DAEMON_ADMIN_H_
#define CXLKV_SRC_DAEMON_ADMIN_H_

#include <cstdint>

#include "rpc/area.h"

namespace cxlkv::daemon {

inline constexpr char kAdminService[] = "admin";

enum AdminOp : uint32_t {
  kAdminPing = 1,  // -> JSON {"node", "pid", "uptime_s"} of the serving daemon
  kAdminStat = 2,  // -> JSON summary: live/silent nodes, cache totals and hit rates
};

// Small slots: answers are short JSON documents. 8 processes per node, 4 requests in flight.
inline rpc::RpcGeometry AdminGeometry() {
  return {.clients_per_node = 8, .depth = 4, .request_bytes = 256, .response_bytes = 4096};
}

}  // namespace cxlkv::daemon

#endif  // CXLKV_SRC_DAEMON_ADMIN_H_
