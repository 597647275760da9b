// The two ways an SSD device moves slot images between its staging arena and the disk:
//
//   RingEngine  io_uring: up to `depth` transfers in flight, new ones queued as completions
//               come back and submitted with one io_uring_submit per round; a few staging
//               buffers beyond the depth let the CPU work of one item overlap the next transfers; completions reaped by spinning a bounded time, then a blocking wait (on a
//               two-core machine an idle device must not hold a core). Registered file and
//               registered buffer when the device could register them.
//   SyncEngine  pread/pwrite, one at a time: where io_uring is refused (seccomp, old kernel).
//
// Both retry EINTR/EAGAIN, continue a short transfer from where it stopped, and fail a transfer
// the device ended early (0 bytes) or refused with a Status naming the offset and the errno —
// never a silently short block.
// Thread-safety: an engine is used by one thread at a time (the device's lock).
#ifndef CXLKV_SRC_TIER_SSD_ENGINE_H_
#define CXLKV_SRC_TIER_SSD_ENGINE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cxlkv/status.h"
#include "tier/io_platform.h"

namespace cxlkv::tier {

// One transfer of a staging buffer: [stage, stage + len) to or from the disk at `offset`.
struct StagedIo {
  bool write = false;
  uint64_t offset = 0;
  uint32_t len = 0;
};

// Where the engines move bytes: a descriptor and an arena of `stages` buffers of `stage_bytes`.
struct EngineTarget {
  IoPlatform* platform = nullptr;
  int fd = -1;
  std::byte* arena = nullptr;
  uint64_t stage_bytes = 0;
  uint32_t stages = 0;  // staging buffers: the ring engine uses depth + a few (see ssd_engine.cc)
  uint32_t depth = 1;   // transfers in flight at most
  std::string name;  // the device, for messages
  // 0: the arena is one registered buffer. Else each stage is cut into pieces of this many bytes
  // (the last one shorter), one registered buffer each, and a transfer continues piece by piece:
  // a passthrough command's buffer must lie in a registered buffer of few enough pages for the
  // kernel's segment limit (ssd_nvme.cc), and the commands are cut at exactly this size.
  uint64_t register_piece = 0;
};

class SlotIoEngine {
 public:
  // prepare(i, stage) fills the staging buffer for transfer i (a write's slot image) and says
  // where it goes; done(i, stage, status) consumes it (a read's validation and copy-out) before
  // the buffer is reused.
  using Prepare = std::function<StagedIo(size_t i, std::byte* stage)>;
  using Done = std::function<void(size_t i, std::byte* stage, const Status& status)>;

  virtual ~SlotIoEngine() = default;
  virtual void Run(size_t count, const Prepare& prepare, const Done& done) = 0;
};

// Creates the io_uring engine: `ring` set up by the platform, with the file and the arena
// registered where possible. *notes gets what could not be registered and why.
std::unique_ptr<SlotIoEngine> MakeRingEngine(const EngineTarget& target, std::unique_ptr<IoRing> ring,
                                             bool register_buffers, uint32_t spin_us, std::string* notes,
                                             bool* buffers_registered, bool* file_registered);
std::unique_ptr<SlotIoEngine> MakeSyncEngine(const EngineTarget& target);

// How many registered buffers one stage is cut into (1 when register_piece is 0).
uint64_t PiecesPerStage(const EngineTarget& t);

// The Status for a failed transfer: NoSpace for ENOSPC/EDQUOT, IoError otherwise.
Status TransferFailure(const std::string& name, bool write, uint64_t offset, int neg_errno);

}  // namespace cxlkv::tier

#endif  // CXLKV_SRC_TIER_SSD_ENGINE_H_
