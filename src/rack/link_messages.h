// The rack link's messages (docs/racks.md, "The rack link"): what one rack's link says to
// another's — the authenticating handshake (link_auth.h), the home racks' directory traffic
// (announce what a rack publishes and evicts; look up who holds a chain) and errors. The
// transport carries whole messages; this file only encodes and decodes them.
//
//   header (16 bytes): magic u16 "RL" | version u8 (1) | type u8 | body length u32 | id u64
//   body: the type's fields, little-endian; strings and lists carry a length first
//
// Everything a peer sends is untrusted: DecodeLinkMessage checks the magic, the version, the
// type, that the body is exactly as long as the header says and its fields fill it exactly,
// every length against its limit before anything is allocated, and names the field that was
// wrong. It never crashes on any input (fuzz/link_fuzz.cc).
#ifndef CXLKV_SRC_RACK_LINK_MESSAGES_H_
#define CXLKV_SRC_RACK_LINK_MESSAGES_H_

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "cxlkv/cache.h"
#include "cxlkv/status.h"

namespace cxlkv::rack {

inline constexpr uint16_t kLinkMagic = 0x4c52;  // "RL" little-endian
inline constexpr uint8_t kLinkVersion = 1;
inline constexpr size_t kLinkHeaderBytes = 16;
inline constexpr uint32_t kLinkMaxBody = 4u << 20;       // largest body any peer may send
inline constexpr size_t kLinkMaxName = 64;               // a rack name (membership.h)
inline constexpr size_t kLinkMaxReason = 1024;           // a refusal or error message
inline constexpr uint32_t kLinkMaxAnnounced = 65536;     // entries in one announce batch
inline constexpr uint32_t kLinkMaxLookupKeys = 4096;     // a chain's keys in one lookup
inline constexpr uint32_t kLinkMaxHolders = 8;           // holders in one lookup answer
inline constexpr uint32_t kLinkMaxFetchKeys = 4096;      // blocks one fetch asks for
inline constexpr size_t kLinkMaxModelId = 95;            // KeyNamespace's limits (cache.h)
inline constexpr size_t kLinkMaxExtraKey = 63;

using Nonce = std::array<uint8_t, 32>;
using Mac = std::array<uint8_t, 32>;  // HMAC-SHA-256

enum class LinkType : uint8_t {
  kHello = 1,      // client → server: who I am, my nonce
  kChallenge = 2,  // server → client: who I am, my nonce, my proof
  kProof = 3,      // client → server: my proof
  kWelcome = 4,    // server → client: authenticated
  kRefused = 5,    // either way: why the handshake failed; the connection ends
  kAnnounce = 6,   // a holder → a home rack: blocks it published or evicted
  kLookup = 7,     // a rack → a home rack: who holds the longest prefix of this chain?
  kLookupAnswer = 8,
  kError = 9,      // the answer to a request that failed
  kFetch = 10,     // a rack → a holder: send me these blocks of this namespace
  kFetchBlock = 11,  // holder → asker: one block (the header of a payload message)
  kFetchEnd = 12,  // holder → asker: the stream's end, and how many blocks it sent
  kAnnounceAck = 13,  // home → holder: an announce batch was applied
};

struct LinkHello {
  std::string rack;
  int64_t life = 0;
  Nonce nonce{};
};
struct LinkChallenge {
  std::string rack;
  int64_t life = 0;
  Nonce nonce{};
  Mac proof{};
};
struct LinkProof {
  Mac proof{};
};
struct LinkWelcome {};
struct LinkRefused {
  std::string reason;
};

enum class AnnounceOp : uint8_t { kPublished = 1, kEvicted = 2 };
struct AnnouncedBlock {
  AnnounceOp op = AnnounceOp::kPublished;
  BlockKey chain;      // the chain's first key: what the home ring hashes
  uint32_t index = 0;  // the block's position in the chain (0: the first)
  BlockKey key;        // the block's own key
  friend bool operator==(const AnnouncedBlock&, const AnnouncedBlock&) = default;
};
struct LinkAnnounce {
  int64_t life = 0;  // the holder's life; entries of an older life are dropped by the home
  std::vector<AnnouncedBlock> blocks;
};
struct LinkLookup {
  std::vector<BlockKey> keys;  // the asker's chain, first key first
};
struct ChainHolder {
  std::string rack;
  int64_t life = 0;
  uint32_t blocks = 0;  // how many leading blocks of the chain it announced
  friend bool operator==(const ChainHolder&, const ChainHolder&) = default;
};
struct LinkLookupAnswer {
  std::vector<ChainHolder> holders;  // longest prefix first; empty: nobody announced it
};
struct LinkError {
  StatusCode code = StatusCode::kInternal;
  std::string message;
};

// A fetch names the namespace whole (model, extra key, layout): the holder serves only blocks
// whose layout is the asker's, so bytes of another shape are never sent as these keys.
struct LinkFetch {
  KeyNamespace ns;
  std::vector<BlockKey> keys;  // the blocks wanted, in chain order
};
struct LinkFetchBlock {
  uint32_t index = 0;     // the block's position in the fetch's keys
  BlockKey key;
  uint64_t bytes = 0;     // the payload's length
  uint64_t checksum = 0;  // XXH3-64 of the payload: the asker verifies before it commits
  friend bool operator==(const LinkFetchBlock&, const LinkFetchBlock&) = default;
};
struct LinkFetchEnd {
  uint32_t blocks = 0;  // how many leading keys the holder sent (it stops at its first miss)
};

struct LinkAnnounceAck {
  uint32_t accepted = 0;   // blocks handed to the directory
  uint32_t not_homed = 0;  // blocks dropped: their chain is not homed at this rack
};

using LinkBody = std::variant<LinkHello, LinkChallenge, LinkProof, LinkWelcome, LinkRefused, LinkAnnounce, LinkLookup,
                              LinkLookupAnswer, LinkError, LinkFetch, LinkFetchBlock, LinkFetchEnd, LinkAnnounceAck>;

struct LinkMessage {
  uint64_t id = 0;  // a request's id; its answer carries the same
  LinkBody body;
  LinkType type() const { return static_cast<LinkType>(body.index() + 1); }
};

// Appends the message's bytes to `out`. Errors: kInvalidArgument when a field is over its limit
// (nothing is appended then).
Status EncodeLinkMessage(const LinkMessage& m, std::vector<uint8_t>& out);

// The whole length (header + body) of the message whose header starts `bytes`, once at least
// kLinkHeaderBytes are there: a stream reader knows how much to wait for. Errors as Decode's
// for the header.
Result<size_t> LinkMessageLength(std::span<const uint8_t> bytes);

// One whole message. Errors: kInvalidArgument (bad magic, type, a length over its limit, a body
// that is not exactly its fields), kVersionMismatch (another protocol version); each message
// names what was wrong.
Result<LinkMessage> DecodeLinkMessage(std::span<const uint8_t> bytes);

}  // namespace cxlkv::rack

#endif  // CXLKV_SRC_RACK_LINK_MESSAGES_H_
