// CRC-32C (Castagnoli, the iSCSI polynomial 0x1EDC6F41, reflected), computed by ISA-L's
// crc32_iscsi, which uses the SSE4.2 crc32 instruction (and folding with PCLMUL) where the CPU
// has it. Standard convention: initial value 0xFFFFFFFF, final xor 0xFFFFFFFF, so that
// Crc32c("123456789") == 0xE3069283 (tests/tier/crc32c_test.cc checks it).
//
// Incremental use over several spans gives the same value as one call over their
// concatenation:
//   Crc32cState s;  s.Update(header);  s.Update(payload);  uint32_t crc = s.Finish();
// Thread-safety: pure functions; a Crc32cState is a value.
#ifndef CXLKV_SRC_TIER_CRC32C_H_
#define CXLKV_SRC_TIER_CRC32C_H_

#include <cstddef>
#include <cstdint>
#include <span>

namespace cxlkv::tier {

class Crc32cState {
 public:
  void Update(const void* data, size_t len);
  void Update(std::span<const std::byte> bytes) { Update(bytes.data(), bytes.size()); }
  // The CRC of everything passed to Update so far (the state may keep being updated).
  uint32_t Finish() const { return ~reg_; }

 private:
  uint32_t reg_ = 0xFFFFFFFFu;  // the register before the final inversion
};

// The CRC-32C of one span.
uint32_t Crc32c(const void* data, size_t len);

}  // namespace cxlkv::tier

#endif  // CXLKV_SRC_TIER_CRC32C_H_
