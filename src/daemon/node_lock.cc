#include "daemon/node_lock.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>

namespace cxlkv::daemon {

std::string NodeLockPath(const std::string& lock_dir, const std::string& pool_id, uint32_t node) {
  return lock_dir + "/cxlkvd-" + pool_id + "-node" + std::to_string(node) + ".lock";
}

namespace {

// The pid written in the lock file at `path`, or 0 (no file, not a number: no daemon).
pid_t PidIn(const std::string& path) {
  std::ifstream in(path);
  long pid = 0;
  if (!(in >> pid) || pid <= 1 || pid > 1 << 22) return 0;
  return static_cast<pid_t>(pid);
}

// True when `pid` is a live process named cxlkvd (a killed daemon leaves its file behind).
bool IsRunningDaemon(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno != EPERM) return false;
  std::ifstream comm("/proc/" + std::to_string(pid) + "/comm");
  std::string name;
  return static_cast<bool>(std::getline(comm, name)) && name == "cxlkvd";
}

}  // namespace

std::optional<uint32_t> LocalDaemonNode(const std::string& pool_id, uint32_t max_nodes, const std::string& lock_dir) {
  for (uint32_t n = 0; n < max_nodes; ++n) {
    const pid_t pid = PidIn(NodeLockPath(lock_dir, pool_id, n));
    if (pid != 0 && IsRunningDaemon(pid)) return n;
  }
  return std::nullopt;
}

}  // namespace cxlkv::daemon
