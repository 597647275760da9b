// `cxlkv bench tier`: the capacity tiers' device layer (docs/tiers.md), each figure next to a
// reference measured in the same run on the same file system:
//
//   ssd_{write,read}/{256KiB,2MiB}/qd{1,32}  the SSD tier's batch Write/Read (header, CRC-32C,
//                     staging copy and all), GB/s of slot bytes moved, vs fio on the same file
//                     (ioengine=io_uring direct=1, same bs, iodepth, numjobs=1). Goal ≥0.85
//                     read, ≥0.8 write.
//   vs_file_per_object/{write,read}/256KiB  the SSD tier at qd32 vs one file per block through
//                     the file system (write+fsync / read). Goal ≥2×.
//   crc_cost/{ssd,dram}_read/256KiB  reads with CRC verification vs without. Goal ≥0.95 (≤5%).
//   combined/256KiB   DRAM+SSD retrieval with bandwidth-proportional placement (Algorithm 1),
//                     both devices read in parallel, vs the sum of each alone (goal ≥0.85) and
//                     vs everything on the SSD alone. Each device's reader is placed as the
//                     store places its worker (worker_affinity.h); each alone figure is the
//                     better of placed and unplaced.
//   page_cache_growth /proc/meminfo Cached after the SSD runs minus before (MiB; reported).
#include <sys/statfs.h>
#include <unistd.h>

#include <linux/magic.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <thread>

#include "bench_clock.h"
#include "suites.h"
#include "tier/dram_device.h"
#include "tier/placement.h"
#include "tier/probe.h"
#include "tier/ssd_device.h"
#include "tier/worker_affinity.h"
#include "tier_refs.h"

namespace cxlkv::bench {
namespace {

using tier::ReadItem;
using tier::SlotTag;
using tier::WriteItem;

tier::SlotTag BenchTag(uint64_t i) { return SlotTag{BlockKey{i, 0xbe7c4}, 1, 1}; }
std::string Kib(uint64_t b) { return b >= (1u << 20) ? std::to_string(b >> 20) + "MiB" : std::to_string(b >> 10) + "KiB"; }

// Writes blocks 0..n-1 into slots[0..n) in one batch; returns bytes/s of slot bytes.
Result<double> WriteAll(tier::Device& dev, const std::vector<uint64_t>& slots, std::span<const std::byte> payload) {
  std::span<const std::span<const std::byte>> scatter(&payload, 1);
  std::vector<WriteItem> items;
  for (size_t i = 0; i < slots.size(); ++i) items.push_back({slots[i], BenchTag(i), scatter});
  auto t0 = Clock::now();
  auto st = dev.Write(items);
  double s = SecondsSince(t0);
  for (const Status& x : st) {
    if (!x.ok()) return Status(x.code(), "bench tier write: " + x.message());
  }
  return static_cast<double>(slots.size() * dev.slot_bytes()) / s;
}

// Reads slots [first, first+count) as blocks first.. into dst (reused: the figure is the device).
Result<double> ReadRange(tier::Device& dev, const std::vector<uint64_t>& slots, size_t first, size_t count,
                         std::span<std::byte> dst) {
  std::vector<ReadItem> items;
  for (size_t i = first; i < first + count; ++i) items.push_back({slots[i], BenchTag(i), dst});
  auto t0 = Clock::now();
  auto st = dev.Read(items);
  double s = SecondsSince(t0);
  for (const Status& x : st) {
    if (!x.ok()) return Status(x.code(), "bench tier read: " + x.message());
  }
  return static_cast<double>(count * dev.slot_bytes()) / s;
}

std::string BenchDir(const std::string& workdir, std::string* note) {
  struct statfs fs {};
  if (::statfs(workdir.c_str(), &fs) == 0 && fs.f_type != TMPFS_MAGIC) return workdir;
  *note = workdir + " is tmpfs (or missing): the SSD tier runs on a file in the working directory instead";
  return std::filesystem::current_path().string();
}

}  // namespace

Result<nlohmann::json> RunTierBench(const BenchOptions& options) {
  const int reps = options.quick ? 2 : options.repetitions;
  const uint64_t span = options.quick ? (32ull << 20) : (256ull << 20);  // bytes per run and size
  std::string dir_note;
  const std::string dir = BenchDir(options.workdir, &dir_note);
  // A device given by the operator is written over, never removed; a file is the bench's own.
  const bool on_device = !options.device.empty();
  const std::string file = on_device ? options.device : dir + "/cxlkv-bench-tier-" + std::to_string(::getpid());
  const bool fio = FioAvailable();
  std::vector<nlohmann::json> results;
  nlohmann::json report;
  auto cleanup = [&] {
    if (!on_device) std::filesystem::remove(file);
  };

  const uint64_t cache_before = PageCacheBytes();
  uint64_t cache_peak = cache_before;
  uint64_t file_cached_peak = 0;
  std::vector<double> qd32_256_write, qd32_256_read, crc_on, crc_off;
  std::string describe;
  for (uint64_t bs : {uint64_t{256} << 10, uint64_t{2} << 20}) {
    const uint64_t n = span / bs;
    std::vector<std::byte> payload(bs - tier::kSlotHeaderBytes, std::byte{0x5a});
    for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<std::byte>(i * 131);
    std::vector<std::byte> dst(payload.size());
    for (uint32_t qd : {1u, 32u}) {
      tier::SsdOptions so;
      so.path = file;
      so.slot_bytes = bs;
      so.size_bytes = span;
      so.queue_depth = qd;
      auto dev = tier::SsdDevice::Open(so);
      if (!dev.ok()) {
        cleanup();
        return dev.status();
      }
      if (qd == 32 && describe.empty()) describe = (*dev)->Describe();
      auto slots = (*dev)->AllocateSlots(n);
      if (!slots.ok()) return slots.status();
      std::vector<double> w, r, fw, fr;
      std::string fio_error;
      for (int rep = 0; rep < reps; ++rep) {
        // fio's write first: it overwrites the slots, ours then rewrites them before reading.
        if (fio) {
          auto x = RunFio(file, "write", bs, qd, span);
          if (x.ok()) fw.push_back(*x); else fio_error = x.status().ToString();
        }
        auto ww = WriteAll(**dev, *slots, payload);
        if (!ww.ok()) return ww.status();
        w.push_back(*ww / 1e9);
        auto rr = ReadRange(**dev, *slots, 0, n, dst);
        if (!rr.ok()) return rr.status();
        r.push_back(*rr / 1e9);
        cache_peak = std::max(cache_peak, PageCacheBytes());
        file_cached_peak = std::max(file_cached_peak, FileCachedBytes(file));
        if (bs == (256u << 10) && qd == 32) {
          (*dev)->set_verify_crc(false);
          auto off = ReadRange(**dev, *slots, 0, n, dst);
          (*dev)->set_verify_crc(true);
          if (!off.ok()) return off.status();
          crc_off.push_back(*off / 1e9);
          crc_on.push_back(r.back());
        }
        if (fio) {
          auto x = RunFio(file, "read", bs, qd, span);
          if (x.ok()) fr.push_back(*x / 1e9); else fio_error = x.status().ToString();
        }
      }
      for (double& x : fw) x /= 1e9;
      std::string tagw = "ssd_write/" + Kib(bs) + "/qd" + std::to_string(qd);
      std::string tagr = "ssd_read/" + Kib(bs) + "/qd" + std::to_string(qd);
      std::string fiow = "fio_write/" + Kib(bs) + "/qd" + std::to_string(qd);
      std::string fior = "fio_read/" + Kib(bs) + "/qd" + std::to_string(qd);
      if (fio && !fw.empty() && !fr.empty()) {
        results.push_back(FigureJson({tagw, "GB/s", true, w, fiow, fw, "SSD tier batch write vs fio on the same file; goal >=0.8"}));
        results.push_back(FigureJson({tagr, "GB/s", true, r, fior, fr, "SSD tier batch read vs fio on the same file; goal >=0.85"}));
      } else {
        results.push_back(FigureJson({tagw, "GB/s", true, w, "", {}, "no fio reference: " + (fio ? fio_error : std::string("fio is not installed (scripts/setup installs it)"))}));
        results.push_back(FigureJson({tagr, "GB/s", true, r, "", {}, "no fio reference"}));
      }
      if (bs == (256u << 10) && qd == 32) {
        qd32_256_write = w;
        qd32_256_read = r;
      }
    }
  }
  results.push_back(FigureJson({"page_cache_growth", "MiB", false,
                                {static_cast<double>(cache_peak - std::min(cache_peak, cache_before)) / (1 << 20)},
                                "", {}, "peak /proc/meminfo Cached during the SSD runs minus before: machine-wide, "
                                "other processes' I/O included"}));
  results.push_back(FigureJson({"tier_file_cached", "MiB", false, {static_cast<double>(file_cached_peak) / (1 << 20)},
                                "", {}, "peak bytes of the tier file in the page cache (mincore) after our runs"}));
  results.push_back(FigureJson({"crc_cost/ssd_read/256KiB", "GB/s", true, crc_on, "ssd_read_no_crc/256KiB/qd32",
                                crc_off, "reads verifying the CRC-32C vs not; goal >=0.95 (<=5% cost)"}));

  // ---- one file per block through the file system, 256 KiB ----
  const uint32_t fpo_count = options.quick ? 64 : 256;
  std::vector<double> fpo_w, fpo_r;
  for (int rep = 0; rep < reps; ++rep) {
    auto x = RunFilePerObject(dir + "/cxlkv-bench-fpo-" + std::to_string(::getpid()), 256 << 10, fpo_count);
    if (!x.ok()) {
      cleanup();
      return x.status();
    }
    fpo_w.push_back(x->write_bytes_per_s / 1e9);
    fpo_r.push_back(x->read_bytes_per_s / 1e9);
  }
  results.push_back(FigureJson({"vs_file_per_object/write/256KiB", "GB/s", true, qd32_256_write,
                                "file_per_object_write/256KiB", fpo_w,
                                "SSD tier qd32 vs one file per block (open+write+fsync+close); goal >=2"}));
  results.push_back(FigureJson({"vs_file_per_object/read/256KiB", "GB/s", true, qd32_256_read,
                                "file_per_object_read/256KiB", fpo_r,
                                "SSD tier qd32 vs one file per block (open+read+close, cache dropped); goal >=2"}));

  // ---- DRAM + SSD with placement vs each alone ----
  {
    const uint64_t bs = 256 << 10;
    const uint64_t n = options.quick ? 64 : 512;
    tier::DramOptions dopt;
    dopt.capacity_bytes = n * bs;
    dopt.slot_bytes = bs;
    auto dram = tier::DramDevice::Create(dopt);
    if (!dram.ok()) return dram.status();
    tier::SsdOptions so;
    so.path = file;
    so.index = 1;
    so.slot_bytes = bs;
    so.size_bytes = std::max(span, n * bs);
    auto ssd = tier::SsdDevice::Open(so);
    if (!ssd.ok()) return ssd.status();
    CXLKV_RETURN_IF_ERROR(tier::ProbeBandwidth(**dram).status());
    CXLKV_RETURN_IF_ERROR(tier::ProbeBandwidth(**ssd).status());
    std::vector<uint64_t> bw{(*dram)->bandwidth(), (*ssd)->bandwidth()};
    auto counts = tier::PlacementCounts(bw, n);
    if (!counts.ok()) return counts.status();
    auto ds = (*dram)->AllocateSlots(n);
    auto ss = (*ssd)->AllocateSlots(n);
    if (!ds.ok() || !ss.ok()) return Internal("bench tier: no slots");
    std::vector<std::byte> payload(bs - tier::kSlotHeaderBytes, std::byte{0x33});
    CXLKV_RETURN_IF_ERROR(WriteAll(**dram, *ds, payload).status());
    CXLKV_RETURN_IF_ERROR(WriteAll(**ssd, *ss, payload).status());
    std::vector<std::byte> dst_d(payload.size()), dst_s(payload.size());
    std::vector<double> both, dram_alone, ssd_alone, sum;
    const uint64_t on_dram = (*counts)[0];
    // Each device read by a thread placed as the store places its worker (worker_affinity.h),
    // alone and combined alike: the DRAM reads on a thread of their own, the SSD's on this one.
    const std::vector<int> allowed = tier::AllowedCpus();
    const tier::WorkerPlacement placed =
        tier::PlaceWorkers({{tier::TierKind::kMem, {}}, {tier::TierKind::kSsd, tier::CompletionCpus(file)}}, allowed);
    report["worker_placement"] = placed.summary;
    (void)tier::BindThisThread(placed.cpus[1]);
    struct Unbind {
      std::vector<int> all;
      ~Unbind() { (void)tier::BindThisThread(all); }
    } unbind{allowed};
    auto on_dram_worker = [&](const std::function<void()>& work) {
      std::thread t([&] {
        (void)tier::BindThisThread(placed.cpus[0]);
        work();
      });
      t.join();
    };
    auto unbound = [&](const std::function<void()>& work) {
      std::thread t([&] {
        (void)tier::BindThisThread(allowed);
        work();
      });
      t.join();
    };
    for (int rep = 0; rep < reps; ++rep) {
      // Each device alone, placed and unplaced: the better of the two is the reference, so
      // placement never lowers the bar it is measured against.
      Result<double> a = 0.0, a_free = 0.0, b_free = 0.0;
      on_dram_worker([&] { a = ReadRange(**dram, *ds, 0, n, dst_d); });
      unbound([&] { a_free = ReadRange(**dram, *ds, 0, n, dst_d); });
      auto b = ReadRange(**ssd, *ss, 0, n, dst_s);
      unbound([&] { b_free = ReadRange(**ssd, *ss, 0, n, dst_s); });
      if (!a.ok() || !b.ok() || !a_free.ok() || !b_free.ok()) return Internal("bench tier: alone read failed");
      a = std::max(*a, *a_free);
      b = std::max(*b, *b_free);
      dram_alone.push_back(*a / 1e9);
      ssd_alone.push_back(*b / 1e9);
      sum.push_back((*a + *b) / 1e9);
      // Blocks [0, on_dram) from DRAM, the rest from the SSD, in parallel (one worker per device).
      Status sa, sb;
      auto t0 = Clock::now();
      std::thread td([&] {
        (void)tier::BindThisThread(placed.cpus[0]);
        if (on_dram > 0) sa = ReadRange(**dram, *ds, 0, on_dram, dst_d).status();
      });
      if (n > on_dram) sb = ReadRange(**ssd, *ss, on_dram, n - on_dram, dst_s).status();
      td.join();
      double s = SecondsSince(t0);
      if (!sa.ok() || !sb.ok()) return Internal("bench tier: combined read failed");
      both.push_back(static_cast<double>(n * bs) / s / 1e9);
    }
    results.push_back(FigureJson({"dram_read/256KiB", "GB/s", true, dram_alone, "", {}, "DRAM tier alone"}));
    results.push_back(FigureJson({"combined/256KiB", "GB/s", true, both, "sum_of_alone/256KiB", sum,
                                  "DRAM+SSD with placement vs DRAM alone + SSD alone; goal >=0.85"}));
    results.push_back(FigureJson({"combined_vs_ssd_only/256KiB", "GB/s", true, both, "ssd_alone/256KiB", ssd_alone,
                                  "DRAM+SSD with placement vs every block on the SSD"}));
    report["placement"] = {{"dram_bytes_per_s", bw[0]}, {"ssd_bytes_per_s", bw[1]},
                           {"blocks_dram", (*counts)[0]}, {"blocks_ssd", (*counts)[1]}};
    // CRC cost where it is most visible: the DRAM tier (memory-bound, no disk to hide it).
    std::vector<double> on, off;
    for (int rep = 0; rep < reps; ++rep) {
      auto x = ReadRange(**dram, *ds, 0, n, dst_d);
      (*dram)->set_verify_crc(false);
      auto y = ReadRange(**dram, *ds, 0, n, dst_d);
      (*dram)->set_verify_crc(true);
      if (!x.ok() || !y.ok()) return Internal("bench tier: dram read failed");
      on.push_back(*x / 1e9);
      off.push_back(*y / 1e9);
    }
    results.push_back(FigureJson({"crc_cost/dram_read/256KiB", "GB/s", true, on, "dram_read_no_crc/256KiB", off,
                                  "DRAM tier reads verifying the CRC-32C vs not (memory-bound: the worst case)"}));
  }
  cleanup();
  report["suite"] = "tier";
  report["machine"] = MachineJson();
  report["repetitions"] = reps;
  report["file"] = file;
  report["ssd_path"] = describe;
  report["fio"] = !fio ? "fio not installed: no reference"
                 : "fio (" + FioEngineFor(file) + " --numjobs=1) on the same " + (on_device ? "device" : "file");
  if (!dir_note.empty()) report["note"] = dir_note;
  report["results"] = results;
  return report;
}

}  // namespace cxlkv::bench
