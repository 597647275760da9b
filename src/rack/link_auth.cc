#include "rack/link_auth.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace cxlkv::rack {
namespace {

void Append(std::vector<uint8_t>& t, const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  t.insert(t.end(), b, b + n);
}

void AppendName(std::vector<uint8_t>& t, const std::string& s) {
  const auto n = static_cast<uint8_t>(s.size());
  Append(t, &n, 1);
  Append(t, s.data(), s.size());
}

Status DrawNonce(Nonce* n) {
  if (RAND_bytes(n->data(), static_cast<int>(n->size())) != 1) return Internal("RAND_bytes failed: no entropy for a link nonce");
  return Status::Ok();
}

bool ValidLinkName(const std::string& r) { return !r.empty() && r.size() <= kLinkMaxName; }

}  // namespace

Result<PoolSecret> PoolSecret::FromBytes(std::vector<uint8_t> bytes) {
  if (bytes.size() < kMinBytes || bytes.size() > kMaxBytes) {
    return InvalidArgument("a pool secret is " + std::to_string(kMinBytes) + " to " + std::to_string(kMaxBytes) +
                           " bytes; this one is " + std::to_string(bytes.size()) +
                           " (make one: head -c 32 /dev/urandom > secret && chmod 600 secret)");
  }
  return PoolSecret(std::move(bytes));
}

Result<PoolSecret> PoolSecret::Load(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    const int e = errno;
    if (e == ENOENT) return NotFound("pool secret " + path + ": no such file");
    return Status(e == EACCES ? StatusCode::kPermissionDenied : StatusCode::kIoError,
                  "pool secret " + path + ": " + std::strerror(e));
  }
  struct stat st{};
  std::vector<uint8_t> bytes;
  Status s;
  if (::fstat(fd, &st) != 0) {
    s = IoError("pool secret " + path + ": " + std::strerror(errno));
  } else if (!S_ISREG(st.st_mode)) {
    s = InvalidArgument("pool secret " + path + " is not a regular file");
  } else if ((st.st_mode & 077) != 0) {
    s = PermissionDenied("pool secret " + path + " may be read by group or others: chmod 600 " + path);
  } else if (st.st_size < static_cast<off_t>(kMinBytes) || st.st_size > static_cast<off_t>(kMaxBytes)) {
    s = InvalidArgument("pool secret " + path + " is " + std::to_string(st.st_size) + " bytes; it must be " +
                        std::to_string(kMinBytes) + " to " + std::to_string(kMaxBytes));
  } else {
    bytes.resize(static_cast<size_t>(st.st_size));
    size_t got = 0;
    while (got < bytes.size()) {
      const ssize_t n = ::read(fd, bytes.data() + got, bytes.size() - got);
      if (n <= 0) {
        s = IoError("pool secret " + path + ": short read");
        break;
      }
      got += static_cast<size_t>(n);
    }
  }
  ::close(fd);
  if (!s.ok()) return s;
  return FromBytes(std::move(bytes));
}

LinkHandshake LinkHandshake::Client(PoolSecret secret, std::string rack, int64_t life) {
  return LinkHandshake(true, std::move(secret), std::move(rack), life);
}

LinkHandshake LinkHandshake::Server(PoolSecret secret, std::string rack, int64_t life) {
  return LinkHandshake(false, std::move(secret), std::move(rack), life);
}

Status LinkHandshake::Fail(std::string why) {
  state_ = State::kFailed;
  return PermissionDenied(std::move(why));
}

Mac LinkHandshake::Prove(const char* label) const {
  std::vector<uint8_t> t;
  static constexpr char kContext[] = "cxlkv rack link v1 ";
  Append(t, kContext, sizeof kContext - 1);
  Append(t, label, std::strlen(label));
  const std::string& client_rack = client_ ? rack_ : peer_rack_;
  const std::string& server_rack = client_ ? peer_rack_ : rack_;
  const int64_t client_life = client_ ? life_ : peer_life_;
  const int64_t server_life = client_ ? peer_life_ : life_;
  AppendName(t, client_rack);
  Append(t, &client_life, sizeof client_life);
  Append(t, client_nonce_.data(), client_nonce_.size());
  AppendName(t, server_rack);
  Append(t, &server_life, sizeof server_life);
  Append(t, server_nonce_.data(), server_nonce_.size());
  Mac mac{};
  unsigned int len = 0;
  HMAC(EVP_sha256(), secret_.bytes().data(), static_cast<int>(secret_.bytes().size()), t.data(), t.size(), mac.data(), &len);
  return mac;
}

Result<LinkHello> LinkHandshake::Hello() {
  if (!client_ || state_ != State::kStart) return Fail("rack-link handshake: hello out of order");
  if (!ValidLinkName(rack_)) return InvalidArgument("rack name '" + rack_ + "' must be 1 to 64 bytes");
  CXLKV_RETURN_IF_ERROR(DrawNonce(&client_nonce_));
  state_ = State::kSentHello;
  return LinkHello{rack_, life_, client_nonce_};
}

Result<LinkChallenge> LinkHandshake::OnHello(const LinkHello& hello) {
  if (client_ || state_ != State::kStart) return Fail("rack-link handshake: a hello out of order");
  if (!ValidLinkName(hello.rack)) return Fail("rack-link hello names no valid rack");
  if (!ValidLinkName(rack_)) return InvalidArgument("rack name '" + rack_ + "' must be 1 to 64 bytes");
  peer_rack_ = hello.rack;
  peer_life_ = hello.life;
  client_nonce_ = hello.nonce;
  CXLKV_RETURN_IF_ERROR(DrawNonce(&server_nonce_));
  state_ = State::kSentChallenge;
  return LinkChallenge{rack_, life_, server_nonce_, Prove("server")};
}

Result<LinkProof> LinkHandshake::OnChallenge(const LinkChallenge& c) {
  if (!client_ || state_ != State::kSentHello) return Fail("rack-link handshake: a challenge out of order");
  if (!ValidLinkName(c.rack)) return Fail("rack-link challenge names no valid rack");
  peer_rack_ = c.rack;
  peer_life_ = c.life;
  server_nonce_ = c.nonce;
  const Mac expected = Prove("server");
  if (CRYPTO_memcmp(expected.data(), c.proof.data(), expected.size()) != 0) {
    return Fail("rack " + c.rack + " did not prove the pool secret (it holds another pool secret, or replayed another connection's challenge): "
                "refusing to talk to it");
  }
  state_ = State::kSentProof;
  return LinkProof{Prove("client")};
}

Status LinkHandshake::OnProof(const LinkProof& p) {
  if (client_ || state_ != State::kSentChallenge) return Fail("rack-link handshake: a proof out of order");
  const Mac expected = Prove("client");
  if (CRYPTO_memcmp(expected.data(), p.proof.data(), expected.size()) != 0) {
    return Fail("rack " + peer_rack_ + " did not prove the pool secret (it holds another pool secret, or replayed another connection's proof)");
  }
  state_ = State::kDone;
  return Status::Ok();
}

Status LinkHandshake::OnWelcome() {
  if (!client_ || state_ != State::kSentProof) return Fail("rack-link handshake: a welcome out of order");
  state_ = State::kDone;
  return Status::Ok();
}

}  // namespace cxlkv::rack
