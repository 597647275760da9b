#include "rpc/tls.h"

#include <arpa/inet.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace cxlkv::rpc {
namespace {

// OpenSSL's error queue (this thread's), oldest first, emptied.
std::string DrainErrors() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    if (!out.empty()) out += "; ";
    const char* reason = ERR_reason_error_string(e);
    out += reason != nullptr ? reason : buf;
  }
  return out;
}

Status FileError(const std::string& flag, const std::string& file, const std::string& what) {
  return InvalidArgument(flag + " " + file + ": " + what);
}

}  // namespace

Result<std::shared_ptr<TlsContext>> TlsContext::Create(Role role, const TlsOptions& o) {
  const char* fix = "give all three of --tls-cert, --tls-key and --tls-ca (PEM files; docs/rpc.md, \"TLS\")";
  if (o.cert_file.empty() || o.key_file.empty() || o.ca_file.empty()) {
    return InvalidArgument(std::string("TLS needs a certificate, its key and the CA peers must chain to: ") + fix);
  }
  for (const auto& [flag, file] : {std::pair{"--tls-cert", &o.cert_file}, {"--tls-key", &o.key_file}, {"--tls-ca", &o.ca_file}}) {
    if (::access(file->c_str(), R_OK) != 0) return FileError(flag, *file, std::strerror(errno));
  }
  ERR_clear_error();
  SSL_CTX* ctx = SSL_CTX_new(role == Role::kServer ? TLS_server_method() : TLS_client_method());
  if (ctx == nullptr) return Internal("SSL_CTX_new: " + DrainErrors());
  auto context = std::shared_ptr<TlsContext>(new TlsContext(role, ctx));
  // Both ends are cxlkv: TLS 1.3 only, no session tickets (no resumption state to guard), and
  // writes that may complete in parts from a buffer that moves between retries.
  SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION);
  SSL_CTX_set_num_tickets(ctx, 0);
  SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  if (SSL_CTX_use_certificate_chain_file(ctx, o.cert_file.c_str()) != 1) {
    return FileError("--tls-cert", o.cert_file, "not a PEM certificate (" + DrainErrors() + ")");
  }
  if (SSL_CTX_use_PrivateKey_file(ctx, o.key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
    const bool mismatch = ERR_GET_REASON(ERR_peek_last_error()) == X509_R_KEY_VALUES_MISMATCH;
    return FileError("--tls-key", o.key_file,
                     (mismatch ? "does not match the certificate " + o.cert_file : std::string("not a PEM private key")) +
                         " (" + DrainErrors() + ")");
  }
  if (SSL_CTX_check_private_key(ctx) != 1) {
    return FileError("--tls-key", o.key_file, "does not match the certificate " + o.cert_file + " (" + DrainErrors() + ")");
  }
  X509* own = SSL_CTX_get0_certificate(ctx);
  if (own != nullptr && X509_cmp_current_time(X509_get0_notAfter(own)) < 0) {
    return FileError("--tls-cert", o.cert_file, "has expired: renew it (peers refuse it)");
  }
  if (own != nullptr && X509_cmp_current_time(X509_get0_notBefore(own)) > 0) {
    return FileError("--tls-cert", o.cert_file, "is not valid yet (check this host's clock)");
  }
  if (SSL_CTX_load_verify_locations(ctx, o.ca_file.c_str(), nullptr) != 1) {
    return FileError("--tls-ca", o.ca_file, "holds no PEM CA certificate (" + DrainErrors() + ")");
  }
  // The server demands a certificate of every client; the client checks the server's.
  SSL_CTX_set_verify(ctx, role == Role::kServer ? SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT : SSL_VERIFY_PEER,
                     nullptr);
  return context;
}

TlsContext::~TlsContext() { SSL_CTX_free(ctx_); }

Result<std::unique_ptr<TlsSession>> TlsSession::Accept(std::shared_ptr<TlsContext> ctx, int fd) {
  ERR_clear_error();
  SSL* ssl = SSL_new(ctx->native());
  if (ssl == nullptr) return Internal("SSL_new: " + DrainErrors());
  auto s = std::unique_ptr<TlsSession>(new TlsSession(std::move(ctx), ssl));
  if (SSL_set_fd(ssl, fd) != 1) return Internal("SSL_set_fd: " + DrainErrors());
  SSL_set_accept_state(ssl);
  return s;
}

Result<std::unique_ptr<TlsSession>> TlsSession::Connect(std::shared_ptr<TlsContext> ctx, int fd,
                                                        const std::string& peer_name) {
  ERR_clear_error();
  SSL* ssl = SSL_new(ctx->native());
  if (ssl == nullptr) return Internal("SSL_new: " + DrainErrors());
  auto s = std::unique_ptr<TlsSession>(new TlsSession(std::move(ctx), ssl));
  if (SSL_set_fd(ssl, fd) != 1) return Internal("SSL_set_fd: " + DrainErrors());
  in_addr ip{};
  const bool is_ip = ::inet_pton(AF_INET, peer_name.c_str(), &ip) == 1;
  const int named = is_ip ? X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), peer_name.c_str())
                          : SSL_set1_host(ssl, peer_name.c_str());
  if (named != 1) return InvalidArgument("cannot check the server's certificate against '" + peer_name + "'");
  if (!is_ip) SSL_set_tlsext_host_name(ssl, peer_name.c_str());
  SSL_set_connect_state(ssl);
  return s;
}

TlsSession::~TlsSession() { SSL_free(ssl_); }

TlsSession::Io TlsSession::Outcome(int ret, const char* what) {
  const int saved_errno = errno;
  const int e = SSL_get_error(ssl_, ret);
  switch (e) {
    case SSL_ERROR_WANT_READ:
      wants_write_ = false;
      return Io::kWouldBlock;
    case SSL_ERROR_WANT_WRITE:
      wants_write_ = true;
      return Io::kWouldBlock;
    case SSL_ERROR_ZERO_RETURN:
      return Io::kClosed;
    default:
      break;
  }
  std::string why = DrainErrors();
  if (e == SSL_ERROR_SYSCALL && why.empty()) {
    if (saved_errno == EAGAIN || saved_errno == EWOULDBLOCK) return Io::kWouldBlock;
    why = saved_errno != 0 ? std::strerror(saved_errno) : "the peer closed the connection";
  }
  const long verify = SSL_get_verify_result(ssl_);
  if (verify != X509_V_OK) {
    why = std::string("the peer's certificate was refused: ") + X509_verify_cert_error_string(verify) +
          (why.empty() ? "" : " (" + why + ")");
  }
  if (!authenticated_) {
    error_ = PermissionDenied(std::string("TLS handshake failed: ") + why +
                              " — both sides need certificates from the pool's CA, within their dates");
  } else {
    error_ = IoError(std::string("TLS ") + what + ": " + why);
  }
  return Io::kError;
}

TlsSession::Io TlsSession::Handshake() {
  if (authenticated_) return Io::kDone;
  ERR_clear_error();
  errno = 0;
  const int r = SSL_do_handshake(ssl_);
  if (r == 1) {
    authenticated_ = true;
    return Io::kDone;
  }
  return Outcome(r, "handshake");
}

TlsSession::Io TlsSession::Read(void* buf, size_t n, size_t* got) {
  *got = 0;
  if (!authenticated_) {
    const Io h = Handshake();
    if (h != Io::kDone) return h;
  }
  ERR_clear_error();
  errno = 0;
  const int r = SSL_read_ex(ssl_, buf, n, got);
  return r == 1 ? Io::kDone : Outcome(r, "read");
}

TlsSession::Io TlsSession::Write(const void* buf, size_t n, size_t* put) {
  *put = 0;
  if (!authenticated_) {
    const Io h = Handshake();
    if (h != Io::kDone) return h;
  }
  ERR_clear_error();
  errno = 0;
  const int r = SSL_write_ex(ssl_, buf, n, put);
  return r == 1 ? Io::kDone : Outcome(r, "write");
}

void TlsSession::Shutdown() {
  ERR_clear_error();
  if (authenticated_) (void)SSL_shutdown(ssl_);
  ERR_clear_error();
}

bool TlsSession::has_buffered() const { return SSL_pending(ssl_) > 0; }

}  // namespace cxlkv::rpc
