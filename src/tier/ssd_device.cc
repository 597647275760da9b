#include "tier/ssd_device.h"

#include <fcntl.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "util/units.h"

namespace cxlkv::tier {

namespace {

constexpr uint64_t kIoUnit = 4096;  // O_DIRECT alignment of offsets, lengths and buffers

Status OpenFailure(const std::string& path, int rc) {
  std::string what = "ssd tier: cannot open " + path + " for reading and writing: " + IoErrnoText(rc);
  switch (-rc) {
    case ENOENT:
    case ENOTDIR:
      return NotFound(what + "; its directory does not exist: create the directory or choose another path");
    case EACCES:
    case EPERM:
    case EROFS:
      return PermissionDenied(what + "; give a path this user can read and write (or fix its permissions)");
    case EISDIR:
      return InvalidArgument(what + "; the path is a directory: name a file inside it");
    default:
      return IoError(what);
  }
}

Status Validate(const SsdOptions& o) {
  if (o.path.empty()) return InvalidArgument("ssd tier: no path given: name a file or a block device");
  if (o.slot_bytes % kIoUnit != 0 || o.slot_bytes <= kSlotHeaderBytes || o.slot_bytes > (uint64_t{1} << 30)) {
    return InvalidArgument("ssd tier " + o.path + ": slot size " + std::to_string(o.slot_bytes) +
                           " must be a multiple of 4 KiB (the O_DIRECT unit), at most 1 GiB");
  }
  if (o.queue_depth == 0 || o.queue_depth > 4096) {
    return InvalidArgument("ssd tier " + o.path + ": queue depth " + std::to_string(o.queue_depth) +
                           " must be 1..4096");
  }
  return Status::Ok();
}

}  // namespace

// One owner per device: a second store on it would hand out the same slots and overwrite the
// first one's blocks and catalog. A process killed with the device open releases the lock when
// its last reference goes, which an io_uring's registered file delays past the exit a little: a
// restart waits that out (up to a second).
int SsdDevice::LockOwner(IoPlatform& pf, int fd) {
  int rc = pf.LockExclusive(fd);
  for (int tries = 0; rc == -EWOULDBLOCK && tries < 50; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    rc = pf.LockExclusive(fd);
  }
  return rc;
}

Status SsdDevice::InUseFailure(const std::string& path) {
  return Busy("ssd tier: " + path + " is in use by another process (another cxlkvd's or store's tier): "
              "give each node's tiers their own file or device");
}

// The staging arena: slot-sized, 4 KiB-aligned buffers, one per transfer in flight and up to 4
// more, in which the next items are prepared and the last ones checked while the device works.
Status SsdDevice::MapArena(const std::string& path, size_t bytes, void** out) {
  void* arena = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (arena == MAP_FAILED) {
    return NoSpace("ssd tier " + path + ": cannot map a staging arena of " + util::FormatBytes(bytes) + ": " +
                   std::strerror(errno) + "; lower the queue depth or the slot size");
  }
  *out = arena;
  return Status::Ok();
}

Status SsdDevice::HoldsOneSlot(const std::string& what, uint64_t bytes, const SsdOptions& o) {
  if (bytes >= o.slot_bytes) return Status::Ok();
  return InvalidArgument("ssd tier: " + what + " holds " + util::FormatBytes(bytes) + ", too small for one slot of " +
                         util::FormatBytes(o.slot_bytes) + ": give a larger size or a larger device");
}

Result<uint64_t> SsdDevice::SizeOnDevice(const std::string& what, uint64_t capacity, const SsdOptions& o) {
  if (o.size_bytes > capacity) {
    return InvalidArgument("ssd tier: " + what + " holds " + util::FormatBytes(capacity) + ", less than the " +
                           util::FormatBytes(o.size_bytes) + " asked: give a smaller size or 0 for all of it");
  }
  const uint64_t size = o.size_bytes > 0 ? o.size_bytes : capacity;
  CXLKV_RETURN_IF_ERROR(HoldsOneSlot(what, size, o));
  return size;
}

Result<std::unique_ptr<SsdDevice>> SsdDevice::Open(const SsdOptions& o) {
  CXLKV_RETURN_IF_ERROR(Validate(o));
  IoPlatform& pf = o.platform ? *o.platform : IoPlatform::Default();
  const std::string& path = o.path;
  DeviceFileFacts facts;
  int rc = pf.Stat(path, &facts);
  if (rc < 0) return OpenFailure(path, rc);
  if (!facts.exists) {
    if (!o.create) {
      return NotFound("ssd tier: " + path + " does not exist: create it (or let cxlkv create it) first");
    }
    if (o.size_bytes == 0) {
      return InvalidArgument("ssd tier: " + path + " does not exist and no size was given: give the tier a size "
                             "(e.g. --tier ssd:" + path + ":64G)");
    }
  }
  if (facts.is_char_device) return OpenNvme(o, pf);  // an NVMe generic device: passthrough (ssd_nvme.cc)
  const bool created = !facts.exists;
  const int flags = O_RDWR | (created ? O_CREAT | O_EXCL : 0);
  SsdIoPath io;
  io.direct = o.direct_io;
  int fd = pf.Open(path, flags | (io.direct ? O_DIRECT : 0), 0600);
  if (fd == -EINVAL && io.direct) {
    io.direct = false;
    io.notes += "; O_DIRECT refused by the file system (" + IoErrnoText(fd) + "): buffered I/O with fdatasync + "
                "fadvise(DONTNEED)";
    fd = pf.Open(path, flags, 0600);
  }
  if (fd < 0) return OpenFailure(path, fd);
  if (!o.direct_io) io.notes += "; O_DIRECT off by option: buffered I/O with fdatasync + fadvise(DONTNEED)";
  auto fail = [&](Status s) -> Status {
    pf.Close(fd);
    if (created) pf.Unlink(path);  // leave nothing behind that we made
    return s;
  };

  rc = LockOwner(pf, fd);
  if (rc == -EWOULDBLOCK) {
    pf.Close(fd);  // never unlinked: even one this call created may be the other process's now
    return InUseFailure(path);
  }
  if (rc < 0) return fail(IoError("ssd tier: cannot lock " + path + ": " + IoErrnoText(rc)));
  rc = pf.Fstat(fd, &facts);
  if (rc < 0) return fail(IoError("ssd tier: cannot stat " + path + ": " + IoErrnoText(rc)));
  uint64_t size = 0;
  if (facts.is_block_device) {
    io.block_device = true;
    Result<uint64_t> on_device = SizeOnDevice("block device " + path, facts.size, o);
    if (!on_device.ok()) return fail(on_device.status());
    size = *on_device;
  } else if (facts.is_regular) {
    size = o.size_bytes > 0 ? o.size_bytes : facts.size;
    if (Status s = HoldsOneSlot(path, size, o); !s.ok()) return fail(s);
    if (o.size_bytes > 0) {
      // Allocate every block now: a tier that does not fit fails here, not on a write hours later,
      // and the file has no holes (no block allocation on the write path).
      rc = pf.Fallocate(fd, size);
      if (rc == -ENOSPC || rc == -EDQUOT) {
        return fail(NoSpace("ssd tier: the file system of " + path + " cannot hold " + util::FormatBytes(size) + " (" +
                            util::FormatBytes(facts.fs_free_bytes) + " free): give a smaller size or another file system"));
      }
      if (rc == -EOPNOTSUPP && facts.size >= size) {
        io.notes += "; fallocate not supported by the file system (file already sized, may have holes)";
      } else if (rc < 0) {
        return fail(IoError("ssd tier: cannot preallocate " + util::FormatBytes(size) + " for " + path + ": " +
                            IoErrnoText(rc) + (rc == -EOPNOTSUPP ? "; preallocate the file yourself (e.g. with dd) "
                                                                   "and give size 0" : "")));
      }
    }
  } else {
    return fail(InvalidArgument("ssd tier: " + path + " is neither a regular file nor a block device"));
  }

  const uint32_t stages = o.use_io_uring ? RingStages(o.queue_depth) : 1;
  size_t arena_bytes = uint64_t{stages} * o.slot_bytes;
  void* arena = nullptr;
  if (Status s = MapArena(path, arena_bytes, &arena); !s.ok()) return fail(s);
  // Some file systems accept O_DIRECT at open and refuse it at the first transfer: try one.
  if (io.direct) {
    ssize_t n = pf.Pread(fd, arena, kIoUnit, 0);
    if (n == -EINVAL) {
      pf.Close(fd);
      fd = pf.Open(path, O_RDWR, 0600);
      if (fd < 0) {
        ::munmap(arena, arena_bytes);
        if (created) pf.Unlink(path);
        return OpenFailure(path, fd);
      }
      io.direct = false;
      io.notes += "; O_DIRECT refused at the first read (" + IoErrnoText(static_cast<int>(n)) +
                  "): buffered I/O with fdatasync + fadvise(DONTNEED)";
    }
  }
  auto dev = std::unique_ptr<SsdDevice>(
      new SsdDevice(o, size, fd, static_cast<std::byte*>(arena), arena_bytes, std::move(io)));
  EngineTarget target{&pf, fd, dev->arena_, o.slot_bytes, stages, o.queue_depth, "ssd tier " + path};
  if (o.use_io_uring) {
    std::unique_ptr<IoRing> ring;
    rc = pf.CreateRing(o.queue_depth, &ring);
    if (rc < 0) {
      dev->path_.notes += "; io_uring refused (" + IoErrnoText(rc) + "): synchronous pread/pwrite";
      target.stages = 1;
      target.depth = 1;
      dev->engine_ = MakeSyncEngine(target);
    } else {
      dev->path_.io_uring = true;
      dev->engine_ = MakeRingEngine(target, std::move(ring), o.register_buffers, o.spin_us, &dev->path_.notes,
                                    &dev->path_.registered_buffers, &dev->path_.registered_file);
    }
  } else {
    dev->path_.notes += "; io_uring off by option: synchronous pread/pwrite";
    dev->engine_ = MakeSyncEngine(target);
  }
  return dev;
}

SsdDevice::SsdDevice(const SsdOptions& o, uint64_t size, int fd, std::byte* arena, size_t arena_bytes,
                     SsdIoPath path)
    : Device(TierKind::kSsd, o.index, o.slot_bytes, kIoUnit, size, "ssd tier " + o.path),
      platform_(o.platform ? o.platform : &IoPlatform::Default()),
      file_(o.path),
      fd_(fd),
      arena_(arena),
      arena_bytes_(arena_bytes),
      depth_(o.queue_depth),
      path_(std::move(path)) {}

SsdDevice::~SsdDevice() {
  engine_.reset();  // the ring (and its buffer registration) goes before the arena
  ::munmap(arena_, arena_bytes_);
  platform_->Unlock(fd_);  // now: the ring's reference to the file may outlive this close a while
  platform_->Close(fd_);
}

std::string SsdDevice::Describe() const {
  std::string s = "ssd[" + std::to_string(index()) + "] " + file_ + ": " + util::FormatBytes(capacity_bytes()) +
                  (path_.nvme_passthrough ? " NVMe namespace" : path_.block_device ? " block device" : " file") +
                  ", slots of each block's size in 4 KiB units, up to " + util::FormatBytes(slot_bytes()) + "; ";
  if (path_.nvme_passthrough) {
    s += "NVMe passthrough (io_uring command) nsid " + std::to_string(path_.nvme.nsid) + ", " +
         std::to_string(path_.nvme.lba_bytes) + " B blocks, " + util::FormatBytes(path_.nvme.max_transfer_bytes) +
         " per command, depth " + std::to_string(depth_) + ", " +
         (path_.registered_buffers ? "registered buffers" : "unregistered buffers") + ", flush after each write batch";
    if (!path_.notes.empty()) s += " [fallbacks" + path_.notes + "]";
    return s;
  }
  if (path_.io_uring) {
    s += "io_uring depth " + std::to_string(depth_) + ", " +
         (path_.registered_file ? "registered file" : "plain file") + ", " +
         (path_.registered_buffers ? "registered buffers" : "unregistered buffers");
  } else {
    s += "synchronous pread/pwrite";
  }
  s += path_.direct ? ", O_DIRECT" : ", buffered (fdatasync + fadvise DONTNEED)";
  if (!path_.notes.empty()) s += " [fallbacks" + path_.notes + "]";
  return s;
}

Status SsdDevice::AfterBatch(bool wrote, uint64_t lo, uint64_t hi) {
  if (lo >= hi) return Status::Ok();
  if (path_.nvme_passthrough) return wrote ? FlushNvme(lo) : Status::Ok();
  if (path_.direct) return Status::Ok();
  if (wrote) {
    int rc = platform_->Fdatasync(fd_);
    if (rc < 0) {
      return TransferFailure(name(), true, lo, rc);
    }
  }
  // Advisory: a refusal only means the cache keeps the pages a while longer.
  (void)platform_->DropCache(fd_, lo, hi - lo);
  return Status::Ok();
}

std::vector<Status> SsdDevice::Write(std::span<const WriteItem> items) {
  std::vector<Status> out(items.size());
  std::vector<size_t> todo;
  std::vector<uint32_t> lens;
  todo.reserve(items.size());
  lens.reserve(items.size());
  uint64_t lo = UINT64_MAX, hi = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    uint32_t n = 0;
    out[i] = CheckWrite(items[i], &n);
    if (!out[i].ok()) continue;
    todo.push_back(i);
    lens.push_back(n);
    lo = std::min(lo, SlotOffset(items[i].slot));
    hi = std::max(hi, SlotOffset(items[i].slot) + DiskSpan(kSlotHeaderBytes + n));
  }
  std::lock_guard lock(mu_);
  engine_->Run(
      todo.size(),
      [&](size_t k, std::byte* stage) {
        const WriteItem& it = items[todo[k]];
        GatherPayload(it.payload, stage + kSlotHeaderBytes);
        SealSlot(stage, it.tag, lens[k]);
        uint64_t image = kSlotHeaderBytes + lens[k];
        uint64_t span = DiskSpan(image);
        std::memset(stage + image, 0, span - image);  // no stale staging bytes on the disk
        return StagedIo{true, SlotOffset(it.slot), static_cast<uint32_t>(span)};
      },
      [&](size_t k, std::byte*, const Status& st) { out[todo[k]] = st; });
  Status after = AfterBatch(true, lo, hi);
  for (size_t k = 0; k < todo.size(); ++k) {
    Status& st = out[todo[k]];
    if (st.ok() && !after.ok()) st = after;  // not durable: the caller must not index it
    CountWrite(st, lens[k]);
  }
  for (size_t i = 0; i < items.size(); ++i) {
    if (!out[i].ok() && (todo.empty() || !std::binary_search(todo.begin(), todo.end(), i))) CountWrite(out[i], 0);
  }
  return out;
}

std::vector<Status> SsdDevice::Read(std::span<ReadItem> items) {
  std::vector<Status> out(items.size());
  std::vector<size_t> todo;
  std::vector<uint32_t> spans;
  todo.reserve(items.size());
  spans.reserve(items.size());
  uint64_t lo = UINT64_MAX, hi = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    out[i] = CheckRead(items[i]);
    if (!out[i].ok()) {
      CountReadError();
      continue;
    }
    todo.push_back(i);
    spans.push_back(static_cast<uint32_t>(DiskSpan(ReadSpan(items[i]))));
    lo = std::min(lo, SlotOffset(items[i].slot));
    hi = std::max(hi, SlotOffset(items[i].slot) + spans.back());
  }
  std::lock_guard lock(mu_);
  engine_->Run(
      todo.size(),
      [&](size_t k, std::byte*) { return StagedIo{false, SlotOffset(items[todo[k]].slot), spans[k]}; },
      [&](size_t k, std::byte* stage, const Status& st) {
        if (!st.ok()) {
          out[todo[k]] = st;
          CountReadError();
          return;
        }
        out[todo[k]] = FinishRead(items[todo[k]], stage, spans[k]);
      });
  (void)AfterBatch(false, lo, hi);
  return out;
}

}  // namespace cxlkv::tier
