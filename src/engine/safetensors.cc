// Weights::LoadSafetensors / SaveSafetensors.
//
// safetensors format: an 8-byte little-endian header length N, N bytes of JSON mapping each
// tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the
// data section that follows the header; an optional "__metadata__" entry), then the data.
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <new>
#include <nlohmann/json.hpp>

#include "engine/weights.h"

namespace cxlkv::engine {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; this reader assumes a little-endian host");

// The safetensors reference implementation's limit; it keeps a bad length from allocating.
constexpr uint64_t kMaxHeaderBytes = 100u << 20;

// Owns a FILE*.
class File {
 public:
  File() = default;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() {
    if (f_ != nullptr) std::fclose(f_);
  }
  Status Open(const std::string& path, const char* mode) {
    f_ = std::fopen(path.c_str(), mode);
    if (f_ != nullptr) return Status::Ok();
    const int err = errno;
    const std::string m = "safetensors file " + path + ": " + std::strerror(err);
    if (err == ENOENT) return NotFound(m);
    if (err == EACCES || err == EPERM) return PermissionDenied(m);
    return IoError(m);
  }
  std::FILE* get() const { return f_; }
  // Closes, reporting a failed flush.
  bool Close() {
    const bool ok = std::fclose(f_) == 0;
    f_ = nullptr;
    return ok;
  }

 private:
  std::FILE* f_ = nullptr;
};

float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign != 0 ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));  // inf / nan
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
}

float Bf16ToFloat(uint16_t b) { return std::bit_cast<float>(uint32_t{b} << 16); }

// Bytes per element of a supported dtype, or 0.
uint32_t DtypeSize(const std::string& dtype) {
  if (dtype == "F32") return 4;
  if (dtype == "F16" || dtype == "BF16") return 2;
  return 0;
}

std::string ShapeString(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// One header entry, checked for structure.
struct Entry {
  std::string dtype;
  std::vector<uint64_t> shape;
  uint64_t begin = 0, end = 0;
};

Status ParseEntry(const std::string& where, const nlohmann::json& v, uint64_t data_bytes,
                  Entry* e) {
  if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
      !v.contains("data_offsets") || !v["dtype"].is_string() || !v["shape"].is_array() ||
      !v["data_offsets"].is_array() || v["data_offsets"].size() != 2) {
    return Corrupted(where + ": header entry is not {dtype, shape, data_offsets: [begin, end]}");
  }
  e->dtype = v["dtype"].get<std::string>();
  for (const auto& d : v["shape"]) {
    if (!d.is_number_unsigned()) return Corrupted(where + ": shape holds a non-integer");
    e->shape.push_back(d.get<uint64_t>());
  }
  const auto& off = v["data_offsets"];
  if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
    return Corrupted(where + ": data_offsets are not integers");
  }
  e->begin = off[0].get<uint64_t>();
  e->end = off[1].get<uint64_t>();
  if (e->begin > e->end || e->end > data_bytes) {
    return Corrupted(where + ": data_offsets [" + std::to_string(e->begin) + ", " +
                     std::to_string(e->end) + ") lie beyond the data section of " +
                     std::to_string(data_bytes) + " bytes (file truncated?)");
  }
  return Status::Ok();
}

}  // namespace

Result<Weights> Weights::LoadSafetensors(const ModelConfig& c, const std::string& path) {
  CXLKV_RETURN_IF_ERROR(c.Validate());
  const std::string what = "safetensors file " + path;
  File f;
  CXLKV_RETURN_IF_ERROR(f.Open(path, "rb"));
  if (std::fseek(f.get(), 0, SEEK_END) != 0) return IoError(what + ": cannot seek");
  const long file_size_l = std::ftell(f.get());
  if (file_size_l < 0) return IoError(what + ": cannot tell its size");
  const uint64_t file_size = static_cast<uint64_t>(file_size_l);
  std::rewind(f.get());

  uint8_t len_bytes[8];
  if (file_size < 8 || std::fread(len_bytes, 1, 8, f.get()) != 8) {
    return Corrupted(what + ": truncated header (" + std::to_string(file_size) +
                     " bytes, the length field alone needs 8)");
  }
  uint64_t header_len;
  std::memcpy(&header_len, len_bytes, 8);
  if (header_len > kMaxHeaderBytes || header_len > file_size - 8) {
    return Corrupted(what + ": truncated header (header length " + std::to_string(header_len) +
                     ", file has " + std::to_string(file_size - 8) + " bytes after the length)");
  }
  std::string header(header_len, '\0');
  if (std::fread(header.data(), 1, header_len, f.get()) != header_len) {
    return IoError(what + ": short read of the header");
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const nlohmann::json::exception& e) {
    return Corrupted(what + ": header is not valid JSON: " + e.what());
  }
  if (!j.is_object()) return Corrupted(what + ": header is not a JSON object");
  const uint64_t data_start = 8 + header_len;
  const uint64_t data_bytes = file_size - data_start;

  std::map<std::string, Entry> entries;
  for (const auto& [name, v] : j.items()) {
    if (name == "__metadata__") continue;
    Entry e;
    CXLKV_RETURN_IF_ERROR(ParseEntry(what + ": tensor " + name, v, data_bytes, &e));
    entries.emplace(name, std::move(e));
  }

  Weights w(c);
  try {
    std::vector<uint8_t> raw;
    for (Tensor& t : w.Tensors()) {
      auto it = entries.find(t.name);
      if (it == entries.end() && t.data == &w.lm_head_) {  // tied head: filled below
        continue;
      }
      if (it == entries.end()) {
        return NotFound(what + ": required tensor " + t.name + " is missing");
      }
      const Entry& e = it->second;
      if (e.shape != t.shape) {
        return InvalidArgument(what + ": tensor " + t.name + " has shape " + ShapeString(e.shape) +
                               ", model config '" + c.name + "' expects " + ShapeString(t.shape));
      }
      const uint32_t esize = DtypeSize(e.dtype);
      if (esize == 0) {
        return NotSupported(what + ": tensor " + t.name + " has dtype " + e.dtype +
                            "; supported dtypes are F32, F16, BF16");
      }
      uint64_t n = 1;
      for (uint64_t d : t.shape) n *= d;
      if (e.end - e.begin != n * esize) {
        return Corrupted(what + ": tensor " + t.name + " spans " + std::to_string(e.end - e.begin) +
                         " bytes, its shape and dtype need " + std::to_string(n * esize));
      }
      raw.resize(e.end - e.begin);
      if (std::fseek(f.get(), static_cast<long>(data_start + e.begin), SEEK_SET) != 0 ||
          std::fread(raw.data(), 1, raw.size(), f.get()) != raw.size()) {
        return IoError(what + ": short read of tensor " + t.name);
      }
      t.data->resize(n);
      float* out = t.data->data();
      if (e.dtype == "F32") {
        std::memcpy(out, raw.data(), raw.size());
      } else {
        const bool bf16 = e.dtype == "BF16";
        for (uint64_t i = 0; i < n; ++i) {
          uint16_t h;
          std::memcpy(&h, raw.data() + 2 * i, 2);
          out[i] = bf16 ? Bf16ToFloat(h) : HalfToFloat(h);
        }
      }
    }
    if (!entries.contains("lm_head.weight")) w.lm_head_ = w.embed_tokens_;
  } catch (const std::bad_alloc&) {
    return NoSpace(what + ": out of memory loading model '" + c.name + "'");
  }
  return w;
}

Status Weights::SaveSafetensors(const std::string& path) const {
  const std::string what = "safetensors file " + path;
  const std::vector<Tensor> tensors = Tensors();
  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  for (const Tensor& t : tensors) {
    const uint64_t bytes = t.data->size() * sizeof(float);
    header[t.name] = {
        {"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  header["__metadata__"] = {{"format", "pt"}, {"writer", "cxlkv reference engine"}};
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data 8-byte aligned

  File f;
  CXLKV_RETURN_IF_ERROR(f.Open(path, "wb"));
  const uint64_t len = text.size();
  bool ok = std::fwrite(&len, 8, 1, f.get()) == 1 &&
            std::fwrite(text.data(), 1, text.size(), f.get()) == text.size();
  for (const Tensor& t : tensors) {
    if (!ok) break;
    ok = std::fwrite(t.data->data(), sizeof(float), t.data->size(), f.get()) == t.data->size();
  }
  const int err = errno;
  if (!f.Close() || !ok) return IoError(what + ": write failed: " + std::strerror(err));
  return Status::Ok();
}

}  // namespace cxlkv::engine
