// Status and Result<T>: the one error type of cxlkv.
//
// Every fallible call returns a Status (code + message) or a Result<T> (a value or a Status).
// No exception crosses the library or the C API; the CLI translates a Status into a one-line
// error and a non-zero exit code at the edge. A message says what was wrong and what to do, e.g.
//   "region /dev/shm/x was made by layout version 3, this build reads version 4: re-create it
//    with 'cxlkv init'".
//
// Thread-safety: Status and Result are values; distinct objects may be used from any thread.
#ifndef CXLKV_STATUS_H_
#define CXLKV_STATUS_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace cxlkv {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument,   // malformed request or option; nothing was changed
  kNotFound,          // no such path, key or name
  kAlreadyExists,     // the name/key/region exists and the caller asked for a fresh one
  kCorrupted,         // a region or record failed validation (bad magic, checksum, truncation)
  kVersionMismatch,   // made by another layout version
  kNoSpace,           // the pool, a tier or a device is full
  kPermissionDenied,  // the OS refused access
  kIoError,           // any other OS-level failure
  kBusy,              // held by another party (e.g. a block being written by another node)
  kTimeout,           // a bounded wait ran out
  kNotSupported,      // the platform or CPU lacks what is needed
  kInternal,          // an invariant broke; a bug in cxlkv
  kLeaseExpired,      // this node's lease lapsed (paused or silent too long): the act was refused
                      // and nothing was published; the node rejoins as a new life, retry then
  kUnavailable,       // no server answers a request (it died, was paused or never started): retry
                      // once one serves again, or start it (cxlkvd)
};

// Returns a stable lower-case name for `code`, e.g. "version-mismatch".
std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "<code-name>: <message>", or "ok".
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Shorthands that read well at the call site: return InvalidArgument("size must be ...").
inline Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status AlreadyExists(std::string m) { return {StatusCode::kAlreadyExists, std::move(m)}; }
inline Status Corrupted(std::string m) { return {StatusCode::kCorrupted, std::move(m)}; }
inline Status VersionMismatch(std::string m) { return {StatusCode::kVersionMismatch, std::move(m)}; }
inline Status NoSpace(std::string m) { return {StatusCode::kNoSpace, std::move(m)}; }
inline Status PermissionDenied(std::string m) { return {StatusCode::kPermissionDenied, std::move(m)}; }
inline Status IoError(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
inline Status Busy(std::string m) { return {StatusCode::kBusy, std::move(m)}; }
inline Status Timeout(std::string m) { return {StatusCode::kTimeout, std::move(m)}; }
inline Status NotSupported(std::string m) { return {StatusCode::kNotSupported, std::move(m)}; }
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status LeaseExpired(std::string m) { return {StatusCode::kLeaseExpired, std::move(m)}; }
inline Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }

// A value of type T, or the Status that explains why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {}  // NOLINT: implicit by design

  bool ok() const { return std::holds_alternative<T>(v_); }
  // REQUIRES: !ok() for a meaningful Status; returns OK when a value is held.
  Status status() const { return ok() ? Status::Ok() : std::get<Status>(v_); }

  // REQUIRES: ok().
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace cxlkv

// Propagates a non-OK Status out of the enclosing function.
#define CXLKV_RETURN_IF_ERROR(expr)              \
  do {                                           \
    ::cxlkv::Status cxlkv_status_ = (expr);      \
    if (!cxlkv_status_.ok()) return cxlkv_status_; \
  } while (0)

#define CXLKV_CONCAT_INNER_(a, b) a##b
#define CXLKV_CONCAT_(a, b) CXLKV_CONCAT_INNER_(a, b)

// Declares `lhs` from a Result's value, or returns its Status. lhs may be `auto x` or `T x`.
#define CXLKV_ASSIGN_OR_RETURN(lhs, expr) \
  CXLKV_ASSIGN_OR_RETURN_IMPL_(CXLKV_CONCAT_(cxlkv_result_, __LINE__), lhs, expr)
#define CXLKV_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()

#endif  // CXLKV_STATUS_H_
