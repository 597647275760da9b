// Where each device's I/O worker runs (docs/tiers.md, "Worker placement"). A disk completes
// its I/O with interrupts on the CPUs its interrupt vectors are routed to; the completion work
// (block layer, io_uring's completion) runs there too. A memory-bound worker that shares such a
// CPU loses a share of it to every completion: on the 2-core VM the DRAM worker slowed by ~20%
// while the SSD read, and combined retrieval fell to 0.79 of the sum of the devices alone. So
// when a disk's completions land on a strict subset of the CPUs this process may use, its
// worker is bound there and the node-DRAM workers to the others; otherwise (spread interrupts,
// as NVMe's per-queue vectors are, or nothing known) no worker is bound.
// Thread-safety: pure functions, except BindThisThread (the calling thread's affinity).
#ifndef CXLKV_SRC_TIER_WORKER_AFFINITY_H_
#define CXLKV_SRC_TIER_WORKER_AFFINITY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "cxlkv/status.h"
#include "tier/device.h"

namespace cxlkv::tier {

// "0-3,6" → {0, 1, 2, 3, 6}; malformed or out-of-range (>= 4096) text → empty.
std::vector<int> ParseCpuList(const std::string& text);
std::string FormatCpuList(const std::vector<int>& cpus);

// The CPUs that take the interrupts of the disk with device number major:minor (a partition
// counts as its disk), read from sysfs (`sys_root`, normally "/sys") and procfs (`proc_root`):
// the disk's PCI function's MSI vectors (or its legacy irq), each vector's effective affinity.
// Empty when any of it is unknown.
std::vector<int> CompletionCpusOfDevice(uint32_t major, uint32_t minor, const std::string& sys_root = "/sys",
                                        const std::string& proc_root = "/proc");
// The same for the disk holding `path` (a file, or a block device itself).
std::vector<int> CompletionCpus(const std::string& path);

// One device as placement sees it.
struct WorkerInput {
  TierKind kind = TierKind::kMem;
  std::vector<int> completion_cpus;  // SSD: CompletionCpus of its file; memory: empty
};
struct WorkerPlacement {
  std::vector<std::vector<int>> cpus;  // per device: the CPUs its worker is bound to (empty: unbound)
  std::string summary;                 // one line for the log and `cxlkv stat`
};
// `allowed`: the CPUs this process may run on (sched_getaffinity).
WorkerPlacement PlaceWorkers(const std::vector<WorkerInput>& devices, const std::vector<int>& allowed);
// The CPUs this process may run on.
std::vector<int> AllowedCpus();
// Binds the calling thread to `cpus` (no-op for an empty set). Returns 0 or -errno.
int BindThisThread(const std::vector<int>& cpus);

}  // namespace cxlkv::tier

#endif  // CXLKV_SRC_TIER_WORKER_AFFINITY_H_
