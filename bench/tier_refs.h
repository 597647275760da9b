// The references `cxlkv bench tier` measures the SSD tier against, on the same file system in the
// same run: fio (io_uring, O_DIRECT, same block size, depth and job count) on the same file, and
// a file-per-object store through the file system (one file per block, write + fsync, read —
// what LMCache's local disk backend and SGLang's file backend do).
#ifndef CXLKV_BENCH_TIER_REFS_H_
#define CXLKV_BENCH_TIER_REFS_H_

#include <cstdint>
#include <string>

#include "cxlkv/status.h"

namespace cxlkv::bench {

// True when a `fio` binary is on PATH.
bool FioAvailable();

// fio's engine options for `file`, as RunFio passes them: "--ioengine=io_uring_cmd
// --cmd_type=nvme" for an NVMe generic device (a character device: what the tier drives by
// passthrough), "--ioengine=io_uring --direct=1 --invalidate=1" for a file or block device.
std::string FioEngineFor(const std::string& file);

// Runs fio once on `file` over [0, bytes): rw "read" or "write", sequential, block size `bs`,
// `iodepth`, numjobs=1, ioengine=io_uring, direct=1, --output-format=json. Returns bytes/s.
Result<double> RunFio(const std::string& file, const std::string& rw, uint64_t bs, uint32_t iodepth,
                      uint64_t bytes);

// One file per block under `dir`: writes `count` blocks of `bs` bytes (open, write, fsync,
// close; then drops the file's cached pages so the read comes from the disk), then reads them
// back (open, read, close). Returns {write bytes/s, read bytes/s}; removes the files.
struct FilePerObjectResult {
  double write_bytes_per_s = 0;
  double read_bytes_per_s = 0;
};
Result<FilePerObjectResult> RunFilePerObject(const std::string& dir, uint64_t bs, uint32_t count);

// The page cache's size now (/proc/meminfo "Cached"), bytes: machine-wide, so other processes'
// file I/O shows in it too.
uint64_t PageCacheBytes();

// Bytes of `file` resident in the page cache now (mincore over a mapping of it): the tier's own
// share, which O_DIRECT should keep at zero.
uint64_t FileCachedBytes(const std::string& file);

}  // namespace cxlkv::bench

#endif  // CXLKV_BENCH_TIER_REFS_H_
