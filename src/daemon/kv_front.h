// The TCP front's `kv` service (rpc/kv_frames.h): the KV cache's data operations for hosts
// outside the CXL domain, run by cxlkvd on a pool it maps. A host that maps the pool never needs
// them (it reads and writes the region itself); one that cannot — a node across the rack's
// network, a tool on a laptop — stores and fetches blocks through the daemon of a node that
// can, like Mooncake's TCP transport. docs/daemon.md, "KV over TCP".
//
// Thread-safety: Handle from one thread (the TCP front's loop).
#ifndef CXLKV_SRC_DAEMON_KV_FRONT_H_
#define CXLKV_SRC_DAEMON_KV_FRONT_H_

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "cxlkv/cache.h"
#include "cxlkv/pool.h"
#include "cxlkv/status.h"
#include "rpc/kv_frames.h"

namespace cxlkv::daemon {

class KvFront {
 public:
  explicit KvFront(Pool& pool) : pool_(pool) {}
  // One request of the `kv` frame service: the answer's payload, or the error to send.
  Result<std::vector<uint8_t>> Handle(uint32_t op, std::span<const uint8_t> request);

 private:
  Result<NamespaceHandle> NamespaceOf(const std::string& model);

  Pool& pool_;
  std::map<std::string, NamespaceHandle> namespaces_;  // registered ones, by model id
};

}  // namespace cxlkv::daemon

#endif  // CXLKV_SRC_DAEMON_KV_FRONT_H_
