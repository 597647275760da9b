#include "tier/nvme_command.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace cxlkv::tier {

namespace {

template <typename T>
T LoadLe(std::span<const std::byte> page, size_t at) {
  T v;
  std::memcpy(&v, page.data() + at, sizeof v);  // x86-64 and aarch64 Linux: little-endian, as NVMe
  return v;
}

constexpr uint32_t kMaxBlocksPerCommand = 65536;  // CDW12 NLB is 16 bits, zero-based

}  // namespace

Status ParseIdentifyNamespace(std::span<const std::byte> page, NvmeNamespace* out) {
  if (page.size() < kNvmeIdentifyBytes) {
    return InvalidArgument("nvme identify namespace: " + std::to_string(page.size()) + " bytes, want 4096");
  }
  const uint64_t nsze = LoadLe<uint64_t>(page, 0);
  const uint8_t nlbaf = LoadLe<uint8_t>(page, 25);
  const uint8_t flbas = LoadLe<uint8_t>(page, 26);
  const uint32_t format = flbas & 0x0f;
  // NLBAF is zero-based; up to 16 formats in the table this field indexes (64 with the extended
  // FLBAS bits 5–6, which a plain namespace does not use).
  if (format > nlbaf || format >= 16) {
    return InvalidArgument("nvme identify namespace: format in use " + std::to_string(format) + " is past the " +
                           std::to_string(nlbaf + 1) + " formats the namespace lists");
  }
  const uint32_t lbaf = LoadLe<uint32_t>(page, 128 + 4 * format);
  const uint32_t lbads = (lbaf >> 16) & 0xff;
  if (lbads < 9 || lbads > 16) {
    return InvalidArgument("nvme identify namespace: block size 2^" + std::to_string(lbads) +
                           " is outside 512 B..64 KiB");
  }
  if (nsze == 0 || nsze > (uint64_t{1} << 48)) {
    return InvalidArgument("nvme identify namespace: size " + std::to_string(nsze) + " blocks is not plausible");
  }
  out->blocks = nsze;
  out->lba_bytes = uint32_t{1} << lbads;
  out->metadata_bytes = lbaf & 0xffff;
  out->metadata_inline = (flbas & 0x10) != 0;
  return Status::Ok();
}

Status CheckNamespaceUsable(const std::string& path, const NvmeNamespace& ns) {
  if (ns.metadata_bytes != 0) {
    return InvalidArgument("ssd tier: NVMe namespace " + path + " is formatted with " + std::to_string(ns.metadata_bytes) +
                           " bytes of metadata per block: reformat it with a plain LBA format (nvme format --lbaf=N) "
                           "or give its block device");
  }
  if (ns.lba_bytes == 0 || ns.lba_bytes > 4096 || 4096 % ns.lba_bytes != 0) {
    return InvalidArgument("ssd tier: NVMe namespace " + path + " has " + std::to_string(ns.lba_bytes) +
                           "-byte blocks; the tier writes 4 KiB units: reformat it with 512 B or 4 KiB blocks "
                           "or give its block device");
  }
  if (ns.max_transfer_bytes < 4096) {
    return InvalidArgument("ssd tier: NVMe namespace " + path + " takes at most " +
                           std::to_string(ns.max_transfer_bytes) + " bytes per command, less than the 4 KiB unit");
  }
  return Status::Ok();
}

uint32_t NvmeCommandCap(const NvmeNamespace& ns) {
  const uint32_t shift = static_cast<uint32_t>(std::countr_zero(ns.lba_bytes));
  const uint64_t cap = std::min<uint64_t>(ns.max_transfer_bytes, uint64_t{kMaxBlocksPerCommand} << shift);
  // Rounded down to the 4 KiB unit so the rest of a transfer stays aligned (the next command's
  // LBA and buffer, and the registered piece it lies in, all advance by whole units).
  return static_cast<uint32_t>(cap & ~uint64_t{4095});
}

NvmeIoCommand MakeNvmeIo(bool write, const NvmeNamespace& ns, void* buf, uint32_t len, uint64_t offset,
                         uint32_t* moved) {
  const uint32_t shift = static_cast<uint32_t>(std::countr_zero(ns.lba_bytes));
  const uint32_t n = std::min(len, NvmeCommandCap(ns));
  const uint64_t slba = offset >> shift;
  NvmeIoCommand c;
  c.opcode = write ? kNvmeOpWrite : kNvmeOpRead;
  c.nsid = ns.nsid;
  c.addr = reinterpret_cast<uint64_t>(buf);
  c.data_len = n;
  c.cdw10 = static_cast<uint32_t>(slba);
  c.cdw11 = static_cast<uint32_t>(slba >> 32);
  c.cdw12 = (n >> shift) - 1;
  *moved = n;
  return c;
}

void SplitNvmeIo(bool write, const NvmeNamespace& ns, void* buf, uint32_t len, uint64_t offset,
                 std::vector<NvmeIoCommand>* out) {
  out->clear();
  uint32_t done = 0;
  while (done < len) {
    uint32_t moved = 0;
    out->push_back(MakeNvmeIo(write, ns, static_cast<std::byte*>(buf) + done, len - done, offset + done, &moved));
    done += moved;
  }
}

std::vector<NvmeIoCommand> SplitNvmeIo(bool write, const NvmeNamespace& ns, void* buf, uint32_t len, uint64_t offset) {
  std::vector<NvmeIoCommand> out;
  SplitNvmeIo(write, ns, buf, len, offset, &out);
  return out;
}

bool NvmeTransferResult::Fold(int32_t res, uint32_t moved) {
  uint32_t status = 0;
  const int32_t bytes = NvmeResultToBytes(res, moved, &status);
  if (bytes < 0 && error_ == 0) {
    error_ = bytes;
    status_ = status;
  } else if (bytes > 0) {
    moved_ += static_cast<uint32_t>(bytes);
  }
  return remaining_ > 0 && --remaining_ == 0;
}

int32_t NvmeResultToBytes(int32_t res, uint32_t moved, uint32_t* nvme_status) {
  *nvme_status = 0;
  if (res == 0) return static_cast<int32_t>(moved);
  if (res < 0) return res;
  *nvme_status = static_cast<uint32_t>(res);
  return -EIO;
}

std::string NvmeStatusText(uint32_t status) {
  const uint32_t sc = status & 0xff;
  const uint32_t sct = (status >> 8) & 0x7;
  const char* what = "error";
  if (sct == 0) {
    switch (sc) {
      case 0x01: what = "invalid opcode"; break;
      case 0x02: what = "invalid field in command"; break;
      case 0x04: what = "data transfer error"; break;
      case 0x06: what = "internal error"; break;
      case 0x0b: what = "invalid namespace or format"; break;
      case 0x80: what = "LBA out of range"; break;
      case 0x81: what = "capacity exceeded"; break;
      case 0x82: what = "namespace not ready"; break;
      default: break;
    }
  } else if (sct == 2) {
    switch (sc) {
      case 0x80: what = "write fault"; break;
      case 0x81: what = "unrecovered read error"; break;
      case 0x86: what = "access denied"; break;
      case 0x87: what = "deallocated or unwritten block"; break;
      default: what = "media or data integrity error"; break;
    }
  }
  char hex[48];
  std::snprintf(hex, sizeof hex, " (NVMe status SCT %u, SC 0x%02x%s)", sct, sc, (status & 0x4000) ? ", do not retry" : "");
  return what + std::string(hex);
}

}  // namespace cxlkv::tier
