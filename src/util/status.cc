#include "cxlkv/status.h"

namespace cxlkv {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid-argument";
    case StatusCode::kNotFound: return "not-found";
    case StatusCode::kAlreadyExists: return "already-exists";
    case StatusCode::kCorrupted: return "corrupted";
    case StatusCode::kVersionMismatch: return "version-mismatch";
    case StatusCode::kNoSpace: return "no-space";
    case StatusCode::kPermissionDenied: return "permission-denied";
    case StatusCode::kIoError: return "io-error";
    case StatusCode::kBusy: return "busy";
    case StatusCode::kTimeout: return "timeout";
    case StatusCode::kNotSupported: return "not-supported";
    case StatusCode::kInternal: return "internal";
    case StatusCode::kLeaseExpired: return "lease-expired";
    case StatusCode::kUnavailable: return "unavailable";
  }
  return "unknown";
}

std::string Status::ToString() const {
  if (ok()) return "ok";
  return std::string(StatusCodeName(code_)) + ": " + message_;
}

}  // namespace cxlkv
