// NVMe passthrough for the SSD tier: the pure part — what an NVM command set
// read or write of a slot transfer looks like, what an identify-namespace page says, and what a
// passthrough completion means. No system call here: the Linux ring (io_platform_linux.cc) puts
// these commands into io_uring's IORING_OP_URING_CMD on the NVMe generic device /dev/ngXnY, and
// the tests' fake namespace executes the very same commands, so the translation is tested once.
//
// Facts from the NVM Express Base / NVM Command Set specifications:
//   identify namespace (admin opcode 0x06, CNS 0): NSZE u64 at byte 0 (size in logical blocks),
//   NLBAF u8 at byte 25 (count of LBA formats − 1), FLBAS u8 at byte 26 (bits 0–3: the format in
//   use, bit 4: metadata transferred inline with the data), LBA format i a u32 at byte 128 + 4i
//   (bits 0–15 MS: metadata bytes per block, bits 16–23 LBADS: log2 of the data size).
//   read 0x02, write 0x01, flush 0x00; CDW10/11 the starting LBA, CDW12 bits 0–15 the number of
//   blocks − 1.
//   A passthrough completion's result is 0 on success, −errno when the kernel refused the command,
//   and the NVMe status field (status code type and code, > 0) when the drive failed it.
#ifndef CXLKV_SRC_TIER_NVME_COMMAND_H_
#define CXLKV_SRC_TIER_NVME_COMMAND_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cxlkv/status.h"

namespace cxlkv::tier {

inline constexpr uint8_t kNvmeOpFlush = 0x00;
inline constexpr uint8_t kNvmeOpWrite = 0x01;
inline constexpr uint8_t kNvmeOpRead = 0x02;
inline constexpr uint8_t kNvmeAdminIdentify = 0x06;
inline constexpr size_t kNvmeIdentifyBytes = 4096;

// What the tier needs to know of one NVMe namespace.
struct NvmeNamespace {
  uint32_t nsid = 0;
  uint32_t lba_bytes = 0;           // data bytes per logical block (512, 4096, ...)
  uint32_t metadata_bytes = 0;      // per block, of the format in use (0 for a plain format)
  bool metadata_inline = false;     // FLBAS bit 4: metadata extends each block in the buffer
  uint64_t blocks = 0;              // NSZE
  uint32_t max_transfer_bytes = 0;  // the largest one command may move (the kernel's limit)

  uint64_t bytes() const { return blocks * lba_bytes; }
};

// Reads an identify-namespace page (untrusted: the drive's, or a fake's). InvalidArgument when a
// field is out of range — a format index past the table, a block size outside 512 B..64 KiB, a
// zero-sized namespace — naming the field. nsid and max_transfer_bytes are not in the page.
Status ParseIdentifyNamespace(std::span<const std::byte> page, NvmeNamespace* out);

// Whether the tier can drive the namespace: plain blocks that divide the 4 KiB I/O unit. Says
// what to do otherwise (reformat, or give the block device).
Status CheckNamespaceUsable(const std::string& path, const NvmeNamespace& ns);

// The bytes one command moves at most on `ns`: its per-command limit, within the 65536 blocks a
// command can name, rounded down to the 4 KiB unit.
uint32_t NvmeCommandCap(const NvmeNamespace& ns);

// One NVM command set I/O command, as the kernel's struct nvme_uring_cmd carries it.
struct NvmeIoCommand {
  uint8_t opcode = 0;
  uint32_t nsid = 0;
  uint64_t addr = 0;       // the host buffer
  uint32_t data_len = 0;   // bytes moved: nlb × block size
  uint32_t cdw10 = 0;      // starting LBA, low 32 bits
  uint32_t cdw11 = 0;      // starting LBA, high 32 bits
  uint32_t cdw12 = 0;      // blocks − 1 (bits 0–15)

  uint64_t start_lba() const { return (uint64_t{cdw11} << 32) | cdw10; }
  uint32_t block_count() const { return (cdw12 & 0xffff) + 1; }
};

// The command for a byte range [offset, offset + len) of the namespace into/from `buf`, capped
// at the namespace's max transfer (and at the 65536 blocks one command can name): *moved gets
// the bytes this command covers, which the ring reports as the completion's result, so the
// engine continues a longer transfer as it continues a short one. offset and len must be
// multiples of the block size (the tier's are of 4 KiB), and len > 0.
NvmeIoCommand MakeNvmeIo(bool write, const NvmeNamespace& ns, void* buf, uint32_t len, uint64_t offset,
                         uint32_t* moved);

// A transfer as the commands that carry it, in order: command k covers bytes [k·cap, (k+1)·cap)
// of the range and of `buf` (cap = NvmeCommandCap(ns)), so they may all be in flight at once —
// what the block layer does for a block device's large I/O, and what passthrough, which the
// kernel never splits, must do itself.
std::vector<NvmeIoCommand> SplitNvmeIo(bool write, const NvmeNamespace& ns, void* buf, uint32_t len, uint64_t offset);
// The same into *out (cleared first), which keeps its capacity: the ring's hot path allocates
// nothing once its vector has grown to a transfer's command count.
void SplitNvmeIo(bool write, const NvmeNamespace& ns, void* buf, uint32_t len, uint64_t offset,
                 std::vector<NvmeIoCommand>* out);

// The result of a transfer split into commands, folded as their completions come back (in any
// order): the bytes of all of them, or the first failure.
class NvmeTransferResult {
 public:
  explicit NvmeTransferResult(uint32_t commands) : remaining_(commands) {}
  // Folds one command's passthrough result (nvme_command.h's convention). True when it was the
  // last one.
  bool Fold(int32_t res, uint32_t moved);
  // Bytes moved, or the first failure (−errno; −EIO for an NVMe status, see nvme_status()).
  int32_t Bytes() const { return error_ != 0 ? error_ : static_cast<int32_t>(moved_); }
  uint32_t nvme_status() const { return status_; }

 private:
  uint32_t remaining_;
  uint32_t moved_ = 0;
  int32_t error_ = 0;
  uint32_t status_ = 0;
};

// The completion result the engine expects (bytes moved, or −errno) from a passthrough result:
// 0 → `moved`; −errno → itself; an NVMe status (> 0) → −EIO (the status goes to *nvme_status).
int32_t NvmeResultToBytes(int32_t res, uint32_t moved, uint32_t* nvme_status);

// "LBA out of range (SCT 0, SC 0x80)" for a status field as the kernel reports it.
std::string NvmeStatusText(uint32_t status);

}  // namespace cxlkv::tier

#endif  // CXLKV_SRC_TIER_NVME_COMMAND_H_
