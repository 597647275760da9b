// Frames of the RPC protocol over a byte stream (the TCP front for hosts outside the CXL
// domain; docs/rpc.md, "TCP front"). The same requests as the shared-memory RPC — a service, an
// opcode, a payload — with the payload inside the message.
//
// Every frame: a 24-byte header, then `length` payload bytes. Little-endian.
//   0  magic    u16  0x4b43 ("CK")
//   2  version  u8   kFrameVersion
//   3  service  u8   which service (FrameService)
//   4  code     u32  request: the opcode; response: the StatusCode of the answer
//   8  id       u64  chosen by the client, echoed in the response (requests may be pipelined)
//   16 length   u32  payload bytes; at most the decoder's limit
//   20 flags    u32  0 (reserved: a frame with any bit set is refused)
//
// The decoder never trusts a byte: it checks magic, version, flags and length before it asks
// for the payload, so a peer cannot make it allocate more than `max_payload`, and it can stop
// and resume at any byte (a frame split over reads).
//
// Thread-safety: FrameDecoder is one connection's; the functions are pure.
#ifndef CXLKV_SRC_RPC_FRAME_H_
#define CXLKV_SRC_RPC_FRAME_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cxlkv/status.h"

namespace cxlkv::rpc {

inline constexpr uint16_t kFrameMagic = 0x4b43;
inline constexpr uint8_t kFrameVersion = 1;
inline constexpr size_t kFrameHeaderBytes = 24;

enum class FrameService : uint8_t {
  kAdmin = 0,  // the pool's admin service (daemon/admin.h)
  kKv = 1,     // the KV cache's data operations, blocks inside the frames (kv_frames.h)
};
inline constexpr uint8_t kFrameServices = 2;

struct Frame {
  uint8_t service = 0;
  uint32_t code = 0;  // opcode (request) or status code (response)
  uint64_t id = 0;
  std::vector<uint8_t> payload;
};

// Appends the encoding of `f` to `out`.
void EncodeFrame(const Frame& f, std::vector<uint8_t>& out);

class FrameDecoder {
 public:
  explicit FrameDecoder(uint32_t max_payload) : max_payload_(max_payload) {}

  enum class Result { kNeedMore, kFrame, kError };
  // Consumes bytes from `in` (advancing it) until one frame is complete (kFrame: in *out), the
  // bytes run out (kNeedMore: call again with more), or the stream is malformed (kError: the
  // reason in error(); the connection cannot be resynchronized and should be closed after an
  // error reply). After kError every call returns kError.
  Result Next(std::span<const uint8_t>& in, Frame* out);
  const Status& error() const { return error_; }
  // The id of the frame being decoded, once its header was read (for the error reply).
  uint64_t pending_id() const { return header_done_ ? id_ : 0; }
  // Bytes held for an incomplete frame: bounded by the header plus max_payload.
  size_t buffered() const { return header_fill_ + payload_.size(); }

 private:
  Result Fail(Status s);

  uint32_t max_payload_;
  uint8_t header_[kFrameHeaderBytes] = {};
  size_t header_fill_ = 0;
  bool header_done_ = false;
  uint8_t service_ = 0;
  uint32_t code_ = 0;
  uint64_t id_ = 0;
  uint32_t length_ = 0;
  std::vector<uint8_t> payload_;
  Status error_;
};

}  // namespace cxlkv::rpc

#endif  // CXLKV_SRC_RPC_FRAME_H_
