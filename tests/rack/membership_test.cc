// Rack membership against a real etcd (Debian's etcd-server, started per test): racks that see
// each other, a leaver and a killed link that vanish, a link paused past its lease that comes
// back as a new life and never acts on the old one, a second link refused, a watch that resyncs
// after a compaction, and etcd answers that are not etcd's.
#include <signal.h>
#include <sys/wait.h>

#include <gtest/gtest.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include <nlohmann/json.hpp>

#include "child.h"
#include "etcd_server.h"
#include "rack/membership.h"

namespace cxlkv::rack {
namespace {

using namespace std::chrono_literals;
using cxlkv::testing::Child;
using cxlkv::testing::EtcdServer;

bool Has(const std::vector<RackMember>& ms, const std::string& rack, int64_t life = 0) {
  return std::any_of(ms.begin(), ms.end(),
                     [&](const RackMember& m) { return m.rack == rack && (life == 0 || m.life == life); });
}

class MembershipTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    etcd_ = EtcdServer::Start(&why);
    ASSERT_NE(etcd_, nullptr) << why;
  }

  MembershipOptions Options(const std::string& rack) const {
    MembershipOptions o;
    o.etcd.endpoints = {etcd_->url()};
    o.etcd.request_timeout = 1000ms;
    o.cluster = "t";
    o.rack = rack;
    o.link_address = "10.200.0.1:7100";
    o.capacity_bytes = 64ull << 30;
    o.namespaces = {"llama-8b", "qwen-32b"};
    o.ttl_seconds = 2;
    return o;
  }

  std::unique_ptr<RackMembership> JoinOrDie(MembershipOptions o) {
    auto m = RackMembership::Join(std::move(o));
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    return m.ok() ? std::move(m).value() : nullptr;
  }

  std::unique_ptr<EtcdServer> etcd_;
};

TEST_F(MembershipTest, TwoRacksSeeEachOtherAndALeaverVanishesAtOnce) {
  auto a = JoinOrDie(Options("a"));
  MembershipOptions ob = Options("b");
  ob.link_address = "10.200.0.2:7100";
  ob.namespaces = {"llama-8b"};
  auto b = JoinOrDie(ob);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->life(), 1);
  EXPECT_EQ(b->life(), 1);
  ASSERT_TRUE(a->WaitFor([](const auto& ms) { return Has(ms, "a") && Has(ms, "b"); }, 5s));
  for (const RackMember& m : a->Members()) {
    if (m.rack != "b") continue;
    EXPECT_EQ(m.life, 1);
    EXPECT_EQ(m.link_address, "10.200.0.2:7100");
    EXPECT_EQ(m.capacity_bytes, 64ull << 30);
    EXPECT_EQ(m.namespaces, std::vector<std::string>{"llama-8b"});
    EXPECT_NE(m.lease, 0);
  }
  ASSERT_TRUE(a->Fence().ok());
  // A leave revokes the lease: the key goes at once, not after the TTL.
  const auto left = std::chrono::steady_clock::now();
  ASSERT_TRUE(b->Leave().ok());
  ASSERT_TRUE(a->WaitFor([](const auto& ms) { return !Has(ms, "b"); }, 1500ms));
  EXPECT_LT(std::chrono::steady_clock::now() - left, 1500ms);
  EXPECT_FALSE(b->Fence().ok());
  // The next registration of b is its second life: life numbers never repeat.
  auto b2 = JoinOrDie(ob);
  ASSERT_TRUE(b2);
  EXPECT_EQ(b2->life(), 2);
  ASSERT_TRUE(a->WaitFor([](const auto& ms) { return Has(ms, "b", 2); }, 5s));
}

// A second link of a live rack waits for the first one's lease, then refuses naming the holder.
TEST_F(MembershipTest, SecondLinkOfALiveRackIsRefusedNamingTheHolder) {
  auto a = JoinOrDie(Options("a"));
  ASSERT_TRUE(a);
  MembershipOptions again = Options("a");
  again.link_address = "10.200.0.9:7100";
  again.join_wait = 300ms;
  auto second = RackMembership::Join(again);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kAlreadyExists);
  EXPECT_NE(second.status().message().find("life 1 at 10.200.0.1:7100"), std::string::npos)
      << second.status().ToString();
  EXPECT_TRUE(a->Fence().ok());
  EXPECT_EQ(a->life(), 1);
}

// A child process drives one link: replies with its life after Join, then answers commands.
enum Command : uint64_t { kFence = 1, kNewLives = 2, kQuit = 3 };
constexpr uint64_t kRefused = 1ull << 63;

int LinkChild(MembershipOptions o, int in, int out) {
  std::atomic<uint64_t> new_lives{0};
  o.on_new_life = [&](int64_t) { new_lives.fetch_add(1); };
  auto m = RackMembership::Join(o);
  if (!m.ok()) {
    cxlkv::testing::Put(out, 0);
    return 1;
  }
  cxlkv::testing::Put(out, static_cast<uint64_t>((*m)->life()));
  uint64_t cmd;
  while (cxlkv::testing::Get(in, &cmd)) {
    if (cmd == kFence) {
      auto life = (*m)->Fence();
      cxlkv::testing::Put(out, life.ok() ? static_cast<uint64_t>(*life) : kRefused | static_cast<uint64_t>((*m)->life()));
    } else if (cmd == kNewLives) {
      cxlkv::testing::Put(out, new_lives.load());
    } else {
      break;
    }
  }
  return 0;
}

TEST_F(MembershipTest, KilledLinkVanishesWithinItsLease) {
  MembershipOptions o = Options("a");
  Child child = Child::Fork([o](int in, int out) { return LinkChild(o, in, out); });
  uint64_t life = 0;
  ASSERT_TRUE(child.Receive(&life));
  ASSERT_EQ(life, 1u);
  auto observer = RackMembership::Observe(Options(""));
  ASSERT_TRUE(observer.ok()) << observer.status().ToString();
  ASSERT_TRUE((*observer)->WaitFor([](const auto& ms) { return Has(ms, "a", 1); }, 5s));
  ::kill(child.pid, SIGKILL);
  EXPECT_EQ(child.Wait(), 128 + SIGKILL);
  // etcd deletes the key when the lease runs out: within the TTL (2 s) and etcd's expiry check.
  EXPECT_TRUE((*observer)->WaitFor([](const auto& ms) { return !Has(ms, "a"); }, 5s));
  EXPECT_TRUE((*observer)->Members().empty());
}

TEST_F(MembershipTest, PausedPastItsLeaseComesBackAsANewLifeAndNeverActsOnTheOld) {
  MembershipOptions o = Options("a");
  Child child = Child::Fork([o](int in, int out) { return LinkChild(o, in, out); });
  uint64_t reply = 0;
  ASSERT_TRUE(child.Receive(&reply));
  ASSERT_EQ(reply, 1u);
  auto observer = RackMembership::Observe(Options(""));
  ASSERT_TRUE(observer.ok()) << observer.status().ToString();
  ASSERT_TRUE((*observer)->WaitFor([](const auto& ms) { return Has(ms, "a", 1); }, 5s));
  ASSERT_TRUE(child.Send(kFence) && child.Receive(&reply));
  EXPECT_EQ(reply, 1u);

  ::kill(child.pid, SIGSTOP);
  ASSERT_TRUE((*observer)->WaitFor([](const auto& ms) { return !Has(ms, "a"); }, 6s));
  ::kill(child.pid, SIGCONT);
  // At once after the pause: the fence refuses life 1 (or already answers with life 2).
  ASSERT_TRUE(child.Send(kFence) && child.Receive(&reply));
  EXPECT_NE(reply, 1u) << "a link paused past its lease acted under its old life";
  if ((reply & kRefused) == 0) {
    EXPECT_EQ(reply, 2u);
  }
  // The keep-alive thread learns the lease is gone and registers life 2.
  ASSERT_TRUE((*observer)->WaitFor([](const auto& ms) { return Has(ms, "a", 2); }, 6s));
  // etcd shows life 2 as its txn commits, a moment before the child hears back: ask until it has.
  const auto deadline = std::chrono::steady_clock::now() + 3s;
  for (;;) {
    ASSERT_TRUE(child.Send(kNewLives) && child.Receive(&reply));
    if (reply != 0 || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(reply, 1u);
  ASSERT_TRUE(child.Send(kFence) && child.Receive(&reply));
  EXPECT_EQ(reply, 2u);
  child.Send(kQuit);
  EXPECT_EQ(child.Wait(), 0);
  // Its exit revoked life 2's lease.
  EXPECT_TRUE((*observer)->WaitFor([](const auto& ms) { return ms.empty(); }, 1500ms));
}

TEST_F(MembershipTest, WatchResyncsAfterItsRevisionsWereCompacted) {
  auto observer = RackMembership::Observe(Options(""));
  ASSERT_TRUE(observer.ok()) << observer.status().ToString();
  RackMembership& view = **observer;
  auto a = JoinOrDie(Options("a"));
  ASSERT_TRUE(a);
  ASSERT_TRUE(view.WaitFor([](const auto& ms) { return Has(ms, "a"); }, 5s));
  EXPECT_EQ(view.resyncs(), 1u);

  // While the watch is away: b joins, a leaves, and etcd forgets the history in between.
  view.PauseWatchForTest();
  auto b = JoinOrDie(Options("b"));
  ASSERT_TRUE(b);
  ASSERT_TRUE(a->Leave().ok());
  auto etcd = EtcdClient::Create({{etcd_->url()}});
  ASSERT_TRUE(etcd.ok());
  auto now = (*etcd)->Put("/cxlkv/t/other", "x");
  ASSERT_TRUE(now.ok()) << now.status().ToString();
  ASSERT_TRUE((*etcd)->Compact(*now).ok());
  view.ResumeWatchForTest();

  ASSERT_TRUE(view.WaitFor([](const auto& ms) { return Has(ms, "b") && !Has(ms, "a"); }, 5s));
  EXPECT_EQ(view.resyncs(), 2u);
  EXPECT_EQ(view.Members().size(), 1u);
}

TEST_F(MembershipTest, MalformedMemberValuesAreLeftOutAndCounted) {
  auto etcd = EtcdClient::Create({{etcd_->url()}});
  ASSERT_TRUE(etcd.ok());
  ASSERT_TRUE((*etcd)->Put("/cxlkv/t/racks/x", "not json").ok());
  ASSERT_TRUE((*etcd)->Put("/cxlkv/t/racks/y", R"({"rack":"z","life":1,"link_address":"a","capacity_bytes":1,"namespaces":[]})").ok());
  auto observer = RackMembership::Observe(Options(""));
  ASSERT_TRUE(observer.ok()) << observer.status().ToString();
  EXPECT_TRUE((*observer)->Members().empty());
  EXPECT_EQ((*observer)->malformed_values(), 2u);
  // A garbage life counter stops a registration with a message that says what to do.
  ASSERT_TRUE((*etcd)->Put("/cxlkv/t/lives/c", "twelve").ok());
  auto c = RackMembership::Join(Options("c"));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kCorrupted);
  EXPECT_NE(c.status().message().find("etcdctl del /cxlkv/t/lives/c"), std::string::npos) << c.status().ToString();
  // The view goes on taking good members beside the garbage.
  auto d = JoinOrDie(Options("d"));
  ASSERT_TRUE(d);
  EXPECT_TRUE((*observer)->WaitFor([](const auto& ms) { return Has(ms, "d", 1); }, 5s));
}

// Runs a shell command, returns its stdout and sets *rc to its exit code.
std::string RunCommand(const std::string& cmd, int* rc) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = ::pclose(p);
  *rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

TEST_F(MembershipTest, RacksCommandListsMembersWithTheirLeases) {
  const char* cli = std::getenv("CXLKV_CLI");
  ASSERT_NE(cli, nullptr) << "CXLKV_CLI names the cxlkv binary (set by ctest)";
  auto a = JoinOrDie(Options("a"));
  ASSERT_TRUE(a);
  auto b = JoinOrDie(Options("b"));
  ASSERT_TRUE(b);
  int rc = -1;
  const std::string out = RunCommand(std::string(cli) + " racks --etcd " + etcd_->url() + " --cluster t --json", &rc);
  ASSERT_EQ(rc, 0) << out;
  auto j = nlohmann::json::parse(out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << out;
  ASSERT_EQ(j["racks"].size(), 2u) << out;
  // The home ring of the two: each holds a share, together the whole circle.
  const double share_a = j["racks"][0]["ring_share"].get<double>(), share_b = j["racks"][1]["ring_share"].get<double>();
  EXPECT_GT(share_a, 0.2) << out;
  EXPECT_GT(share_b, 0.2) << out;
  EXPECT_NEAR(share_a + share_b, 1.0, 1e-9) << out;
  EXPECT_EQ(j["racks"][0]["rack"], "a");
  EXPECT_EQ(j["racks"][0]["life"], 1);
  EXPECT_EQ(j["racks"][0]["link_address"], "10.200.0.1:7100");
  EXPECT_GE(j["racks"][0]["lease_ttl_s"].get<int64_t>(), 1) << out;
  EXPECT_LE(j["racks"][0]["lease_ttl_s"].get<int64_t>(), 2) << out;
  // No etcd there: one line saying so, a failure exit.
  const std::string err =
      RunCommand(std::string(cli) + " racks --etcd http://127.0.0.1:1 --timeout-ms 300 2>&1", &rc);
  EXPECT_EQ(rc, 1);
  EXPECT_NE(err.find("no etcd endpoint answered"), std::string::npos) << err;
}

TEST(MembershipOptionsTest, BadNamesAndTtlsAreRefusedBeforeAnyIo) {
  MembershipOptions o;
  o.etcd.endpoints = {"http://127.0.0.1:1"};
  o.rack = "a/b";
  EXPECT_EQ(RackMembership::Join(o).status().code(), StatusCode::kInvalidArgument);
  o.rack = "a";
  o.cluster = "";
  EXPECT_EQ(RackMembership::Join(o).status().code(), StatusCode::kInvalidArgument);
  o.cluster = "c";
  o.ttl_seconds = 1;
  EXPECT_EQ(RackMembership::Join(o).status().code(), StatusCode::kInvalidArgument);
}

TEST(EtcdClientTest, EndpointsThatAreNotEtcdGiveClearErrors) {
  EXPECT_EQ(EtcdClient::Create({{}}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(EtcdClient::Create({{"http://nohost"}}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(EtcdClient::Create({{"https://127.0.0.1:2379"}}).status().code(), StatusCode::kNotSupported);

  // Nothing listens: unavailable, naming the endpoint and what to do.
  auto closed = EtcdClient::Create({{"http://127.0.0.1:1"}, 500ms});
  ASSERT_TRUE(closed.ok());
  auto r = (*closed)->Get("/k");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("127.0.0.1:1"), std::string::npos) << r.status().ToString();

  // An HTTP server that is not etcd: its answers are refused, never trusted.
  httplib::Server web;
  web.Post(R"(/v3/.*)", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("<html>hello</html>", "text/html");
  });
  const int port = web.bind_to_any_port("127.0.0.1");
  std::thread serve([&] { web.listen_after_bind(); });
  // bind_to_any_port already listens: a connection waits in the backlog until accepted.
  auto wrong = EtcdClient::Create({{"http://127.0.0.1:" + std::to_string(port)}, 1000ms});
  ASSERT_TRUE(wrong.ok());
  auto g = (*wrong)->Get("/k");
  EXPECT_EQ(g.status().code(), StatusCode::kCorrupted) << g.status().ToString();
  EXPECT_NE(g.status().message().find("etcd v3 client URL"), std::string::npos);
  auto lease = (*wrong)->LeaseGrant(5);
  EXPECT_EQ(lease.status().code(), StatusCode::kCorrupted);
  int events = 0;
  auto w = (*wrong)->Watch("/k", 0, [&](const auto&, int64_t) { return ++events, true; }, 1000ms);
  EXPECT_EQ(w.status().code(), StatusCode::kCorrupted) << w.status().ToString();
  EXPECT_EQ(events, 0);
  web.stop();
  serve.join();
}

TEST(EtcdClientTest, Base64RoundTripsEveryLengthAndRefusesGarbage) {
  std::string bytes;
  for (int n = 0; n < 7; ++n) {
    auto back = Base64Decode(Base64Encode(bytes));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, bytes);
    bytes.push_back(static_cast<char>(0xf0 + n));
  }
  EXPECT_FALSE(Base64Decode("abc").ok());
  EXPECT_FALSE(Base64Decode("a*c=").ok());
  EXPECT_EQ(PrefixEnd("/a/"), "/a0");
  EXPECT_EQ(PrefixEnd(std::string("a\xff", 2)), "b");
}

}  // namespace
}  // namespace cxlkv::rack
