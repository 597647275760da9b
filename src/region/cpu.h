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
  bool avx512bw = false;  // byte and word lanes (the near-memory digests' integer scores)
  bool avx512vnni = false;  // fused int16 multiply-add-accumulate (the digests' scores again)
  bool fma = false;   // with avx2 (AVX-512 has its own fused multiply-add)
  bool f16c = false;  // fp16 <-> fp32 conversion (the near-memory attention's fp16 KV)

  // "clflush clflushopt clwb avx2 avx512f avx512bw fma f16c"-style list of what is present.
  std::string ToString() const;
};

// Detected once, then cached; safe to call from any thread.
const CpuFeatures& Cpu();

}  // namespace cxlkv::region

#endif  // CXLKV_SRC_REGION_CPU_H_
