#include "tier/slot_format.h"

#include <bit>
#include <cstddef>
#include <cstring>
#include <type_traits>

#include "tier/crc32c.h"

namespace cxlkv::tier {

namespace {

// The header as stored (little-endian hosts only: x86-64 and arm64, the platforms cxlkv runs on).
struct SlotHeader {
  uint64_t magic;
  uint16_t version;
  uint16_t header_bytes;
  uint32_t flags;
  uint64_t key_lo;
  uint64_t key_hi;
  uint64_t ns;
  uint64_t generation;
  uint32_t payload_bytes;
  uint32_t reserved0;
  uint32_t crc;
  uint32_t reserved1;
};
static_assert(std::is_standard_layout_v<SlotHeader>);
static_assert(sizeof(SlotHeader) == kSlotHeaderBytes);
static_assert(offsetof(SlotHeader, crc) == 56);
static_assert(std::endian::native == std::endian::little, "the slot format is little-endian");

constexpr size_t kCrcCoveredHeaderBytes = offsetof(SlotHeader, crc);

uint32_t SlotCrc(const std::byte* slot, uint32_t payload_bytes) {
  Crc32cState s;
  s.Update(slot, kCrcCoveredHeaderBytes);
  s.Update(slot + kSlotHeaderBytes, payload_bytes);
  return s.Finish();
}

}  // namespace

std::string_view SlotVerdictName(SlotVerdict v) {
  switch (v) {
    case SlotVerdict::kValid: return "valid";
    case SlotVerdict::kEmpty: return "empty";
    case SlotVerdict::kCorrupt: return "corrupt";
    case SlotVerdict::kStale: return "stale";
  }
  return "unknown";
}

void SealSlot(std::byte* slot, const SlotTag& tag, uint32_t payload_bytes) {
  SlotHeader h{};
  h.magic = kSlotMagic;
  h.version = kSlotFormatVersion;
  h.header_bytes = kSlotHeaderBytes;
  h.key_lo = tag.key.lo;
  h.key_hi = tag.key.hi;
  h.ns = tag.ns;
  h.generation = tag.generation;
  h.payload_bytes = payload_bytes;
  std::memcpy(slot, &h, sizeof h);
  h.crc = SlotCrc(slot, payload_bytes);
  std::memcpy(slot + offsetof(SlotHeader, crc), &h.crc, sizeof h.crc);
}

SlotVerdict CheckSlot(const std::byte* slot, size_t readable, uint64_t payload_limit, const SlotTag& expect,
                      bool verify_crc, uint32_t* payload_bytes) {
  if (readable < kSlotHeaderBytes) return SlotVerdict::kCorrupt;
  SlotHeader h;
  std::memcpy(&h, slot, sizeof h);  // copy: the image may be unaligned and is untrusted
  if (h.magic == 0) return SlotVerdict::kEmpty;
  if (h.magic != kSlotMagic || h.version != kSlotFormatVersion || h.header_bytes != kSlotHeaderBytes ||
      h.flags != 0 || h.reserved1 != 0) {  // reserved1 lies outside the CRC: must be zero
    return SlotVerdict::kCorrupt;
  }
  // Bounds before use: the claimed length must fit what was read and what the caller can take.
  if (h.payload_bytes > payload_limit || h.payload_bytes > readable - kSlotHeaderBytes) {
    return SlotVerdict::kCorrupt;
  }
  if (verify_crc && SlotCrc(slot, h.payload_bytes) != h.crc) return SlotVerdict::kCorrupt;
  if (h.key_lo != expect.key.lo || h.key_hi != expect.key.hi || h.ns != expect.ns ||
      h.generation != expect.generation) {
    return SlotVerdict::kStale;
  }
  *payload_bytes = h.payload_bytes;
  return SlotVerdict::kValid;
}

}  // namespace cxlkv::tier
