#include "util/units.h"

#include <cctype>
#include <cstdio>
#include <cstring>
#include <limits>

namespace cxlkv::util {

Result<uint64_t> ParseByteSize(std::string_view text) {
  std::string_view t = text;
  while (!t.empty() && std::isspace(static_cast<unsigned char>(t.back()))) t.remove_suffix(1);
  size_t i = 0;
  uint64_t value = 0;
  while (i < t.size() && std::isdigit(static_cast<unsigned char>(t[i]))) {
    uint64_t digit = static_cast<uint64_t>(t[i] - '0');
    if (value > (std::numeric_limits<uint64_t>::max() - digit) / 10) {
      return InvalidArgument("size '" + std::string(text) + "' is too large");
    }
    value = value * 10 + digit;
    ++i;
  }
  if (i == 0) {
    return InvalidArgument("size '" + std::string(text) +
                           "' is not a number of bytes (examples: 4096, 64M, 2G)");
  }
  std::string suffix;
  for (; i < t.size(); ++i) suffix += static_cast<char>(std::tolower(static_cast<unsigned char>(t[i])));
  int shift = -1;
  if (suffix.empty() || suffix == "b") shift = 0;
  else if (suffix == "k" || suffix == "kb" || suffix == "kib") shift = 10;
  else if (suffix == "m" || suffix == "mb" || suffix == "mib") shift = 20;
  else if (suffix == "g" || suffix == "gb" || suffix == "gib") shift = 30;
  else if (suffix == "t" || suffix == "tb" || suffix == "tib") shift = 40;
  if (shift < 0) {
    return InvalidArgument("size '" + std::string(text) + "' has an unknown unit '" + suffix +
                           "' (use K, M, G or T)");
  }
  if (shift > 0 && value > (std::numeric_limits<uint64_t>::max() >> shift)) {
    return InvalidArgument("size '" + std::string(text) + "' is too large");
  }
  return value << shift;
}

std::string FormatBytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  double v = static_cast<double>(bytes);
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  if (u == 0 || v == static_cast<double>(static_cast<uint64_t>(v))) {
    std::snprintf(buf, sizeof(buf), "%llu %s", static_cast<unsigned long long>(v), kUnits[u]);
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f %s", v, kUnits[u]);
  }
  return buf;
}

std::string Hex64(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string HexBytes(const uint8_t* p, size_t n) {
  static const char* kDigits = "0123456789abcdef";
  std::string s;
  s.reserve(n * 2);
  for (size_t i = 0; i < n; ++i) {
    s += kDigits[p[i] >> 4];
    s += kDigits[p[i] & 15];
  }
  return s;
}

std::string PrintableName(const char* p, size_t n) {
  std::string out(p, strnlen(p, n));
  for (char& c : out) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) c = '?';
  }
  return out;
}

}  // namespace cxlkv::util
