// The rack link over UCX (rack/ucx_link.h), on loopback TCP: a call crosses only after the
// handshake, a stranger with another secret is refused, 2 MiB payloads arrive byte-exact by
// rendezvous, a call past its deadline ends and the link connects again, and a peer that is
// paused times out while one killed -9 mid-call ends the call kUnavailable, never a hang.
//
// Under ThreadSanitizer, UCX's memory hooks (libucm patches madvise, which glibc calls as each
// thread starts) crash before TSan knows the thread: the tsan test preset sets
// UCX_MEM_MMAP_HOOK_MODE=none and UCX_MEM_MALLOC_HOOKS=no.
#include <signal.h>
#include <sys/wait.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <future>
#include <thread>

#include "child.h"
#include "rack/ucx_link.h"

namespace cxlkv::rack {
namespace {

using namespace std::chrono_literals;
using cxlkv::testing::Child;

constexpr uint64_t kNeverAnswered = 666;  // a lookup whose first key has this `lo` gets no answer

PoolSecret UcxSecret(uint8_t fill) { return *PoolSecret::FromBytes(std::vector<uint8_t>(32, fill)); }

UcxLinkOptions LinkOptions(const std::string& rack, bool listen) {
  UcxLinkOptions o;
  o.rack = rack;
  o.life = 5;
  o.listen = listen ? "127.0.0.1:0" : "";
  o.transports = "tcp";
  o.connect_timeout = 3000ms;
  return o;
}

// Answers a lookup with one holder that names the asker's first key and this rack, so the
// test sees which request the answer is to; a fetch with its keys' blocks (below).
void ServeLookup(const LinkMessage& m, LinkReply& reply, const std::string& rack) {
  const auto& keys = std::get<LinkLookup>(m.body).keys;
  if (keys[0].lo == kNeverAnswered) return;
  reply.Send(LinkMessage{m.id, LinkLookupAnswer{{{rack + "/" + std::to_string(keys[0].lo), reply.peer_life(),
                                                   static_cast<uint32_t>(keys.size())}}}});
}

uint8_t PatternByte(const BlockKey& key, size_t i) { return static_cast<uint8_t>(key.lo * 31 + i * 7 + (i >> 12)); }

// Streams one payload of `bytes` per key, each filled from its key, then the end.
void ServeFetch(const LinkMessage& m, LinkReply& reply, uint64_t bytes) {
  const auto& fetch = std::get<LinkFetch>(m.body);
  for (uint32_t i = 0; i < fetch.keys.size(); ++i) {
    auto payload = std::make_shared<std::vector<uint8_t>>(bytes);
    for (size_t b = 0; b < bytes; ++b) (*payload)[b] = PatternByte(fetch.keys[i], b);
    reply.Send(LinkMessage{m.id, LinkFetchBlock{i, fetch.keys[i], bytes, 0}}, *payload,
               [payload](Status) {});  // the payload lives until UCX is done with it
  }
  reply.Send(LinkMessage{m.id, LinkFetchEnd{static_cast<uint32_t>(fetch.keys.size())}});
}

LinkRequestHandler ServerHandler(const std::string& rack, uint64_t payload_bytes = 0) {
  return [rack, payload_bytes](const LinkMessage& m, LinkReply& reply) {
    if (std::holds_alternative<LinkLookup>(m.body)) return ServeLookup(m, reply, rack);
    if (std::holds_alternative<LinkFetch>(m.body)) return ServeFetch(m, reply, payload_bytes);
    reply.Send(LinkMessage{m.id, LinkError{StatusCode::kNotSupported, "not served here"}});
  };
}

std::unique_ptr<UcxLink> StartOrDie(UcxLinkOptions o, PoolSecret secret, LinkRequestHandler h) {
  auto link = UcxLink::Start(std::move(o), std::move(secret), std::move(h));
  EXPECT_TRUE(link.ok()) << link.status().ToString();
  return link.ok() ? std::move(link).value() : nullptr;
}

LinkLookup LookupOf(uint64_t first, size_t n = 3) {
  LinkLookup l;
  for (uint64_t i = 0; i < n; ++i) l.keys.push_back({first + i, 1});
  return l;
}

// The child's side of the pause and kill test: a listening link; it reports its port, then
// reports each request it will never answer, until it is killed.
int ServeInChild(int in, int out) {
  std::atomic<int> held{0};
  auto link = UcxLink::Start(LinkOptions("rack-b", true), UcxSecret(7),
                             [out, &held](const LinkMessage& m, LinkReply& reply) {
                               const auto* l = std::get_if<LinkLookup>(&m.body);
                               if (l && l->keys[0].lo == kNeverAnswered) {
                                 cxlkv::testing::Put(out, 1000 + held.fetch_add(1));
                                 return;
                               }
                               if (l) ServeLookup(m, reply, "rack-b");
                             });
  if (!link.ok()) return 2;
  const std::string& a = (*link)->address();
  if (!cxlkv::testing::Put(out, std::stoull(a.substr(a.rfind(':') + 1)))) return 3;
  uint64_t cmd;
  while (cxlkv::testing::Get(in, &cmd)) {
  }
  return 0;
}

// First in this file: it forks, so it runs before any link of this process starts UCX.
TEST(UcxLink, PausedPeerTimesOutAndKilledPeerFailsTheCallWithoutAHang) {
  Child child = Child::Fork([](int in, int out) { return ServeInChild(in, out); });
  ASSERT_GT(child.pid, 0);
  uint64_t port = 0;
  ASSERT_TRUE(child.Receive(&port));
  const std::string peer = "127.0.0.1:" + std::to_string(port);
  auto a = StartOrDie(LinkOptions("rack-a", false), UcxSecret(7), nullptr);
  ASSERT_NE(a, nullptr);
  auto first = a->Call(peer, LookupOf(10), 5000ms);
  ASSERT_TRUE(first.ok()) << first.status().ToString();

  // Paused past the call's deadline: the call times out; resumed, the peer serves again.
  ASSERT_EQ(kill(child.pid, SIGSTOP), 0);
  int stopped = 0;  // a stop is delivered asynchronously: wait until the child is stopped
  ASSERT_EQ(waitpid(child.pid, &stopped, WUNTRACED), child.pid);
  ASSERT_TRUE(WIFSTOPPED(stopped));
  auto paused = a->Call(peer, LookupOf(11), 300ms);
  EXPECT_EQ(paused.status().code(), StatusCode::kTimeout) << paused.status().ToString();
  ASSERT_EQ(kill(child.pid, SIGCONT), 0);
  auto resumed = a->Call(peer, LookupOf(12), 5000ms);
  ASSERT_TRUE(resumed.ok()) << resumed.status().ToString();
  EXPECT_EQ(std::get<LinkLookupAnswer>(resumed->body).holders.at(0).rack, "rack-b/12");

  // Killed while it holds a call: the call ends kUnavailable, long before its deadline.
  auto held = std::async(std::launch::async, [&] { return a->Call(peer, LookupOf(kNeverAnswered), 60000ms); });
  uint64_t holding = 0;
  ASSERT_TRUE(child.Receive(&holding));  // the child has the request
  const auto killed_at = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(child.pid, SIGKILL), 0);
  ASSERT_EQ(held.wait_for(30s), std::future_status::ready) << "a call to a killed peer hung";
  auto r = held.get();
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - killed_at, 30s);
  EXPECT_GE(a->counters().peer_failures, 1u);
  EXPECT_FALSE(a->last_problem().empty());
  EXPECT_EQ(child.Wait(), 128 + SIGKILL);
  // The next call to the dead address fails cleanly too.
  auto again = a->Call(peer, LookupOf(13), 3000ms);
  EXPECT_FALSE(again.ok());
}

TEST(UcxLink, CallsCrossOnlyAfterTheHandshakeAndStrangersAreRefused) {
  auto b = StartOrDie(LinkOptions("rack-b", true), UcxSecret(7), ServerHandler("rack-b"));
  ASSERT_NE(b, nullptr);
  auto a = StartOrDie(LinkOptions("rack-a", false), UcxSecret(7), nullptr);
  ASSERT_NE(a, nullptr);
  for (uint64_t i = 1; i <= 3; ++i) {  // one connection, three calls
    auto r = a->Call(b->address(), LookupOf(i * 100, i), 5000ms);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const auto& h = std::get<LinkLookupAnswer>(r->body).holders;
    ASSERT_EQ(h.size(), 1u);
    EXPECT_EQ(h[0].rack, "rack-b/" + std::to_string(i * 100));
    EXPECT_EQ(h[0].life, 5) << "the server saw the client's life from its hello";
    EXPECT_EQ(h[0].blocks, i);
  }
  EXPECT_EQ(a->counters().connections, 1u);
  // A request the server does not serve: its error comes back as the call's status.
  auto announce = a->Call(b->address(), LinkAnnounce{5, {}}, 5000ms);
  EXPECT_EQ(announce.status().code(), StatusCode::kNotSupported) << announce.status().ToString();

  auto stranger = StartOrDie(LinkOptions("rack-x", false), UcxSecret(9), nullptr);
  ASSERT_NE(stranger, nullptr);
  auto refused = stranger->Call(b->address(), LookupOf(1), 5000ms);
  EXPECT_EQ(refused.status().code(), StatusCode::kPermissionDenied) << refused.status().ToString();
  EXPECT_GE(stranger->counters().refused + b->counters().refused, 1u);
  EXPECT_EQ(stranger->counters().connections, 0u);

  auto nobody = a->Call("127.0.0.1:1", LookupOf(1), 3000ms);
  EXPECT_FALSE(nobody.ok());
  auto bad = a->Call("not-an-address", LookupOf(1), 3000ms);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(UcxLink::Start(LinkOptions("", false), UcxSecret(7), nullptr).status().code(), StatusCode::kInvalidArgument);
}

// Collects a fetch's payloads into buffers of its own.
class CollectingSink : public LinkStreamSink {
 public:
  explicit CollectingSink(size_t blocks) : buffers_(blocks), arrived_(blocks) {}
  Result<std::span<uint8_t>> PayloadBuffer(const LinkMessage& m, uint64_t bytes) override {
    const auto* b = std::get_if<LinkFetchBlock>(&m.body);
    if (!b || b->index >= buffers_.size() || b->bytes != bytes) return InvalidArgument("unexpected payload");
    buffers_[b->index].assign(bytes, 0);
    return std::span<uint8_t>(buffers_[b->index]);
  }
  void Arrived(const LinkMessage& m, Status status) override {
    if (status.ok()) arrived_[std::get<LinkFetchBlock>(m.body).index] = true;
  }
  bool Message(const LinkMessage& m) override {
    if (const auto* e = std::get_if<LinkFetchEnd>(&m.body)) return ended_ = e->blocks, true;
    return false;
  }
  std::vector<std::vector<uint8_t>> buffers_;
  std::vector<bool> arrived_;
  uint32_t ended_ = 0;
};

TEST(UcxLink, PayloadsArriveByteExactAndALateCallReconnects) {
  constexpr uint64_t kBlock = 2u << 20;  // 2 MiB: UCX sends it by rendezvous
  auto b = StartOrDie(LinkOptions("rack-b", true), UcxSecret(7), ServerHandler("rack-b", kBlock));
  ASSERT_NE(b, nullptr);
  auto a = StartOrDie(LinkOptions("rack-a", false), UcxSecret(7), nullptr);
  ASSERT_NE(a, nullptr);
  LinkFetch fetch;
  fetch.ns.model_id = "m";
  for (uint64_t i = 0; i < 4; ++i) fetch.keys.push_back({40 + i, 2});
  CollectingSink sink(fetch.keys.size());
  const Status s = a->Stream(b->address(), fetch, sink, 20000ms);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(sink.ended_, 4u);
  for (size_t i = 0; i < fetch.keys.size(); ++i) {
    ASSERT_TRUE(sink.arrived_[i]) << "block " << i;
    ASSERT_EQ(sink.buffers_[i].size(), kBlock);
    size_t wrong = 0;
    for (size_t k = 0; k < kBlock; ++k) wrong += sink.buffers_[i][k] != PatternByte(fetch.keys[i], k);
    EXPECT_EQ(wrong, 0u) << "block " << i << " arrived with wrong bytes";
  }
  EXPECT_EQ(a->counters().payload_bytes_in, 4 * kBlock);
  EXPECT_EQ(b->counters().payload_bytes_out, 4 * kBlock);

  // A call the server never answers ends at its deadline and closes the connection; the next
  // call connects and authenticates again.
  auto late = a->Call(b->address(), LookupOf(kNeverAnswered), 200ms);
  EXPECT_EQ(late.status().code(), StatusCode::kTimeout) << late.status().ToString();
  auto after = a->Call(b->address(), LookupOf(7), 5000ms);
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  EXPECT_EQ(a->counters().connections, 2u);
}

}  // namespace
}  // namespace cxlkv::rack
