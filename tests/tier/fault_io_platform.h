// An IoPlatform that injects faults into the real one (CONVENTIONS: "the platform behind one
// seam"): refuses io_uring, buffer registration or O_DIRECT; turns scripted reads/writes into an
// errno or a short transfer, on the synchronous path and on the ring's completions alike.
#ifndef CXLKV_TESTS_TIER_FAULT_IO_PLATFORM_H_
#define CXLKV_TESTS_TIER_FAULT_IO_PLATFORM_H_

#include <fcntl.h>

#include <algorithm>
#include <deque>
#include <map>
#include <memory>

#include "tier/io_platform.h"

namespace cxlkv::tier::testing {

// A scripted outcome for one transfer: errno < 0 → that error (the sync path does not transfer;
// the ring path has transferred, which is harmless: the retry writes the same bytes); short_to >
// 0 → at most that many bytes reported.
struct Fault {
  int neg_errno = 0;
  uint32_t short_to = 0;
};

class FaultIoPlatform : public IoPlatform {
 public:
  int ring_error = 0;             // CreateRing fails with it
  int register_buffer_error = 0;  // the ring's RegisterBuffers fails with it
  int open_direct_error = 0;      // Open with O_DIRECT fails with it
  int open_error = 0;             // every Open fails with it
  int fallocate_error = 0;
  int fdatasync_error = 0;
  std::deque<Fault> write_faults, read_faults;  // consumed in order, one per transfer
  int transfers = 0;                            // transfers seen (both paths)

  int Open(const std::string& path, int flags, mode_t mode) override {
    if (open_error) return open_error;
    if ((flags & O_DIRECT) && open_direct_error) return open_direct_error;
    return IoPlatform::Open(path, flags, mode);
  }
  int Fallocate(int fd, uint64_t size) override {
    return fallocate_error ? fallocate_error : IoPlatform::Fallocate(fd, size);
  }
  int Fdatasync(int fd) override { return fdatasync_error ? fdatasync_error : IoPlatform::Fdatasync(fd); }

  ssize_t Pread(int fd, void* buf, size_t len, uint64_t offset) override {
    Fault f;
    if (Next(&read_faults, &f) && f.neg_errno) return f.neg_errno;
    return IoPlatform::Pread(fd, buf, f.short_to ? std::min<size_t>(len, f.short_to) : len, offset);
  }
  ssize_t Pwrite(int fd, const void* buf, size_t len, uint64_t offset) override {
    Fault f;
    if (Next(&write_faults, &f) && f.neg_errno) return f.neg_errno;
    return IoPlatform::Pwrite(fd, buf, f.short_to ? std::min<size_t>(len, f.short_to) : len, offset);
  }

  int CreateRing(unsigned depth, std::unique_ptr<IoRing>* out) override {
    if (ring_error) return ring_error;
    std::unique_ptr<IoRing> real;
    int rc = IoPlatform::CreateRing(depth, &real);
    if (rc < 0) return rc;
    *out = std::make_unique<Ring>(this, std::move(real));
    return 0;
  }

  // Takes the next scripted fault of a direction, if any. (SsdDevice::Open's O_DIRECT check reads
  // once through Pread: script read faults after Open.)
  bool Next(std::deque<Fault>* q, Fault* f) {
    ++transfers;
    if (q->empty()) return false;
    *f = q->front();
    q->pop_front();
    return true;
  }

 private:
  class Ring : public IoRing {
   public:
    Ring(FaultIoPlatform* p, std::unique_ptr<IoRing> real) : p_(p), real_(std::move(real)) {}
    int RegisterFile(int fd) override { return real_->RegisterFile(fd); }
    int RegisterBuffers(std::span<const RegisteredSpan> spans) override {
      return p_->register_buffer_error ? p_->register_buffer_error : real_->RegisterBuffers(spans);
    }
    bool Queue(const RingOp& op) override {
      writes_[op.user_data] = op.write;
      return real_->Queue(op);
    }
    int Submit() override { return real_->Submit(); }
    int Peek(RingCompletion* out) override {
      int rc = real_->Peek(out);
      if (rc == 1) Inject(out);
      return rc;
    }
    int Wait(RingCompletion* out) override {
      int rc = real_->Wait(out);
      if (rc == 0) Inject(out);
      return rc;
    }

   private:
    void Inject(RingCompletion* c) {
      Fault f;
      if (!p_->Next(writes_[c->user_data] ? &p_->write_faults : &p_->read_faults, &f)) return;
      if (f.neg_errno) {
        c->res = f.neg_errno;
      } else if (f.short_to && c->res > 0) {
        c->res = std::min<int32_t>(c->res, static_cast<int32_t>(f.short_to));
      }
    }
    FaultIoPlatform* p_;
    std::unique_ptr<IoRing> real_;
    std::map<uint64_t, bool> writes_;
  };
};

}  // namespace cxlkv::tier::testing

#endif  // CXLKV_TESTS_TIER_FAULT_IO_PLATFORM_H_
