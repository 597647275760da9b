// Offset pointers: the only way one shared structure refers to another (DESIGN.md rule 2).
//
// Virtual addresses differ per process and per host, so nothing in the region stores a pointer.
// An Offset<T> is 64 bits: bits [55:0] are a byte offset from the start of one region, bits
// [63:56] name which region of an interleaved pool (0 for a single-region pool). The raw value 0
// is null: byte 0 of region 0 is the superblock, never an object. Conversion to a pointer needs
// the mapping's base and is bounds-checked in every build (ToPtr below).
#ifndef CXLKV_SRC_REGION_OFFSET_H_
#define CXLKV_SRC_REGION_OFFSET_H_

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>

namespace cxlkv::region {

inline constexpr int kOffsetRegionShift = 56;
inline constexpr uint64_t kOffsetByteMask = (uint64_t{1} << kOffsetRegionShift) - 1;
inline constexpr uint32_t kMaxPoolRegions = 256;

template <typename T>
class Offset {
 public:
  constexpr Offset() = default;
  constexpr explicit Offset(uint64_t raw) : raw_(raw) {}
  static constexpr Offset Make(uint32_t region_index, uint64_t byte_offset) {
    return Offset((uint64_t{region_index} << kOffsetRegionShift) | (byte_offset & kOffsetByteMask));
  }

  constexpr uint64_t raw() const { return raw_; }
  constexpr bool is_null() const { return raw_ == 0; }
  constexpr explicit operator bool() const { return raw_ != 0; }
  constexpr uint32_t region_index() const { return static_cast<uint32_t>(raw_ >> kOffsetRegionShift); }
  constexpr uint64_t byte_offset() const { return raw_ & kOffsetByteMask; }

  // An offset `bytes` further into the same region.
  template <typename U = T>
  constexpr Offset<U> Plus(uint64_t bytes) const { return Offset<U>(raw_ + bytes); }
  template <typename U>
  constexpr Offset<U> As() const { return Offset<U>(raw_); }

  friend constexpr bool operator==(Offset a, Offset b) { return a.raw_ == b.raw_; }

 private:
  uint64_t raw_ = 0;
};

// Offsets are stored in shared memory: they must stay one plain word.
static_assert(sizeof(Offset<int>) == 8);
static_assert(std::is_standard_layout_v<Offset<int>>);
static_assert(std::is_trivially_copyable_v<Offset<int>>);

// Converts `off` to a pointer into the mapping [base, base+size) of its region. In every build
// (offsets are read from shared memory) an offset whose object would not fit in the
// mapping aborts with the offending value: following it would scribble over someone's data.
// Code that decodes an offset from the region checks it first and returns kCorrupted.
template <typename T>
T* ToPtr(uint8_t* base, uint64_t size, Offset<T> off) {
  if (off.is_null() || off.byte_offset() > size || sizeof(T) > size - off.byte_offset()) [[unlikely]] {
    std::fprintf(stderr, "cxlkv: offset 0x%llx out of bounds of a %llu-byte region\n",
                 static_cast<unsigned long long>(off.raw()), static_cast<unsigned long long>(size));
    std::abort();
  }
  return reinterpret_cast<T*>(base + off.byte_offset());
}

}  // namespace cxlkv::region

#endif  // CXLKV_SRC_REGION_OFFSET_H_
