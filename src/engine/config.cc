#include "engine/config.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string_view>

namespace cxlkv::engine {
namespace {

// The uint32 fields, in ToJson order.
struct U32Field {
  const char* key;
  uint32_t ModelConfig::*member;
};
constexpr U32Field kU32Fields[] = {
    {"vocab_size", &ModelConfig::vocab_size},
    {"hidden_size", &ModelConfig::hidden_size},
    {"num_layers", &ModelConfig::num_layers},
    {"num_heads", &ModelConfig::num_heads},
    {"num_kv_heads", &ModelConfig::num_kv_heads},
    {"head_dim", &ModelConfig::head_dim},
    {"intermediate_size", &ModelConfig::intermediate_size},
    {"max_position", &ModelConfig::max_position},
};
struct FloatField {
  const char* key;
  float ModelConfig::*member;
};
constexpr FloatField kFloatFields[] = {
    {"rope_theta", &ModelConfig::rope_theta},
    {"rms_norm_eps", &ModelConfig::rms_norm_eps},
};

std::string KnownKeys() {
  std::string s = "name, seed";
  for (const auto& f : kU32Fields) s += std::string(", ") + f.key;
  for (const auto& f : kFloatFields) s += std::string(", ") + f.key;
  return s;
}

Status FieldError(std::string_view key, std::string_view want, const nlohmann::json& got) {
  return InvalidArgument("model config field '" + std::string(key) + "' must be " +
                         std::string(want) + ", got " + got.dump());
}

// Sets *out from an unsigned JSON integer no larger than `max`.
template <typename T>
Status ParseUnsigned(std::string_view key, const nlohmann::json& v, uint64_t max, T* out) {
  // Parsed text holds non-negative integers as unsigned, values built in C++ as signed.
  const bool in_range = v.is_number_unsigned()  ? v.get<uint64_t>() <= max
                        : v.is_number_integer() ? v.get<int64_t>() >= 0 &&
                                                      static_cast<uint64_t>(v.get<int64_t>()) <= max
                                                : false;
  if (!in_range) {
    return FieldError(key, "a non-negative integer no larger than " + std::to_string(max), v);
  }
  *out = static_cast<T>(v.get<uint64_t>());
  return Status::Ok();
}

}  // namespace

Result<ModelConfig> ModelConfig::FromJson(const nlohmann::json& j) {
  if (!j.is_object()) {
    return InvalidArgument("model config must be a JSON object, got " + std::string(j.type_name()));
  }
  ModelConfig c;
  for (const auto& [key, v] : j.items()) {
    if (key == "name") {
      if (!v.is_string()) return FieldError(key, "a string", v);
      c.name = v.get<std::string>();
      continue;
    }
    if (key == "seed") {
      CXLKV_RETURN_IF_ERROR(ParseUnsigned(key, v, std::numeric_limits<uint64_t>::max(), &c.seed));
      continue;
    }
    bool known = false;
    for (const auto& f : kU32Fields) {
      if (key != f.key) continue;
      CXLKV_RETURN_IF_ERROR(
          ParseUnsigned(key, v, std::numeric_limits<uint32_t>::max(), &(c.*f.member)));
      known = true;
    }
    for (const auto& f : kFloatFields) {
      if (key != f.key) continue;
      if (!v.is_number()) return FieldError(key, "a number", v);
      c.*f.member = v.get<float>();
      known = true;
    }
    if (!known) {
      return InvalidArgument("unknown model config field '" + key +
                             "' (known fields: " + KnownKeys() + ")");
    }
  }
  CXLKV_RETURN_IF_ERROR(c.Validate());
  return c;
}

Result<ModelConfig> ModelConfig::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    if (err == ENOENT) return NotFound("model config " + path + ": no such file");
    return IoError("model config " + path + ": cannot open: " + std::strerror(err));
  }
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) return IoError("model config " + path + ": read failed");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgument("model config " + path + " is not valid JSON: " + e.what());
  }
  Result<ModelConfig> c = FromJson(j);
  if (!c.ok()) return InvalidArgument("model config " + path + ": " + c.status().message());
  return c;
}

nlohmann::json ModelConfig::ToJson() const {
  nlohmann::json j;
  j["name"] = name;
  for (const auto& f : kU32Fields) j[f.key] = this->*f.member;
  for (const auto& f : kFloatFields) j[f.key] = this->*f.member;
  j["seed"] = seed;
  return j;
}

Status ModelConfig::Validate() const {
  if (name.empty()) return InvalidArgument("model config field 'name' must not be empty");
  for (const auto& f : kU32Fields) {
    if (this->*f.member == 0) {
      return InvalidArgument("model config field '" + std::string(f.key) +
                             "' must be greater than 0");
    }
  }
  for (const auto& f : kFloatFields) {
    const float v = this->*f.member;
    if (!std::isfinite(v) || v <= 0.0f) {
      return InvalidArgument("model config field '" + std::string(f.key) +
                             "' must be a positive finite number, got " + std::to_string(v));
    }
  }
  if (uint64_t{num_heads} * head_dim != hidden_size) {
    return InvalidArgument("model config field 'hidden_size' (" + std::to_string(hidden_size) +
                           ") must equal num_heads * head_dim (" + std::to_string(num_heads) +
                           " * " + std::to_string(head_dim) + ")");
  }
  if (num_heads % num_kv_heads != 0) {
    return InvalidArgument("model config field 'num_kv_heads' (" + std::to_string(num_kv_heads) +
                           ") must divide num_heads (" + std::to_string(num_heads) + ")");
  }
  if (head_dim % 2 != 0) {
    return InvalidArgument("model config field 'head_dim' (" + std::to_string(head_dim) +
                           ") must be even (RoPE rotates two halves)");
  }
  return Status::Ok();
}

uint64_t ModelConfig::KvBytesPerToken() const {
  return uint64_t{num_layers} * 2 * num_kv_heads * head_dim * sizeof(float);
}

}  // namespace cxlkv::engine
