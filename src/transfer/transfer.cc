#include "transfer/transfer.h"

#include <algorithm>
#include <cstring>

#include "region/coherence.h"
#include "transfer/request.h"

namespace cxlkv::transfer {

CpuTransfer::CpuTransfer(KvCache& cache, TransferOptions options) : cache_(cache), options_(options) {
  options_.threads = std::max<uint32_t>(1, options_.threads);
  for (uint32_t i = 1; i < options_.threads; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

CpuTransfer::~CpuTransfer() {
  {
    // Layer-wise steps still queued run to the end first: they write into engine memory and
    // reserved pool blocks their handles still account for.
    std::lock_guard<std::mutex> lock(async_mu_);
    async_stop_ = true;
  }
  async_cv_.notify_all();
  if (async_thread_.joinable()) async_thread_.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& w : workers_) w.join();
}

namespace {

// Worker `i` of `n` takes a contiguous run of pieces holding about 1/n of the bytes: the pieces
// that end within its share (prefix[k] = bytes up to and including piece k).
std::pair<size_t, size_t> Share(std::span<const uint64_t> prefix, uint32_t i, uint32_t n) {
  const uint64_t total = prefix.back();
  auto at = [&](uint64_t bytes) {
    return static_cast<size_t>(std::upper_bound(prefix.begin(), prefix.end(), bytes) - prefix.begin());
  };
  return {at(total * i / n), at(total * (i + 1) / n)};
}

}  // namespace

void CpuTransfer::CopyRange(std::span<const Piece> pieces, bool to_pool) {
  if (!to_pool) {
    // P2: another host wrote these. Invalidate every source in a batch, one fence, so the
    // misses of many small pieces overlap instead of queueing behind one fence each.
    for (const Piece& p : pieces) cache_.InvalidateForRead(p.src, p.bytes, /*fence=*/false);
    region::FullFence();
  }
  for (const Piece& p : pieces) {
    if (to_pool) {
      if (p.bytes < options_.small_piece_bytes) {
        // Small: plain stores, then publish the lines (P1/P3: never left dirty in this cache).
        std::memcpy(p.dst, p.src, p.bytes);
        region::FlushLinesUnfenced(p.dst, p.bytes);
      } else {
        region::NtCopyUnfenced(p.dst, p.src, p.bytes);  // the fence below orders the batch
      }
    } else {
      if (p.bytes < options_.small_piece_bytes) {
        std::memcpy(p.dst, p.src, p.bytes);
      } else {
        region::NtCopyUnfenced(p.dst, p.src, p.bytes);  // streaming: the engine's buffer, not our cache
      }
    }
  }
  region::FullFence();
}

void CpuTransfer::CopyAll(std::span<const Piece> pieces, bool to_pool) {
  if (pieces.empty()) return;
  if (workers_.empty() || pieces.size() == 1) return CopyRange(pieces, to_pool);
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = pieces;
    job_to_pool_ = to_pool;
    pending_ = static_cast<uint32_t>(workers_.size());
    ++job_generation_;
  }
  cv_.notify_all();
  std::vector<uint64_t>& prefix = prefix_;
  prefix.resize(pieces.size());
  uint64_t sum = 0;
  for (size_t i = 0; i < pieces.size(); ++i) prefix[i] = (sum += pieces[i].bytes);
  auto [b, e] = Share(prefix, 0, options_.threads);
  CopyRange(pieces.subspan(b, e - b), to_pool);
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this] { return pending_ == 0; });
}

void CpuTransfer::WorkerLoop(uint32_t index) {
  uint64_t seen = 0;
  std::vector<uint64_t> prefix;
  for (;;) {
    std::span<const Piece> job;
    bool to_pool;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || job_generation_ != seen; });
      if (stop_) return;
      seen = job_generation_;
      job = job_;
      to_pool = job_to_pool_;
    }
    prefix.resize(job.size());
    uint64_t sum = 0;
    for (size_t i = 0; i < job.size(); ++i) prefix[i] = (sum += job[i].bytes);
    auto [b, e] = Share(prefix, index, options_.threads);
    CopyRange(job.subspan(b, e - b), to_pool);
    {
      std::lock_guard<std::mutex> lock(mu_);
      --pending_;
    }
    done_cv_.notify_one();
  }
}

Result<GatherResult> CpuTransfer::GatherWrite(const NamespaceHandle& ns, const EngineKvLayout& layout,
                                              std::span<const uint32_t> block_ids, std::span<const BlockKey> keys) {
  // Validate everything before reserving anything.
  CXLKV_RETURN_IF_ERROR(ValidateGather("gather-write", ns, layout, block_ids, keys));
  std::lock_guard<std::mutex> call(call_mu_);
  GatherResult out;
  std::vector<Reservation> reserved;
  std::vector<uint32_t> reserved_ids;
  CXLKV_RETURN_IF_ERROR(ReserveAll(cache_, ns, layout.PoolBlockBytes(), block_ids, keys, reserved, reserved_ids, out));
  pieces_.clear();
  for (size_t i = 0; i < reserved.size(); ++i) {
    uint8_t* block = cache_.ReservedPtr(reserved[i]);
    for (uint32_t l = 0; l < layout.num_layers(); ++l) {
      for (uint32_t p = 0; p < layout.parts(); ++p) {
        pieces_.push_back({block + layout.PoolPieceOffset(l, p), layout.EnginePiece(l, p, reserved_ids[i]),
                           layout.PieceBytes()});
      }
    }
  }
  CopyAll(pieces_, /*to_pool=*/true);
  return CommitAll(cache_, reserved, out);
}

Status CpuTransfer::ScatterRead(const EngineKvLayout& layout, std::span<const uint32_t> block_ids,
                                std::span<const BlockPin> pins) {
  CXLKV_RETURN_IF_ERROR(ValidateScatter("scatter-read", layout, block_ids, pins));
  std::lock_guard<std::mutex> call(call_mu_);
  pieces_.clear();
  for (size_t i = 0; i < pins.size(); ++i) {
    const uint8_t* block = cache_.PayloadPtr(pins[i]);
    for (uint32_t l = 0; l < layout.num_layers(); ++l) {
      for (uint32_t p = 0; p < layout.parts(); ++p) {
        pieces_.push_back({layout.EnginePiece(l, p, block_ids[i]), block + layout.PoolPieceOffset(l, p),
                           layout.PieceBytes()});
      }
    }
  }
  CopyAll(pieces_, /*to_pool=*/false);
  return Status::Ok();
}

Result<CapacityRead> CpuTransfer::LoadFromCapacity(const NamespaceHandle& ns, const EngineKvLayout& layout,
                                                   std::span<const uint32_t> block_ids,
                                                   std::span<const BlockKey> keys) {
  if (block_ids.size() != keys.size()) {
    return InvalidArgument("load from capacity: " + std::to_string(block_ids.size()) + " engine blocks for " +
                           std::to_string(keys.size()) + " keys");
  }
  CXLKV_RETURN_IF_ERROR(layout.Validate());
  size_t done = 0;  // `use` is called for consecutive parts of the prefix, in order
  return cache_.ReadCapacity(ns, keys, layout.PoolBlockBytes(), [&](std::span<const BlockPin> staged) {
    if (done + staged.size() > block_ids.size()) return Internal("capacity read returned more blocks than asked");
    Status s = ScatterRead(layout, block_ids.subspan(done, staged.size()), staged);
    done += staged.size();
    return s;
  });
}

Status CpuTransfer::SparseRead(const EngineKvLayout& layout, std::span<const BlockPin> pins,
                               const SparseSelection& sel, const SparseDestination& dst) {
  CXLKV_RETURN_IF_ERROR(layout.Validate());
  if (layout.kind == EngineLayoutKind::kMla) return InvalidArgument("sparse read: MLA blocks have no K/V heads");
  const uint32_t layers = layout.num_layers(), heads = layout.num_kv_heads;
  if (sel.num_layers != layers || sel.num_kv_heads != heads || sel.tokens.size() != uint64_t{layers} * heads) {
    return InvalidArgument("sparse read: the selection is not shaped " + std::to_string(layers) + " layers x " +
                           std::to_string(heads) + " heads like the layout");
  }
  if (dst.k.size() != layers || dst.v.size() != layers) {
    return InvalidArgument("sparse read: the destination needs a K and a V buffer per layer");
  }
  for (uint32_t l = 0; l < layers; ++l) {
    if (!dst.k[l] || !dst.v[l]) return InvalidArgument("sparse read: layer " + std::to_string(l) + " has a null buffer");
  }
  const uint64_t block_bytes = layout.PoolBlockBytes();
  for (size_t i = 0; i < pins.size(); ++i) {
    if (pins[i].bytes != block_bytes) {
      return InvalidArgument("sparse read: pool block " + std::to_string(i) + " is not of this layout's size: "
                             "layout signature mismatch");
    }
  }
  const uint64_t request_tokens = uint64_t{layout.block_size} * pins.size();
  for (size_t s = 0; s < sel.tokens.size(); ++s) {
    if (sel.tokens[s].size() > dst.capacity) {
      return InvalidArgument("sparse read: " + std::to_string(sel.tokens[s].size()) + " tokens selected for one head, "
                             "the destination holds " + std::to_string(dst.capacity));
    }
    for (uint32_t t : sel.tokens[s]) {
      if (t >= request_tokens) {
        return InvalidArgument("sparse read: token " + std::to_string(t) + " is beyond the request's " +
                               std::to_string(request_tokens) + " tokens");
      }
    }
  }
  const uint64_t head_bytes = uint64_t{layout.head_size} * DtypeBytes(layout.dtype);
  std::lock_guard<std::mutex> call(call_mu_);
  pieces_.clear();
  for (uint32_t l = 0; l < layers; ++l) {
    for (uint32_t h = 0; h < heads; ++h) {
      const auto& tokens = sel.tokens[uint64_t{l} * heads + h];
      for (size_t i = 0; i < tokens.size(); ++i) {
        const uint32_t t = tokens[i];
        const uint8_t* block = cache_.PayloadPtr(pins[t / layout.block_size]);
        const uint64_t row = (layout.PoolBlockFormat() == kPoolBlockFormatHeadMajor
                                  ? uint64_t{h} * layout.block_size + t % layout.block_size
                                  : uint64_t{t % layout.block_size} * heads + h) *
                             head_bytes;
        const uint64_t out = (uint64_t{h} * dst.capacity + i) * head_bytes;
        pieces_.push_back({dst.k[l] + out, block + layout.PoolPieceOffset(l, 0) + row, head_bytes});
        pieces_.push_back({dst.v[l] + out, block + layout.PoolPieceOffset(l, 1) + row, head_bytes});
      }
    }
  }
  CopyAll(pieces_, /*to_pool=*/false);
  return Status::Ok();
}

}  // namespace cxlkv::transfer
