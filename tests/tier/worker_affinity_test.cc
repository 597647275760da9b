// Where the device workers run (worker_affinity.h): CPU lists, the interrupt CPUs of a disk read
// from a sysfs/procfs tree built here (a partition, MSI vectors, a legacy irq, a vector whose
// affinity is unknown), the placement rule, and binding a thread.
#include "tier/worker_affinity.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

namespace cxlkv::tier {
namespace {

namespace fs = std::filesystem;

TEST(WorkerAffinity, CpuListsParseAndFormatAndRefuseWhatTheyCannotRead) {
  EXPECT_EQ(ParseCpuList("0-3,6\n"), (std::vector<int>{0, 1, 2, 3, 6}));
  EXPECT_EQ(ParseCpuList("5"), (std::vector<int>{5}));
  EXPECT_EQ(ParseCpuList("3,1,1-2"), (std::vector<int>{1, 2, 3}));
  for (const char* bad : {"", "x", "1-", "3-1", "1,,2", "-1", "0-99999"}) {
    EXPECT_TRUE(ParseCpuList(bad).empty()) << bad;
  }
  EXPECT_EQ(FormatCpuList({0, 1, 2, 3, 6, 8, 9}), "0-3,6,8-9");
  EXPECT_EQ(FormatCpuList({}), "");
}

// A sysfs and procfs of one machine, under a scratch directory.
class FakeSys {
 public:
  FakeSys() : root_(fs::current_path() / ("affinity-" + std::to_string(::getpid()))) {
    fs::remove_all(root_);
    fs::create_directories(root_ / "sys" / "dev" / "block");
    fs::create_directories(root_ / "proc" / "irq");
  }
  ~FakeSys() { fs::remove_all(root_); }
  std::string sys() const { return (root_ / "sys").string(); }
  std::string proc() const { return (root_ / "proc").string(); }
  // A disk `name` under a PCI function, its device link, and (optionally) a partition 8:1.
  fs::path AddDisk(const std::string& name, const std::string& function) {
    const fs::path pci = root_ / "sys" / "devices" / "pci0000:00" / function;
    const fs::path disk = pci / "host0" / "block" / name;
    fs::create_directories(disk / (name + "1"));
    std::ofstream(disk / (name + "1") / "partition") << "1\n";
    fs::create_directory_symlink(pci / "host0", disk / "device");
    fs::create_directory_symlink(disk, root_ / "sys" / "dev" / "block" / "8:0");
    fs::create_directory_symlink(disk / (name + "1"), root_ / "sys" / "dev" / "block" / "8:1");
    return pci;
  }
  void Vectors(const fs::path& pci, const std::vector<int>& irqs) {
    fs::create_directories(pci / "msi_irqs");
    for (int irq : irqs) std::ofstream(pci / "msi_irqs" / std::to_string(irq)) << "msix\n";
  }
  void Affinity(int irq, const std::string& list, const char* file = "effective_affinity_list") {
    fs::create_directories(root_ / "proc" / "irq" / std::to_string(irq));
    std::ofstream(root_ / "proc" / "irq" / std::to_string(irq) / file) << list << "\n";
  }

 private:
  fs::path root_;
};

TEST(WorkerAffinity, ADisksCompletionCpusAreItsVectorsEffectiveAffinities) {
  FakeSys f;
  const fs::path pci = f.AddDisk("sda", "0000:00:03.0");
  f.Vectors(pci, {40, 41});
  f.Affinity(40, "1");
  f.Affinity(41, "3");
  EXPECT_EQ(CompletionCpusOfDevice(8, 0, f.sys(), f.proc()), (std::vector<int>{1, 3}));
  EXPECT_EQ(CompletionCpusOfDevice(8, 1, f.sys(), f.proc()), (std::vector<int>{1, 3})) << "a partition is its disk";
  EXPECT_TRUE(CompletionCpusOfDevice(9, 0, f.sys(), f.proc()).empty()) << "an unknown device number";
}

TEST(WorkerAffinity, AVectorOfUnknownAffinityMakesTheWholeSetUnknown) {
  FakeSys f;
  const fs::path pci = f.AddDisk("sda", "0000:00:03.0");
  f.Vectors(pci, {40, 41});
  f.Affinity(40, "1");
  EXPECT_TRUE(CompletionCpusOfDevice(8, 0, f.sys(), f.proc()).empty());
  f.Affinity(41, "0-1", "smp_affinity_list");  // no effective list: the configured one
  EXPECT_EQ(CompletionCpusOfDevice(8, 0, f.sys(), f.proc()), (std::vector<int>{0, 1}));
}

TEST(WorkerAffinity, ALegacyIrqIsUsedWhereThereAreNoMsiVectors) {
  FakeSys f;
  const fs::path pci = f.AddDisk("sda", "0000:00:03.0");
  std::ofstream(pci / "irq") << "11\n";
  f.Affinity(11, "2");
  EXPECT_EQ(CompletionCpusOfDevice(8, 0, f.sys(), f.proc()), (std::vector<int>{2}));
}

TEST(WorkerAffinity, SsdWorkersGoWhereCompletionsLandAndMemoryWorkersElsewhere) {
  const std::vector<int> all{0, 1, 2, 3};
  // Confined interrupts: the SSD's worker there, memory workers on the rest.
  WorkerPlacement p = PlaceWorkers({{TierKind::kMem, {}}, {TierKind::kSsd, {1}}}, all);
  EXPECT_EQ(p.cpus[0], (std::vector<int>{0, 2, 3}));
  EXPECT_EQ(p.cpus[1], (std::vector<int>{1}));
  EXPECT_NE(p.summary.find("device 1 (ssd) on CPU 1"), std::string::npos) << p.summary;
  // Two disks on different CPUs: memory workers avoid both.
  p = PlaceWorkers({{TierKind::kSsd, {0}}, {TierKind::kMem, {}}, {TierKind::kSsd, {2, 9}}}, all);
  EXPECT_EQ(p.cpus[0], (std::vector<int>{0}));
  EXPECT_EQ(p.cpus[1], (std::vector<int>{1, 3}));
  EXPECT_EQ(p.cpus[2], (std::vector<int>{2})) << "a CPU we may not use is not a place";
  // Interrupts spread over every CPU (NVMe's per-queue vectors), unknown, or only where we may
  // not run: nobody is bound.
  for (const std::vector<int>& spread : {all, std::vector<int>{}, std::vector<int>{7}}) {
    p = PlaceWorkers({{TierKind::kMem, {}}, {TierKind::kSsd, spread}}, all);
    EXPECT_TRUE(p.cpus[0].empty() && p.cpus[1].empty()) << p.summary;
    EXPECT_NE(p.summary.find("not bound"), std::string::npos) << p.summary;
  }
  // Every CPU takes some disk's interrupts: memory workers stay unbound rather than nowhere.
  p = PlaceWorkers({{TierKind::kMem, {}}, {TierKind::kSsd, {0}}}, {0});
  EXPECT_TRUE(p.cpus[1].empty()) << "a strict subset only";
  p = PlaceWorkers({{TierKind::kMem, {}}, {TierKind::kSsd, {0}}, {TierKind::kSsd, {1}}}, {0, 1});
  EXPECT_TRUE(p.cpus[0].empty());
}

TEST(WorkerAffinity, BindingAThreadConfinesItToThoseCpus) {
  const std::vector<int> allowed = AllowedCpus();
  ASSERT_FALSE(allowed.empty());
  std::vector<int> seen;
  std::thread t([&] {
    ASSERT_EQ(BindThisThread({allowed.back()}), 0);
    cpu_set_t set;
    CPU_ZERO(&set);
    ASSERT_EQ(::pthread_getaffinity_np(::pthread_self(), sizeof set, &set), 0);
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) seen.push_back(c);
    }
    EXPECT_EQ(::sched_getcpu(), allowed.back());
    EXPECT_EQ(BindThisThread({}), 0) << "an empty set binds nothing";
  });
  t.join();
  EXPECT_EQ(seen, (std::vector<int>{allowed.back()}));
  // The real machine: whatever its disk reports, the answer is a valid set or nothing.
  for (int c : CompletionCpus(fs::current_path().string())) EXPECT_GE(c, 0);
}

}  // namespace
}  // namespace cxlkv::tier
