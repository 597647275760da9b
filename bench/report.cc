#include "report.h"

#include <algorithm>
#include <fstream>
#include <thread>

#include "region/coherence.h"
#include "region/cpu.h"

namespace cxlkv::bench {

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

nlohmann::json FigureJson(const Figure& f) {
  nlohmann::json j;
  j["name"] = f.name;
  j["unit"] = f.unit;
  j["higher_is_better"] = f.higher_is_better;
  j["median"] = Median(f.samples);
  j["samples"] = f.samples;
  j["reference"] = f.reference;
  if (!f.reference.empty()) {
    double ref = Median(f.reference_samples);
    j["reference_median"] = ref;
    j["ratio"] = ref > 0 ? Median(f.samples) / ref : 0.0;
  } else {
    j["reference_median"] = nullptr;
    j["ratio"] = nullptr;
  }
  j["note"] = f.note;
  return j;
}

nlohmann::json MachineJson() {
  nlohmann::json j;
  std::string model = "unknown";
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      auto colon = line.find(':');
      if (colon != std::string::npos) model = line.substr(colon + 2);
      break;
    }
  }
  j["cpu"] = model;
  j["cores"] = std::thread::hardware_concurrency();
  j["cpu_features"] = region::Cpu().ToString();
  j["nt_copy"] = region::NtCopyVariant();
  return j;
}

void PrintTable(const nlohmann::json& report, std::FILE* out) {
  std::fprintf(out, "suite %s on %s (%u cores)\n", report.value("suite", "?").c_str(),
               report["machine"].value("cpu", "?").c_str(),
               report["machine"].value("cores", 0u));
  std::fprintf(out, "%-34s %12s %-8s  %-30s %12s %8s\n", "figure", "median", "unit", "reference",
               "ref median", "ratio");
  for (const auto& r : report["results"]) {
    std::string ref = r.value("reference", "");
    if (ref.empty()) {
      std::fprintf(out, "%-34s %12.3f %-8s\n", r["name"].get<std::string>().c_str(),
                   r["median"].get<double>(), r["unit"].get<std::string>().c_str());
    } else {
      std::fprintf(out, "%-34s %12.3f %-8s  %-30s %12.3f %8.3f\n",
                   r["name"].get<std::string>().c_str(), r["median"].get<double>(),
                   r["unit"].get<std::string>().c_str(), ref.c_str(),
                   r["reference_median"].get<double>(), r["ratio"].get<double>());
    }
  }
}

}  // namespace cxlkv::bench
