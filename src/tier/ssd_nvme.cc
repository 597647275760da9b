// The SSD tier on an NVMe generic device (/dev/ngXnY): NVMe passthrough through io_uring
// (ssd_device.h, nvme_command.h). Opening one identifies the namespace, checks its format, sets
// up a 128-byte-submission ring and proves it with one read before the device serves anything.
#include <fcntl.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>

#include "tier/ssd_device.h"
#include "util/units.h"

namespace cxlkv::tier {

namespace {

// "/dev/ng0n1" → "/dev/nvme0n1": the block device of the same namespace, for messages.
std::string BlockDeviceOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string dir = path.substr(0, slash + 1);
  const std::string name = path.substr(slash + 1);
  if (name.rfind("ng", 0) == 0) return dir + "nvme" + name.substr(2);
  return "the namespace's block device (/dev/nvmeXnY)";
}

Status IdentifyFailure(const std::string& path, int rc, const std::string& why) {
  const std::string use = "; give " + BlockDeviceOf(path) + ", a file, or another path";
  switch (-rc) {
    case ENOTTY:
    case EINVAL:
      if (why.empty()) {
        return InvalidArgument("ssd tier: " + path + " is a character device but not an NVMe namespace (" +
                               IoErrnoText(rc) + ")" + use);
      }
      return InvalidArgument("ssd tier: " + why + use);
    case EACCES:
    case EPERM:
      return PermissionDenied("ssd tier: " + path + ": the NVMe identify command was refused (" + IoErrnoText(rc) +
                              "): run the daemon with CAP_SYS_ADMIN" + use);
    default:
      return IoError("ssd tier: " + path + ": NVMe identify failed: " + (why.empty() ? IoErrnoText(rc) : why));
  }
}

}  // namespace

Result<std::unique_ptr<SsdDevice>> SsdDevice::OpenNvme(const SsdOptions& o, IoPlatform& pf) {
  const std::string& path = o.path;
  if (!o.use_io_uring) {
    return InvalidArgument("ssd tier: " + path + " is an NVMe generic device, driven only by io_uring passthrough, "
                           "and io_uring is off by option: give " + BlockDeviceOf(path) + " for synchronous I/O");
  }
  int fd = pf.Open(path, O_RDWR, 0);
  if (fd < 0) {
    if (fd == -EACCES || fd == -EPERM) {
      return PermissionDenied("ssd tier: cannot open " + path + " for reading and writing: " + IoErrnoText(fd) +
                              "; give this user access to the device (or run the daemon as its owner)");
    }
    return IoError("ssd tier: cannot open " + path + ": " + IoErrnoText(fd));
  }
  auto fail = [&](Status s) -> Status {
    pf.Close(fd);
    return s;
  };
  int rc = LockOwner(pf, fd);
  if (rc == -EWOULDBLOCK) return fail(InUseFailure(path));
  if (rc < 0) return fail(IoError("ssd tier: cannot lock " + path + ": " + IoErrnoText(rc)));

  SsdIoPath io;
  io.nvme_passthrough = true;
  io.direct = true;  // past the page cache by construction
  std::string why;
  rc = pf.NvmeIdentify(fd, path, &io.nvme, &why);
  if (rc < 0) return fail(IdentifyFailure(path, rc, why));
  if (Status s = CheckNamespaceUsable(path, io.nvme); !s.ok()) return fail(s);
  Result<uint64_t> size = SizeOnDevice("NVMe namespace " + path, io.nvme.bytes(), o);
  if (!size.ok()) return fail(size.status());
  const uint32_t stages = RingStages(o.queue_depth);
  const size_t arena_bytes = uint64_t{stages} * o.slot_bytes;
  void* arena = nullptr;
  if (Status s = MapArena(path, arena_bytes, &arena); !s.ok()) return fail(s);
  auto dev = std::unique_ptr<SsdDevice>(
      new SsdDevice(o, *size, fd, static_cast<std::byte*>(arena), arena_bytes, std::move(io)));
  // From here the device owns fd and arena: its destructor releases them on every failure.
  std::string notes;
  Status started = dev->StartNvmeEngine(o.register_buffers, o.spin_us, &notes);
  if (!started.ok() && dev->path_.registered_buffers) {
    // Registered buffers for commands (IORING_URING_CMD_FIXED, Linux 6.1) are refused by older
    // kernels, and by any that finds a piece too large for its queue's segment limit (EINVAL):
    // the same command with a plain buffer, which the kernel maps per command, works.
    notes = "; registered buffers refused for NVMe commands (" + started.message() + "): unregistered buffers";
    std::string ignored;
    started = dev->StartNvmeEngine(/*register_buffers=*/false, o.spin_us, &ignored);
  }
  if (!started.ok()) {
    return Status(started.code(), started.code() == StatusCode::kIoError
                                      ? "ssd tier: an NVMe passthrough read failed (" + started.message() + "): give " +
                                            BlockDeviceOf(path) + " instead"
                                      : started.message());
  }
  dev->path_.notes += notes;
  return dev;
}

Status SsdDevice::StartNvmeEngine(bool register_buffers, uint32_t spin_us, std::string* notes) {
  engine_.reset();  // a ring being replaced goes (with its registrations) before the new one
  const std::string use = ": give " + BlockDeviceOf(file_) + " instead";
  // Room for every command of `depth` transfers in flight at once (io_uring takes up to 32768).
  const uint64_t commands_per_slot = (slot_bytes() + NvmeCommandCap(path_.nvme) - 1) / NvmeCommandCap(path_.nvme);
  if (commands_per_slot > 32768) {
    return InvalidArgument("ssd tier: " + file_ + ": a slot of " + util::FormatBytes(slot_bytes()) + " takes " +
                           std::to_string(commands_per_slot) + " commands of " +
                           util::FormatBytes(NvmeCommandCap(path_.nvme)) + ", more than a ring holds: use smaller slots");
  }
  const auto entries = static_cast<unsigned>(std::min<uint64_t>(uint64_t{depth_} * commands_per_slot, 32768));
  std::unique_ptr<IoRing> ring;
  int rc = platform_->CreateNvmeRing(entries, path_.nvme, &ring);
  if (rc == -EINVAL) {
    return NotSupported("ssd tier: " + file_ + ": this kernel's io_uring cannot carry NVMe commands (128-byte "
                        "submissions need Linux 5.19 or later)" + use);
  }
  if (rc < 0) {
    return NotSupported("ssd tier: " + file_ + ": io_uring refused (" + IoErrnoText(rc) +
                        "), and an NVMe generic device has no synchronous path" + use);
  }
  const uint32_t stages = static_cast<uint32_t>(arena_bytes_ / slot_bytes());
  EngineTarget target{platform_, fd_, arena_, slot_bytes(), stages, depth_, name()};
  // One registered buffer per command-sized piece of each stage: the kernel maps a command's
  // registered buffer as a whole, from the command's start to the buffer's end, and refuses one
  // of more pages than its segment limit (Debian's 6.1: EINVAL for a 72 MiB arena registered as
  // one buffer); pieces of exactly the command size keep every command inside one of them.
  target.register_piece = NvmeCommandCap(path_.nvme);
  path_.io_uring = true;
  engine_ = MakeRingEngine(target, std::move(ring), register_buffers, spin_us, notes, &path_.registered_buffers,
                           &path_.registered_file);
  // One read of the first 4 KiB proves the path: the command set, the buffer mapping, the
  // namespace id. Its bytes are not used (slot 0's header is validated on its own reads).
  Status probe;
  engine_->Run(
      1, [](size_t, std::byte*) { return StagedIo{false, 0, 4096}; },
      [&](size_t, std::byte*, const Status& st) { probe = st; });
  if (!probe.ok()) {
    engine_.reset();
    return probe;
  }
  return Status::Ok();
}

Status SsdDevice::FlushNvme(uint64_t offset) {
  uint32_t status = 0;
  int rc = platform_->NvmeFlush(fd_, path_.nvme.nsid, &status);
  if (rc == 0) return Status::Ok();
  Status s = TransferFailure(name(), true, offset, rc);
  return IoError(s.message() + " (the flush after the batch" + (status ? ": " + NvmeStatusText(status) : "") + ")");
}

}  // namespace cxlkv::tier
