#include <cuda_runtime.h>

#include "transfer/cuda_copy.h"

namespace cxlkv::transfer {
namespace {

constexpr unsigned kWarpsPerBlock = 8;
constexpr unsigned kMaxBlocks = 4096;

// One warp per piece (grid-stride over pieces): a KV piece is 160 B (a sparse token row) to
// tens of KiB (a layer slab), so a warp — 512 B per 16-byte-wide step — wastes little on the
// small ones and many warps in flight hide the latency of the large ones over the link.
__global__ void CopyPiecesKernel(const CudaPiece* pieces, uint32_t count) {
  const unsigned lane = threadIdx.x % 32;
  const unsigned warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const unsigned warps = gridDim.x * blockDim.x / 32;
  for (uint32_t i = warp; i < count; i += warps) {
    const CudaPiece p = pieces[i];
    auto* dst = reinterpret_cast<unsigned char*>(p.dst);
    const auto* src = reinterpret_cast<const unsigned char*>(p.src);
    uint64_t done = 0;
    if (((p.dst | p.src) & 15) == 0) {
      const uint64_t vectors = p.bytes / 16;
      auto* d = reinterpret_cast<uint4*>(dst);
      const auto* s = reinterpret_cast<const uint4*>(src);
      for (uint64_t v = lane; v < vectors; v += 32) d[v] = s[v];
      done = vectors * 16;
    }
    for (uint64_t b = done + lane; b < p.bytes; b += 32) dst[b] = src[b];
  }
}

}  // namespace

int LaunchPieceCopy(const CudaPiece* device_pieces, uint32_t count, CUstream_st* stream) {
  if (count == 0) return 0;
  unsigned blocks = (count + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  CopyPiecesKernel<<<blocks, kWarpsPerBlock * 32, 0, stream>>>(device_pieces, count);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cxlkv::transfer
