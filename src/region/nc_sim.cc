#include "region/nc_sim.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "region/coherence.h"

namespace cxlkv::region {

namespace {
constexpr uint64_t kLine = kCacheLine;
}  // namespace

NcSimCache::NcSimCache(uint8_t* memory, uint64_t size, const SimOptions& options)
    : memory_(memory), size_(size), options_(options), rng_(options.seed) {}

NcSimCache::Line& NcSimCache::Fill(uint64_t line_index) {
  auto it = lines_.find(line_index);
  if (it != lines_.end()) {
    ++stats_.hits;
    return it->second;
  }
  ++stats_.misses;
  if ((line_index + 1) * kLine > size_) {
    std::fprintf(stderr, "cxlkv: simulated access to line %llu beyond a %llu-byte region\n",
                 static_cast<unsigned long long>(line_index), static_cast<unsigned long long>(size_));
    std::abort();
  }
  Line line;
  const auto* src = reinterpret_cast<uint64_t*>(memory_ + line_index * kLine);
  // The device holds 8-byte words atomically; other hosts may be writing the line meanwhile.
  for (size_t w = 0; w < 8; ++w) line.words[w] = __atomic_load_n(src + w, __ATOMIC_RELAXED);
  resident_.push_back(line_index);
  auto [pos, inserted] = lines_.emplace(line_index, line);
  (void)inserted;
  if (lines_.size() > options_.capacity_lines) {
    // Evict some other line to make room (never the one being filled).
    for (;;) {
      uint64_t victim = resident_[rng_() % resident_.size()];
      if (victim != line_index) {
        Evict(victim);
        break;
      }
    }
    pos = lines_.find(line_index);
  }
  return pos->second;
}

void NcSimCache::WriteBack(uint64_t line_index, Line& line) {
  // The whole line goes back, including words this host never stored to: that is how a stale
  // dirty line clobbers a neighbour's newer value (false sharing across hosts).
  auto* dst = reinterpret_cast<uint64_t*>(memory_ + line_index * kLine);
  size_t pause_after = 8;
  if (chaos_ && std::uniform_real_distribution<double>(0.0, 1.0)(rng_) < options_.torn_writeback_probability) {
    pause_after = 1 + rng_() % 7;
  }
  for (size_t w = 0; w < 8; ++w) {
    if (w == pause_after) std::this_thread::sleep_for(std::chrono::microseconds(20));
    __atomic_store_n(dst + w, line.words[w], __ATOMIC_RELAXED);
  }
  line.dirty = false;
}

void NcSimCache::Evict(uint64_t line_index) {
  auto it = lines_.find(line_index);
  if (it == lines_.end()) return;
  if (it->second.dirty) WriteBack(line_index, it->second);
  lines_.erase(it);
  auto r = std::find(resident_.begin(), resident_.end(), line_index);
  *r = resident_.back();
  resident_.pop_back();
  ++stats_.evictions;
}

void NcSimCache::FlushLine(uint64_t line_index) {
  auto it = lines_.find(line_index);
  if (it == lines_.end()) return;
  if (it->second.dirty) {
    WriteBack(line_index, it->second);
    ++stats_.flushed_dirty;
  }
  lines_.erase(it);
  auto r = std::find(resident_.begin(), resident_.end(), line_index);
  *r = resident_.back();
  resident_.pop_back();
}

void NcSimCache::SetChaos(bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  chaos_ = on;
}

void NcSimCache::Chaos() {
  if (!chaos_ || resident_.empty()) return;
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  if (coin(rng_) < options_.writeback_probability) {
    uint64_t pick = resident_[rng_() % resident_.size()];
    Line& line = lines_.at(pick);
    if (line.dirty) {
      WriteBack(pick, line);
      ++stats_.random_writebacks;
    }
  }
  if (coin(rng_) < options_.evict_probability) {
    Evict(resident_[rng_() % resident_.size()]);
  }
}

uint64_t NcSimCache::Load64(uint64_t off) {
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.loads;
  Chaos();
  Line& line = Fill(off / kLine);
  return line.words[(off % kLine) / 8];
}

void NcSimCache::Store64(uint64_t off, uint64_t value) {
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.stores;
  Chaos();
  Line& line = Fill(off / kLine);
  line.words[(off % kLine) / 8] = value;
  line.dirty = true;
}

void NcSimCache::Read(uint64_t off, void* dst, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.loads;
  Chaos();
  auto* out = static_cast<uint8_t*>(dst);
  while (n > 0) {
    uint64_t idx = off / kLine;
    size_t in_line = off % kLine;
    size_t take = std::min<size_t>(n, kLine - in_line);
    Line& line = Fill(idx);
    std::memcpy(out, reinterpret_cast<uint8_t*>(line.words.data()) + in_line, take);
    out += take;
    off += take;
    n -= take;
  }
}

void NcSimCache::Write(uint64_t off, const void* src, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.stores;
  Chaos();
  auto* in = static_cast<const uint8_t*>(src);
  while (n > 0) {
    uint64_t idx = off / kLine;
    size_t in_line = off % kLine;
    size_t take = std::min<size_t>(n, kLine - in_line);
    Line& line = Fill(idx);
    std::memcpy(reinterpret_cast<uint8_t*>(line.words.data()) + in_line, in, take);
    line.dirty = true;
    in += take;
    off += take;
    n -= take;
  }
}

void NcSimCache::Flush(uint64_t off, size_t n) {
  if (n == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (uint64_t idx = off / kLine; idx <= (off + n - 1) / kLine; ++idx) FlushLine(idx);
}

void NcSimCache::Invalidate(uint64_t off, size_t n) { Flush(off, n); }

void NcSimCache::DropEverything() {
  std::lock_guard<std::mutex> lock(mu_);
  lines_.clear();
  resident_.clear();
}

void NcSimCache::WriteBackEverything() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [idx, line] : lines_) {
    if (line.dirty) WriteBack(idx, line);
  }
  lines_.clear();
  resident_.clear();
}

SimStats NcSimCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

size_t NcSimCache::dirty_lines() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& [idx, line] : lines_) n += line.dirty ? 1 : 0;
  return n;
}

}  // namespace cxlkv::region
