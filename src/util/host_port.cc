#include "util/host_port.h"

#include <charconv>

namespace cxlkv::util {

Result<HostPort> ParseHostPort(const std::string& text, const std::string& what) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size()) {
    return InvalidArgument(what + " '" + text + "' is not HOST:PORT (for example 127.0.0.1:9464)");
  }
  HostPort hp;
  hp.host = text.substr(0, colon);
  const char* first = text.data() + colon + 1;
  const char* last = text.data() + text.size();
  auto [end, ec] = std::from_chars(first, last, hp.port);
  if (ec != std::errc() || end != last || hp.port < 0 || hp.port > 65535) {
    return InvalidArgument("the port of " + what + " '" + text + "' must be a number in 0..65535");
  }
  return hp;
}

}  // namespace cxlkv::util
