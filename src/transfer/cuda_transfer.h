// The CUDA transfer path (Beluga O5/O6, TraCT §4.4): the same requests as CpuTransfer, with the
// engine's layer tensors in GPU memory and the pool's regions registered with cudaHostRegister,
// so a whole request's pieces move in ONE kernel launch on the caller's stream.
//
//   auto t = transfer::CudaTransfer::Create(cache, pool.MappedRanges());
//   (*t)->ScatterRead(gpu_layout, block_ids, pins, stream);   // enqueued; returns at once
//
// Built only where nvcc is found (CXLKV_HAVE_CUDA); elsewhere Create returns kNotSupported.
// Thread-safety: one call at a time per CudaTransfer.
#ifndef CXLKV_SRC_TRANSFER_CUDA_TRANSFER_H_
#define CXLKV_SRC_TRANSFER_CUDA_TRANSFER_H_

#include <memory>
#include <span>
#include <vector>

#include "cxlkv/cache.h"
#include "cxlkv/layout.h"
#include "transfer/request.h"

struct CUstream_st;  // cudaStream_t without the CUDA headers

namespace cxlkv::transfer {

struct CudaTransferOptions {
  int device = 0;  // CUDA device ordinal. Default 0.
};

class CudaTransfer {
 public:
  // Whether this build has the CUDA path.
  static bool Built();
  // Registers every range (Pool::MappedRanges) with the device. Errors: kNotSupported (built
  // without CUDA, or no usable CUDA device/driver: use CpuTransfer), kIoError (registration
  // failed; the CUDA error is in the message).
  static Result<std::unique_ptr<CudaTransfer>> Create(KvCache& cache, std::vector<std::span<uint8_t>> ranges,
                                                      CudaTransferOptions options = {});
  ~CudaTransfer();  // unregisters the ranges
  CudaTransfer(const CudaTransfer&) = delete;
  CudaTransfer& operator=(const CudaTransfer&) = delete;

  // Pinned pool blocks → engine blocks (layer pointers are device pointers), one kernel on
  // `stream`; returns once enqueued, without waiting. REQUIRES: the pins stay held until the
  // stream has passed this copy. Errors as CpuTransfer::ScatterRead (nothing enqueued), kIoError.
  Status ScatterRead(const EngineKvLayout& layout, std::span<const uint32_t> block_ids,
                     std::span<const BlockPin> pins, CUstream_st* stream);

  // Engine blocks → pool blocks, one kernel on `stream`, then the one host wait of this path:
  // a block is committed only once its bytes have landed (P1, publish after payload). Errors
  // as CpuTransfer::GatherWrite; a failed kernel aborts every reservation (nothing published).
  Result<GatherResult> GatherWrite(const NamespaceHandle& ns, const EngineKvLayout& layout,
                                   std::span<const uint32_t> block_ids, std::span<const BlockKey> keys,
                                   CUstream_st* stream);

  // Waits until `stream` has passed every copy enqueued on it (so pins read by a ScatterRead
  // may be released). Errors: kIoError (the CUDA error is in the message).
  Status Synchronize(CUstream_st* stream);

  struct Impl;

 private:
  explicit CudaTransfer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace cxlkv::transfer

#endif  // CXLKV_SRC_TRANSFER_CUDA_TRANSFER_H_
