#include "tier_refs.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <vector>

#include <nlohmann/json.hpp>

namespace cxlkv::bench {

bool FioAvailable() { return std::system("command -v fio >/dev/null 2>&1") == 0; }

std::string FioEngineFor(const std::string& file) {
  struct stat st {};
  if (::stat(file.c_str(), &st) == 0 && S_ISCHR(st.st_mode)) return "--ioengine=io_uring_cmd --cmd_type=nvme";
  return "--ioengine=io_uring --direct=1 --invalidate=1";
}

Result<double> RunFio(const std::string& file, const std::string& rw, uint64_t bs, uint32_t iodepth,
                      uint64_t bytes) {
  std::string cmd = "fio --name=cxlkv-ref --filename='" + file + "' --rw=" + rw + " --bs=" + std::to_string(bs) +
                    " --iodepth=" + std::to_string(iodepth) + " --numjobs=1 " + FioEngineFor(file) +
                    " --size=" + std::to_string(bytes) + " --offset=0 --output-format=json 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return IoError("cannot run fio: " + std::string(std::strerror(errno)));
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  int rc = ::pclose(p);
  if (rc != 0) return IoError("fio failed (exit " + std::to_string(rc) + "): " + out.substr(0, 400));
  // fio may print notes before the JSON document.
  size_t brace = out.find('{');
  if (brace == std::string::npos) return IoError("fio printed no JSON: " + out.substr(0, 400));
  auto doc = nlohmann::json::parse(out.substr(brace), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.contains("jobs") || doc["jobs"].empty()) {
    return IoError("fio's JSON has no jobs: " + out.substr(0, 400));
  }
  const auto& job = doc["jobs"][0];
  const char* dir = rw == "write" ? "write" : "read";
  if (!job.contains(dir) || !job[dir].contains("bw_bytes")) return IoError("fio's JSON has no bw_bytes");
  return job[dir]["bw_bytes"].get<double>();
}

Result<FilePerObjectResult> RunFilePerObject(const std::string& dir, uint64_t bs, uint32_t count) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return IoError("file-per-object: cannot create " + dir + ": " + std::strerror(errno));
  }
  std::vector<char> block(bs), in(bs);
  for (size_t i = 0; i < bs; ++i) block[i] = static_cast<char>(i * 31 + 1);
  auto name = [&](uint32_t i) { return dir + "/blk-" + std::to_string(i); };
  auto fail = [&](const std::string& what) -> Status {
    for (uint32_t i = 0; i < count; ++i) ::unlink(name(i).c_str());
    ::rmdir(dir.c_str());
    return IoError("file-per-object: " + what + ": " + std::strerror(errno));
  };
  using Clock = std::chrono::steady_clock;
  auto t0 = Clock::now();
  for (uint32_t i = 0; i < count; ++i) {
    int fd = ::open(name(i).c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
    if (fd < 0) return fail("open");
    if (::write(fd, block.data(), bs) != static_cast<ssize_t>(bs) || ::fsync(fd) != 0) {
      ::close(fd);
      return fail("write");
    }
    ::close(fd);
  }
  auto t1 = Clock::now();
  // Out of the page cache (written and synced: DONTNEED drops them), so reads hit the disk.
  for (uint32_t i = 0; i < count; ++i) {
    int fd = ::open(name(i).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      ::close(fd);
    }
  }
  auto t2 = Clock::now();
  for (uint32_t i = 0; i < count; ++i) {
    int fd = ::open(name(i).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return fail("open for read");
    size_t got = 0;
    while (got < bs) {
      ssize_t n = ::read(fd, in.data() + got, bs - got);
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    ::close(fd);
    if (got != bs) return fail("short read");
  }
  auto t3 = Clock::now();
  for (uint32_t i = 0; i < count; ++i) ::unlink(name(i).c_str());
  ::rmdir(dir.c_str());
  double bytes = static_cast<double>(bs) * count;
  return FilePerObjectResult{bytes / std::chrono::duration<double>(t1 - t0).count(),
                             bytes / std::chrono::duration<double>(t3 - t2).count()};
}

uint64_t PageCacheBytes() {
  std::ifstream in("/proc/meminfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("Cached:", 0) == 0) return std::strtoull(line.c_str() + 7, nullptr, 10) * 1024;
  }
  return 0;
}

uint64_t FileCachedBytes(const std::string& file) {
  int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  struct stat st {};
  uint64_t resident = 0;
  if (::fstat(fd, &st) == 0 && st.st_size > 0) {
    size_t len = static_cast<size_t>(st.st_size);
    void* p = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, 0);
    if (p != MAP_FAILED) {
      const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
      std::vector<unsigned char> vec((len + page - 1) / page);
      if (::mincore(p, len, vec.data()) == 0) {
        for (unsigned char v : vec) resident += (v & 1) ? page : 0;
      }
      ::munmap(p, len);
    }
  }
  ::close(fd);
  return resident;
}

}  // namespace cxlkv::bench
