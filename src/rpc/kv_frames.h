// The requests of the TCP front's `kv` service (frame.h, FrameService::kKv): the KV cache's
// data operations for hosts outside the CXL domain, the block's bytes inside the frames. The
// daemon runs them (daemon/kv_front.h); this is only their encoding, shared with the clients
// (`cxlkv put|get|evict --tcp`) and fuzzed with the frame decoder (fuzz/frame_fuzz.cc).
//
// Keys are an engine's block hashes (any 1..64 bytes, e.g. vLLM's chained hashes) in a
// namespace named by the model id (blocks of any size), so a key put over TCP is the key
// `cxlkv put --key` makes on a host in the domain (the CLI's namespace is model "cli").
//
// Request (little-endian; every field checked before use, the bytes are a stranger's):
//   u16 model length, model bytes (1..95), u16 key count (1..kMaxKvKeys),
//   per key: u8 length (1..64), the bytes; then, for kKvPut only, the block (the rest).
// Answers: kKvPut nothing; kKvGet the block; kKvExists u32 the count of leading keys cached;
// kKvEvict u64 the blocks evicted. Errors travel as the frame's status code and message.
#ifndef CXLKV_SRC_RPC_KV_FRAMES_H_
#define CXLKV_SRC_RPC_KV_FRAMES_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cxlkv/status.h"

namespace cxlkv::rpc {

enum KvOp : uint32_t {
  kKvPut = 1,     // one key and its block -> nothing (kAlreadyExists when cached)
  kKvGet = 2,     // one key -> its block (kNotFound when not cached)
  kKvExists = 3,  // keys -> u32 how many leading ones are cached
  kKvEvict = 4,   // keys -> u64 how many were evicted (pinned or in-flight ones stay)
};

inline constexpr size_t kMaxKvKeys = 4096;
inline constexpr size_t kMaxKvKeyBytes = 64;
inline constexpr size_t kMaxKvModelBytes = 95;  // KeyNamespace::model_id's limit

struct KvRequest {
  std::string model;
  std::vector<std::vector<uint8_t>> keys;
  std::span<const uint8_t> block;  // kKvPut: a view into the decoded bytes
};

std::vector<uint8_t> EncodeKvRequest(const std::string& model, const std::vector<std::string>& keys,
                                     std::span<const uint8_t> block = {});
// kInvalidArgument naming the first field that is out of range or runs past the end.
Result<KvRequest> DecodeKvRequest(uint32_t op, std::span<const uint8_t> in);

}  // namespace cxlkv::rpc

#endif  // CXLKV_SRC_RPC_KV_FRAMES_H_
