#include "rpc/kv_frames.h"

#include <cstring>

namespace cxlkv::rpc {
namespace {

template <typename T>
void Put(std::vector<uint8_t>& out, T v) {
  const size_t at = out.size();
  out.resize(at + sizeof v);
  std::memcpy(out.data() + at, &v, sizeof v);
}

// Reads fixed-width fields and byte runs, failing (never reading past the end) on a short body.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> in) : in_(in) {}
  template <typename T>
  bool Get(T* v) {
    if (in_.size() - at_ < sizeof(T)) return false;
    std::memcpy(v, in_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return true;
  }
  bool Bytes(size_t n, std::span<const uint8_t>* out) {
    if (in_.size() - at_ < n) return false;
    *out = in_.subspan(at_, n);
    at_ += n;
    return true;
  }
  std::span<const uint8_t> rest() const { return in_.subspan(at_); }

 private:
  std::span<const uint8_t> in_;
  size_t at_ = 0;
};

Status Malformed(const std::string& what) {
  return InvalidArgument("malformed kv request: " + what + " (see src/daemon/kv_front.h for the encoding)");
}

}  // namespace

std::vector<uint8_t> EncodeKvRequest(const std::string& model, const std::vector<std::string>& keys,
                                     std::span<const uint8_t> block) {
  std::vector<uint8_t> out;
  Put(out, static_cast<uint16_t>(model.size()));
  out.insert(out.end(), model.begin(), model.end());
  Put(out, static_cast<uint16_t>(keys.size()));
  for (const std::string& k : keys) {
    Put(out, static_cast<uint8_t>(k.size()));
    out.insert(out.end(), k.begin(), k.end());
  }
  out.insert(out.end(), block.begin(), block.end());
  return out;
}

Result<KvRequest> DecodeKvRequest(uint32_t op, std::span<const uint8_t> in) {
  if (op < kKvPut || op > kKvEvict) return InvalidArgument("the kv service has no opcode " + std::to_string(op));
  Reader r(in);
  KvRequest req;
  uint16_t model_len = 0;
  std::span<const uint8_t> model;
  if (!r.Get(&model_len) || model_len == 0 || model_len > kMaxKvModelBytes || !r.Bytes(model_len, &model)) {
    return Malformed("the model id must be 1.." + std::to_string(kMaxKvModelBytes) + " bytes");
  }
  req.model.assign(model.begin(), model.end());
  uint16_t count = 0;
  if (!r.Get(&count) || count == 0 || count > kMaxKvKeys) {
    return Malformed("the key count must be 1.." + std::to_string(kMaxKvKeys));
  }
  if ((op == kKvPut || op == kKvGet) && count != 1) return Malformed("put and get take exactly one key");
  req.keys.reserve(count);
  for (uint16_t i = 0; i < count; ++i) {
    uint8_t len = 0;
    std::span<const uint8_t> key;
    if (!r.Get(&len) || len == 0 || len > kMaxKvKeyBytes || !r.Bytes(len, &key)) {
      return Malformed("key " + std::to_string(i) + " must be 1.." + std::to_string(kMaxKvKeyBytes) +
                       " bytes and inside the request");
    }
    req.keys.emplace_back(key.begin(), key.end());
  }
  req.block = r.rest();
  if (op == kKvPut && req.block.empty()) return Malformed("a put needs a block of at least one byte after its key");
  if (op != kKvPut && !req.block.empty()) return Malformed(std::to_string(req.block.size()) + " bytes after the keys");
  return req;
}

}  // namespace cxlkv::rpc
