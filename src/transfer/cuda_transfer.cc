// The CUDA transfer path's host side: validation and reservation as the CPU path, piece
// descriptors staged through a small ring of pinned buffers, one kernel per request.
#include "transfer/cuda_transfer.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "transfer/cuda_copy.h"

namespace cxlkv::transfer {

namespace {

Status CudaError(const std::string& what, cudaError_t e) {
  return Status(StatusCode::kIoError, what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

Status OutsideRegistered() {
  return InvalidArgument("a pool block lies outside the ranges registered with the GPU: create the CudaTransfer "
                         "with Pool::MappedRanges() of the pool the cache belongs to");
}

// A descriptor buffer and the event after the kernel that last read it: the ring lets the
// next requests stage theirs while earlier kernels still run, without a host wait.
struct StagingSlot {
  CudaPiece* host = nullptr;    // pinned
  CudaPiece* device = nullptr;
  size_t capacity = 0;          // pieces
  cudaEvent_t consumed = nullptr;
};

constexpr size_t kSlots = 4;

}  // namespace

struct CudaTransfer::Impl {
  KvCache* cache = nullptr;
  int device = 0;
  struct Registered {
    uint8_t* host;
    uint64_t bytes;
    uint8_t* device;
    bool ours;  // registered by us (else by someone else in this process: not ours to drop)
  };
  std::vector<Registered> ranges;
  StagingSlot slots[kSlots];
  size_t next_slot = 0;
  cudaEvent_t gather_done = nullptr;
  std::vector<CudaPiece> pieces;  // built on the host, copied into a slot

  ~Impl() {
    cudaSetDevice(device);
    for (auto& s : slots) {
      if (s.consumed) {
        cudaEventSynchronize(s.consumed);
        cudaEventDestroy(s.consumed);
      }
      if (s.host) cudaFreeHost(s.host);
      if (s.device) cudaFree(s.device);
    }
    if (gather_done) cudaEventDestroy(gather_done);
    for (auto& r : ranges) {
      if (r.ours) cudaHostUnregister(r.host);
    }
  }

  // The device-visible address of a pool byte.
  uint64_t DeviceAddress(const uint8_t* p) const {
    for (const auto& r : ranges) {
      if (p >= r.host && p < r.host + r.bytes) return reinterpret_cast<uint64_t>(r.device + (p - r.host));
    }
    return 0;  // validated pins always fall in a mapped range
  }

  // Stages `pieces` and launches the kernel on `stream`. Nothing waits on the host unless the
  // ring wraps onto a slot whose kernel has not run yet.
  Status Launch(CUstream_st* stream) {
    if (pieces.empty()) return Status::Ok();
    StagingSlot& s = slots[next_slot++ % kSlots];
    cudaError_t e = cudaEventSynchronize(s.consumed);
    if (e != cudaSuccess) return CudaError("waiting for a staging buffer", e);
    if (s.capacity < pieces.size()) {
      const size_t capacity = std::max(pieces.size(), s.capacity * 2);
      if (s.host) cudaFreeHost(s.host);
      if (s.device) cudaFree(s.device);
      s.host = nullptr;
      s.device = nullptr;
      s.capacity = 0;
      if ((e = cudaHostAlloc(reinterpret_cast<void**>(&s.host), capacity * sizeof(CudaPiece), cudaHostAllocDefault)) !=
          cudaSuccess) {
        return CudaError("allocating pinned piece descriptors", e);
      }
      if ((e = cudaMalloc(reinterpret_cast<void**>(&s.device), capacity * sizeof(CudaPiece))) != cudaSuccess) {
        return CudaError("allocating device piece descriptors", e);
      }
      s.capacity = capacity;
    }
    std::copy(pieces.begin(), pieces.end(), s.host);
    if ((e = cudaMemcpyAsync(s.device, s.host, pieces.size() * sizeof(CudaPiece), cudaMemcpyHostToDevice, stream)) !=
        cudaSuccess) {
      return CudaError("staging piece descriptors", e);
    }
    if (int launched = LaunchPieceCopy(s.device, static_cast<uint32_t>(pieces.size()), stream); launched != 0) {
      return CudaError("launching the piece copy kernel", static_cast<cudaError_t>(launched));
    }
    if ((e = cudaEventRecord(s.consumed, stream)) != cudaSuccess) return CudaError("recording an event", e);
    return Status::Ok();
  }
};

bool CudaTransfer::Built() { return true; }

Result<std::unique_ptr<CudaTransfer>> CudaTransfer::Create(KvCache& cache, std::vector<std::span<uint8_t>> ranges,
                                                           CudaTransferOptions options) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    return Status(StatusCode::kNotSupported,
                  std::string("no usable CUDA device (") + (e != cudaSuccess ? cudaGetErrorString(e) : "none found") +
                      "): run on a GPU host, or use transfer::CpuTransfer");
  }
  if (options.device < 0 || options.device >= count) {
    return InvalidArgument("CUDA device " + std::to_string(options.device) + " does not exist (this host has " +
                           std::to_string(count) + ")");
  }
  if ((e = cudaSetDevice(options.device)) != cudaSuccess) return CudaError("selecting the device", e);
  auto impl = std::make_unique<Impl>();
  impl->cache = &cache;
  impl->device = options.device;
  for (auto range : ranges) {
    // TraCT §4.4: the region is registered once, so the kernel reaches pool bytes directly.
    e = cudaHostRegister(range.data(), range.size(), cudaHostRegisterPortable | cudaHostRegisterMapped);
    bool ours = e == cudaSuccess;
    if (e == cudaErrorHostMemoryAlreadyRegistered) {
      (void)cudaGetLastError();  // clear the sticky-less error; someone in this process did it
    } else if (e != cudaSuccess) {
      return CudaError("registering " + std::to_string(range.size()) + " bytes of the pool with the GPU", e);
    }
    void* device = nullptr;
    if ((e = cudaHostGetDevicePointer(&device, range.data(), 0)) != cudaSuccess) {
      if (ours) cudaHostUnregister(range.data());
      return CudaError("mapping the registered pool into the device's address space", e);
    }
    impl->ranges.push_back({range.data(), range.size(), static_cast<uint8_t*>(device), ours});
  }
  for (auto& s : impl->slots) {
    if ((e = cudaEventCreateWithFlags(&s.consumed, cudaEventDisableTiming)) != cudaSuccess) {
      return CudaError("creating an event", e);
    }
  }
  if ((e = cudaEventCreateWithFlags(&impl->gather_done, cudaEventDisableTiming)) != cudaSuccess) {
    return CudaError("creating an event", e);
  }
  return std::unique_ptr<CudaTransfer>(new CudaTransfer(std::move(impl)));
}

CudaTransfer::CudaTransfer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaTransfer::~CudaTransfer() = default;

Status CudaTransfer::Synchronize(CUstream_st* stream) {
  if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) return CudaError("waiting for the stream", e);
  return Status::Ok();
}

Status CudaTransfer::ScatterRead(const EngineKvLayout& layout, std::span<const uint32_t> block_ids,
                                 std::span<const BlockPin> pins, CUstream_st* stream) {
  CXLKV_RETURN_IF_ERROR(ValidateScatter("cuda scatter-read", layout, block_ids, pins));
  Impl& m = *impl_;
  m.pieces.clear();
  for (size_t i = 0; i < pins.size(); ++i) {
    const uint8_t* block = m.cache->PayloadPtr(pins[i]);
    if (m.DeviceAddress(block) == 0) return OutsideRegistered();
    // P2: another host wrote these; the device's reads snoop this host's caches, which must
    // not hold stale copies.
    m.cache->InvalidateForRead(block, pins[i].bytes, /*fence=*/i + 1 == pins.size());
    for (uint32_t l = 0; l < layout.num_layers(); ++l) {
      for (uint32_t p = 0; p < layout.parts(); ++p) {
        m.pieces.push_back({reinterpret_cast<uint64_t>(layout.EnginePiece(l, p, block_ids[i])),
                            m.DeviceAddress(block + layout.PoolPieceOffset(l, p)), layout.PieceBytes()});
      }
    }
  }
  return m.Launch(stream);
}

Result<GatherResult> CudaTransfer::GatherWrite(const NamespaceHandle& ns, const EngineKvLayout& layout,
                                               std::span<const uint32_t> block_ids, std::span<const BlockKey> keys,
                                               CUstream_st* stream) {
  CXLKV_RETURN_IF_ERROR(ValidateGather("cuda gather-write", ns, layout, block_ids, keys));
  Impl& m = *impl_;
  GatherResult out;
  std::vector<Reservation> reserved;
  std::vector<uint32_t> reserved_ids;
  CXLKV_RETURN_IF_ERROR(ReserveAll(*m.cache, ns, layout.PoolBlockBytes(), block_ids, keys, reserved, reserved_ids, out));
  m.pieces.clear();
  for (size_t i = 0; i < reserved.size(); ++i) {
    uint8_t* block = m.cache->ReservedPtr(reserved[i]);
    if (m.DeviceAddress(block) == 0) {
      for (auto& r : reserved) (void)m.cache->Abort(r);
      return OutsideRegistered();
    }
    for (uint32_t l = 0; l < layout.num_layers(); ++l) {
      for (uint32_t p = 0; p < layout.parts(); ++p) {
        m.pieces.push_back({m.DeviceAddress(block + layout.PoolPieceOffset(l, p)),
                            reinterpret_cast<uint64_t>(layout.EnginePiece(l, p, reserved_ids[i])), layout.PieceBytes()});
      }
    }
  }
  Status launched = m.Launch(stream);
  cudaError_t e = cudaSuccess;
  if (launched.ok() && (e = cudaEventRecord(m.gather_done, stream)) == cudaSuccess) {
    e = cudaEventSynchronize(m.gather_done);  // P1: the payload lands before any commit
  }
  if (!launched.ok() || e != cudaSuccess) {
    for (auto& r : reserved) (void)m.cache->Abort(r);
    return launched.ok() ? CudaError("cuda gather-write", e) : launched;
  }
  return CommitAll(*m.cache, reserved, out);
}

}  // namespace cxlkv::transfer
