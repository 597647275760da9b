#include "region/sim_audit.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace cxlkv::region {

std::unique_ptr<SimSiteAudit> SimSiteAudit::FromEnvironment() {
  const char* drop = std::getenv("CXLKV_SIM_DROP");
  const char* sites = std::getenv("CXLKV_SIM_SITES");
  if ((drop == nullptr || *drop == '\0') && (sites == nullptr || *sites == '\0')) return nullptr;
  std::unique_ptr<SimSiteAudit> audit(new SimSiteAudit);
  if (sites != nullptr) audit->sites_path_ = sites;
  if (drop != nullptr) {
    std::string list = drop;
    size_t start = 0;
    while (start <= list.size()) {
      size_t comma = list.find(',', start);
      if (comma == std::string::npos) comma = list.size();
      if (comma > start) audit->drop_.insert(list.substr(start, comma - start));
      start = comma + 1;
    }
  }
  return audit;
}

std::string SimSiteAudit::SiteName(const CallSite& site) {
  std::string file = site.file;
  // The last "src/" component: sources are compiled by absolute path from any checkout.
  size_t at = file.rfind("/src/");
  if (at != std::string::npos) file = file.substr(at + 1);
  return file + ":" + std::to_string(site.line);
}

bool SimSiteAudit::Observe(SimSiteKind kind, const CallSite& site) {
  std::string name = SiteName(site);
  bool skip = drop_.count(name) != 0;
  if (!sites_path_.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (seen_.insert(name).second) {
      // O_APPEND: the processes of a test append to one file; one short write() each is whole.
      std::string line = std::string(kind == SimSiteKind::kFlush ? "flush " : "invalidate ") + name + "\n";
      int fd = ::open(sites_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
      if (fd >= 0) {
        ssize_t written = ::write(fd, line.data(), line.size());
        (void)written;  // a lost line only shortens the audit's list; the test itself goes on
        ::close(fd);
      }
    }
  }
  return skip;
}

}  // namespace cxlkv::region
