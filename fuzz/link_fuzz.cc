// libFuzzer target: the rack link's message decoder (src/rack/link_messages.h) on any bytes a
// peer can send. It must never crash or read past the input; LinkMessageLength and
// DecodeLinkMessage must agree on the header; every refusal must say why; and every message it
// accepts must be within its limits and encode back to exactly the bytes it came from. An
// accepted hello, challenge or proof also goes through a server's or client's handshake
// (src/rack/link_auth.h), which must refuse it (the fuzzer holds no secret) without crashing.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <vector>

#include "rack/link_auth.h"
#include "rack/link_messages.h"

namespace {

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "link_fuzz: %s\n", what);
  std::abort();
}

void CheckLimits(const cxlkv::rack::LinkMessage& m) {
  using namespace cxlkv::rack;
  if (const auto* a = std::get_if<LinkAnnounce>(&m.body); a && a->blocks.size() > kLinkMaxAnnounced) Fail("announce over its limit");
  if (const auto* l = std::get_if<LinkLookup>(&m.body); l && (l->keys.empty() || l->keys.size() > kLinkMaxLookupKeys)) {
    Fail("lookup key count out of range");
  }
  if (const auto* h = std::get_if<LinkLookupAnswer>(&m.body); h && h->holders.size() > kLinkMaxHolders) Fail("holders over their limit");
  if (const auto* f = std::get_if<LinkFetch>(&m.body);
      f && (f->keys.empty() || f->keys.size() > kLinkMaxFetchKeys || f->ns.model_id.empty() || f->ns.model_id.size() > kLinkMaxModelId ||
            f->ns.extra_key.size() > kLinkMaxExtraKey)) {
    Fail("fetch out of its limits");
  }
}

void CheckHandshake(const cxlkv::rack::LinkMessage& m) {
  using namespace cxlkv::rack;
  static const PoolSecret secret = *PoolSecret::FromBytes(std::vector<uint8_t>(32, 7));
  if (const auto* hello = std::get_if<LinkHello>(&m.body)) {
    auto server = LinkHandshake::Server(secret, "fuzz-server", 1);
    if (!server.OnHello(*hello).ok()) return;
    if (server.OnProof(LinkProof{}).ok() || server.authenticated()) Fail("a server accepted a proof of zeros");
  } else if (const auto* challenge = std::get_if<LinkChallenge>(&m.body)) {
    auto client = LinkHandshake::Client(secret, "fuzz-client", 1);
    if (!client.Hello().ok()) Fail("hello");
    // The challenge's proof was made for another nonce: it must not verify.
    if (client.OnChallenge(*challenge).ok()) Fail("a client accepted a challenge made for another connection");
  } else if (const auto* proof = std::get_if<LinkProof>(&m.body)) {
    auto server = LinkHandshake::Server(secret, "fuzz-server", 1);
    if (server.OnProof(*proof).ok()) Fail("a server accepted a proof before any hello");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cxlkv::rack;
  const std::span<const uint8_t> in(data, size);
  auto length = LinkMessageLength(in);
  auto m = DecodeLinkMessage(in);
  if (!length.ok() && m.ok()) Fail("decoded a message whose header LinkMessageLength refuses");
  if (!m.ok()) {
    if (m.status().message().empty()) Fail("a refusal without a reason");
    return 0;
  }
  if (*length != size) Fail("decoded a message of another length than its header says");
  CheckLimits(*m);
  std::vector<uint8_t> again;
  if (!EncodeLinkMessage(*m, again).ok()) Fail("an accepted message does not encode");
  if (again.size() != size || !std::equal(again.begin(), again.end(), data)) Fail("a message re-encodes differently");
  CheckHandshake(*m);
  return 0;
}
