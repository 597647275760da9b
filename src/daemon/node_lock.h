// Which node's daemon runs on this host: the one-daemon-per-node lock file (daemon.h), read by
// others. A CLI command joins the local daemon's node as one more process of it instead of
// starting a node life of its own (DESIGN.md: serving processes and the CLI are the daemon's
// clients and still work without one).
#ifndef CXLKV_SRC_DAEMON_NODE_LOCK_H_
#define CXLKV_SRC_DAEMON_NODE_LOCK_H_

#include <cstdint>
#include <optional>
#include <string>

namespace cxlkv::daemon {

inline constexpr char kDefaultLockDir[] = "/dev/shm";

// The lock file of node `node`'s daemon of pool `pool_id`; it holds the daemon's pid.
std::string NodeLockPath(const std::string& lock_dir, const std::string& pool_id, uint32_t node);

// The lowest node below `max_nodes` whose cxlkvd of pool `pool_id` runs on this host, if any.
// It reads the pids in the lock files and asks the kernel whether that process is a running
// cxlkvd, so it never takes the lock itself (a probe holding it for an instant would make a
// daemon starting then refuse to run). A pid reused by another cxlkvd is harmless: the caller
// joins a node whose daemon runs, or Pool::Open starts that node's life as usual.
std::optional<uint32_t> LocalDaemonNode(const std::string& pool_id, uint32_t max_nodes,
                                        const std::string& lock_dir = kDefaultLockDir);

}  // namespace cxlkv::daemon

#endif  // CXLKV_SRC_DAEMON_NODE_LOCK_H_
