// NVMe passthrough for the SSD tier: the commands (nvme_command.h) against the specification's
// layout, the device over a fake namespace (every refusal and fallback), and — under
// scripts/nvme-vm, where CXLKV_TEST_NVME_NG names a real (emulated) drive — the real path,
// cross-checked through the namespace's block device.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "fake_nvme_platform.h"
#include "tier/nvme_command.h"
#include "tier/ssd_device.h"
#include "tier/tier_store.h"
#include "tier_test_util.h"

namespace cxlkv::tier {
namespace {

using testing::FakeNvmePlatform;
using testing::Payload;
using testing::RoundTrip;
using testing::ScratchDir;
using testing::Tag;

// ---- the commands ----

std::vector<std::byte> IdentifyPage(uint64_t nsze, uint8_t nlbaf, uint8_t flbas, std::vector<uint32_t> formats) {
  std::vector<std::byte> page(kNvmeIdentifyBytes);
  std::memcpy(page.data(), &nsze, 8);
  page[25] = std::byte{nlbaf};
  page[26] = std::byte{flbas};
  for (size_t i = 0; i < formats.size(); ++i) std::memcpy(page.data() + 128 + 4 * i, &formats[i], 4);
  return page;
}

TEST(NvmeCommand, IdentifyReadsTheFormatInUse) {
  NvmeNamespace ns;
  // Format 0: 512 B; format 1: 4 KiB; format 2: 4 KiB + 8 B metadata inline.
  auto page = IdentifyPage(1 << 20, 2, 1, {9u << 16, 12u << 16, (12u << 16) | 8});
  ASSERT_TRUE(ParseIdentifyNamespace(page, &ns).ok());
  EXPECT_EQ(ns.blocks, 1u << 20);
  EXPECT_EQ(ns.lba_bytes, 4096u);
  EXPECT_EQ(ns.metadata_bytes, 0u);
  EXPECT_EQ(ns.bytes(), uint64_t{4} << 30);
  page[26] = std::byte{0x12};  // format 2, metadata inline
  ASSERT_TRUE(ParseIdentifyNamespace(page, &ns).ok());
  EXPECT_EQ(ns.metadata_bytes, 8u);
  EXPECT_TRUE(ns.metadata_inline);
}

TEST(NvmeCommand, IdentifyOutOfRangeFieldsAreErrorsNamingTheField) {
  NvmeNamespace ns;
  auto past = IdentifyPage(100, 0, 3, {9u << 16});
  Status s = ParseIdentifyNamespace(past, &ns);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("format in use 3"), std::string::npos) << s.message();
  auto tiny = IdentifyPage(100, 0, 0, {8u << 16});
  EXPECT_NE(ParseIdentifyNamespace(tiny, &ns).message().find("block size 2^8"), std::string::npos);
  auto huge = IdentifyPage(100, 0, 0, {17u << 16});
  EXPECT_EQ(ParseIdentifyNamespace(huge, &ns).code(), StatusCode::kInvalidArgument);
  auto empty = IdentifyPage(0, 0, 0, {12u << 16});
  EXPECT_NE(ParseIdentifyNamespace(empty, &ns).message().find("size 0 blocks"), std::string::npos);
  std::vector<std::byte> shorter(512);
  EXPECT_EQ(ParseIdentifyNamespace(shorter, &ns).code(), StatusCode::kInvalidArgument);
}

TEST(NvmeCommand, UsableNamespacesArePlainAndDivideTheIoUnit) {
  NvmeNamespace ns;
  ns.lba_bytes = 512;
  ns.blocks = 1000;
  ns.max_transfer_bytes = 128 << 10;
  EXPECT_TRUE(CheckNamespaceUsable("/dev/ng0n1", ns).ok());
  ns.metadata_bytes = 8;
  EXPECT_NE(CheckNamespaceUsable("/dev/ng0n1", ns).message().find("nvme format"), std::string::npos);
  ns.metadata_bytes = 0;
  ns.lba_bytes = 8192;
  EXPECT_NE(CheckNamespaceUsable("/dev/ng0n1", ns).message().find("8192-byte blocks"), std::string::npos);
  ns.lba_bytes = 4096;
  ns.max_transfer_bytes = 2048;
  EXPECT_EQ(CheckNamespaceUsable("/dev/ng0n1", ns).code(), StatusCode::kInvalidArgument);
}

TEST(NvmeCommand, ReadsAndWritesNameLbasAndZeroBasedCounts) {
  NvmeNamespace ns;
  ns.nsid = 3;
  ns.lba_bytes = 512;
  ns.blocks = uint64_t{1} << 40;
  ns.max_transfer_bytes = 1 << 20;
  std::byte buf[1];
  uint32_t moved = 0;
  NvmeIoCommand w = MakeNvmeIo(true, ns, buf, 256 << 10, uint64_t{5} << 33, &moved);
  EXPECT_EQ(w.opcode, kNvmeOpWrite);
  EXPECT_EQ(w.nsid, 3u);
  EXPECT_EQ(w.addr, reinterpret_cast<uint64_t>(buf));
  EXPECT_EQ(moved, 256u << 10);
  EXPECT_EQ(w.data_len, 256u << 10);
  EXPECT_EQ(w.start_lba(), (uint64_t{5} << 33) / 512);
  EXPECT_EQ(w.cdw11, ((uint64_t{5} << 33) / 512) >> 32);  // LBAs past 2^32 keep their high bits
  EXPECT_EQ(w.cdw12, (256u << 10) / 512 - 1);
  ns.lba_bytes = 4096;
  NvmeIoCommand r = MakeNvmeIo(false, ns, buf, 8192, 4096 * 7, &moved);
  EXPECT_EQ(r.opcode, kNvmeOpRead);
  EXPECT_EQ(r.start_lba(), 7u);
  EXPECT_EQ(r.block_count(), 2u);
}

TEST(NvmeCommand, ATransferPastTheLimitIsCutToWholeUnits) {
  NvmeNamespace ns;
  ns.nsid = 1;
  ns.lba_bytes = 512;
  ns.blocks = 1 << 30;
  ns.max_transfer_bytes = (128 << 10) + 1000;  // not a multiple of the unit: cut to 128 KiB
  std::byte buf[1];
  uint32_t moved = 0;
  NvmeIoCommand c = MakeNvmeIo(true, ns, buf, 2 << 20, 0, &moved);
  EXPECT_EQ(moved, 128u << 10);
  EXPECT_EQ(c.block_count(), 256u);
  ns.max_transfer_bytes = 1 << 30;  // the 16-bit block count caps it: 65536 × 512 B = 32 MiB
  c = MakeNvmeIo(false, ns, buf, 64 << 20, 0, &moved);
  EXPECT_EQ(moved, 32u << 20);
  EXPECT_EQ(c.cdw12, 65535u);
}

TEST(NvmeCommand, CompletionsBecomeBytesOrErrors) {
  uint32_t status = 7;
  EXPECT_EQ(NvmeResultToBytes(0, 4096, &status), 4096);
  EXPECT_EQ(status, 0u);
  EXPECT_EQ(NvmeResultToBytes(-EINVAL, 4096, &status), -EINVAL);
  EXPECT_EQ(NvmeResultToBytes(0x281, 4096, &status), -EIO);
  EXPECT_EQ(status, 0x281u);
  EXPECT_NE(NvmeStatusText(0x281).find("unrecovered read error"), std::string::npos);
  EXPECT_NE(NvmeStatusText(0x4080).find("LBA out of range"), std::string::npos);
  EXPECT_NE(NvmeStatusText(0x4080).find("do not retry"), std::string::npos);
}

// ---- the device over a fake namespace ----

struct FakeDrive {
  explicit FakeDrive(uint32_t lba, uint64_t bytes = 64 << 20)
      : pf("/dev/ng9n1", dir.File("media"), bytes, lba) {}
  SsdOptions Options(uint64_t slot_bytes = 256 << 10) {
    SsdOptions o;
    o.path = "/dev/ng9n1";
    o.slot_bytes = slot_bytes;
    o.platform = &pf;
    return o;
  }
  ScratchDir dir;
  FakeNvmePlatform pf;
};

class NvmePassthrough : public ::testing::TestWithParam<uint32_t> {};

TEST_P(NvmePassthrough, BytesReadBackIdenticalAndLieWhereTheSlotsAre) {
  FakeDrive d(GetParam());
  auto dev = SsdDevice::Open(d.Options((2 << 20) + 4096));
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  EXPECT_TRUE((*dev)->io_path().nvme_passthrough);
  EXPECT_TRUE((*dev)->io_path().registered_buffers);
  EXPECT_EQ((*dev)->slot_count(), (64u << 20) / ((2 << 20) + 4096));
  EXPECT_NE((*dev)->Describe().find("NVMe passthrough"), std::string::npos) << (*dev)->Describe();
  d.pf.commands = d.pf.transfers_queued = 0;
  // 2 MiB blocks (2 MiB + 4 KiB on the disk): 17 commands each, of 128 KiB and a last 4 KiB,
  // queued together as one transfer — not one after another.
  RoundTrip(**dev, 9, 2 << 20, 11);
  EXPECT_EQ(d.pf.transfers_queued, 2 * 9);
  EXPECT_EQ(d.pf.commands, 2 * 9 * 17);
  EXPECT_EQ(d.pf.largest_command, 128u << 10);
  EXPECT_GT(d.pf.most_in_flight, 1u);
  RoundTrip(**dev, 20, 5000, 99);       // small ones, in one command each
  EXPECT_EQ(d.pf.commands, 2 * 9 * 17 + 2 * 20);
  EXPECT_EQ(d.pf.fixed_commands, d.pf.commands + 1);  // and the open's probe
  EXPECT_EQ(d.pf.flushes, 2);  // one per write batch

  // The same bytes through the file path over the media: the LBAs the commands named are the
  // byte offsets the slots have.
  auto slots = (*dev)->AllocateSlots(1);
  ASSERT_TRUE(slots.ok());
  auto data = Payload(5, 300000);
  std::span<const std::byte> piece(data);
  WriteItem w{(*slots)[0], Tag(5), {&piece, 1}};
  ASSERT_TRUE((*dev)->Write({&w, 1})[0].ok());
  dev->reset();
  SsdOptions file;
  file.path = d.dir.File("media");
  file.slot_bytes = (2 << 20) + 4096;
  file.create = false;
  auto plain = SsdDevice::Open(file);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  std::vector<std::byte> back(data.size());
  ReadItem r{(*slots)[0], Tag(5), back};
  ASSERT_TRUE((*plain)->Read({&r, 1})[0].ok());
  EXPECT_EQ(r.verdict, SlotVerdict::kValid);
  EXPECT_EQ(back, data);
}

INSTANTIATE_TEST_SUITE_P(LbaSizes, NvmePassthrough, ::testing::Values(512u, 4096u),
                         [](const auto& info) { return "Lba" + std::to_string(info.param); });

TEST(NvmePassthroughFallback, FixedBuffersRefusedForCommandsUseUnregisteredBuffers) {
  FakeDrive d(4096);
  d.pf.refuse_fixed_buffers = true;
  auto dev = SsdDevice::Open(d.Options());
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  EXPECT_FALSE((*dev)->io_path().registered_buffers);
  EXPECT_NE((*dev)->io_path().notes.find("registered buffers refused for NVMe commands"), std::string::npos)
      << (*dev)->io_path().notes;
  RoundTrip(**dev, 6, 200000, 3);
}

TEST(NvmePassthroughFallback, ADriveErrorOnAReadFailsThatBlockNamingTheStatus) {
  FakeDrive d(4096);
  auto dev = SsdDevice::Open(d.Options());
  ASSERT_TRUE(dev.ok());
  auto slots = (*dev)->AllocateSlots(2);
  ASSERT_TRUE(slots.ok());
  auto a = Payload(1, 100000), b = Payload(2, 100000);
  std::span<const std::byte> pa(a), pb(b);
  std::vector<WriteItem> w{{(*slots)[0], Tag(1), {&pa, 1}}, {(*slots)[1], Tag(2), {&pb, 1}}};
  for (const Status& s : (*dev)->Write(w)) ASSERT_TRUE(s.ok()) << s.ToString();
  d.pf.read_statuses = {0x4281};  // the first read: unrecovered read error, do not retry
  std::vector<std::byte> ba(a.size()), bb(b.size());
  std::vector<ReadItem> r{{(*slots)[0], Tag(1), ba}, {(*slots)[1], Tag(2), bb}};
  auto rs = (*dev)->Read(r);
  EXPECT_EQ(rs[0].code(), StatusCode::kIoError);
  EXPECT_NE(rs[0].message().find("unrecovered read error"), std::string::npos) << rs[0].message();
  ASSERT_TRUE(rs[1].ok()) << rs[1].ToString();
  EXPECT_EQ(bb, b);
  rs = (*dev)->Read(r);  // the drive answers again: nothing was lost
  ASSERT_TRUE(rs[0].ok());
  EXPECT_EQ(ba, a);
}

TEST(NvmePassthroughFallback, AFailedFlushFailsTheBatchSoNothingIsCatalogued) {
  FakeDrive d(512);
  auto dev = SsdDevice::Open(d.Options());
  ASSERT_TRUE(dev.ok());
  auto slots = (*dev)->AllocateSlots(3);
  ASSERT_TRUE(slots.ok());
  auto data = Payload(8, 4000);
  std::span<const std::byte> p(data);
  std::vector<WriteItem> w;
  for (uint64_t s : *slots) w.push_back({s, Tag(s), {&p, 1}});
  d.pf.flush_status = 0x06;  // internal error
  for (const Status& s : (*dev)->Write(w)) {
    EXPECT_EQ(s.code(), StatusCode::kIoError);
    EXPECT_NE(s.message().find("the flush after the batch: internal error"), std::string::npos) << s.message();
  }
  d.pf.flush_status = 0;
  for (const Status& s : (*dev)->Write(w)) EXPECT_TRUE(s.ok()) << s.ToString();
}

TEST(NvmePassthroughOpen, EveryRefusalSaysWhatToDo) {
  struct Case {
    const char* name;
    std::function<void(FakeNvmePlatform&, SsdOptions&)> set;
    StatusCode code;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"not nvme", [](auto& pf, auto&) { pf.identify_error = -ENOTTY; }, StatusCode::kInvalidArgument,
       "not an NVMe namespace"},
      {"identify refused", [](auto& pf, auto&) { pf.identify_error = -EACCES; }, StatusCode::kPermissionDenied,
       "CAP_SYS_ADMIN"},
      {"metadata format", [](auto& pf, auto&) { pf.format_in_use = 1; }, StatusCode::kInvalidArgument,
       "8 bytes of metadata"},
      {"old kernel", [](auto& pf, auto&) { pf.ring_error = -EINVAL; }, StatusCode::kNotSupported, "5.19"},
      {"io_uring refused", [](auto& pf, auto&) { pf.ring_error = -EPERM; }, StatusCode::kNotSupported,
       "no synchronous path"},
      {"io_uring off", [](auto&, auto& o) { o.use_io_uring = false; }, StatusCode::kInvalidArgument,
       "give /dev/nvme9n1"},
      {"too large", [](auto&, auto& o) { o.size_bytes = 1ull << 30; }, StatusCode::kInvalidArgument,
       "less than the 1 GiB asked"},
      {"smaller than a slot", [](auto&, auto& o) { o.slot_bytes = 128ull << 20; }, StatusCode::kInvalidArgument,
       "too small for one slot of 128 MiB"},
      {"limit below a unit", [](auto& pf, auto&) { pf.ns.max_transfer_bytes = 1024; },
       StatusCode::kInvalidArgument, "at most 1024 bytes per command"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    FakeDrive d(4096);
    SsdOptions o = d.Options();
    c.set(d.pf, o);
    auto dev = SsdDevice::Open(o);
    ASSERT_FALSE(dev.ok());
    EXPECT_EQ(dev.status().code(), c.code) << dev.status().ToString();
    EXPECT_NE(dev.status().message().find(c.says), std::string::npos) << dev.status().message();
    EXPECT_NE(dev.status().message().find("/dev/ng9n1"), std::string::npos) << dev.status().message();
  }
}

TEST(NvmePassthroughOpen, ASecondOwnerIsRefusedAndTheFirstKeepsServing) {
  FakeDrive d(4096);
  auto first = SsdDevice::Open(d.Options());
  ASSERT_TRUE(first.ok());
  auto second = SsdDevice::Open(d.Options());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kBusy) << second.status().ToString();
  RoundTrip(**first, 3, 10000, 4);
}

TEST(TierSpecCatalog, ADeviceNamesADirectoryForItsCatalog) {
  auto s = ParseTierSpec("ssd:/dev/ng0n1:0:catalog=/var/lib/cxlkv");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->path, "/dev/ng0n1");
  EXPECT_EQ(s->bytes, 0u);
  EXPECT_EQ(s->catalog_dir, "/var/lib/cxlkv");
  EXPECT_EQ(s->StateBase(), "/var/lib/cxlkv/ng0n1");
  auto f = ParseTierSpec("ssd:/data/a:b/kv.tier:64G");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->StateBase(), "/data/a:b/kv.tier");
  EXPECT_FALSE(ParseTierSpec("ssd:/dev/ng0n1:0:catalog=").ok());
}

// ---- a real drive (scripts/nvme-vm) ----

const char* RealDrive() { return std::getenv("CXLKV_TEST_NVME_NG"); }

TEST(NvmeDrive, PassthroughBytesReadBackAndMatchTheBlockDevice) {
  if (RealDrive() == nullptr) GTEST_SKIP() << "no NVMe drive (runs under scripts/nvme-vm)";
  SsdOptions o;
  o.path = RealDrive();
  o.slot_bytes = (2 << 20) + 4096;
  o.size_bytes = 64 << 20;
  auto dev = SsdDevice::Open(o);
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  std::printf("%s\n", (*dev)->Describe().c_str());
  ASSERT_TRUE((*dev)->io_path().nvme_passthrough);
  // Registered in command-sized pieces, the staging buffers are taken by the kernel for
  // commands (as one 72 MiB buffer, Linux 6.1 refuses them: EINVAL).
  EXPECT_TRUE((*dev)->io_path().registered_buffers) << (*dev)->io_path().notes;
  RoundTrip(**dev, 12, 2 << 20, 21);
  RoundTrip(**dev, 25, 70000, 77);
  // Written through passthrough, read through the block layer: the LBAs are the slots' offsets.
  auto slots = (*dev)->AllocateSlots(4);
  ASSERT_TRUE(slots.ok());
  std::vector<std::vector<std::byte>> data;
  std::vector<std::span<const std::byte>> pieces;
  std::vector<WriteItem> w;
  for (size_t i = 0; i < 4; ++i) data.push_back(Payload(40 + i, (1 << 20) + 512 * i));
  for (size_t i = 0; i < 4; ++i) pieces.emplace_back(data[i]);
  for (size_t i = 0; i < 4; ++i) w.push_back({(*slots)[i], Tag(40 + i), {&pieces[i], 1}});
  for (const Status& s : (*dev)->Write(w)) ASSERT_TRUE(s.ok()) << s.ToString();
  dev->reset();
  SsdOptions b = o;
  b.path = std::getenv("CXLKV_TEST_NVME_BLOCK");
  auto block = SsdDevice::Open(b);
  ASSERT_TRUE(block.ok()) << block.status().ToString();
  ASSERT_TRUE((*block)->io_path().block_device);
  for (size_t i = 0; i < 4; ++i) {
    std::vector<std::byte> back(data[i].size());
    ReadItem r{(*slots)[i], Tag(40 + i), back};
    ASSERT_TRUE((*block)->Read({&r, 1})[0].ok());
    EXPECT_EQ(r.verdict, SlotVerdict::kValid) << i;
    EXPECT_EQ(back, data[i]) << "block " << i;
  }
}

TEST(NvmeDrive, ARegisteredBufferFreeRingWorksToo) {
  if (RealDrive() == nullptr) GTEST_SKIP() << "no NVMe drive (runs under scripts/nvme-vm)";
  SsdOptions o;
  o.path = RealDrive();
  o.size_bytes = 32 << 20;
  o.register_buffers = false;
  o.queue_depth = 1;
  auto dev = SsdDevice::Open(o);
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  EXPECT_FALSE((*dev)->io_path().registered_buffers);
  RoundTrip(**dev, 30, 250000, 5);
}

}  // namespace
}  // namespace cxlkv::tier
