// Blocks over cxlkvd's TCP front (the `kv` frame service, rpc/kv_frames.h) for hosts outside the
// CXL domain: bytes put over TCP read back identical over TCP and through the region, in both
// metadata modes; malformed kv requests get a named error and the connection goes on; a frame
// over the daemon's limit is refused and the daemon keeps serving; on an address others reach,
// only clients with a certificate from the pool's CA get in.
#include <cstring>

#include "daemon_harness.h"
#include "rpc/kv_frames.h"
#include "test_certs.h"

namespace cxlkv {
// gtest prints a test's parameter in its ctest name: the mode's name, not its bytes.
inline void PrintTo(MetadataMode m, std::ostream* os) { *os << MetadataModeName(m); }
}  // namespace cxlkv

namespace cxlkv::testing {
namespace {

using rpc::EncodeKvRequest;

std::vector<uint8_t> Bytes(size_t n, uint8_t seed) {
  std::vector<uint8_t> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(seed + i * 31 + (i >> 8));
  return b;
}

constexpr uint8_t kKv = static_cast<uint8_t>(rpc::FrameService::kKv);

class KvOverTcp : public ::testing::TestWithParam<MetadataMode> {};

TEST_P(KvOverTcp, BlocksPutOverTcpReadBackIdenticalOverTcpAndThroughTheRegion) {
  TempRegionPath path("cxlkvdkv");
  MakePool(path.path(), GetParam());
  DaemonProcess d = DaemonProcess::Start(path.path(), 0, "--tcp 127.0.0.1:0 --tcp-max-frame 3000000");
  const int port = d.TcpPort();
  ASSERT_GT(port, 0) << d.first_line;
  auto client = rpc::TcpClient::Connect("127.0.0.1:" + std::to_string(port), std::chrono::seconds(20));
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  rpc::TcpClient& c = **client;
  const std::vector<size_t> sizes = {1, 4096, 100000, 2u << 20};
  std::vector<std::string> keys;
  for (size_t i = 0; i < sizes.size(); ++i) {
    keys.push_back("block-" + std::to_string(i));
    auto put = c.Call(kKv, rpc::kKvPut, EncodeKvRequest("cli", {keys[i]}, Bytes(sizes[i], static_cast<uint8_t>(i))));
    ASSERT_TRUE(put.ok()) << keys[i] << ": " << put.status().ToString();
  }
  auto again = c.Call(kKv, rpc::kKvPut, EncodeKvRequest("cli", {keys[0]}, Bytes(1, 0)));
  EXPECT_EQ(again.status().code(), StatusCode::kAlreadyExists);
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto got = c.Call(kKv, rpc::kKvGet, EncodeKvRequest("cli", {keys[i]}));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, Bytes(sizes[i], static_cast<uint8_t>(i))) << keys[i] << ": bytes differ over TCP";
  }
  // The same keys through the region (a host in the domain, the CLI's namespace).
  const std::string out = path.path() + "-out";
  Output get = Sh(Cli() + " get --path " + path.path() + " --key " + keys[2] + " --out " + out);
  ASSERT_EQ(get.code, 0) << get.out;
  {
    std::ifstream in(out, std::ios::binary);
    std::vector<uint8_t> local((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(local, Bytes(sizes[2], 2)) << "the region holds other bytes than TCP put";
  }
  ::unlink(out.c_str());
  // Exists: the leading keys cached; a gap stops the count.
  auto exists = c.Call(kKv, rpc::kKvExists, EncodeKvRequest("cli", {keys[0], keys[1], "missing", keys[2]}));
  ASSERT_TRUE(exists.ok()) << exists.status().ToString();
  uint32_t hit = 0;
  ASSERT_EQ(exists->size(), sizeof hit);
  std::memcpy(&hit, exists->data(), sizeof hit);
  EXPECT_EQ(hit, 2u);
  // Another model's namespace does not see these keys.
  auto other = c.Call(kKv, rpc::kKvGet, EncodeKvRequest("another-model", {keys[0]}));
  EXPECT_EQ(other.status().code(), StatusCode::kNotFound);
  // Evict, then a miss.
  auto evicted = c.Call(kKv, rpc::kKvEvict, EncodeKvRequest("cli", {keys[1]}));
  ASSERT_TRUE(evicted.ok()) << evicted.status().ToString();
  uint64_t n = 0;
  ASSERT_EQ(evicted->size(), sizeof n);
  std::memcpy(&n, evicted->data(), sizeof n);
  EXPECT_EQ(n, 1u);
  EXPECT_EQ(c.Call(kKv, rpc::kKvGet, EncodeKvRequest("cli", {keys[1]})).status().code(), StatusCode::kNotFound);
  // The CLI over TCP: what it puts, the region holds.
  const std::string data = path.path() + "-data";
  {
    std::ofstream f(data, std::ios::binary);
    for (uint8_t b : Bytes(5000, 9)) f.put(static_cast<char>(b));
  }
  const std::string tcp = " --tcp 127.0.0.1:" + std::to_string(port);
  Output put = Sh(Cli() + " put" + tcp + " --key from-cli --data " + data);
  ASSERT_EQ(put.code, 0) << put.out;
  get = Sh(Cli() + " get --path " + path.path() + " --key from-cli --out " + out);
  ASSERT_EQ(get.code, 0) << get.out;
  EXPECT_EQ(Sh("cmp " + data + " " + out).code, 0);
  EXPECT_EQ(Sh(Cli() + " get" + tcp + " --key not-there --out " + out).code, 2);
  ::unlink(out.c_str());
  ::unlink(data.c_str());
  ::kill(d.pid, SIGTERM);
  EXPECT_EQ(d.Wait(), 0);
  Output check = Sh(Cli() + " check --path " + path.path());
  EXPECT_EQ(check.code, 0) << check.out;
}

INSTANTIATE_TEST_SUITE_P(BothMetadataModes, KvOverTcp,
                         ::testing::Values(MetadataMode::kDecentralized, MetadataMode::kCentral),
                         [](const auto& info) { return std::string(MetadataModeName(info.param)); });

TEST(Cxlkvd, MalformedKvRequestsGetNamedErrorsAndTheConnectionGoesOn) {
  TempRegionPath path("cxlkvdkvbad");
  MakePool(path.path());
  DaemonProcess d = DaemonProcess::Start(path.path(), 0, "--tcp 127.0.0.1:0 --tcp-max-frame 65536");
  const int port = d.TcpPort();
  ASSERT_GT(port, 0) << d.first_line;
  auto good = EncodeKvRequest("cli", {"k"}, Bytes(100, 1));
  std::vector<std::pair<uint32_t, std::vector<uint8_t>>> bad = {
      {rpc::kKvPut, {}},                                     // empty
      {rpc::kKvPut, {0, 0}},                                 // a model id of 0 bytes
      {rpc::kKvPut, {200, 0, 'a'}},                          // a model id longer than the request
      {rpc::kKvGet, EncodeKvRequest("cli", {})},             // no key
      {rpc::kKvGet, EncodeKvRequest("cli", {"a", "b"})},     // get takes one key
      {rpc::kKvPut, EncodeKvRequest("cli", {"k"})},          // a put with no block
      {rpc::kKvExists, EncodeKvRequest("cli", {"k"}, Bytes(3, 0))},  // bytes after the keys
      {rpc::kKvGet, EncodeKvRequest("cli", {std::string(65, 'x')})},  // a key over 64 bytes
      {rpc::kKvGet, {3, 0, 'c', 'l', 'i', 1, 0, 9, 'a'}},    // a key length past the end
      {99, good},                                            // no such opcode
  };
  RawConn conn(port);
  uint64_t id = 1;
  for (const auto& [op, payload] : bad) {
    SCOPED_TRACE("request " + std::to_string(id));
    conn.Send(Encode(kKv, op, id, payload));
    rpc::Frame f;
    ASSERT_TRUE(conn.Read(&f));
    EXPECT_EQ(f.id, id);
    EXPECT_EQ(f.code, static_cast<uint32_t>(StatusCode::kInvalidArgument)) << std::string(f.payload.begin(), f.payload.end());
    EXPECT_FALSE(f.payload.empty()) << "an error without a message";
    ++id;
  }
  // The same connection still works.
  conn.Send(Encode(kKv, rpc::kKvPut, id, good));
  rpc::Frame f;
  ASSERT_TRUE(conn.Read(&f));
  EXPECT_EQ(f.code, 0u) << std::string(f.payload.begin(), f.payload.end());
  // A block over the daemon's frame limit: an error answer, that connection closed, others served.
  {
    RawConn big(port);
    big.Send(Encode(kKv, rpc::kKvPut, 1, EncodeKvRequest("cli", {"big"}, Bytes(70000, 3))));
    rpc::Frame e;
    ASSERT_TRUE(big.Read(&e));
    EXPECT_NE(e.code, 0u);
    EXPECT_TRUE(big.Closed());
  }
  conn.Send(Encode(kKv, rpc::kKvGet, ++id, EncodeKvRequest("cli", {"k"})));
  ASSERT_TRUE(conn.Read(&f));
  EXPECT_EQ(f.code, 0u);
  EXPECT_EQ(f.payload, Bytes(100, 1));
  ::kill(d.pid, SIGTERM);
  EXPECT_EQ(d.Wait(), 0);
}

TEST(Cxlkvd, TcpFrontOnAnAddressOthersReachServesOnlyCertifiedClients) {
  TempRegionPath path("cxlkvdtls");
  MakePool(path.path());
  CertDir dir;
  const TestCert ca = TestCert::Ca(dir.path(), "pool-ca");
  const TestCert server = ca.Leaf(dir.path(), "cxlkvd");
  const TestCert client = ca.Leaf(dir.path(), "client");
  const std::string serve_tls = " --tls-cert " + server.cert_file() + " --tls-key " + server.key_file() + " --tls-ca " + ca.cert_file();
  const std::string client_tls = " --tls-cert " + client.cert_file() + " --tls-key " + client.key_file() + " --tls-ca " + ca.cert_file();
  // Plain TCP on an address others reach: refused at start, saying what to give.
  Output open = Sh(DaemonBinary() + " --path " + path.path() + " --node 0 --tcp 0.0.0.0:0");
  EXPECT_NE(open.code, 0);
  EXPECT_NE(open.out.find("--tls-cert"), std::string::npos) << open.out;

  DaemonProcess d = DaemonProcess::Start(path.path(), 0, "--tcp 0.0.0.0:0 --metrics 127.0.0.1:0" + serve_tls);
  const int port = d.TcpPort();
  ASSERT_GT(port, 0) << d.first_line;
  EXPECT_NE(d.first_line.find("mutual TLS"), std::string::npos) << d.first_line;
  const std::string tcp = " --tcp 127.0.0.1:" + std::to_string(port);
  const std::string data = path.path() + "-data", out = path.path() + "-out";
  {
    std::ofstream f(data, std::ios::binary);
    for (uint8_t b : Bytes(3000, 5)) f.put(static_cast<char>(b));
  }
  // Without a certificate: nothing put, nothing read, nothing evicted.
  Output plain_put = Sh(Cli() + " put" + tcp + " --key secret --data " + data);
  EXPECT_NE(plain_put.code, 0);
  EXPECT_NE(plain_put.out.find("TLS"), std::string::npos) << plain_put.out;
  EXPECT_EQ(Sh(Cli() + " get --path " + path.path() + " --key secret --out " + out).code, 2) << "a refused put landed";
  // With one: the bytes go in and come back (the client's files also come from the environment).
  ASSERT_EQ(Sh(Cli() + " put" + tcp + " --key secret --data " + data + client_tls).code, 0);
  Output plain_get = Sh(Cli() + " get" + tcp + " --key secret --out " + out);
  EXPECT_NE(plain_get.code, 0);
  EXPECT_NE(plain_get.code, 2) << "a refused client learned the key is absent";
  EXPECT_NE(Sh(Cli() + " evict" + tcp + " --key secret").code, 0);
  const std::string env = "CXLKV_TLS_CERT=" + client.cert_file() + " CXLKV_TLS_KEY=" + client.key_file() +
                          " CXLKV_TLS_CA=" + ca.cert_file() + " ";
  Output got = Sh(env + Cli() + " get" + tcp + " --key secret --out " + out);
  ASSERT_EQ(got.code, 0) << got.out;
  EXPECT_EQ(Sh("cmp " + data + " " + out).code, 0) << "bytes differ after a refused evict";
  // The refusals show on /metrics, which promtool accepts.
  const std::string metrics = Scrape(d.MetricsPort());
  EXPECT_GE(SumOf(metrics, "cxlkv_tcp_refused_total"), 3.0) << metrics;
  std::string report;
  EXPECT_EQ(PromtoolCheck(metrics, &report), 0) << report;
  ::unlink(out.c_str());
  ::unlink(data.c_str());
  ::kill(d.pid, SIGTERM);
  EXPECT_EQ(d.Wait(), 0);
}

}  // namespace
}  // namespace cxlkv::testing
