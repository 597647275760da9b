// Shared by the digest dot products of kernels.cc and digest_kernels.cc. StoreSums4: the four
// sums of four int32 vectors at once (AVX512BW): interleave and add within 128-bit lanes until
// each lane holds [a0, a1, a2, a3] partials, then fold the lanes (integers: any order gives the
// same sums).
#ifndef CXLKV_SRC_PNM_INT_SUMS_H_
#define CXLKV_SRC_PNM_INT_SUMS_H_

#include <immintrin.h>

#include <cstdint>

namespace cxlkv::pnm::internal {

__attribute__((target("avx512f,avx512bw"))) inline void StoreSums4(__m512i a0, __m512i a1, __m512i a2, __m512i a3,
                                                                  int32_t* out) {
  const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
  const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
  const __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
  const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
  const __m128i x = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), x);
}

// The bytes of a 64-byte digest step that are left (`left` >= 32: 2n is a multiple of 32).
inline __mmask64 DigestChunkMask(uint32_t left) { return left >= 64 ? ~__mmask64{0} : __mmask64{0xffffffffu}; }

}  // namespace cxlkv::pnm::internal

#endif  // CXLKV_SRC_PNM_INT_SUMS_H_
