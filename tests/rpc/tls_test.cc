// Mutual TLS on the TCP front (rpc/tls.h): a certified client is served; every other peer —
// plain TCP, no certificate, a stranger's CA, an expired certificate, silence — is refused
// before one request is decoded, and the front says why. The client refuses servers it cannot
// verify; bad TLS files are refused at start naming the flag to fix.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <thread>

#include "rpc/frame.h"
#include "rpc/tcp_client.h"
#include "rpc/tcp_front.h"
#include "test_certs.h"

namespace cxlkv {
namespace {

using namespace std::chrono_literals;
using testing::CertDir;
using testing::TestCert;

constexpr uint8_t kKv = static_cast<uint8_t>(rpc::FrameService::kKv);

int ConnectTo(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  return fd;
}

// A TLS client made by hand with OpenSSL, for the peers rpc::TlsContext refuses to be: one with
// no certificate, one past its dates. True if the front answered its request.
bool HandMadeClientIsAnswered(int port, const char* cert, const char* key) {
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  if (cert != nullptr) {
    EXPECT_EQ(SSL_CTX_use_certificate_file(ctx, cert, SSL_FILETYPE_PEM), 1);
    EXPECT_EQ(SSL_CTX_use_PrivateKey_file(ctx, key, SSL_FILETYPE_PEM), 1);
  }
  SSL_CTX_set_verify(ctx, SSL_VERIFY_NONE, nullptr);  // this client tests the server
  const int fd = ConnectTo(port);
  SSL* ssl = SSL_new(ctx);
  SSL_set_fd(ssl, fd);
  bool answered = false;
  if (SSL_connect(ssl) == 1) {
    rpc::Frame f;
    f.service = kKv;
    f.code = 7;
    f.id = 1;
    f.payload = {1, 2, 3};
    std::vector<uint8_t> bytes;
    rpc::EncodeFrame(f, bytes);
    uint8_t buf[256];
    answered = SSL_write(ssl, bytes.data(), static_cast<int>(bytes.size())) > 0 && SSL_read(ssl, buf, sizeof buf) > 0;
  }
  SSL_free(ssl);
  SSL_CTX_free(ctx);
  ::close(fd);
  return answered;
}

class TlsFrontTest : public ::testing::Test {
 protected:
  Result<std::unique_ptr<rpc::TcpFront>> StartFront(rpc::TlsOptions tls, const std::string& address = "127.0.0.1:0",
                                                    std::chrono::milliseconds handshake = 5s) {
    rpc::TcpFrontOptions o;
    o.address = address;
    o.tls = std::move(tls);
    o.handshake_timeout = handshake;
    o.max_payload = 1 << 20;
    o.max_output_bytes = 4 << 20;
    std::vector<rpc::LocalService> local(rpc::kFrameServices);
    // Echoes the request with the opcode appended: an answer proves the request was served.
    local[kKv] = [this](uint32_t op, std::span<const uint8_t> req) -> Result<std::vector<uint8_t>> {
      served_.fetch_add(1);
      std::vector<uint8_t> out(req.begin(), req.end());
      out.push_back(static_cast<uint8_t>(op));
      return out;
    };
    return rpc::TcpFront::Start({}, o, std::move(local));
  }

  // Waits (bounded) until the front has refused `n` connections.
  static bool WaitRefused(const rpc::TcpFront& f, uint64_t n) {
    for (auto deadline = std::chrono::steady_clock::now() + 10s; std::chrono::steady_clock::now() < deadline;) {
      if (f.stats().refused >= n) return true;
      std::this_thread::sleep_for(5ms);
    }
    return false;
  }

  std::atomic<int> served_{0};
  CertDir dir_;
  TestCert ca_ = TestCert::Ca(dir_.path(), "pool-ca");
  TestCert server_ = ca_.Leaf(dir_.path(), "server");
  TestCert client_ = ca_.Leaf(dir_.path(), "client");
};

TEST_F(TlsFrontTest, CertifiedClientIsServedAndFramesLargerThanARecordRoundTrip) {
  auto front = StartFront(server_.Options(ca_));
  ASSERT_TRUE(front.ok()) << front.status().ToString();
  auto c = rpc::TcpClient::Connect("127.0.0.1:" + std::to_string((*front)->port()), 5s, client_.Options(ca_));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  for (size_t size : {size_t{1}, size_t{16 << 10}, size_t{200 << 10}}) {  // one record, several, many
    std::vector<uint8_t> payload(size);
    for (size_t i = 0; i < size; ++i) payload[i] = static_cast<uint8_t>(i * 131 + size);
    auto answer = (*c)->Call(kKv, 9, payload);
    ASSERT_TRUE(answer.ok()) << answer.status().ToString();
    payload.push_back(9);
    EXPECT_EQ(*answer, payload) << size << " bytes";
  }
  EXPECT_EQ(served_.load(), 3);
  EXPECT_EQ((*front)->stats().refused, 0u);
  EXPECT_EQ((*front)->last_refusal(), "");
}

TEST_F(TlsFrontTest, PeersWithoutAValidCertificateAreRefusedBeforeAnyRequest) {
  auto front = StartFront(server_.Options(ca_), "127.0.0.1:0", 300ms);
  ASSERT_TRUE(front.ok()) << front.status().ToString();
  const int port = (*front)->port();
  const std::string address = "127.0.0.1:" + std::to_string(port);
  const std::vector<uint8_t> request = {42};

  // Plain TCP: its frame is not a TLS ClientHello.
  {
    auto plain = rpc::TcpClient::Connect(address, 5s);
    ASSERT_TRUE(plain.ok()) << plain.status().ToString();
    auto r = (*plain)->Call(kKv, 1, request);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("TLS"), std::string::npos) << r.status().ToString();
    ASSERT_TRUE(WaitRefused(**front, 1));
  }
  // A certificate from another CA (the client itself trusts the right one).
  {
    TestCert other_ca = TestCert::Ca(dir_.path(), "other-ca");
    TestCert stranger = other_ca.Leaf(dir_.path(), "stranger");
    auto c = rpc::TcpClient::Connect(address, 5s, stranger.Options(ca_));
    ASSERT_TRUE(c.ok()) << c.status().ToString();  // TLS 1.3: the server's refusal comes after
    auto r = (*c)->Call(kKv, 1, request);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kPermissionDenied) << r.status().ToString();
    ASSERT_TRUE(WaitRefused(**front, 2));
    EXPECT_NE((*front)->last_refusal().find("certificate"), std::string::npos) << (*front)->last_refusal();
  }
  // No certificate at all.
  EXPECT_FALSE(HandMadeClientIsAnswered(port, nullptr, nullptr));
  ASSERT_TRUE(WaitRefused(**front, 3));
  EXPECT_NE((*front)->last_refusal().find("certificate"), std::string::npos) << (*front)->last_refusal();
  // The pool's CA signed it, but it expired yesterday.
  TestCert expired = ca_.Leaf(dir_.path(), "expired", "127.0.0.1", -2 * 86400, -86400);
  EXPECT_FALSE(HandMadeClientIsAnswered(port, expired.cert_file().c_str(), expired.key_file().c_str()));
  ASSERT_TRUE(WaitRefused(**front, 4));
  EXPECT_NE((*front)->last_refusal().find("expired"), std::string::npos) << (*front)->last_refusal();
  // Connected and silent: refused at the handshake deadline, the connection closed.
  {
    const int fd = ConnectTo(port);
    ASSERT_TRUE(WaitRefused(**front, 5));
    EXPECT_NE((*front)->last_refusal().find("no TLS handshake"), std::string::npos) << (*front)->last_refusal();
    char b;
    EXPECT_LE(::recv(fd, &b, 1, 0), 0);
    ::close(fd);
  }
  EXPECT_EQ(served_.load(), 0);
  EXPECT_EQ((*front)->stats().frames, 0u);
  EXPECT_EQ((*front)->stats().refused, 5u);

  // The front still serves who belongs.
  auto good = rpc::TcpClient::Connect(address, 5s, client_.Options(ca_));
  ASSERT_TRUE(good.ok()) << good.status().ToString();
  ASSERT_TRUE((*good)->Call(kKv, 1, request).ok());
  EXPECT_EQ(served_.load(), 1);
}

TEST_F(TlsFrontTest, ClientRefusesServersItCannotVerify) {
  TestCert other_ca = TestCert::Ca(dir_.path(), "other-ca");
  TestCert impostor = other_ca.Leaf(dir_.path(), "impostor");
  TestCert misnamed = ca_.Leaf(dir_.path(), "misnamed", "10.9.8.7");
  for (const TestCert* cert : {&impostor, &misnamed}) {
    auto front = StartFront({cert->cert_file(), cert->key_file(), ca_.cert_file()});
    ASSERT_TRUE(front.ok()) << front.status().ToString();
    auto c = rpc::TcpClient::Connect("127.0.0.1:" + std::to_string((*front)->port()), 5s, client_.Options(ca_));
    ASSERT_FALSE(c.ok()) << cert->cert_file();
    EXPECT_EQ(c.status().code(), StatusCode::kPermissionDenied) << c.status().ToString();
    EXPECT_NE(c.status().message().find(cert == &impostor ? "certificate" : "mismatch"), std::string::npos)
        << c.status().ToString();
  }
  EXPECT_EQ(served_.load(), 0);
}

TEST_F(TlsFrontTest, BadSetupsAreRefusedAtStartNamingWhatToFix) {
  auto expect = [&](Result<std::unique_ptr<rpc::TcpFront>> r, const std::string& says) {
    ASSERT_FALSE(r.ok()) << says;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status().ToString();
  };
  // Plain TCP on an address others reach.
  expect(StartFront({}, "0.0.0.0:0"), "--tls-cert");
  expect(StartFront({server_.cert_file(), server_.key_file(), ""}), "all three");
  expect(StartFront({server_.cert_file(), dir_.path() + "/absent.key", ca_.cert_file()}), "--tls-key");
  expect(StartFront({server_.cert_file(), client_.key_file(), ca_.cert_file()}), "does not match");
  std::ofstream(dir_.path() + "/garbage.crt") << "not a certificate\n";
  expect(StartFront({dir_.path() + "/garbage.crt", server_.key_file(), ca_.cert_file()}), "not a PEM certificate");
  TestCert expired = ca_.Leaf(dir_.path(), "expired", "127.0.0.1", -2 * 86400, -86400);
  expect(StartFront(expired.Options(ca_)), "has expired");
  // A loopback address needs no TLS; TLS works on any.
  EXPECT_TRUE(StartFront({}).ok());
  EXPECT_TRUE(StartFront(server_.Options(ca_), "0.0.0.0:0").ok());
}

}  // namespace
}  // namespace cxlkv
