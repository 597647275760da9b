// The rack link's messages and handshake (rack/link_messages.h, rack/link_auth.h): every message
// round-trips exactly; malformed ones are refused naming the field, whatever the cut; only a
// peer that holds the pool secret gets through, and a replayed or reflected proof does not.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "rack/link_auth.h"
#include "rack/link_messages.h"

namespace cxlkv::rack {
namespace {

std::vector<uint8_t> Encode(const LinkMessage& m) {
  std::vector<uint8_t> out;
  const Status s = EncodeLinkMessage(m, out);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return out;
}

// One message of every type, with every field away from zero.
std::vector<LinkMessage> OneOfEach() {
  Nonce n{};
  Mac mac{};
  for (size_t i = 0; i < n.size(); ++i) n[i] = static_cast<uint8_t>(i + 1), mac[i] = static_cast<uint8_t>(200 - i);
  LinkAnnounce announce{7, {}};
  for (uint32_t i = 0; i < 300; ++i) {
    announce.blocks.push_back({i % 3 == 0 ? AnnounceOp::kEvicted : AnnounceOp::kPublished, BlockKey{11, 12}, i,
                               BlockKey{1000 + i, 2000 + i}});
  }
  LinkLookup lookup;
  for (uint64_t i = 0; i < 64; ++i) lookup.keys.push_back({i * 3, i * 5 + 1});
  return {
      {1, LinkHello{"rack-a", 3, n}},
      {2, LinkChallenge{"rack-b", 9, n, mac}},
      {3, LinkProof{mac}},
      {4, LinkWelcome{}},
      {5, LinkRefused{"no"}},
      {6, announce},
      {7, lookup},
      {8, LinkLookupAnswer{{{"rack-c", 4, 12}, {"rack-d", 1, 3}}}},
      {9, LinkError{StatusCode::kNotFound, "evicted since"}},
      {10, LinkFetch{KeyNamespace{"llama-3-8b", KvLayoutSignature{KvDtype::kBf16, 32, 8, 128, 16, 1, 2, 0, 2, 1}, "lora-7"},
                     {{1, 2}, {3, 4}, {5, 6}}}},
      {11, LinkFetchBlock{2, BlockKey{5, 6}, 1u << 21, 0xfeedfacecafebeefull}},
      {12, LinkFetchEnd{3}},
      {13, LinkAnnounceAck{250, 50}},
  };
}

TEST(LinkMessages, EveryTypeRoundTripsExactly) {
  for (const LinkMessage& m : OneOfEach()) {
    SCOPED_TRACE("type " + std::to_string(static_cast<int>(m.type())));
    const std::vector<uint8_t> bytes = Encode(m);
    auto length = LinkMessageLength(bytes);
    ASSERT_TRUE(length.ok()) << length.status().ToString();
    EXPECT_EQ(*length, bytes.size());
    auto back = DecodeLinkMessage(bytes);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->id, m.id);
    ASSERT_EQ(back->type(), m.type());
    EXPECT_EQ(Encode(*back), bytes) << "decoding lost or changed a field";
  }
  const auto a = std::get<LinkAnnounce>(DecodeLinkMessage(Encode(OneOfEach()[5]))->body);
  EXPECT_EQ(a.blocks, std::get<LinkAnnounce>(OneOfEach()[5].body).blocks);
  const auto h = std::get<LinkLookupAnswer>(DecodeLinkMessage(Encode(OneOfEach()[7]))->body);
  EXPECT_EQ(h.holders, std::get<LinkLookupAnswer>(OneOfEach()[7].body).holders);
  const auto f = std::get<LinkFetch>(DecodeLinkMessage(Encode(OneOfEach()[9]))->body);
  EXPECT_EQ(f.ns.model_id, "llama-3-8b");
  EXPECT_EQ(f.ns.extra_key, "lora-7");
  EXPECT_EQ(f.ns.layout.dtype, KvDtype::kBf16);
  EXPECT_EQ(f.ns.layout.num_layers, 32u);
  EXPECT_EQ(f.ns.layout.tp_size, 2u);
  EXPECT_EQ(f.keys.size(), 3u);
  EXPECT_EQ(std::get<LinkFetchBlock>(DecodeLinkMessage(Encode(OneOfEach()[10]))->body),
            std::get<LinkFetchBlock>(OneOfEach()[10].body));
}

TEST(LinkMessages, MalformedMessagesAreRefusedNamingWhatWasWrong) {
  auto refused = [](std::vector<uint8_t> bytes, StatusCode code, const std::string& says) {
    auto r = DecodeLinkMessage(bytes);
    ASSERT_FALSE(r.ok()) << says;
    EXPECT_EQ(r.status().code(), code) << r.status().ToString();
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status().ToString();
  };
  const std::vector<uint8_t> hello = Encode(OneOfEach()[0]);
  auto with = [&](size_t at, uint8_t v) {
    auto b = hello;
    b[at] = v;
    return b;
  };
  refused(with(0, 'X'), StatusCode::kInvalidArgument, "bad magic");
  refused(with(2, 2), StatusCode::kVersionMismatch, "same cxlkv release");
  refused(with(3, 0), StatusCode::kInvalidArgument, "unknown rack-link message type 0");
  refused(with(3, 14), StatusCode::kInvalidArgument, "unknown rack-link message type 14");
  refused(with(7, 0x7f), StatusCode::kInvalidArgument, "is over");  // a body length past the limit
  refused(with(16, 0), StatusCode::kInvalidArgument, "empty rack name");
  refused(with(16, 65), StatusCode::kInvalidArgument, "over its limit");  // a rack name of 65 bytes
  {
    auto b = hello;
    b.push_back(0);
    b[4] += 1;  // the header counts the extra byte: a field too many
    refused(b, StatusCode::kInvalidArgument, "after the last field");
  }
  {
    auto b = Encode(OneOfEach()[5]);  // announce: a count far past what the body holds
    b[kLinkHeaderBytes + 8] = 0xff, b[kLinkHeaderBytes + 9] = 0xff, b[kLinkHeaderBytes + 10] = 0;
    refused(b, StatusCode::kInvalidArgument, "more than the body holds");
    b = Encode(OneOfEach()[5]);
    b[kLinkHeaderBytes + 12] = 9;  // the first block's op
    refused(b, StatusCode::kInvalidArgument, "has op 9");
  }
  {
    auto b = Encode(OneOfEach()[8]);  // error: code 0 is no error
    b[kLinkHeaderBytes] = 0;
    refused(b, StatusCode::kInvalidArgument, "is no status");
  }
  {
    auto b = Encode(OneOfEach()[9]);  // fetch: the dtype byte follows the two names
    b[kLinkHeaderBytes + 1 + 10 + 1 + 6] = 9;
    refused(b, StatusCode::kInvalidArgument, "is no KV dtype");
  }
  LinkMessage empty_lookup{1, LinkLookup{}};
  std::vector<uint8_t> sink;
  EXPECT_EQ(EncodeLinkMessage(empty_lookup, sink).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(sink.empty()) << "a refused encode appended bytes";
  // Every cut of every message is refused, never read past its end.
  for (const LinkMessage& m : OneOfEach()) {
    const std::vector<uint8_t> bytes = Encode(m);
    for (size_t cut = 0; cut < bytes.size(); ++cut) {
      EXPECT_FALSE(DecodeLinkMessage({bytes.data(), cut}).ok()) << "type " << static_cast<int>(m.type()) << " cut at " << cut;
    }
  }
}

PoolSecret Secret(uint8_t fill) { return *PoolSecret::FromBytes(std::vector<uint8_t>(32, fill)); }

struct Transcript {
  LinkHello hello;
  LinkChallenge challenge;
  LinkProof proof;
};

// Runs a whole handshake between a client and a server; returns what crossed the wire.
Transcript Complete(LinkHandshake& client, LinkHandshake& server) {
  Transcript t;
  t.hello = *client.Hello();
  t.challenge = *server.OnHello(t.hello);
  t.proof = *client.OnChallenge(t.challenge);
  EXPECT_TRUE(server.OnProof(t.proof).ok());
  EXPECT_TRUE(client.OnWelcome().ok());
  return t;
}

TEST(LinkHandshake, RacksHoldingTheSecretProveItToEachOther) {
  auto client = LinkHandshake::Client(Secret(1), "rack-a", 4);
  auto server = LinkHandshake::Server(Secret(1), "rack-b", 2);
  Complete(client, server);
  EXPECT_TRUE(client.authenticated());
  EXPECT_TRUE(server.authenticated());
  EXPECT_EQ(server.peer_rack(), "rack-a");
  EXPECT_EQ(server.peer_life(), 4);
  EXPECT_EQ(client.peer_rack(), "rack-b");
  EXPECT_EQ(client.peer_life(), 2);
}

TEST(LinkHandshake, AnotherSecretIsRefusedOnEitherSide) {
  // The server holds another secret: the client refuses it before sending any proof.
  {
    auto client = LinkHandshake::Client(Secret(1), "rack-a", 1);
    auto server = LinkHandshake::Server(Secret(2), "rack-b", 1);
    auto challenge = server.OnHello(*client.Hello());
    ASSERT_TRUE(challenge.ok());
    auto proof = client.OnChallenge(*challenge);
    ASSERT_FALSE(proof.ok());
    EXPECT_EQ(proof.status().code(), StatusCode::kPermissionDenied);
    EXPECT_NE(proof.status().message().find("rack-b did not prove the pool secret"), std::string::npos)
        << proof.status().ToString();
    EXPECT_FALSE(client.authenticated());
  }
  // A client without the secret that ignores the server's proof: its own is refused.
  {
    auto honest = LinkHandshake::Client(Secret(1), "rack-a", 1);
    auto server = LinkHandshake::Server(Secret(1), "rack-b", 1);
    auto challenge = *server.OnHello(*honest.Hello());
    (void)challenge;
    LinkProof guessed{};
    guessed.proof.fill(0x5a);  // without the secret, a proof is a guess
    const Status s = server.OnProof(guessed);
    EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.ToString();
    EXPECT_FALSE(server.authenticated());
  }
}

TEST(LinkHandshake, ReplayedOrReflectedProofsAreRefused) {
  auto c1 = LinkHandshake::Client(Secret(1), "rack-a", 1);
  auto s1 = LinkHandshake::Server(Secret(1), "rack-b", 1);
  const Transcript recorded = Complete(c1, s1);
  // An eavesdropper replays the client's side into a new connection: the server's fresh nonce
  // makes the old proof worthless.
  auto s2 = LinkHandshake::Server(Secret(1), "rack-b", 1);
  ASSERT_TRUE(s2.OnHello(recorded.hello).ok());
  const Status replayed = s2.OnProof(recorded.proof);
  EXPECT_EQ(replayed.code(), StatusCode::kPermissionDenied) << replayed.ToString();
  EXPECT_FALSE(s2.authenticated());
  // ... or impersonates the server to a new client with the recorded challenge.
  auto c2 = LinkHandshake::Client(Secret(1), "rack-a", 1);
  ASSERT_TRUE(c2.Hello().ok());
  auto answered = c2.OnChallenge(recorded.challenge);
  EXPECT_EQ(answered.status().code(), StatusCode::kPermissionDenied);
  EXPECT_FALSE(c2.authenticated());
  // A server's own proof sent back as a client's proof (a reflection) does not verify.
  auto c3 = LinkHandshake::Client(Secret(1), "rack-a", 1);
  auto s3 = LinkHandshake::Server(Secret(1), "rack-b", 1);
  auto challenge = *s3.OnHello(*c3.Hello());
  EXPECT_EQ(s3.OnProof(LinkProof{challenge.proof}).code(), StatusCode::kPermissionDenied);
}

TEST(LinkHandshake, StepsOutOfOrderAreRefused) {
  auto server = LinkHandshake::Server(Secret(1), "rack-b", 1);
  EXPECT_EQ(server.OnProof(LinkProof{}).code(), StatusCode::kPermissionDenied);  // a proof before any hello
  auto client = LinkHandshake::Client(Secret(1), "rack-a", 1);
  EXPECT_EQ(client.OnWelcome().code(), StatusCode::kPermissionDenied);  // a welcome before any proof
  EXPECT_FALSE(client.authenticated());
  auto twice = LinkHandshake::Server(Secret(1), "rack-b", 1);
  auto c = LinkHandshake::Client(Secret(1), "rack-a", 1);
  const LinkHello hello = *c.Hello();
  ASSERT_TRUE(twice.OnHello(hello).ok());
  EXPECT_FALSE(twice.OnHello(hello).ok()) << "a second hello on one connection";
  EXPECT_FALSE(LinkHandshake::Server(Secret(1), "rack-b", 1).OnHello(LinkHello{"", 1, {}}).ok());
}

TEST(PoolSecretTest, OnlyAnOwnerOnlyFileOfEnoughBytesIsASecret) {
  const std::string dir = std::filesystem::temp_directory_path() / ("cxlkv_secret_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto write = [&](const std::string& name, size_t bytes, mode_t mode) {
    const std::string p = dir + "/" + name;
    std::ofstream(p) << std::string(bytes, 's');
    ::chmod(p.c_str(), mode);
    return p;
  };
  auto good = PoolSecret::Load(write("good", 32, 0600));
  ASSERT_TRUE(good.ok()) << good.status().ToString();
  EXPECT_EQ(good->bytes().size(), 32u);
  auto open = PoolSecret::Load(write("open", 32, 0644));
  EXPECT_EQ(open.status().code(), StatusCode::kPermissionDenied);
  EXPECT_NE(open.status().message().find("chmod 600"), std::string::npos) << open.status().ToString();
  EXPECT_EQ(PoolSecret::Load(write("short", 10, 0600)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PoolSecret::Load(dir + "/absent").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(PoolSecret::Load(dir).status().code(), StatusCode::kInvalidArgument);  // a directory
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace cxlkv::rack
