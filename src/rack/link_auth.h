// Who may speak on a rack link (docs/racks.md, "Authentication"): a challenge-response keyed by
// the pool secret every rack of the fleet holds, run on every connection before any other
// message is read.
//
//   client → server  hello     {client rack, life, nonce_c}
//   server → client  challenge {server rack, life, nonce_s, HMAC(secret, "server" ‖ transcript)}
//   client → server  proof     {HMAC(secret, "client" ‖ transcript)}
//   server → client  welcome   (or refused {why}, and the connection ends)
//
// The transcript is both racks' names, lives and nonces. Each side draws a fresh 32-byte nonce
// per connection (OpenSSL's RAND_bytes), so a proof recorded from one connection answers no
// other: a replayed proof or challenge is refused. The labels differ by direction, so a proof
// cannot be reflected back at its sender. MACs are compared in constant time. Both sides prove
// the secret: a client never sends anything to a server that has not.
//
// Authentication proves only that the peer holds the secret. That the rack and life it names
// are a live member (membership.h) is the caller's check, against its view.
//
// Thread-safety: a LinkHandshake is one connection's, used by one thread.
#ifndef CXLKV_SRC_RACK_LINK_AUTH_H_
#define CXLKV_SRC_RACK_LINK_AUTH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "cxlkv/status.h"
#include "rack/link_messages.h"

namespace cxlkv::rack {

class PoolSecret {
 public:
  static constexpr size_t kMinBytes = 32;
  static constexpr size_t kMaxBytes = 4096;
  // Reads the secret from a file that only its owner may read (like ssh's keys). Errors:
  // kNotFound, kPermissionDenied (readable by group or others: chmod 600), kInvalidArgument
  // (not a regular file, or not 32 to 4096 bytes).
  static Result<PoolSecret> Load(const std::string& path);
  // Errors: kInvalidArgument (not 32 to 4096 bytes).
  static Result<PoolSecret> FromBytes(std::vector<uint8_t> bytes);

  const std::vector<uint8_t>& bytes() const { return bytes_; }

 private:
  explicit PoolSecret(std::vector<uint8_t> b) : bytes_(std::move(b)) {}
  std::vector<uint8_t> bytes_;
};

class LinkHandshake {
 public:
  // This side: its rack and life, and the secret.
  static LinkHandshake Client(PoolSecret secret, std::string rack, int64_t life);
  static LinkHandshake Server(PoolSecret secret, std::string rack, int64_t life);

  // Client: the hello to send first (draws nonce_c).
  Result<LinkHello> Hello();
  // Server: checks the hello's shape and answers the challenge (draws nonce_s).
  Result<LinkChallenge> OnHello(const LinkHello& hello);
  // Client: checks the server's proof; on success, the proof to send. kPermissionDenied when
  // the server does not hold the secret (or replays another connection's challenge).
  Result<LinkProof> OnChallenge(const LinkChallenge& challenge);
  // Server: checks the client's proof; then authenticated(). kPermissionDenied as above.
  Status OnProof(const LinkProof& proof);
  // Client: the server's welcome completes the client side.
  Status OnWelcome();

  bool authenticated() const { return state_ == State::kDone; }
  const std::string& peer_rack() const { return peer_rack_; }
  int64_t peer_life() const { return peer_life_; }

 private:
  enum class State { kStart, kSentHello, kSentChallenge, kSentProof, kDone, kFailed };
  LinkHandshake(bool client, PoolSecret secret, std::string rack, int64_t life)
      : client_(client), secret_(std::move(secret)), rack_(std::move(rack)), life_(life) {}
  Mac Prove(const char* label) const;
  Status Fail(std::string why);

  bool client_;
  PoolSecret secret_;
  std::string rack_;
  int64_t life_;
  State state_ = State::kStart;
  Nonce client_nonce_{}, server_nonce_{};
  std::string peer_rack_;
  int64_t peer_life_ = 0;
};

}  // namespace cxlkv::rack

#endif  // CXLKV_SRC_RACK_LINK_AUTH_H_
