// An IoPlatform with an NVMe namespace in it: a path that is a character device whose identify
// page, flush and passthrough ring are played by the test over a backing regular file (the
// namespace's media). The ring executes the very commands nvme_command.h builds, checks them as
// a drive and the kernel would (block-aligned, within the namespace, within the per-command
// limit), and completes them the passthrough way (0, −errno, or an NVMe status), so the SSD
// device's passthrough path runs end to end without a drive. The real drive path runs under
// scripts/nvme-vm (tests NvmeDrive.*).
#ifndef CXLKV_TESTS_TIER_FAKE_NVME_PLATFORM_H_
#define CXLKV_TESTS_TIER_FAKE_NVME_PLATFORM_H_

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <vector>

#include "tier/io_platform.h"
#include "tier/nvme_command.h"

namespace cxlkv::tier::testing {

class FakeNvmePlatform : public IoPlatform {
 public:
  // `device` is the path the tier is given; `media` the regular file that holds its blocks.
  FakeNvmePlatform(std::string device, std::string media, uint64_t bytes, uint32_t lba_bytes)
      : device_(std::move(device)), media_(std::move(media)) {
    ns.nsid = 1;
    ns.lba_bytes = lba_bytes;
    ns.blocks = bytes / lba_bytes;
    ns.max_transfer_bytes = 128 << 10;
    int fd = ::open(media_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd >= 0) {
      (void)::ftruncate(fd, static_cast<off_t>(bytes));
      ::close(fd);
    }
  }
  ~FakeNvmePlatform() override { ::unlink(media_.c_str()); }

  NvmeNamespace ns;                 // what identify reports (max_transfer_bytes included)
  uint8_t format_in_use = 0;        // FLBAS low bits written into the identify page
  int identify_error = 0;           // NvmeIdentify fails with it
  int ring_error = 0;               // CreateNvmeRing fails with it
  bool refuse_fixed_buffers = false;  // commands naming a registered buffer fail with -EINVAL
  int flush_error = 0;
  uint32_t flush_status = 0;        // an NVMe status for the flush
  std::deque<uint32_t> read_statuses;  // NVMe statuses for the next read commands (0 = fine)
  int flushes = 0, commands = 0, fixed_commands = 0;
  uint32_t largest_command = 0;
  uint32_t most_in_flight = 0;  // transfers submitted together at most
  int transfers_queued = 0;     // ops the engine queued (each one or more commands)

  int Stat(const std::string& path, DeviceFileFacts* out) override {
    if (path != device_) return IoPlatform::Stat(path, out);
    *out = DeviceFileFacts{};
    out->exists = true;
    out->is_char_device = true;
    return 0;
  }
  int Open(const std::string& path, int flags, mode_t mode) override {
    return IoPlatform::Open(path == device_ ? media_ : path, flags, mode);
  }
  int NvmeIdentify(int, const std::string& path, NvmeNamespace* out, std::string* why) override {
    if (identify_error) return identify_error;
    // The page a drive would return, read back by the production parser.
    std::vector<std::byte> page(kNvmeIdentifyBytes);
    const uint64_t nsze = ns.blocks;
    std::memcpy(page.data(), &nsze, 8);
    page[25] = std::byte{1};  // two formats
    page[26] = std::byte{format_in_use};
    auto lbaf = [&](int i, uint32_t lba, uint32_t ms) {
      const uint32_t v = (static_cast<uint32_t>(__builtin_ctz(lba)) << 16) | ms;
      std::memcpy(page.data() + 128 + 4 * i, &v, 4);
    };
    lbaf(0, ns.lba_bytes, ns.metadata_bytes);
    lbaf(1, 4096, 8);
    Status s = ParseIdentifyNamespace(page, out);
    if (!s.ok()) {
      *why = path + ": " + s.message();
      return -EINVAL;
    }
    out->nsid = ns.nsid;
    out->max_transfer_bytes = ns.max_transfer_bytes;
    return 0;
  }
  int NvmeFlush(int, uint32_t nsid, uint32_t* nvme_status) override {
    *nvme_status = 0;
    ++flushes;
    if (nsid != ns.nsid) return -EINVAL;
    if (flush_error) return flush_error;
    if (flush_status) {
      *nvme_status = flush_status;
      return -EIO;
    }
    return 0;
  }
  int CreateNvmeRing(unsigned, const NvmeNamespace& n, std::unique_ptr<IoRing>* out) override {
    if (ring_error) return ring_error;
    *out = std::make_unique<Ring>(this, n);
    return 0;
  }

 private:
  // Executes each command at Submit, completing it in order.
  class Ring : public IoRing {
   public:
    Ring(FakeNvmePlatform* p, const NvmeNamespace& n) : p_(p), ns_(n) {}
    int RegisterFile(int fd) override {
      fd_ = fd;
      return 0;
    }
    int RegisterBuffers(std::span<const RegisteredSpan> spans) override {
      buffers_.assign(spans.begin(), spans.end());
      return 0;
    }
    // A transfer's commands as the Linux ring makes them (SplitNvmeIo), executed at Submit.
    bool Queue(const RingOp& op) override {
      ++p_->transfers_queued;
      queued_.push_back({SplitNvmeIo(op.write, ns_, op.buf, op.len, op.offset), op});
      return true;
    }
    int Submit() override {
      const int n = static_cast<int>(queued_.size());
      for (const Pending& q : queued_) {
        // Folded in reverse: completions come back in any order.
        NvmeTransferResult result(static_cast<uint32_t>(q.cmds.size()));
        for (size_t k = q.cmds.size(); k-- > 0;) (void)result.Fold(Execute(q, k), q.cmds[k].data_len);
        done_.push_back({q.op.user_data, result.Bytes(), result.nvme_status()});
      }
      p_->most_in_flight = std::max<uint32_t>(p_->most_in_flight, static_cast<uint32_t>(queued_.size()));
      queued_.clear();
      return n;
    }
    int Peek(RingCompletion* out) override {
      if (done_.empty()) return 0;
      *out = done_.front();
      done_.pop_front();
      return 1;
    }
    int Wait(RingCompletion* out) override { return Peek(out) == 1 ? 0 : -EAGAIN; }

   private:
    struct Pending {
      std::vector<NvmeIoCommand> cmds;
      RingOp op;
    };
    // The passthrough result of command k of a transfer: 0, −errno (the kernel's refusal) or a
    // status.
    int32_t Execute(const Pending& q, size_t k) {
      const NvmeIoCommand& c = q.cmds[k];
      ++p_->commands;
      p_->largest_command = std::max(p_->largest_command, c.data_len);
      const int fd = q.op.fixed_file ? fd_ : q.op.fd;
      if (q.op.buf_index >= 0) {
        ++p_->fixed_commands;
        if (p_->refuse_fixed_buffers) return -EINVAL;
        const size_t index = static_cast<size_t>(q.op.buf_index) + k;  // CreateNvmeRing's contract
        if (index >= buffers_.size()) return -EFAULT;
        const RegisteredSpan& r = buffers_[index];
        auto* b = reinterpret_cast<std::byte*>(c.addr);
        auto* base = static_cast<std::byte*>(r.base);
        if (b < base || b + c.data_len > base + r.len) return -EFAULT;
        // As Linux 6.1 maps a registered buffer for a command: every page from the command's
        // start to the buffer's end counts against the queue's segment limit.
        if (static_cast<uint64_t>(base + r.len - b) > ns_.max_transfer_bytes) return -EINVAL;
      }
      if (c.data_len > ns_.max_transfer_bytes) return -EINVAL;  // the kernel's limit
      if (c.nsid != ns_.nsid) return 0x0b;                       // invalid namespace
      if (uint64_t{c.block_count()} * ns_.lba_bytes != c.data_len) return 0x02;  // invalid field
      if (c.start_lba() + c.block_count() > ns_.blocks) return 0x80;             // LBA out of range
      if (c.opcode == kNvmeOpRead && !p_->read_statuses.empty()) {
        const uint32_t st = p_->read_statuses.front();
        p_->read_statuses.pop_front();
        if (st != 0) return static_cast<int32_t>(st);
      }
      const off_t at = static_cast<off_t>(c.start_lba() * ns_.lba_bytes);
      auto* buf = reinterpret_cast<void*>(c.addr);
      const ssize_t n = c.opcode == kNvmeOpWrite ? ::pwrite(fd, buf, c.data_len, at) : ::pread(fd, buf, c.data_len, at);
      if (n < 0) return -errno;
      if (static_cast<uint32_t>(n) != c.data_len) return 0x04;  // data transfer error
      return 0;
    }

    FakeNvmePlatform* p_;
    NvmeNamespace ns_;
    int fd_ = -1;
    std::vector<RegisteredSpan> buffers_;
    std::vector<Pending> queued_;
    std::deque<RingCompletion> done_;
  };

  std::string device_, media_;
};

}  // namespace cxlkv::tier::testing

#endif  // CXLKV_TESTS_TIER_FAKE_NVME_PLATFORM_H_
