// Byte sizes and small formatting helpers shared by every layer and the CLI.
#ifndef CXLKV_SRC_UTIL_UNITS_H_
#define CXLKV_SRC_UTIL_UNITS_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "cxlkv/status.h"

namespace cxlkv::util {

// Parses "4096", "64K", "512M", "2G", "1T" (binary multiples; "KiB"/"KB"/"k" spellings too).
Result<uint64_t> ParseByteSize(std::string_view text);

// "2.0 GiB", "512 MiB", "4 KiB", "17 B".
std::string FormatBytes(uint64_t bytes);

// "0x" + 16 hex digits.
std::string Hex64(uint64_t v);

// Lower-case hex of a byte string.
std::string HexBytes(const uint8_t* p, size_t n);

// A name read from the region (up to the first NUL, at most `n` bytes) with every byte that is
// not printable ASCII replaced by '?': safe to print and to put in JSON (which must be UTF-8).
std::string PrintableName(const char* p, size_t n);

}  // namespace cxlkv::util

#endif  // CXLKV_SRC_UTIL_UNITS_H_
