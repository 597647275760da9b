#include "region/cpu.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace cxlkv::region {

namespace {

CpuFeatures Detect() {
  CpuFeatures f;
#if defined(__x86_64__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx)) {
    f.clflush = (edx >> 19) & 1;
    bool osxsave = (ecx >> 27) & 1;
    bool avx = (ecx >> 28) & 1;
    unsigned xcr0_lo = 0;
    if (osxsave) {
      unsigned xcr0_hi = 0;
      __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    }
    // The OS must save YMM (bits 1,2) and for AVX-512 also opmask/ZMM state (bits 5,6,7).
    bool ymm_ok = avx && (xcr0_lo & 0x6) == 0x6;
    bool zmm_ok = ymm_ok && (xcr0_lo & 0xe0) == 0xe0;
    f.fma = ymm_ok && ((ecx >> 12) & 1);
    f.f16c = ymm_ok && ((ecx >> 29) & 1);
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) {
      f.avx2 = ymm_ok && ((ebx >> 5) & 1);
      f.avx512f = zmm_ok && ((ebx >> 16) & 1);
      f.avx512bw = zmm_ok && ((ebx >> 30) & 1);
      f.avx512vnni = zmm_ok && ((ecx >> 11) & 1);
      f.clflushopt = (ebx >> 23) & 1;
      f.clwb = (ebx >> 24) & 1;
    }
  }
#endif
  return f;
}

}  // namespace

const CpuFeatures& Cpu() {
  static const CpuFeatures features = Detect();
  return features;
}

std::string CpuFeatures::ToString() const {
  std::string s;
  auto add = [&s](bool present, const char* name) {
    if (!present) return;
    if (!s.empty()) s += ' ';
    s += name;
  };
  add(clflush, "clflush");
  add(clflushopt, "clflushopt");
  add(clwb, "clwb");
  add(avx2, "avx2");
  add(avx512f, "avx512f");
  add(avx512bw, "avx512bw");
  add(avx512vnni, "avx512vnni");
  add(fma, "fma");
  add(f16c, "f16c");
  return s.empty() ? "none" : s;
}

}  // namespace cxlkv::region
