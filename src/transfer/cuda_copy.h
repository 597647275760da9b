// The one kernel of the CUDA transfer path: copy a batch of pieces (device-visible pointers:
// device memory, or host memory registered with cudaHostRegister) in a single launch
// (Beluga O5/O6). Plain C++ so the host side compiles without nvcc.
#ifndef CXLKV_SRC_TRANSFER_CUDA_COPY_H_
#define CXLKV_SRC_TRANSFER_CUDA_COPY_H_

#include <cstdint>

struct CUstream_st;

namespace cxlkv::transfer {

struct CudaPiece {
  uint64_t dst;    // device-visible address
  uint64_t src;
  uint64_t bytes;
};

// Enqueues one kernel on `stream` copying `count` pieces whose descriptors are at
// `device_pieces` (device-visible). Returns the launch's cudaError_t as an int (0 = success).
int LaunchPieceCopy(const CudaPiece* device_pieces, uint32_t count, CUstream_st* stream);

}  // namespace cxlkv::transfer

#endif  // CXLKV_SRC_TRANSFER_CUDA_COPY_H_
