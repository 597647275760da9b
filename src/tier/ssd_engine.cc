#include "tier/ssd_engine.h"

#include <cerrno>
#include <algorithm>
#include <chrono>
#include <deque>

namespace cxlkv::tier {

namespace {

// EINTR/EAGAIN are transient: try again, but not forever (a device that answers EAGAIN for ever
// is broken, and the caller must hear of it).
constexpr int kMaxRetries = 64;

bool Transient(int neg_errno) { return neg_errno == -EINTR || neg_errno == -EAGAIN; }

struct Inflight {
  size_t item = 0;
  StagedIo io;
  uint32_t done = 0;     // bytes already transferred
  int retries = 0;
  bool busy = false;     // holds an item whose done() has not been called
  Status status;         // the outcome, once the transfer finished
};

// Stage life: free → prepared (ready) → in flight (at most `depth`) → finished → done() → free.
// There are a few more stages than the depth, so the CPU work of an item — a write's gather and
// CRC (prepare) and a read's validation and copy-out (done) — runs while the next transfers are
// already on the device: at queue depth 1 the device never waits for the CPU.
class RingEngine final : public SlotIoEngine {
 public:
  RingEngine(const EngineTarget& t, std::unique_ptr<IoRing> ring, bool fixed_buffers, bool fixed_file,
             uint32_t spin_us)
      : t_(t), ring_(std::move(ring)), fixed_buffers_(fixed_buffers), fixed_file_(fixed_file), spin_us_(spin_us),
        slots_(t.stages) {}

  void Run(size_t count, const Prepare& prepare, const Done& done) override {
    if (!broken_.ok()) {
      FailRest(0, count, done);
      return;
    }
    std::vector<uint32_t> free_stages;
    for (uint32_t s = t_.stages; s > 0; --s) free_stages.push_back(s - 1);
    std::deque<uint32_t> ready;        // prepared, not yet queued
    std::vector<uint32_t> requeue;     // in flight, to be queued again (retry, short transfer)
    std::vector<uint32_t> finished;    // transfer over, done() not yet called
    size_t next = 0;
    uint32_t inflight = 0;
    auto prepare_free = [&] {
      while (next < count && !free_stages.empty()) {
        uint32_t s = free_stages.back();
        free_stages.pop_back();
        slots_[s] = Inflight{next, prepare(next, Stage(s)), 0, 0, true, Status::Ok()};
        ready.push_back(s);
        ++next;
      }
    };
    prepare_free();
    while (!ready.empty() || inflight > 0 || !finished.empty()) {
      // Queue retries and ready items up to the depth; one submit for all. A ring without room
      // for an item's submissions (a passthrough transfer takes one per command) keeps the item
      // for a later round, after completions made room.
      uint32_t queued = 0;
      std::vector<uint32_t> waiting;
      for (uint32_t s : requeue) {
        if (QueueStage(s)) ++queued;
        else waiting.push_back(s);
      }
      requeue.swap(waiting);
      while (inflight < t_.depth && !ready.empty() && QueueStage(ready.front())) {
        ready.pop_front();
        ++inflight;
        ++queued;
      }
      if (inflight == requeue.size() && queued == 0 && (!requeue.empty() || !ready.empty())) {
        // Nothing in the ring and still no room: it can never take this transfer.
        Break(-EOVERFLOW, finished, done);  // every prepared item, ready ones included, fails
        FailRest(next, count, done);
        return;
      }
      if (queued > 0) {
        int rc = ring_->Submit();
        for (int r = 0; rc < 0 && Transient(rc) && r < kMaxRetries; ++r) rc = ring_->Submit();
        if (rc < 0) {
          // The ring refused the batch: its state is unknown, so it is not used again (the
          // device reports every later batch as failed with this reason).
          Break(rc, finished, done);
          FailRest(next, count, done);
          return;
        }
      }
      // The CPU work of finished items and of the next ones, while the device works.
      for (uint32_t s : finished) {
        Finish(s, done);
        free_stages.push_back(s);
      }
      finished.clear();
      prepare_free();
      if (inflight == requeue.size()) continue;  // nothing in the ring to wait for
      // Reap: spin briefly (a completion is usually microseconds away at depth), then sleep.
      RingCompletion c;
      bool got = ring_->Peek(&c) == 1;
      if (!got && spin_us_ > 0) {
        auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
        while (!got && std::chrono::steady_clock::now() < until) got = ring_->Peek(&c) == 1;
      }
      if (!got) {
        int rc = ring_->Wait(&c);
        if (rc < 0) {
          Break(rc, finished, done);
          FailRest(next, count, done);
          return;
        }
      }
      do {
        uint32_t s = static_cast<uint32_t>(c.user_data);
        if (Complete(s, c)) {
          finished.push_back(s);
          --inflight;
        } else {
          requeue.push_back(s);
        }
      } while (ring_->Peek(&c) == 1);
    }
  }

 private:
  std::byte* Stage(uint32_t s) const { return t_.arena + uint64_t{s} * t_.stage_bytes; }

  // The registered buffer holding byte `at` of stage s (EngineTarget::register_piece).
  int BufferIndex(uint32_t s, uint32_t at) const {
    if (t_.register_piece == 0) return 0;
    return static_cast<int>(s * PiecesPerStage(t_) + at / t_.register_piece);
  }

  bool QueueStage(uint32_t s) {
    Inflight& f = slots_[s];
    RingOp op;
    op.write = f.io.write;
    op.fd = fixed_file_ ? 0 : t_.fd;
    op.fixed_file = fixed_file_;
    op.buf = Stage(s) + f.done;
    op.len = f.io.len - f.done;
    op.offset = f.io.offset + f.done;
    op.buf_index = fixed_buffers_ ? BufferIndex(s, f.done) : -1;
    op.user_data = s;
    return ring_->Queue(op);
  }

  // Returns true when the transfer is over (its status set), false to queue it again.
  bool Complete(uint32_t s, const RingCompletion& c) {
    Inflight& f = slots_[s];
    const int32_t res = c.res;
    if (res < 0 && Transient(res) && ++f.retries <= kMaxRetries) return false;
    if (res < 0) {
      f.status = TransferFailure(t_.name, f.io.write, f.io.offset + f.done, res);
      if (c.nvme_status != 0) f.status = IoError(f.status.message() + ": " + NvmeStatusText(c.nvme_status));
      return true;
    }
    if (res == 0 && f.done < f.io.len) {
      f.status = IoError(t_.name + ": " + (f.io.write ? "write" : "read") + " at offset " +
                         std::to_string(f.io.offset + f.done) + " transferred 0 of " +
                         std::to_string(f.io.len - f.done) + " bytes (end of the device?)");
      return true;
    }
    f.done += static_cast<uint32_t>(res);
    if (f.done < f.io.len) return false;  // short: continue from where it stopped
    f.status = Status::Ok();
    return true;
  }

  void Finish(uint32_t s, const Done& done) {
    slots_[s].busy = false;
    done(slots_[s].item, Stage(s), slots_[s].status);
  }

  void Break(int rc, const std::vector<uint32_t>& finished, const Done& done) {
    broken_ = IoError(t_.name + ": the io_uring failed (" + IoErrnoText(rc) +
                      "); reopen the device (it falls back to synchronous I/O if io_uring stays refused)");
    for (uint32_t s : finished) Finish(s, done);  // these completed: their own outcome
    for (uint32_t s = 0; s < t_.stages; ++s) {
      if (slots_[s].busy) {
        slots_[s].status = broken_;
        Finish(s, done);
      }
    }
  }

  // Items never prepared still get their done() call, with the ring's failure.
  void FailRest(size_t next, size_t count, const Done& done) {
    for (size_t i = next; i < count; ++i) done(i, nullptr, broken_);
  }

  EngineTarget t_;
  std::unique_ptr<IoRing> ring_;
  const bool fixed_buffers_;
  const bool fixed_file_;
  const uint32_t spin_us_;
  std::vector<Inflight> slots_;
  Status broken_;
};

class SyncEngine final : public SlotIoEngine {
 public:
  explicit SyncEngine(const EngineTarget& t) : t_(t) {}

  void Run(size_t count, const Prepare& prepare, const Done& done) override {
    std::byte* stage = t_.arena;
    for (size_t i = 0; i < count; ++i) {
      StagedIo io = prepare(i, stage);
      done(i, stage, Transfer(io, stage));
    }
  }

 private:
  Status Transfer(const StagedIo& io, std::byte* stage) {
    uint32_t moved = 0;
    int retries = 0;
    while (moved < io.len) {
      ssize_t n = io.write ? t_.platform->Pwrite(t_.fd, stage + moved, io.len - moved, io.offset + moved)
                           : t_.platform->Pread(t_.fd, stage + moved, io.len - moved, io.offset + moved);
      if (n < 0 && Transient(static_cast<int>(n)) && ++retries <= kMaxRetries) continue;
      if (n < 0) return TransferFailure(t_.name, io.write, io.offset + moved, static_cast<int>(n));
      if (n == 0) {
        return IoError(t_.name + ": " + (io.write ? "write" : "read") + " at offset " +
                       std::to_string(io.offset + moved) + " transferred 0 of " + std::to_string(io.len - moved) +
                       " bytes (end of the device?)");
      }
      moved += static_cast<uint32_t>(n);  // short: continue from where it stopped
    }
    return Status::Ok();
  }

  EngineTarget t_;
};

}  // namespace

uint64_t PiecesPerStage(const EngineTarget& t) {
  return t.register_piece == 0 ? 1 : (t.stage_bytes + t.register_piece - 1) / t.register_piece;
}

Status TransferFailure(const std::string& name, bool write, uint64_t offset, int neg_errno) {
  std::string what = name + ": " + (write ? "write" : "read") + " at offset " + std::to_string(offset) +
                     " failed: " + IoErrnoText(neg_errno);
  if (neg_errno == -ENOSPC || neg_errno == -EDQUOT) {
    return NoSpace(what + "; the file system under the tier is full: free space there or give a preallocated file");
  }
  return IoError(what);
}

std::unique_ptr<SlotIoEngine> MakeRingEngine(const EngineTarget& target, std::unique_ptr<IoRing> ring,
                                             bool register_buffers, uint32_t spin_us, std::string* notes,
                                             bool* buffers_registered, bool* file_registered) {
  int rc = ring->RegisterFile(target.fd);
  *file_registered = rc == 0;
  if (rc < 0) *notes += "; file not registered (" + IoErrnoText(rc) + ")";
  *buffers_registered = false;
  if (register_buffers) {
    std::vector<RegisteredSpan> spans;
    if (target.register_piece == 0) {
      spans.push_back({target.arena, uint64_t{target.stages} * target.stage_bytes});
    } else {
      for (uint32_t s = 0; s < target.stages; ++s) {
        for (uint64_t at = 0; at < target.stage_bytes; at += target.register_piece) {
          spans.push_back({target.arena + uint64_t{s} * target.stage_bytes + at,
                           std::min(target.register_piece, target.stage_bytes - at)});
        }
      }
    }
    rc = ring->RegisterBuffers(spans);
    *buffers_registered = rc == 0;
    if (rc < 0) {
      *notes += "; buffers not registered (" + IoErrnoText(rc) +
                (rc == -ENOMEM ? ": RLIMIT_MEMLOCK too low? raise it with ulimit -l" : "") +
                "): io_uring with unregistered buffers";
    }
  } else {
    *notes += "; buffers not registered (turned off by option)";
  }
  return std::make_unique<RingEngine>(target, std::move(ring), *buffers_registered, *file_registered, spin_us);
}

std::unique_ptr<SlotIoEngine> MakeSyncEngine(const EngineTarget& target) { return std::make_unique<SyncEngine>(target); }

}  // namespace cxlkv::tier
