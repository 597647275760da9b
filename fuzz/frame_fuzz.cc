// libFuzzer target: the TCP front's frame decoder (src/rpc/frame.h) on any bytes a
// peer can send. The input is cut into reads at places the first bytes choose, as a socket
// delivers them; the decoder must never crash, never hold more than one frame's worth of
// bytes (header + its payload limit), refuse a malformed stream for good once it has, and
// every frame it decodes must encode back to exactly the bytes it was decoded from. A frame of
// the `kv` service also goes through its request decoder (src/rpc/kv_frames.h): whatever it
// accepts is within the limits and encodes back to the same payload. A frame of service byte 2
// (no TCP service: a fuzzing route) goes through the near-memory attention service's request
// decoders (src/pnm/service_protocol.h) by its opcode, with the same checks.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <span>
#include <vector>

#include "rpc/frame.h"
#include "pnm/service_protocol.h"
#include "rpc/kv_frames.h"

namespace {

constexpr uint32_t kLimit = 4096;

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "frame_fuzz: %s\n", what);
  std::abort();
}

void CheckKvRequest(const cxlkv::rpc::Frame& f) {
  using namespace cxlkv::rpc;
  auto r = DecodeKvRequest(f.code, f.payload);
  if (!r.ok()) {
    if (r.status().message().empty()) Fail("a kv request refused without a reason");
    return;
  }
  if (r->model.empty() || r->model.size() > kMaxKvModelBytes) Fail("a kv model id out of range");
  if (r->keys.empty() || r->keys.size() > kMaxKvKeys) Fail("a kv key count out of range");
  std::vector<std::string> keys;
  for (const auto& k : r->keys) {
    if (k.empty() || k.size() > kMaxKvKeyBytes) Fail("a kv key out of range");
    keys.emplace_back(k.begin(), k.end());
  }
  if ((f.code == kKvPut) == r->block.empty()) Fail("a kv block where none belongs, or none where one does");
  const std::vector<uint8_t> again = EncodeKvRequest(r->model, keys, r->block);
  if (again != f.payload) Fail("a kv request re-encodes differently");
}

template <typename T, typename Encode>
void CheckReencodes(const cxlkv::Result<T>& r, const std::vector<uint8_t>& payload, const Encode& encode,
                    const char* what) {
  if (!r.ok()) {
    if (r.status().message().empty()) Fail("a pnm request refused without a reason");
    return;
  }
  if (encode(*r) != payload) Fail(what);
}

void CheckPnmRequest(const cxlkv::rpc::Frame& f) {
  using namespace cxlkv::pnm;
  switch (f.code % 6) {
    case 0:
      CheckReencodes(DecodeOpen(f.payload), f.payload, [](const OpenRequest& r) { return EncodeOpen(r); },
                     "a pnm open re-encodes differently");
      break;
    case 1: {
      auto r = DecodeExtend(f.payload);
      if (r.ok() && (r->keys.empty() || r->keys.size() > kMaxExtendKeys)) Fail("a pnm extend's key count out of range");
      CheckReencodes(r, f.payload, [](const ExtendRequest& e) { return EncodeExtend(e); },
                     "a pnm extend re-encodes differently");
      break;
    }
    case 2:
      CheckReencodes(DecodeAttend(f.payload), f.payload,
                     [](const std::vector<AttendJobRequest>& jobs) {
                       std::vector<uint8_t> out;
                       EncodeAttend(jobs, out);
                       return out;
                     },
                     "a pnm attend re-encodes differently");
      break;
    case 3:
      CheckReencodes(DecodeAttendSplit(f.payload), f.payload,
                     [](const std::vector<AttendJobRequest>& jobs) {
                       std::vector<uint8_t> out;
                       EncodeAttendSplit(jobs, out);
                       return out;
                     },
                     "a pnm split attend re-encodes differently");
      break;
    case 4: {
      // Answers come from the daemon's slot in shared memory: untrusted too. Shapes from the
      // frame's code: 1-3 jobs of 1-4 heads, head_dim 16, 1-2 KV heads.
      const size_t jobs = 1 + (f.code >> 3) % 3;
      std::vector<std::pair<uint32_t, uint32_t>> shapes(jobs, {1 + (f.code >> 5) % 4, 16});
      std::vector<uint32_t> kv_heads(jobs, 1 + (f.code >> 7) % 2);
      auto plain = DecodeAttendAnswer(f.payload, shapes);
      if (plain.ok() && plain->size() != jobs) Fail("a pnm attend answer of the wrong job count");
      auto split = DecodeAttendSplitAnswer(f.payload, shapes, kv_heads);
      if (split.ok()) {
        for (const AttendJobAnswer& a : *split) {
          if (a.status.ok() && a.heads.size() != kv_heads[0]) Fail("a pnm split answer without a part per KV head");
          for (const SplitHeadAnswer& h : a.heads) {
            if (std::adjacent_find(h.recall.begin(), h.recall.end(), std::greater_equal<>()) != h.recall.end()) {
              Fail("a pnm split answer's recalls decoded out of order");
            }
          }
        }
      }
      break;
    }
    default:
      CheckReencodes(DecodeContexts(f.payload), f.payload,
                     [](const std::vector<uint64_t>& ids) { return EncodeContexts(ids); },
                     "a pnm context list re-encodes differently");
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t cut = data[0] | 1;  // read sizes: 1..255 bytes, varied by the input
  std::span<const uint8_t> stream(data + 1, size - 1);
  cxlkv::rpc::FrameDecoder decoder(kLimit);
  size_t consumed = 0;  // bytes the decoder took, to check each frame's encoding against
  size_t frame_start = 0;
  bool failed = false;
  while (!stream.empty()) {
    const size_t n = std::min<size_t>(stream.size(), cut);
    std::span<const uint8_t> read = stream.first(n);
    stream = stream.subspan(n);
    while (!read.empty()) {
      cxlkv::rpc::Frame f;
      const size_t before = read.size();
      const auto r = decoder.Next(read, &f);
      consumed += before - read.size();
      if (decoder.buffered() > cxlkv::rpc::kFrameHeaderBytes + kLimit) Fail("decoder holds more than one frame");
      if (r == cxlkv::rpc::FrameDecoder::Result::kError) {
        if (decoder.error().ok()) Fail("an error without a reason");
        failed = true;
        break;
      }
      if (failed) Fail("a frame after an error");
      if (r == cxlkv::rpc::FrameDecoder::Result::kNeedMore) break;
      if (f.payload.size() > kLimit) Fail("a payload over the limit");
      if (f.service == static_cast<uint8_t>(cxlkv::rpc::FrameService::kKv)) CheckKvRequest(f);
      if (f.service == 2) CheckPnmRequest(f);
      std::vector<uint8_t> again;
      cxlkv::rpc::EncodeFrame(f, again);
      const size_t len = consumed - frame_start;
      const uint8_t* original = data + 1 + frame_start;
      if (again.size() != len || !std::equal(again.begin(), again.end(), original)) Fail("re-encoding differs");
      frame_start = consumed;
    }
    if (failed) {
      std::span<const uint8_t> more = stream;
      cxlkv::rpc::Frame f;
      if (!more.empty() && decoder.Next(more, &f) != cxlkv::rpc::FrameDecoder::Result::kError) {
        Fail("the decoder recovered from a malformed stream");
      }
      break;
    }
  }
  return 0;
}
