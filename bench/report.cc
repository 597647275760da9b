#include "report.h"

#include <algorithm>
#include <fstream>
#include <string>
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

const char* Goal::Key() const {
  if (on == On::kRatio) return at_most ? "ratio_max" : "ratio_min";
  return at_most ? "median_max" : "median_min";
}

bool Goal::Met(double value) const {
  if (!(value > 0)) return false;
  return at_most ? value <= bound : value >= bound;
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
  if (f.goal) {
    const double value = f.goal->on == Goal::On::kRatio
                             ? (j["ratio"].is_null() ? 0.0 : j["ratio"].get<double>())
                             : j["median"].get<double>();
    j["goal"] = {{f.goal->Key(), f.goal->bound}};
    j["met"] = f.goal->Met(value);
  } else {
    j["goal"] = nullptr;
    j["met"] = nullptr;
  }
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

namespace {

// "<= 3", ">= 0.85", "median >= 4": a figure's goal as the table shows it ("" without one).
std::string GoalText(const nlohmann::json& figure) {
  if (!figure.contains("goal") || !figure["goal"].is_object() || figure["goal"].empty()) return "";
  const auto it = figure["goal"].begin();
  const std::string& key = it.key();
  char text[64];
  std::snprintf(text, sizeof text, "%s%s %g", key.starts_with("median") ? "median " : "",
                key.ends_with("_max") ? "<=" : ">=", it.value().get<double>());
  return text;
}

}  // namespace

void PrintTable(const nlohmann::json& report, std::FILE* out) {
  const nlohmann::json& machine = report["machine"];
  std::fprintf(out, "suite %s on %s (%u cores)", report.value("suite", "?").c_str(),
               machine.value("cpu", "?").c_str(), machine.value("cores", 0u));
  if (machine.contains("line_pingpong_ns") && machine.contains("nt_copy_gbps")) {
    std::fprintf(out, "; limits: line ping-pong %.0f ns/round trip, one-thread nt copy %.2f GB/s",
                 machine["line_pingpong_ns"].get<double>(), machine["nt_copy_gbps"].get<double>());
  }
  std::fprintf(out, "\n%-34s %12s %-8s  %-30s %12s %8s  %-13s %s\n", "figure", "median", "unit",
               "reference", "ref median", "ratio", "goal", "met");
  int goals = 0, met_goals = 0;
  std::string missed;
  for (const auto& r : report["results"]) {
    const std::string ref = r.value("reference", "");
    const std::string goal = GoalText(r);
    const std::string name = r["name"].get<std::string>();
    std::fprintf(out, "%-34s %12.3f %-8s", name.c_str(), r["median"].get<double>(),
                 r["unit"].get<std::string>().c_str());
    if (!ref.empty()) {
      std::fprintf(out, "  %-30s %12.3f %8.3f", ref.c_str(), r["reference_median"].get<double>(),
                   r["ratio"].get<double>());
    } else if (!goal.empty()) {
      std::fprintf(out, "  %-30s %12s %8s", "-", "-", "-");
    }
    if (!goal.empty()) {
      const bool met = r.value("met", false);
      std::fprintf(out, "  %-13s %s", goal.c_str(), met ? "met" : "MISSED");
      ++goals;
      met_goals += met ? 1 : 0;
      if (!met) missed += (missed.empty() ? "" : ", ") + name;
    }
    std::fprintf(out, "\n");
  }
  if (goals > 0) {
    std::fprintf(out, "goals: %d of %d met%s%s\n", met_goals, goals,
                 missed.empty() ? "" : "; missed: ", missed.c_str());
  }
}

}  // namespace cxlkv::bench
