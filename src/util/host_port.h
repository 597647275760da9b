// "HOST:PORT" as the daemon's flags spell an address (--metrics, --tcp): parsed once, with an
// error that names the flag's value and an example.
#ifndef CXLKV_SRC_UTIL_HOST_PORT_H_
#define CXLKV_SRC_UTIL_HOST_PORT_H_

#include <string>

#include "cxlkv/status.h"

namespace cxlkv::util {

struct HostPort {
  std::string host;
  int port = 0;  // 0..65535; 0 asks the OS for a free port where the caller allows it
};

// Splits at the last ':'. Errors: kInvalidArgument naming `what` (e.g. "metrics address").
Result<HostPort> ParseHostPort(const std::string& text, const std::string& what);

}  // namespace cxlkv::util

#endif  // CXLKV_SRC_UTIL_HOST_PORT_H_
