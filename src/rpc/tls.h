// Mutual TLS for the TCP front and its clients (docs/rpc.md, "TLS"), over Debian's OpenSSL.
//
// The TCP front is a network surface: whoever reaches its port could read, write and evict any
// block of the pool. With TLS on, a peer is served only after a TLS 1.3 handshake in which both
// sides present a certificate that chains to the pool's CA, within its validity dates; the
// client also checks that the server's certificate names the address it dialled (an IP or DNS
// subject-alternative name). Nothing of a request is decoded before the handshake is done.
//
// A TlsSession runs over a socket the caller owns and polls. Its I/O never blocks on its own:
// on a non-blocking socket Read/Write answer kWouldBlock with what they wait for; on a blocking
// one with SO_RCVTIMEO/SO_SNDTIMEO, kWouldBlock means that timeout ran out.
//
// Thread-safety: a TlsContext is shared by any number of sessions on any threads; one session
// is used by one thread at a time.
#ifndef CXLKV_SRC_RPC_TLS_H_
#define CXLKV_SRC_RPC_TLS_H_

#include <cstddef>
#include <memory>
#include <string>

#include "cxlkv/status.h"

typedef struct ssl_ctx_st SSL_CTX;
typedef struct ssl_st SSL;

namespace cxlkv::rpc {

// PEM files. All three or none: TLS is on when any is given, and then each must be.
struct TlsOptions {
  std::string cert_file;  // this side's certificate (may carry its chain after it)
  std::string key_file;   // its private key
  std::string ca_file;    // the CA(s) the peer's certificate must chain to
  bool enabled() const { return !cert_file.empty() || !key_file.empty() || !ca_file.empty(); }
};

class TlsContext {
 public:
  enum class Role { kServer, kClient };
  // Loads and checks the files: each must exist and parse, the key must match the certificate,
  // and the certificate must be within its dates. Errors: kInvalidArgument naming the file and
  // what is wrong with it (and which flag gives it).
  static Result<std::shared_ptr<TlsContext>> Create(Role role, const TlsOptions& options);
  ~TlsContext();
  TlsContext(const TlsContext&) = delete;
  TlsContext& operator=(const TlsContext&) = delete;

  Role role() const { return role_; }
  SSL_CTX* native() const { return ctx_; }

 private:
  TlsContext(Role role, SSL_CTX* ctx) : role_(role), ctx_(ctx) {}
  Role role_;
  SSL_CTX* ctx_;
};

class TlsSession {
 public:
  enum class Io { kDone, kWouldBlock, kClosed, kError };
  // A server session over an accepted socket: its handshake runs inside the first Reads.
  static Result<std::unique_ptr<TlsSession>> Accept(std::shared_ptr<TlsContext> ctx, int fd);
  // A client session over a connected socket; the server's certificate must name `peer_name`
  // (an IPv4 address or a DNS name). Call Handshake before Read/Write.
  static Result<std::unique_ptr<TlsSession>> Connect(std::shared_ptr<TlsContext> ctx, int fd,
                                                     const std::string& peer_name);
  ~TlsSession();  // frees the session; the socket stays the caller's
  TlsSession(const TlsSession&) = delete;
  TlsSession& operator=(const TlsSession&) = delete;

  // Drives the handshake. kDone once it is complete (then `authenticated()`), kError with
  // `error()` saying why the peer or this side refused.
  Io Handshake();
  // Up to `n` bytes into `buf`; `*got` says how many when kDone. kClosed: the peer ended the
  // session cleanly.
  Io Read(void* buf, size_t n, size_t* got);
  // Up to `n` bytes; `*put` says how many when kDone. The buffer may move between retries.
  Io Write(const void* buf, size_t n, size_t* put);
  // Sends close_notify, best effort (the socket's shutdown is the caller's).
  void Shutdown();

  bool authenticated() const { return authenticated_; }
  // After kWouldBlock: true if OpenSSL waits for the socket to be writable (else readable).
  bool wants_write() const { return wants_write_; }
  // Decrypted bytes held inside the session that a poll of the socket will not announce.
  bool has_buffered() const;
  // After kError: what went wrong, e.g. "the peer's certificate has expired (...)".
  const Status& error() const { return error_; }

 private:
  TlsSession(std::shared_ptr<TlsContext> ctx, SSL* ssl) : ctx_(std::move(ctx)), ssl_(ssl) {}
  Io Outcome(int ret, const char* what);

  std::shared_ptr<TlsContext> ctx_;
  SSL* ssl_;
  bool authenticated_ = false;
  bool wants_write_ = false;
  Status error_;
};

}  // namespace cxlkv::rpc

#endif  // CXLKV_SRC_RPC_TLS_H_
