// The format of one slot, the same on every capacity device (DRAM and SSD), so every device
// validates a read the same way (docs/tiers.md, "Slot format").
//
//   offset  size  field
//   0       8     magic "CXKVSLT1" (little-endian u64 kSlotMagic)
//   8       2     format version (kSlotFormatVersion)
//   10      2     header bytes (64)
//   12      4     flags (0)
//   16      16    block key (BlockKey lo, hi)
//   32      8     namespace (the tier store writes its fingerprint: namespace_book.h)
//   40      8     generation (bumped by the owner each time the slot is reused)
//   48      4     payload bytes
//   52      4     reserved (0)
//   56      4     CRC-32C over bytes [0, 56) of the header and the payload
//   60      4     reserved (0)
//   64      ...   payload, then zero padding to the I/O unit
//
// Everything read from a device is untrusted: the header's lengths are checked against the slot
// and the destination before they are used, and a slot is data only when magic, version, sizes
// and CRC hold AND key, namespace and generation are the ones the caller expects. Anything else
// is a miss — never data: an empty slot, a corrupt one (a flipped bit anywhere in header or
// payload), a torn one (the CRC covers the payload, so a write cut short fails it), or a reused
// one (a valid slot of another key or an older/newer generation).
// Thread-safety: pure functions over caller-owned memory.
#ifndef CXLKV_SRC_TIER_SLOT_FORMAT_H_
#define CXLKV_SRC_TIER_SLOT_FORMAT_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "cxlkv/cache.h"

namespace cxlkv::tier {

inline constexpr uint64_t kSlotMagic = 0x31544C53564B5843ull;  // "CXKVSLT1"
inline constexpr uint16_t kSlotFormatVersion = 1;
inline constexpr uint32_t kSlotHeaderBytes = 64;

// Who a slot holds: the identity the caller checks on every read.
struct SlotTag {
  BlockKey key;             // the block key (128 bits, as the prefix cache names blocks)
  uint64_t ns = 0;          // namespace (the cache's namespace id, or a hash of it)
  uint64_t generation = 0;  // the writer's count for this slot: a reused slot never validates
                            // for an older owner
  friend bool operator==(const SlotTag&, const SlotTag&) = default;
};

// How a read of one slot turned out.
enum class SlotVerdict : uint8_t {
  kValid = 0,   // the expected block: its payload is returned
  kEmpty,       // never written (no magic): a miss
  kCorrupt,     // bad magic/version/length or CRC mismatch (bit flip, torn write): a miss
  kStale,       // a valid slot of another key, namespace or generation (reused): a miss
};
std::string_view SlotVerdictName(SlotVerdict v);

// Writes the header of a slot whose payload (`payload_bytes`) already lies at
// slot + kSlotHeaderBytes, computing the CRC over header and payload.
void SealSlot(std::byte* slot, const SlotTag& tag, uint32_t payload_bytes);

// Validates the slot image in [slot, slot + readable) against `expect`. `payload_limit` bounds
// the payload length the header may claim (the slot's capacity, or the destination's size,
// whichever is smaller). On kValid sets *payload_bytes. verify_crc=false skips only the CRC
// (benchmarks measure its cost with it); never turn it off in serving.
SlotVerdict CheckSlot(const std::byte* slot, size_t readable, uint64_t payload_limit, const SlotTag& expect,
                      bool verify_crc, uint32_t* payload_bytes);

}  // namespace cxlkv::tier

#endif  // CXLKV_SRC_TIER_SLOT_FORMAT_H_
