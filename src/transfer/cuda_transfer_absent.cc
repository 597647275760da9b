// The CUDA path of a build without nvcc: every entry says so.
#include "transfer/cuda_transfer.h"

namespace cxlkv::transfer {

struct CudaTransfer::Impl {};

bool CudaTransfer::Built() { return false; }

Result<std::unique_ptr<CudaTransfer>> CudaTransfer::Create(KvCache&, std::vector<std::span<uint8_t>>,
                                                           CudaTransferOptions) {
  return Status(StatusCode::kNotSupported,
                "this cxlkv was built without CUDA (no nvcc found at configure time): use transfer::CpuTransfer, "
                "or rebuild on a host with the CUDA toolkit");
}

CudaTransfer::CudaTransfer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaTransfer::~CudaTransfer() = default;

Status CudaTransfer::ScatterRead(const EngineKvLayout&, std::span<const uint32_t>, std::span<const BlockPin>,
                                 CUstream_st*) {
  return Status(StatusCode::kNotSupported, "built without CUDA");
}

Result<GatherResult> CudaTransfer::GatherWrite(const NamespaceHandle&, const EngineKvLayout&,
                                               std::span<const uint32_t>, std::span<const BlockKey>, CUstream_st*) {
  return Status(StatusCode::kNotSupported, "built without CUDA");
}

Status CudaTransfer::Synchronize(CUstream_st*) { return Status(StatusCode::kNotSupported, "built without CUDA"); }

}  // namespace cxlkv::transfer
