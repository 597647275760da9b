#include "serve/report.h"

#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <set>

#include "util/units.h"

namespace cxlkv::serve {

namespace {

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = static_cast<size_t>(std::min<double>(v.size() - 1, std::ceil(p * v.size()) - 1));
  return v[i];
}

}  // namespace

RunSummary Summarize(const std::string& name, const ServeRun& run) {
  RunSummary s;
  s.name = name;
  s.requests = run.records.size();
  s.wall_s = run.wall_s;
  s.retries = run.retries;
  double tpot_sum = 0, seen_sum = 0;
  size_t tpot_n = 0, tokens = 0, hit = 0, blocks = 0, from_mem = 0, from_ssd = 0;
  std::set<std::string> groups_seen;
  for (const auto& r : run.records) {
    s.ttft_ms.push_back(static_cast<double>(r.first_ns - r.arrival_ns) / 1e6);
    if (!r.group.empty() && !groups_seen.insert(r.group).second) {  // records are in request order
      ++s.seen_requests;
      seen_sum += s.ttft_ms.back();
    }
    if (r.tokens.size() > 1) {
      tpot_sum += static_cast<double>(r.done_ns - r.first_ns) / 1e6 / static_cast<double>(r.tokens.size() - 1);
      ++tpot_n;
    }
    tokens += r.tokens.size();
    hit += r.prefill.hit_blocks;
    s.blocks_not_stored += r.prefill.blocks_not_stored;
    from_mem += r.prefill.hit_from_mem;
    from_ssd += r.prefill.hit_from_ssd;
    blocks += r.prefill.prompt_blocks;
    s.computed_tokens += r.prefill.computed_tokens + r.decode.computed_tokens;
    s.bytes_moved += r.prefill.bytes_loaded + r.prefill.bytes_stored + r.decode.bytes_loaded + r.decode.bytes_stored;
  }
  s.ttft_mean_ms = std::accumulate(s.ttft_ms.begin(), s.ttft_ms.end(), 0.0) / std::max<size_t>(1, s.ttft_ms.size());
  s.ttft_seen_mean_ms = s.seen_requests ? seen_sum / static_cast<double>(s.seen_requests) : 0;
  s.ttft_p50_ms = Percentile(s.ttft_ms, 0.50);
  s.ttft_p99_ms = Percentile(s.ttft_ms, 0.99);
  s.tpot_mean_ms = tpot_n ? tpot_sum / static_cast<double>(tpot_n) : 0;
  s.requests_per_s = run.wall_s > 0 ? static_cast<double>(s.requests) / run.wall_s : 0;
  s.tokens_per_s = run.wall_s > 0 ? static_cast<double>(tokens) / run.wall_s : 0;
  s.hit_rate = blocks ? static_cast<double>(hit) / static_cast<double>(blocks) : 0;
  s.hit_rate_mem = blocks ? static_cast<double>(from_mem) / static_cast<double>(blocks) : 0;
  s.hit_rate_ssd = blocks ? static_cast<double>(from_ssd) / static_cast<double>(blocks) : 0;
  return s;
}

double HitRate(const ServeRun& run, size_t first, size_t last) {
  size_t hit = 0, blocks = 0;
  for (size_t i = first; i < last && i < run.records.size(); ++i) {
    hit += run.records[i].prefill.hit_blocks;
    blocks += run.records[i].prefill.prompt_blocks;
  }
  return blocks ? static_cast<double>(hit) / static_cast<double>(blocks) : 0;
}

void PrintTable(std::FILE* out, std::span<const RunSummary> runs) {
  std::fprintf(out, "%-34s %9s %9s %9s %9s %9s %8s %9s %7s %10s %10s\n", "configuration", "TTFT mean", "TTFT seen",
               "TTFT p50", "TTFT p99", "TPOT", "req/s", "tok/s", "hit", "prefilled", "KV moved");
  std::fprintf(out, "%-34s %9s %9s %9s %9s %9s %8s %9s %7s %10s %10s\n", "", "(ms)", "(ms)", "(ms)", "(ms)", "(ms)", "",
               "", "", "(tokens)", "");
  for (const auto& s : runs) {
    std::fprintf(out, "%-34s %9.1f %9.1f %9.1f %9.1f %9.2f %8.2f %9.1f %6.1f%% %10u %10s\n", s.name.c_str(),
                 s.ttft_mean_ms, s.ttft_seen_mean_ms, s.ttft_p50_ms, s.ttft_p99_ms, s.tpot_mean_ms, s.requests_per_s,
                 s.tokens_per_s, 100 * s.hit_rate, s.computed_tokens, util::FormatBytes(s.bytes_moved).c_str());
  }
  std::fprintf(out, "TTFT seen: mean over the requests whose prompt shares its document or session with an earlier "
               "request (the cache-hit TTFT)\n");
}

void PrintTierHits(std::FILE* out, std::span<const RunSummary> runs) {
  std::fprintf(out, "%-34s %7s %9s %9s %9s\n", "prefix hits served from", "all", "region", "node DRAM", "SSD");
  for (const auto& s : runs) {
    std::fprintf(out, "%-34s %6.1f%% %8.1f%% %8.1f%% %8.1f%%\n", s.name.c_str(), 100 * s.hit_rate,
                 100 * (s.hit_rate - s.hit_rate_mem - s.hit_rate_ssd), 100 * s.hit_rate_mem, 100 * s.hit_rate_ssd);
  }
}

nlohmann::json SummaryJson(const RunSummary& s) {
  return {{"name", s.name},
          {"requests", s.requests},
          {"ttft_ms", {{"mean", s.ttft_mean_ms}, {"p50", s.ttft_p50_ms}, {"p99", s.ttft_p99_ms}}},
          {"ttft_seen_ms", {{"mean", s.ttft_seen_mean_ms}, {"requests", s.seen_requests}}},
          {"tpot_ms", s.tpot_mean_ms},
          {"requests_per_s", s.requests_per_s},
          {"tokens_per_s", s.tokens_per_s},
          {"hit_rate", s.hit_rate},
          {"hit_rate_by_tier",
           {{"region", s.hit_rate - s.hit_rate_mem - s.hit_rate_ssd}, {"dram", s.hit_rate_mem}, {"ssd", s.hit_rate_ssd}}},
          {"computed_tokens", s.computed_tokens},
          {"bytes_moved", s.bytes_moved},
          {"wall_s", s.wall_s},
          {"retries", s.retries},
          {"blocks_not_stored", s.blocks_not_stored}};
}

Status PlotTtftCdf(const std::string& png, std::span<const RunSummary> runs) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    return NotFound("no gnuplot on this host: install gnuplot-nox (scripts/setup does) for the TTFT CDF plot");
  }
  const std::string base = png.substr(0, png.rfind('.'));
  std::ofstream script(base + ".gp");
  script << "set terminal pngcairo size 900,560 noenhanced\n"
         << "set output '" << png << "'\n"
         << "set title 'TTFT CDF by configuration'\nset xlabel 'TTFT (ms)'\nset ylabel 'fraction of requests'\n"
         << "set logscale x\nset key bottom right\nset grid\nplot ";
  for (size_t i = 0; i < runs.size(); ++i) {
    const std::string data = base + "." + std::to_string(i) + ".dat";
    std::ofstream d(data);
    std::vector<double> v = runs[i].ttft_ms;
    std::sort(v.begin(), v.end());
    for (size_t k = 0; k < v.size(); ++k) d << v[k] << " " << static_cast<double>(k + 1) / v.size() << "\n";
    script << (i ? ", " : "") << "'" << data << "' using 1:2 with steps lw 2 title '" << runs[i].name << "'";
  }
  script << "\n";
  script.close();
  const std::string cmd = "gnuplot '" + base + ".gp' 2>/dev/null || (sed -i 's/pngcairo/png/' '" + base +
                          ".gp' && gnuplot '" + base + ".gp')";
  if (std::system(cmd.c_str()) != 0) return IoError("gnuplot failed to draw " + png + " (script: " + base + ".gp)");
  return Status::Ok();
}

}  // namespace cxlkv::serve
