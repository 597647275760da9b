#include "rack/link_messages.h"

#include <cstring>

namespace cxlkv::rack {
namespace {

constexpr const char* kTypeNames[] = {"hello", "challenge", "proof", "welcome", "refused",
                                      "announce", "lookup", "lookup answer", "error",
                                      "fetch", "fetch block", "fetch end", "announce ack"};
constexpr size_t kTypes = sizeof kTypeNames / sizeof kTypeNames[0];
static_assert(kTypes == std::variant_size_v<LinkBody>);
// The smallest encoding of one list element: what a count is checked against before a reserve.
constexpr size_t kAnnouncedBytes = 1 + 16 + 4 + 16;
constexpr size_t kKeyBytes = 16;
constexpr size_t kHolderMinBytes = 1 + 8 + 4;
constexpr uint8_t kMaxDtype = static_cast<uint8_t>(KvDtype::kFp32);

class Writer {
 public:
  explicit Writer(std::vector<uint8_t>& out) : out_(out) {}
  template <typename T>
  void Int(T v) {
    uint8_t b[sizeof(T)];
    std::memcpy(b, &v, sizeof v);  // little-endian hosts only (x86-64, arm64)
    out_.insert(out_.end(), b, b + sizeof b);
  }
  void Bytes(std::span<const uint8_t> b) { out_.insert(out_.end(), b.begin(), b.end()); }
  void Key(const BlockKey& k) {
    Int(k.lo);
    Int(k.hi);
  }
  void Str8(const std::string& s) {  // callers checked s.size() <= 255
    Int(static_cast<uint8_t>(s.size()));
    Bytes({reinterpret_cast<const uint8_t*>(s.data()), s.size()});
  }
  void Str16(const std::string& s) {
    Int(static_cast<uint16_t>(s.size()));
    Bytes({reinterpret_cast<const uint8_t*>(s.data()), s.size()});
  }

 private:
  std::vector<uint8_t>& out_;
};

// Bounds-checked reads of an untrusted body; the first failure names its field and sticks.
class Reader {
 public:
  Reader(std::span<const uint8_t> in, const char* type) : in_(in), type_(type) {}
  template <typename T>
  T Int(const char* field) {
    T v{};
    if (Need(sizeof v, field)) std::memcpy(&v, in_.data() + pos_, sizeof v), pos_ += sizeof v;
    return v;
  }
  template <size_t N>
  std::array<uint8_t, N> Array(const char* field) {
    std::array<uint8_t, N> a{};
    if (Need(N, field)) std::memcpy(a.data(), in_.data() + pos_, N), pos_ += N;
    return a;
  }
  BlockKey Key(const char* field) {
    BlockKey k;
    k.lo = Int<uint64_t>(field);
    k.hi = Int<uint64_t>(field);
    return k;
  }
  std::string Str(size_t length, size_t max, const char* field) {
    if (length > max) return Fail(std::string(field) + " of " + std::to_string(length) + " bytes is over its limit of " + std::to_string(max)), "";
    if (!Need(length, field)) return "";
    std::string s(reinterpret_cast<const char*>(in_.data() + pos_), length);
    pos_ += length;
    return s;
  }
  std::string Str8(size_t max, const char* field) { return Str(Int<uint8_t>(field), max, field); }
  std::string Str16(size_t max, const char* field) { return Str(Int<uint16_t>(field), max, field); }
  // A list count: within its limit and within what the rest of the body can hold.
  uint32_t Count(uint32_t max, size_t min_element_bytes, const char* field) {
    const uint32_t n = Int<uint32_t>(field);
    if (!ok()) return 0;
    if (n > max) return Fail(std::string(field) + " count " + std::to_string(n) + " is over its limit of " + std::to_string(max)), 0;
    if (size_t{n} * min_element_bytes > in_.size() - pos_) return Fail(std::string(field) + " count " + std::to_string(n) + " is more than the body holds"), 0;
    return n;
  }
  bool ok() const { return error_.empty(); }
  Status Finish() {
    if (ok() && pos_ != in_.size()) Fail(std::to_string(in_.size() - pos_) + " bytes after the last field");
    if (ok()) return Status::Ok();
    return InvalidArgument(std::string("malformed rack-link ") + type_ + ": " + error_);
  }
  void Fail(const std::string& why) {
    if (error_.empty()) error_ = why;
  }

 private:
  bool Need(size_t n, const char* field) {
    if (!ok()) return false;
    if (in_.size() - pos_ < n) {
      Fail(std::string("cut short in ") + field);
      return false;
    }
    return true;
  }
  std::span<const uint8_t> in_;
  size_t pos_ = 0;
  const char* type_;
  std::string error_;
};

Status CheckName(const std::string& rack, const char* what) {
  if (rack.empty() || rack.size() > kLinkMaxName) {
    return InvalidArgument(std::string(what) + " '" + rack + "' must be 1 to " + std::to_string(kLinkMaxName) + " bytes");
  }
  return Status::Ok();
}

Status EncodeBody(const LinkBody& body, Writer& w) {
  return std::visit(
      [&](const auto& b) -> Status {
        using T = std::decay_t<decltype(b)>;
        if constexpr (std::is_same_v<T, LinkHello>) {
          CXLKV_RETURN_IF_ERROR(CheckName(b.rack, "hello rack"));
          w.Str8(b.rack), w.Int(b.life), w.Bytes(b.nonce);
        } else if constexpr (std::is_same_v<T, LinkChallenge>) {
          CXLKV_RETURN_IF_ERROR(CheckName(b.rack, "challenge rack"));
          w.Str8(b.rack), w.Int(b.life), w.Bytes(b.nonce), w.Bytes(b.proof);
        } else if constexpr (std::is_same_v<T, LinkProof>) {
          w.Bytes(b.proof);
        } else if constexpr (std::is_same_v<T, LinkWelcome>) {
        } else if constexpr (std::is_same_v<T, LinkRefused>) {
          w.Str16(b.reason.substr(0, kLinkMaxReason));
        } else if constexpr (std::is_same_v<T, LinkAnnounce>) {
          if (b.blocks.size() > kLinkMaxAnnounced) return InvalidArgument("an announce batch holds at most " + std::to_string(kLinkMaxAnnounced) + " blocks");
          w.Int(b.life), w.Int(static_cast<uint32_t>(b.blocks.size()));
          for (const AnnouncedBlock& a : b.blocks) w.Int(static_cast<uint8_t>(a.op)), w.Key(a.chain), w.Int(a.index), w.Key(a.key);
        } else if constexpr (std::is_same_v<T, LinkLookup>) {
          if (b.keys.empty() || b.keys.size() > kLinkMaxLookupKeys) return InvalidArgument("a lookup carries 1 to " + std::to_string(kLinkMaxLookupKeys) + " keys");
          w.Int(static_cast<uint32_t>(b.keys.size()));
          for (const BlockKey& k : b.keys) w.Key(k);
        } else if constexpr (std::is_same_v<T, LinkLookupAnswer>) {
          if (b.holders.size() > kLinkMaxHolders) return InvalidArgument("a lookup answer names at most " + std::to_string(kLinkMaxHolders) + " holders");
          w.Int(static_cast<uint32_t>(b.holders.size()));
          for (const ChainHolder& h : b.holders) {
            CXLKV_RETURN_IF_ERROR(CheckName(h.rack, "holder rack"));
            w.Str8(h.rack), w.Int(h.life), w.Int(h.blocks);
          }
        } else if constexpr (std::is_same_v<T, LinkError>) {
          w.Int(static_cast<uint8_t>(b.code)), w.Str16(b.message.substr(0, kLinkMaxReason));
        } else if constexpr (std::is_same_v<T, LinkFetch>) {
          if (b.ns.model_id.empty() || b.ns.model_id.size() > kLinkMaxModelId || b.ns.extra_key.size() > kLinkMaxExtraKey) {
            return InvalidArgument("a fetch's model id must be 1 to 95 bytes, its extra key at most 63");
          }
          if (b.keys.empty() || b.keys.size() > kLinkMaxFetchKeys) return InvalidArgument("a fetch asks for 1 to " + std::to_string(kLinkMaxFetchKeys) + " blocks");
          const KvLayoutSignature& l = b.ns.layout;
          w.Str8(b.ns.model_id), w.Str8(b.ns.extra_key), w.Int(static_cast<uint8_t>(l.dtype));
          for (uint32_t v : {l.num_layers, l.num_kv_heads, l.head_size, l.block_size, l.tp_rank, l.tp_size, l.pp_stage, l.kv_parts, l.block_format}) w.Int(v);
          w.Int(static_cast<uint32_t>(b.keys.size()));
          for (const BlockKey& k : b.keys) w.Key(k);
        } else if constexpr (std::is_same_v<T, LinkFetchBlock>) {
          w.Int(b.index), w.Key(b.key), w.Int(b.bytes), w.Int(b.checksum);
        } else if constexpr (std::is_same_v<T, LinkFetchEnd>) {
          w.Int(b.blocks);
        } else if constexpr (std::is_same_v<T, LinkAnnounceAck>) {
          w.Int(b.accepted), w.Int(b.not_homed);
        }
        return Status::Ok();
      },
      body);
}

Result<LinkBody> DecodeBody(LinkType type, std::span<const uint8_t> in) {
  Reader r(in, kTypeNames[static_cast<size_t>(type) - 1]);
  LinkBody body;
  switch (type) {
    case LinkType::kHello: {
      LinkHello b;
      b.rack = r.Str8(kLinkMaxName, "rack"), b.life = r.Int<int64_t>("life"), b.nonce = r.Array<32>("nonce");
      if (r.ok() && b.rack.empty()) r.Fail("an empty rack name");
      body = std::move(b);
      break;
    }
    case LinkType::kChallenge: {
      LinkChallenge b;
      b.rack = r.Str8(kLinkMaxName, "rack"), b.life = r.Int<int64_t>("life"), b.nonce = r.Array<32>("nonce");
      b.proof = r.Array<32>("proof");
      if (r.ok() && b.rack.empty()) r.Fail("an empty rack name");
      body = std::move(b);
      break;
    }
    case LinkType::kProof:
      body = LinkProof{r.Array<32>("proof")};
      break;
    case LinkType::kWelcome:
      body = LinkWelcome{};
      break;
    case LinkType::kRefused:
      body = LinkRefused{r.Str16(kLinkMaxReason, "reason")};
      break;
    case LinkType::kAnnounce: {
      LinkAnnounce b;
      b.life = r.Int<int64_t>("life");
      const uint32_t n = r.Count(kLinkMaxAnnounced, kAnnouncedBytes, "blocks");
      b.blocks.reserve(n);
      for (uint32_t i = 0; i < n && r.ok(); ++i) {
        AnnouncedBlock a;
        const auto op = r.Int<uint8_t>("op");
        if (r.ok() && op != static_cast<uint8_t>(AnnounceOp::kPublished) && op != static_cast<uint8_t>(AnnounceOp::kEvicted)) {
          r.Fail("block " + std::to_string(i) + " has op " + std::to_string(op) + " (1 published, 2 evicted)");
        }
        a.op = static_cast<AnnounceOp>(op);
        a.chain = r.Key("chain"), a.index = r.Int<uint32_t>("index"), a.key = r.Key("key");
        b.blocks.push_back(a);
      }
      body = std::move(b);
      break;
    }
    case LinkType::kLookup: {
      LinkLookup b;
      const uint32_t n = r.Count(kLinkMaxLookupKeys, kKeyBytes, "keys");
      if (r.ok() && n == 0) r.Fail("a lookup of no keys");
      b.keys.reserve(n);
      for (uint32_t i = 0; i < n && r.ok(); ++i) b.keys.push_back(r.Key("key"));
      body = std::move(b);
      break;
    }
    case LinkType::kLookupAnswer: {
      LinkLookupAnswer b;
      const uint32_t n = r.Count(kLinkMaxHolders, kHolderMinBytes, "holders");
      for (uint32_t i = 0; i < n && r.ok(); ++i) {
        ChainHolder h;
        h.rack = r.Str8(kLinkMaxName, "holder rack"), h.life = r.Int<int64_t>("holder life"), h.blocks = r.Int<uint32_t>("holder blocks");
        if (r.ok() && h.rack.empty()) r.Fail("a holder with an empty rack name");
        b.holders.push_back(std::move(h));
      }
      body = std::move(b);
      break;
    }
    case LinkType::kError: {
      LinkError b;
      const auto code = r.Int<uint8_t>("code");
      if (r.ok() && (code == 0 || code > static_cast<uint8_t>(StatusCode::kUnavailable))) {
        r.Fail("error code " + std::to_string(code) + " is no status");
      }
      b.code = static_cast<StatusCode>(code);
      b.message = r.Str16(kLinkMaxReason, "message");
      body = std::move(b);
      break;
    }
    case LinkType::kFetch: {
      LinkFetch b;
      b.ns.model_id = r.Str8(kLinkMaxModelId, "model id"), b.ns.extra_key = r.Str8(kLinkMaxExtraKey, "extra key");
      if (r.ok() && b.ns.model_id.empty()) r.Fail("an empty model id");
      const auto dtype = r.Int<uint8_t>("dtype");
      if (r.ok() && dtype > kMaxDtype) r.Fail("dtype " + std::to_string(dtype) + " is no KV dtype");
      KvLayoutSignature& l = b.ns.layout;
      l.dtype = static_cast<KvDtype>(dtype);
      for (uint32_t* v : {&l.num_layers, &l.num_kv_heads, &l.head_size, &l.block_size, &l.tp_rank, &l.tp_size, &l.pp_stage, &l.kv_parts, &l.block_format}) {
        *v = r.Int<uint32_t>("layout");
      }
      const uint32_t n = r.Count(kLinkMaxFetchKeys, kKeyBytes, "keys");
      if (r.ok() && n == 0) r.Fail("a fetch of no keys");
      b.keys.reserve(n);
      for (uint32_t i = 0; i < n && r.ok(); ++i) b.keys.push_back(r.Key("key"));
      body = std::move(b);
      break;
    }
    case LinkType::kFetchBlock: {
      LinkFetchBlock b;
      b.index = r.Int<uint32_t>("index"), b.key = r.Key("key"), b.bytes = r.Int<uint64_t>("bytes"), b.checksum = r.Int<uint64_t>("checksum");
      body = b;
      break;
    }
    case LinkType::kFetchEnd:
      body = LinkFetchEnd{r.Int<uint32_t>("blocks")};
      break;
    case LinkType::kAnnounceAck: {
      LinkAnnounceAck b;
      b.accepted = r.Int<uint32_t>("accepted"), b.not_homed = r.Int<uint32_t>("not homed");
      body = b;
      break;
    }
  }
  CXLKV_RETURN_IF_ERROR(r.Finish());
  return body;
}

}  // namespace

Status EncodeLinkMessage(const LinkMessage& m, std::vector<uint8_t>& out) {
  std::vector<uint8_t> body;
  Writer bw(body);
  CXLKV_RETURN_IF_ERROR(EncodeBody(m.body, bw));
  if (body.size() > kLinkMaxBody) return InvalidArgument("a rack-link message body of " + std::to_string(body.size()) + " bytes is over " + std::to_string(kLinkMaxBody));
  Writer w(out);
  w.Int(kLinkMagic), w.Int(kLinkVersion), w.Int(static_cast<uint8_t>(m.type())), w.Int(static_cast<uint32_t>(body.size()));
  w.Int(m.id);
  w.Bytes(body);
  return Status::Ok();
}

Result<size_t> LinkMessageLength(std::span<const uint8_t> bytes) {
  if (bytes.size() < kLinkHeaderBytes) return InvalidArgument("a rack-link header is 16 bytes; got " + std::to_string(bytes.size()));
  Reader r(bytes.first(kLinkHeaderBytes), "header");
  const auto magic = r.Int<uint16_t>("magic");
  const auto version = r.Int<uint8_t>("version");
  const auto type = r.Int<uint8_t>("type");
  const auto length = r.Int<uint32_t>("length");
  if (magic != kLinkMagic) return InvalidArgument("not a rack-link message (bad magic): is the peer a cxlkv rack link?");
  if (version != kLinkVersion) {
    return Status(StatusCode::kVersionMismatch, "the peer speaks rack-link version " + std::to_string(version) +
                                                    ", this link " + std::to_string(kLinkVersion) + ": run the same cxlkv release on both racks");
  }
  if (type == 0 || type > kTypes) return InvalidArgument("unknown rack-link message type " + std::to_string(type));
  if (length > kLinkMaxBody) return InvalidArgument("a rack-link body of " + std::to_string(length) + " bytes is over " + std::to_string(kLinkMaxBody));
  return kLinkHeaderBytes + length;
}

Result<LinkMessage> DecodeLinkMessage(std::span<const uint8_t> bytes) {
  CXLKV_ASSIGN_OR_RETURN(const size_t whole, LinkMessageLength(bytes));
  if (bytes.size() != whole) {
    return InvalidArgument("a rack-link message of " + std::to_string(bytes.size()) + " bytes whose header says " + std::to_string(whole));
  }
  LinkMessage m;
  std::memcpy(&m.id, bytes.data() + 8, sizeof m.id);
  CXLKV_ASSIGN_OR_RETURN(m.body, DecodeBody(static_cast<LinkType>(bytes[3]), bytes.subspan(kLinkHeaderBytes)));
  return m;
}

}  // namespace cxlkv::rack
