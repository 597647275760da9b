#include "tier/worker_affinity.h"

#include <pthread.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <set>

namespace cxlkv::tier {

namespace {

constexpr int kMaxCpu = 4096;

std::string ReadLine(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::string line;
  std::getline(in, line);
  return line;
}

bool ParseInt(std::string_view s, int* out) {
  const char* end = s.data() + s.size();
  auto [ptr, ec] = std::from_chars(s.data(), end, *out);
  return ec == std::errc() && ptr == end && *out >= 0;
}

}  // namespace

std::vector<int> ParseCpuList(const std::string& text) {
  std::set<int> cpus;
  std::string_view rest = text;
  while (!rest.empty() && (rest.back() == '\n' || rest.back() == ' ')) rest.remove_suffix(1);
  if (rest.empty()) return {};
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    const size_t dash = item.find('-');
    int lo = 0, hi = 0;
    if (!ParseInt(item.substr(0, dash), &lo)) return {};
    hi = lo;
    if (dash != std::string_view::npos && !ParseInt(item.substr(dash + 1), &hi)) return {};
    if (hi < lo || hi >= kMaxCpu) return {};
    for (int c = lo; c <= hi; ++c) cpus.insert(c);
  }
  return {cpus.begin(), cpus.end()};
}

std::string FormatCpuList(const std::vector<int>& cpus) {
  std::string s;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!s.empty()) s += ",";
    s += std::to_string(cpus[i]);
    if (j > i) s += "-" + std::to_string(cpus[j]);
    i = j + 1;
  }
  return s;
}

std::vector<int> CompletionCpusOfDevice(uint32_t major, uint32_t minor, const std::string& sys_root,
                                        const std::string& proc_root) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path disk = fs::canonical(fs::path(sys_root) / "dev" / "block" / (std::to_string(major) + ":" + std::to_string(minor)), ec);
  if (ec) return {};
  if (fs::exists(disk / "partition", ec)) disk = disk.parent_path();
  fs::path dev = fs::canonical(disk / "device", ec);
  if (ec) return {};
  // Up from the disk's device to the function that owns the interrupt vectors.
  std::vector<int> irqs;
  const fs::path top = fs::canonical(fs::path(sys_root) / "devices", ec);
  if (ec) return {};
  for (fs::path at = dev; at.has_relative_path() && at != top && at != at.parent_path(); at = at.parent_path()) {
    if (fs::is_directory(at / "msi_irqs", ec)) {
      for (const auto& e : fs::directory_iterator(at / "msi_irqs", ec)) {
        int irq = 0;
        if (ParseInt(e.path().filename().string(), &irq)) irqs.push_back(irq);
      }
      break;
    }
    int irq = 0;
    if (fs::exists(at / "irq", ec) && ParseInt(ReadLine(at / "irq"), &irq) && irq > 0) {
      irqs.push_back(irq);
      break;
    }
  }
  if (irqs.empty()) return {};
  std::set<int> cpus;
  for (int irq : irqs) {
    const fs::path dir = fs::path(proc_root) / "irq" / std::to_string(irq);
    std::string list = ReadLine(dir / "effective_affinity_list");
    if (list.empty()) list = ReadLine(dir / "smp_affinity_list");
    const std::vector<int> these = ParseCpuList(list);
    if (these.empty()) return {};  // one vector unknown: the whole set is
    cpus.insert(these.begin(), these.end());
  }
  return {cpus.begin(), cpus.end()};
}

std::vector<int> CompletionCpus(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  const dev_t d = S_ISBLK(st.st_mode) ? st.st_rdev : st.st_dev;
  return CompletionCpusOfDevice(major(d), minor(d));
}

WorkerPlacement PlaceWorkers(const std::vector<WorkerInput>& devices, const std::vector<int>& allowed) {
  WorkerPlacement out;
  out.cpus.resize(devices.size());
  const std::set<int> ok(allowed.begin(), allowed.end());
  std::set<int> interrupted;  // CPUs some disk's completions land on
  for (size_t i = 0; i < devices.size(); ++i) {
    if (devices[i].kind != TierKind::kSsd) continue;
    std::vector<int> mine;
    for (int c : devices[i].completion_cpus) {
      if (ok.contains(c)) mine.push_back(c);
    }
    // Only a strict subset says something: completions everywhere (or nowhere we may run)
    // give no reason to bind.
    if (mine.empty() || mine.size() == ok.size()) continue;
    out.cpus[i] = mine;
    interrupted.insert(mine.begin(), mine.end());
  }
  if (interrupted.empty()) {
    out.summary = "workers not bound (no disk's completions are confined to some of this process's CPUs)";
    return out;
  }
  std::vector<int> quiet;
  for (int c : allowed) {
    if (!interrupted.contains(c)) quiet.push_back(c);
  }
  for (size_t i = 0; i < devices.size(); ++i) {
    if (devices[i].kind == TierKind::kMem) out.cpus[i] = quiet;
  }
  for (size_t i = 0; i < devices.size(); ++i) {
    if (!out.summary.empty()) out.summary += ", ";
    out.summary += "device " + std::to_string(i) + " (" + std::string(TierKindName(devices[i].kind)) + ") on " +
                   (out.cpus[i].empty() ? std::string("any CPU") : "CPU " + FormatCpuList(out.cpus[i]));
  }
  out.summary += " (SSD workers where their disk's completion interrupts land, memory workers away from them)";
  return out;
}

std::vector<int> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return {};
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

int BindThisThread(const std::vector<int>& cpus) {
  if (cpus.empty()) return 0;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) {
    if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &set);
  }
  return -::pthread_setaffinity_np(::pthread_self(), sizeof set, &set);
}

}  // namespace cxlkv::tier
