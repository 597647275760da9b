// The link service (rack/link_service.h) between two rack links over loopback TCP: a holder's
// announce lands in the home's directory under the rack it authenticated as, and a lookup then
// names it with its prefix; an announce under another life is refused; blocks of chains not
// homed here are dropped and counted; a link without a pool refuses fetches with a clear error.
#include <gtest/gtest.h>

#include "rack/link_service.h"

namespace cxlkv::rack {
namespace {

using namespace std::chrono_literals;

PoolSecret ServiceSecret() { return *PoolSecret::FromBytes(std::vector<uint8_t>(32, 11)); }

std::unique_ptr<UcxLink> StartServiceLink(const std::string& rack, int64_t life, bool listen, LinkRequestHandler h) {
  UcxLinkOptions o;
  o.rack = rack;
  o.life = life;
  o.listen = listen ? "127.0.0.1:0" : "";
  o.transports = "tcp";
  auto link = UcxLink::Start(o, ServiceSecret(), std::move(h));
  EXPECT_TRUE(link.ok()) << link.status().ToString();
  return link.ok() ? std::move(link).value() : nullptr;
}

// A chain of `n` blocks whose first key names it.
LinkAnnounce ChainAnnounce(int64_t life, uint64_t chain, uint32_t n) {
  LinkAnnounce a{life, {}};
  for (uint32_t i = 0; i < n; ++i) a.blocks.push_back({AnnounceOp::kPublished, {chain, 0}, i, {chain + i, 0}});
  return a;
}

LinkLookup ChainLookup(uint64_t chain, uint32_t n) {
  LinkLookup l;
  for (uint32_t i = 0; i < n; ++i) l.keys.push_back({chain + i, 0});
  return l;
}

TEST(LinkService, AnnouncesLandUnderTheAuthenticatedRackAndLookupsFindThem) {
  ChainDirectory directory;
  // This rack is home to even chains only.
  LinkService service(directory, nullptr, {[](const BlockKey& chain) { return chain.lo % 2 == 0; }});
  auto home = StartServiceLink("rack-home", 1, true, service.Handler());
  auto holder = StartServiceLink("rack-a", 3, false, nullptr);
  ASSERT_NE(home, nullptr);
  ASSERT_NE(holder, nullptr);

  LinkAnnounce batch = ChainAnnounce(3, 1000, 6);
  const LinkAnnounce odd = ChainAnnounce(3, 2001, 4);
  batch.blocks.insert(batch.blocks.end(), odd.blocks.begin(), odd.blocks.end());
  auto ack = holder->Call(home->address(), batch, 5000ms);
  ASSERT_TRUE(ack.ok()) << ack.status().ToString();
  const auto& a = std::get<LinkAnnounceAck>(ack->body);
  EXPECT_EQ(a.accepted, 6u);
  EXPECT_EQ(a.not_homed, 4u);

  // The asker's chain shares the first four blocks of the announced one.
  LinkLookup ask = ChainLookup(1000, 4);
  ask.keys.push_back({77777, 0});
  auto found = holder->Call(home->address(), ask, 5000ms);
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  const auto& holders = std::get<LinkLookupAnswer>(found->body).holders;
  ASSERT_EQ(holders.size(), 1u);
  EXPECT_EQ(holders[0].rack, "rack-a") << "the holder is the rack the handshake proved";
  EXPECT_EQ(holders[0].life, 3);
  EXPECT_EQ(holders[0].blocks, 4u);
  auto not_homed = holder->Call(home->address(), ChainLookup(2001, 4), 5000ms);
  ASSERT_TRUE(not_homed.ok());
  EXPECT_TRUE(std::get<LinkLookupAnswer>(not_homed->body).holders.empty());

  // An announce under a life the peer did not authenticate with is refused, nothing applied.
  auto stale = holder->Call(home->address(), ChainAnnounce(2, 4000, 3), 5000ms);
  EXPECT_EQ(stale.status().code(), StatusCode::kPermissionDenied) << stale.status().ToString();
  EXPECT_NE(stale.status().message().find("life 2"), std::string::npos) << stale.status().ToString();
  auto none = holder->Call(home->address(), ChainLookup(4000, 3), 5000ms);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(std::get<LinkLookupAnswer>(none->body).holders.empty());

  // No pool here: a fetch is refused with a reason, not dropped.
  LinkFetch fetch;
  fetch.ns.model_id = "m";
  fetch.keys = {{1000, 0}};
  auto refused = holder->Call(home->address(), fetch, 5000ms);
  EXPECT_EQ(refused.status().code(), StatusCode::kNotSupported) << refused.status().ToString();

  const auto c = service.counters();
  EXPECT_EQ(c.announces, 1u);
  EXPECT_EQ(c.announced, 6u);
  EXPECT_EQ(c.not_homed, 4u);
  EXPECT_EQ(c.wrong_life, 1u);
  EXPECT_EQ(c.lookups, 3u);
  EXPECT_EQ(c.lookup_hits, 1u);
  EXPECT_EQ(c.unserved, 1u);
  EXPECT_EQ(directory.stats().blocks, 6u);
}

}  // namespace
}  // namespace cxlkv::rack
