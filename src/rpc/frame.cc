#include "rpc/frame.h"

#include <algorithm>
#include <cstring>

namespace cxlkv::rpc {
namespace {

template <typename T>
void PutLe(std::vector<uint8_t>& out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i)));
}

template <typename T>
T GetLe(const uint8_t* p) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= uint64_t{p[i]} << (8 * i);
  return static_cast<T>(v);
}

}  // namespace

void EncodeFrame(const Frame& f, std::vector<uint8_t>& out) {
  out.reserve(out.size() + kFrameHeaderBytes + f.payload.size());
  PutLe<uint16_t>(out, kFrameMagic);
  PutLe<uint8_t>(out, kFrameVersion);
  PutLe<uint8_t>(out, f.service);
  PutLe<uint32_t>(out, f.code);
  PutLe<uint64_t>(out, f.id);
  PutLe<uint32_t>(out, static_cast<uint32_t>(f.payload.size()));
  PutLe<uint32_t>(out, 0);
  out.insert(out.end(), f.payload.begin(), f.payload.end());
}

FrameDecoder::Result FrameDecoder::Fail(Status s) {
  error_ = std::move(s);
  payload_.clear();
  payload_.shrink_to_fit();
  return Result::kError;
}

FrameDecoder::Result FrameDecoder::Next(std::span<const uint8_t>& in, Frame* out) {
  if (!error_.ok()) return Result::kError;
  if (!header_done_) {
    const size_t take = std::min(in.size(), kFrameHeaderBytes - header_fill_);
    std::memcpy(header_ + header_fill_, in.data(), take);
    header_fill_ += take;
    in = in.subspan(take);
    // Check what has arrived as soon as it has: a stream that is not ours is refused at its
    // first bytes, not after a header's worth.
    if (header_fill_ >= 2 && GetLe<uint16_t>(header_) != kFrameMagic) {
      return Fail(InvalidArgument("not a cxlkv frame (bad magic): is this client speaking the cxlkv TCP protocol?"));
    }
    if (header_fill_ >= 3 && header_[2] != kFrameVersion) {
      return Fail(VersionMismatch("frame version " + std::to_string(header_[2]) + ", this daemon speaks " +
                                  std::to_string(kFrameVersion) + ": upgrade the client or the daemon"));
    }
    if (header_fill_ < kFrameHeaderBytes) return Result::kNeedMore;
    service_ = header_[3];
    code_ = GetLe<uint32_t>(header_ + 4);
    id_ = GetLe<uint64_t>(header_ + 8);
    length_ = GetLe<uint32_t>(header_ + 16);
    const uint32_t flags = GetLe<uint32_t>(header_ + 20);
    header_done_ = true;
    if (flags != 0) return Fail(InvalidArgument("frame flags " + std::to_string(flags) + " are reserved (must be 0)"));
    if (length_ > max_payload_) {
      return Fail(InvalidArgument("frame payload of " + std::to_string(length_) + " bytes exceeds the limit of " +
                                  std::to_string(max_payload_)));
    }
    payload_.clear();
    payload_.reserve(length_);
  }
  const size_t take = std::min<size_t>(in.size(), length_ - payload_.size());
  payload_.insert(payload_.end(), in.begin(), in.begin() + static_cast<std::ptrdiff_t>(take));
  in = in.subspan(take);
  if (payload_.size() < length_) return Result::kNeedMore;
  out->service = service_;
  out->code = code_;
  out->id = id_;
  out->payload = std::move(payload_);
  payload_ = {};
  header_fill_ = 0;
  header_done_ = false;
  return Result::kFrame;
}

}  // namespace cxlkv::rpc
