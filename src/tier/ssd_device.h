// The SSD tier (tier 2): one preallocated large file, or a raw block device, opened O_DIRECT and
// carved by the user-space SlotAllocator into slots of each block's size in 4 KiB units — no file
// per block, no file-system metadata per block (Unified KV pooling §IV-B "KV-passthrough", with
// io_uring in the place of SPDK). Slot s lies at byte s·4 KiB. A write gathers the payload into a staging
// buffer behind the 64-byte header (slot_format.h), seals it with its CRC-32C and writes
// header+payload rounded up to 4 KiB; a read fetches header+destination size, validates, and
// copies the payload out.
//
// I/O path, best first, each fallback taken automatically and said by Describe() (and each
// forceable by an option, so tests run them all):
//   io_uring, registered file and buffers  → unregistered buffers when registration is refused
//     (ENOMEM under a low RLIMIT_MEMLOCK)  → synchronous pread/pwrite when io_uring itself is
//     refused (EPERM under seccomp, ENOSYS).
//   O_DIRECT → buffered I/O when the file system refuses it (EINVAL), with fdatasync after each
//     write batch and fadvise(DONTNEED) after every batch so the page cache does not grow.
//   An NVMe generic device (/dev/ngXnY, a character device): NVMe passthrough — each transfer
//     an NVM read/write command in an io_uring IORING_OP_URING_CMD (nvme_command.h), past the
//     block layer; registered file and buffers, or unregistered buffers when the kernel refuses
//     fixed buffers for commands. No synchronous fallback exists for such a device (it has no
//     read/write): when passthrough is refused, Open fails naming the block device to give.
//
// Durability: a Write batch returns when its data reached the device (O_DIRECT completion, or
// fdatasync on the buffered path; on passthrough, an NVM flush after the batch, so a drive's
// volatile write cache holds nothing the catalog then names). With O_DIRECT on a file or block
// device, a drive's volatile cache may still hold it until the catalog's fdatasync flushes it.
// Thread-safety: as Device; batches are serialized by one mutex.
#ifndef CXLKV_SRC_TIER_SSD_DEVICE_H_
#define CXLKV_SRC_TIER_SSD_DEVICE_H_

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>

#include "tier/device.h"
#include "tier/io_platform.h"
#include "tier/ssd_engine.h"

namespace cxlkv::tier {

struct SsdOptions {
  std::string path;                 // required: a file (created if missing) or a block device
  uint32_t index = 0;               // the device's index in the pool (Table I device_idx)
  uint64_t size_bytes = 0;          // a file: preallocated to this size (never shrunk); 0: use
                                    // the existing file's size. A block device: 0 = all of it
  uint64_t slot_bytes = 256 << 10;  // the largest slot: default 256 KiB, header included; a
                                    // multiple of 4 KiB
  uint32_t queue_depth = 32;        // default 32: transfers in flight (staging: depth + up to 4)
  uint32_t spin_us = 20;            // default 20 µs of polling for a completion before sleeping
  bool create = true;               // default true: create a missing file (not its directory)
  // Force the fallbacks (tests; or an operator working around a broken kernel feature):
  bool use_io_uring = true;         // false: synchronous pread/pwrite
  bool register_buffers = true;     // false: io_uring with unregistered buffers
  bool direct_io = true;            // false: buffered I/O + fdatasync + fadvise(DONTNEED)
  IoPlatform* platform = nullptr;   // default: IoPlatform::Default()
};

// The I/O path a device ended up with.
struct SsdIoPath {
  bool io_uring = false;
  bool registered_buffers = false;
  bool registered_file = false;
  bool direct = false;
  bool block_device = false;
  bool nvme_passthrough = false;
  NvmeNamespace nvme;  // passthrough: the namespace
  std::string notes;  // every fallback taken and why ("" when none)
};

class SsdDevice final : public Device {
 public:
  // Fails with a message that says what to do: NotFound (no such file and create=false, or no
  // such directory), PermissionDenied (not readable and writable), InvalidArgument (too small
  // for one slot, bad slot size or depth), NoSpace (the file system cannot hold the size).
  static Result<std::unique_ptr<SsdDevice>> Open(const SsdOptions& options);
  ~SsdDevice() override;

  std::string Describe() const override;
  std::vector<Status> Write(std::span<const WriteItem> items) override;
  std::vector<Status> Read(std::span<ReadItem> items) override;

  const SsdIoPath& io_path() const { return path_; }
  const std::string& file() const { return file_; }

 private:
  SsdDevice(const SsdOptions& options, uint64_t size, int fd, std::byte* arena, size_t arena_bytes,
            SsdIoPath path);
  // The buffered path's substitute for O_DIRECT: data to the device, clean pages dropped. On
  // passthrough: the flush that makes a write batch durable.
  Status AfterBatch(bool wrote, uint64_t lo, uint64_t hi);
  Status FlushNvme(uint64_t offset);
  // Open's parts (ssd_device.cc; OpenNvme and its probe in ssd_nvme.cc).
  static Result<std::unique_ptr<SsdDevice>> OpenNvme(const SsdOptions& options, IoPlatform& pf);
  static int LockOwner(IoPlatform& pf, int fd);
  static Status InUseFailure(const std::string& path);
  static Status MapArena(const std::string& path, size_t bytes, void** out);
  // The tier's bytes on a device of `capacity` bytes (`what`: "block device /dev/sdb", for
  // messages): all of it, or the size asked when one was. Refuses a size larger than the
  // device and a device smaller than one slot.
  static Result<uint64_t> SizeOnDevice(const std::string& what, uint64_t capacity, const SsdOptions& options);
  static Status HoldsOneSlot(const std::string& what, uint64_t bytes, const SsdOptions& options);
  // Staging buffers for a ring of `depth`: one per transfer in flight and up to 4 more.
  static uint32_t RingStages(uint32_t depth) { return depth + std::min(depth, 4u); }
  // Sets up the passthrough ring and engine (registering buffers or not) and reads the first
  // 4 KiB through it: a kernel or drive that refuses the commands is found here, not on a spill.
  Status StartNvmeEngine(bool register_buffers, uint32_t spin_us, std::string* notes);

  std::mutex mu_;
  IoPlatform* const platform_;
  const std::string file_;
  const int fd_;
  std::byte* const arena_;
  const size_t arena_bytes_;
  const uint32_t depth_;
  SsdIoPath path_;
  std::unique_ptr<SlotIoEngine> engine_;  // GUARDED_BY(mu_)
};

// The bytes of a slot image on disk: header + payload rounded up to the 4 KiB I/O unit.
inline uint64_t DiskSpan(uint64_t image_bytes) { return (image_bytes + 4095) & ~uint64_t{4095}; }

}  // namespace cxlkv::tier

#endif  // CXLKV_SRC_TIER_SSD_DEVICE_H_
