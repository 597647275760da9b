#include "test_region.h"

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>

#include <gtest/gtest.h>

namespace cxlkv::testing {

namespace {
std::atomic<int> counter{0};
}  // namespace

TempRegionPath::TempRegionPath(const std::string& tag) {
  path_ = "/dev/shm/cxlkv-test-" + std::to_string(::getpid()) + "-" + tag + "-" +
          std::to_string(counter.fetch_add(1));
}

TempRegionPath::~TempRegionPath() {
  std::error_code ec;
  std::filesystem::remove(path_, ec);
  // A staging file left by a failed create (path.init-<pid>).
  std::filesystem::remove(path_ + ".init-" + std::to_string(::getpid()), ec);
}

std::unique_ptr<Region> CreateOrDie(const std::string& path, uint64_t size, uint32_t max_nodes) {
  RegionCreateOptions opts;
  opts.size = size;
  opts.max_nodes = max_nodes;
  auto region = Region::Create(path, opts);
  EXPECT_TRUE(region.ok()) << region.status().ToString();
  if (!region.ok()) return nullptr;
  return std::move(region).value();
}

std::vector<int> RunForked(int n, const std::function<int(int)>& body) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids;
  for (int i = 0; i < n; ++i) {
    pid_t pid = ::fork();
    if (pid == 0) {
      int rc = body(i);
      std::fflush(stderr);
      ::_exit(rc);
    }
    pids.push_back(pid);
  }
  std::vector<int> codes;
  for (pid_t pid : pids) {
    int status = 0;
    if (pid < 0 || ::waitpid(pid, &status, 0) < 0) {
      codes.push_back(-1);
    } else if (WIFEXITED(status)) {
      codes.push_back(WEXITSTATUS(status));
    } else {
      codes.push_back(128 + WTERMSIG(status));
    }
  }
  return codes;
}

}  // namespace cxlkv::testing
