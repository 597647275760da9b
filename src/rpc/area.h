// The shared-memory RPC area of one service (Beluga §6.2): fixed request/response slots in the
// pool, one channel per (client node, process slot), `depth` slots per channel.
//
// The area is an object allocated from the pool and published under the root name
// "cxlkv.rpc.<service>", so any pool can carry any number of services, and the layers below
// (which plan the region's fixed areas) need not know about RPC. Its header is written once by
// the creator and checked by every opener before a value from it is used to compute an offset
// (the area is untrusted input like every region byte: docs/protocol.md, "Validation").
//
// Layout (every part 64-byte aligned; W = who writes it):
//   line 0                 header (creator, once): magic, version, geometry, service lock, checksum
//   line 1                 server line (the serving process): server word, beat word
//   lines 2 .. 2+N         presence line per client node (that node's processes, a local
//                          atomic or): word 0 the bitmap of channels opened on the node, so
//                          a server polls only those
//   then per node, per channel, per slot (a ring: request n goes to slot (n-1) % depth):
//     request slot         W client: word 0 the request word (n, published last),
//                          word 1 opcode << 32 | payload length, payload from byte 16
//     response slot        W server: word 0 the response word (n << 2 | state),
//                          word 1 status code << 32 | length, payload (or the error message) from 16
//
// Thread-safety: RpcArea is immutable after Open; its accessors are safe from any thread.
#ifndef CXLKV_SRC_RPC_AREA_H_
#define CXLKV_SRC_RPC_AREA_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "cxlkv/pool.h"
#include "cxlkv/status.h"
#include "region/meta.h"

namespace cxlkv::rpc {

inline constexpr uint64_t kRpcMagic = 0x4350524b4c5843ull;  // "CXLKRPC" little-endian
inline constexpr uint32_t kRpcVersion = 1;
inline constexpr uint64_t kLine = 64;
inline constexpr uint64_t kSlotHeaderBytes = 16;  // the state word and the opcode/status word

// The shape of a service's slots. Every field is validated at open (ValidateGeometry).
struct RpcGeometry {
  uint32_t clients_per_node = 16;  // channels per node: a process uses the one of its process slot.
                                   // Default 16.
  uint32_t depth = 8;              // slots per channel: outstanding requests per client. Default 8.
  uint32_t request_bytes = 512;    // per request slot, header included; a multiple of 64. Default 512.
  uint32_t response_bytes = 512;   // per response slot, likewise. Default 512.
};

// The state of a response slot (low two bits of the response word).
enum class SlotState : uint64_t {
  kNone = 0,
  kAccepted = 1,  // the server took a non-idempotent request: it runs at most once
  kDone = 2,      // the response (status, length, payload) is complete and flushed
};

inline uint64_t ResponseWord(uint64_t seq, SlotState state) { return (seq << 2) | static_cast<uint64_t>(state); }
inline uint64_t ResponseSeq(uint64_t word) { return word >> 2; }
inline SlotState ResponseState(uint64_t word) { return static_cast<SlotState>(word & 3); }

// The server word: who serves. Bits 63..56 node + 1 (0: nobody), 55..24 the node's life
// (incarnation, 32 bits), 23..0 the term (bumped by every takeover).
inline uint64_t ServerWord(uint32_t node, uint64_t life, uint32_t term) {
  return (uint64_t{node + 1} << 56) | ((life & 0xffffffffull) << 24) | (term & 0xffffffu);
}
inline bool ServerPresent(uint64_t w) { return (w >> 56) != 0; }
inline uint32_t ServerNode(uint64_t w) { return static_cast<uint32_t>(w >> 56) - 1; }
inline uint64_t ServerLife(uint64_t w) { return (w >> 24) & 0xffffffffull; }
inline uint32_t ServerTerm(uint64_t w) { return static_cast<uint32_t>(w & 0xffffff); }

// Validates a geometry for a pool of `max_nodes` nodes; the message names the field.
Status ValidateGeometry(const RpcGeometry& g, uint32_t max_nodes);
// Bytes of the area for that geometry.
uint64_t AreaBytes(const RpcGeometry& g, uint32_t max_nodes);

class RpcArea {
 public:
  // The root name of `service`'s area.
  static std::string RootName(std::string_view service);

  // Opens the service's area, creating it (with `geometry` and a newly allocated pool lock
  // that designates the server) when the pool has none. Two processes creating it at once
  // both end with the same area. Errors: kInvalidArgument (service name, geometry), kNoSpace
  // (no room in the pool, no free lock), kCorrupted (the area fails validation; it names
  // what), kVersionMismatch.
  static Result<std::unique_ptr<RpcArea>> OpenOrCreate(Pool& pool, std::string_view service,
                                                       const RpcGeometry& geometry = {});
  // Opens an existing area only. Errors as above, and kNotFound when there is none.
  static Result<std::unique_ptr<RpcArea>> Open(Pool& pool, std::string_view service);

  const std::string& service() const { return service_; }
  const RpcGeometry& geometry() const { return geometry_; }
  uint32_t max_nodes() const { return max_nodes_; }
  uint32_t lock() const { return lock_; }  // the pool lock the serving process holds
  region::MetaAccess& meta() const { return *meta_; }

  // Offsets within the region the area lives in.
  uint64_t server_word() const { return base_ + kLine; }
  uint64_t server_beat() const { return base_ + kLine + 8; }
  uint64_t presence(uint32_t node) const { return base_ + 2 * kLine + uint64_t{node} * kLine; }
  // Slot `slot` (0 .. depth) of channel `channel` (0 .. clients_per_node) of `node`.
  uint64_t request(uint32_t node, uint32_t channel, uint32_t slot) const { return SlotBase(node, channel, slot); }
  uint64_t response(uint32_t node, uint32_t channel, uint32_t slot) const {
    return SlotBase(node, channel, slot) + geometry_.request_bytes;
  }
  uint64_t request_capacity() const { return geometry_.request_bytes - kSlotHeaderBytes; }
  uint64_t response_capacity() const { return geometry_.response_bytes - kSlotHeaderBytes; }

 private:
  RpcArea() = default;
  static Result<std::unique_ptr<RpcArea>> Attach(Pool& pool, std::string_view service, uint64_t raw_offset,
                                                 uint64_t size);
  uint64_t SlotBase(uint32_t node, uint32_t channel, uint32_t slot) const {
    const uint64_t index = (uint64_t{node} * geometry_.clients_per_node + channel) * geometry_.depth + slot;
    return slots_ + index * (uint64_t{geometry_.request_bytes} + geometry_.response_bytes);
  }

  std::string service_;
  RpcGeometry geometry_;
  uint32_t max_nodes_ = 0;
  uint32_t lock_ = 0;
  region::MetaAccess* meta_ = nullptr;
  uint64_t base_ = 0;   // the header's offset in its region
  uint64_t slots_ = 0;  // the first slot's offset
};

}  // namespace cxlkv::rpc

#endif  // CXLKV_SRC_RPC_AREA_H_
