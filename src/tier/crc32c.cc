#include "tier/crc32c.h"

#include <isa-l/crc.h>

#include <climits>

namespace cxlkv::tier {

void Crc32cState::Update(const void* data, size_t len) {
  // ISA-L's crc32_iscsi takes the register as is and returns it without a final inversion, and
  // its length is an int: feed spans above INT_MAX in pieces.
  auto* p = static_cast<unsigned char*>(const_cast<void*>(data));
  while (len > 0) {
    size_t piece = len > static_cast<size_t>(INT_MAX) ? (size_t{1} << 30) : len;
    reg_ = crc32_iscsi(p, static_cast<int>(piece), reg_);
    p += piece;
    len -= piece;
  }
}

uint32_t Crc32c(const void* data, size_t len) {
  Crc32cState s;
  s.Update(data, len);
  return s.Finish();
}

}  // namespace cxlkv::tier
