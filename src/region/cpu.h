// CPU features the coherence primitives choose between, detected once at run time (cpuid), so
// one binary runs on any x86-64 and uses AVX-512 streaming stores where the CPU has them.
#ifndef CXLKV_SRC_REGION_CPU_H_
#define CXLKV_SRC_REGION_CPU_H_

#include <string>

namespace cxlkv::region {

struct CpuFeatures {
  bool clflush = false;
  bool clflushopt = false;
  bool clwb = false;
  bool avx2 = false;
  bool avx512f = false;

  // "clflush clflushopt clwb avx2 avx512f"-style list of what is present.
  std::string ToString() const;
};

// Detected once, then cached; safe to call from any thread.
const CpuFeatures& Cpu();

}  // namespace cxlkv::region

#endif  // CXLKV_SRC_REGION_CPU_H_
