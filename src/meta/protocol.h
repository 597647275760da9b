// The metadata service's requests (central mode, Beluga §6.2; docs/metadata.md): one table of
// opcodes and one binary encoding shared by the service (service.cc) and its client
// (client.cc). Every request carries the caller's writer word (node, process slot, life): the
// service acts for that life, and refuses it once the life is over.
//
// Encoding: little-endian fixed-width fields; a key is 16 bytes (lo, hi). Everything a service
// reads is untrusted (another process wrote it): WireReader fails on a short or over-long body
// instead of reading past it.
#ifndef CXLKV_SRC_META_PROTOCOL_H_
#define CXLKV_SRC_META_PROTOCOL_H_

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "cxlkv/cache.h"
#include "rpc/area.h"

namespace cxlkv::meta {

inline constexpr char kMetaService[] = "meta";

enum MetaOp : uint32_t {
  kRegister = 1,       // KeyNamespace -> NamespaceHandle
  kLookupPin = 2,      // writer, handle, keys -> hit count, pins (pins taken: not idempotent)
  kExists = 3,         // writer, handle, keys -> hit count (nothing written)
  kRelease = 4,        // writer, slots of the pins (u32 each) -> nothing
  kReserve = 5,        // writer, handle, bytes, keys -> per-key outcome, then its distinct messages
  kCommit = 6,         // writer, reservations -> status
  kAbort = 7,          // writer, reservations -> status
  kPeek = 8,           // writer, handle, keys -> per-key state
  kEvictKeys = 9,      // writer, handle, keys -> evicted count
  kEvictAll = 10,      // writer -> evicted count
  kReclaimWriter = 11, // writer, dead process's life and slot (same node) -> entries dropped
  kStats = 12,         // writer -> used bytes, capacity, entries reclaimed by sweeps
  kEvictNamespace = 13,  // writer, handle -> evicted count
};

// 16 processes per node with 4 requests in flight each; 2 KiB requests (about 120 keys) and
// 4 KiB answers (about 100 pins): long prompts go in several requests.
inline rpc::RpcGeometry MetaGeometry() {
  return {.clients_per_node = 16, .depth = 4, .request_bytes = 2048, .response_bytes = 4096};
}

// Fixed per-item sizes of the encoding (the client sizes its batches with them).
inline constexpr size_t kKeyBytes = 16;
inline constexpr size_t kPinBytes = 40;          // slot, tier, generation, offset, bytes, checksum
inline constexpr size_t kReleaseBytes = 4;       // a pin's slot: all a release needs (the pin table is the caller's)
inline constexpr size_t kReservationBytes = 32;  // slot, pad, generation, offset, bytes
inline constexpr size_t kOutcomeBytes = 48;      // outcome, code, message, pad, writer node, reservation, writer life
inline constexpr size_t kPeekBytes = 16;         // state, live, pad, writer node, writer life
inline constexpr size_t kHandleBytes = 32;       // id, block size, block bytes, seed
inline constexpr size_t kMaxMessageBytes = 200;  // an error message in a reserve answer
inline constexpr uint8_t kNoMessage = 0xff;       // a reserve outcome whose message did not fit

class WireWriter {
 public:
  explicit WireWriter(std::span<uint8_t> out) : out_(out) {}
  template <typename T>
  void Put(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    Bytes(&v, sizeof v);
  }
  void Bytes(const void* p, size_t n) {
    if (n == 0) return;  // an empty vector's data() may be null, which memcpy must not see
    if (n > out_.size() - at_) {
      overflow_ = true;
      return;
    }
    std::memcpy(out_.data() + at_, p, n);
    at_ += n;
  }
  void Key(const BlockKey& k) {
    Put(k.lo);
    Put(k.hi);
  }
  void Text(std::string_view s, size_t max) {  // u16 length, then the bytes (cut at `max`)
    const size_t n = std::min(s.size(), max);
    Put(static_cast<uint16_t>(n));
    Bytes(s.data(), n);
  }
  void Handle(const NamespaceHandle& h);
  size_t size() const { return at_; }
  bool overflow() const { return overflow_; }

 private:
  std::span<uint8_t> out_;
  size_t at_ = 0;
  bool overflow_ = false;
};

class WireReader {
 public:
  explicit WireReader(std::span<const uint8_t> in) : in_(in) {}
  template <typename T>
  bool Get(T* v) {
    static_assert(std::is_trivially_copyable_v<T>);
    return Bytes(v, sizeof *v);
  }
  bool Bytes(void* p, size_t n) {
    if (n == 0) return true;  // an empty vector's data() may be null, which memcpy must not see
    if (n > in_.size() - at_) return false;
    std::memcpy(p, in_.data() + at_, n);
    at_ += n;
    return true;
  }
  bool Key(BlockKey* k) { return Get(&k->lo) && Get(&k->hi); }
  bool Text(std::string* s, size_t max);
  bool Handle(NamespaceHandle* h);
  // A count of `item_bytes`-sized items that must fill exactly the rest of the body.
  bool Count(uint32_t* n, size_t item_bytes) { return Get(n) && uint64_t{*n} * item_bytes == remaining(); }
  size_t remaining() const { return in_.size() - at_; }
  bool done() const { return at_ == in_.size(); }

 private:
  std::span<const uint8_t> in_;
  size_t at_ = 0;
};

// Whole-message encodings shared by both sides.
void PutPin(WireWriter& w, const BlockPin& p);
bool GetPin(WireReader& r, BlockPin* p);
void PutReservation(WireWriter& w, const Reservation& r);
bool GetReservation(WireReader& r, Reservation* out);
// A key batch: u32 count, then the keys; on reading, the count must fill the rest of the body.
void PutKeys(WireWriter& w, std::span<const BlockKey> keys);
bool GetKeys(WireReader& r, std::vector<BlockKey>* keys);
void PutNamespace(WireWriter& w, const KeyNamespace& ns);
bool GetNamespace(WireReader& r, KeyNamespace* ns);

}  // namespace cxlkv::meta

#endif  // CXLKV_SRC_META_PROTOCOL_H_
