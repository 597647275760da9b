// Layer-wise pipelining and asynchronous prefetch (Unified KV pooling §II-B): a load or a store
// is cut into one step per layer; a background thread runs the steps FIFO, each as one batched
// copy split across the transfer's workers, and publishes per-layer progress to the handle.
#include <algorithm>

#include "transfer/transfer.h"

namespace cxlkv::transfer {

struct LayerwiseState {
  bool to_pool = false;
  uint32_t num_layers = 0;
  // Pieces of layer l: pieces[layer_begin[l], layer_begin[l + 1]).
  std::vector<CpuTransfer::Piece> pieces;
  std::vector<size_t> layer_begin;
  std::function<void(uint32_t)> on_layer_ready;

  std::mutex mu;
  std::condition_variable cv;
  uint32_t layers_done = 0;     // steps whose bytes are in place (a load's in layer order: 0..done-1)
  uint32_t steps_finished = 0;  // steps whose callback has returned too: nothing touches the state after
  std::vector<bool> reported;   // store: layers the engine reported computed
  uint32_t reported_count = 0;  // store

  // Store only: what Finish commits.
  std::vector<Reservation> reserved;
  GatherResult result;

  // Builds the pieces of every layer of `blocks` engine/pool block pairs, layer-major.
  template <typename PieceOf>
  void BuildPieces(const EngineKvLayout& layout, size_t blocks, PieceOf piece_of) {
    num_layers = layout.num_layers();
    pieces.reserve(blocks * num_layers * layout.parts());
    layer_begin.reserve(num_layers + 1);
    for (uint32_t l = 0; l < num_layers; ++l) {
      layer_begin.push_back(pieces.size());
      for (size_t i = 0; i < blocks; ++i) {
        for (uint32_t p = 0; p < layout.parts(); ++p) pieces.push_back(piece_of(i, l, p));
      }
    }
    layer_begin.push_back(pieces.size());
  }
  void WaitReady(uint32_t steps) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return layers_done >= steps; });
  }
  void WaitFinished(uint32_t steps) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return steps_finished >= steps; });
  }
};

void CpuTransfer::Enqueue(std::shared_ptr<LayerwiseState> state, uint32_t layer) {
  {
    std::lock_guard<std::mutex> lock(async_mu_);
    if (!async_thread_.joinable()) async_thread_ = std::thread([this] { AsyncLoop(); });
    async_queue_.emplace_back(std::move(state), layer);
  }
  async_cv_.notify_one();
}

void CpuTransfer::AsyncLoop() {
  for (;;) {
    std::pair<std::shared_ptr<LayerwiseState>, uint32_t> step;
    {
      std::unique_lock<std::mutex> lock(async_mu_);
      async_cv_.wait(lock, [this] { return async_stop_ || !async_queue_.empty(); });
      if (async_queue_.empty()) return;  // stopping, and nothing left to run
      step = std::move(async_queue_.front());
      async_queue_.pop_front();
    }
    RunLayer(*step.first, step.second);
  }
}

void CpuTransfer::RunLayer(LayerwiseState& state, uint32_t layer) {
  const size_t b = state.layer_begin[layer], e = state.layer_begin[layer + 1];
  {
    std::lock_guard<std::mutex> call(call_mu_);
    // CopyAll ends with a fence: the layer's bytes are globally visible (pool side: flushed or
    // streamed, P1) before it is reported ready.
    CopyAll(std::span<const Piece>(state.pieces).subspan(b, e - b), state.to_pool);
  }
  {
    std::lock_guard<std::mutex> lock(state.mu);
    ++state.layers_done;
  }
  state.cv.notify_all();
  if (state.on_layer_ready) state.on_layer_ready(layer);
  {
    std::lock_guard<std::mutex> lock(state.mu);
    ++state.steps_finished;
  }
  state.cv.notify_all();
}

Result<std::unique_ptr<LayerLoad>> CpuTransfer::StartLoad(const EngineKvLayout& layout,
                                                          std::span<const uint32_t> block_ids,
                                                          std::span<const BlockPin> pins,
                                                          std::function<void(uint32_t layer)> on_layer_ready) {
  CXLKV_RETURN_IF_ERROR(ValidateScatter("layer-wise load", layout, block_ids, pins));
  auto state = std::make_shared<LayerwiseState>();
  state->to_pool = false;
  state->on_layer_ready = std::move(on_layer_ready);
  state->BuildPieces(layout, pins.size(), [&](size_t i, uint32_t l, uint32_t p) {
    return Piece{layout.EnginePiece(l, p, block_ids[i]), cache_.PayloadPtr(pins[i]) + layout.PoolPieceOffset(l, p),
                 layout.PieceBytes()};
  });
  for (uint32_t l = 0; l < state->num_layers; ++l) Enqueue(state, l);
  return std::unique_ptr<LayerLoad>(new LayerLoad(std::move(state)));
}

Result<std::unique_ptr<LayerStore>> CpuTransfer::StartStore(const NamespaceHandle& ns, const EngineKvLayout& layout,
                                                            std::span<const uint32_t> block_ids,
                                                            std::span<const BlockKey> keys) {
  CXLKV_RETURN_IF_ERROR(ValidateGather("layer-wise store", ns, layout, block_ids, keys));
  auto state = std::make_shared<LayerwiseState>();
  state->to_pool = true;
  std::vector<uint32_t> reserved_ids;
  CXLKV_RETURN_IF_ERROR(
      ReserveAll(cache_, ns, layout.PoolBlockBytes(), block_ids, keys, state->reserved, reserved_ids, state->result));
  state->BuildPieces(layout, state->reserved.size(), [&](size_t i, uint32_t l, uint32_t p) {
    return Piece{cache_.ReservedPtr(state->reserved[i]) + layout.PoolPieceOffset(l, p),
                 layout.EnginePiece(l, p, reserved_ids[i]), layout.PieceBytes()};
  });
  state->reported.assign(state->num_layers, false);
  return std::unique_ptr<LayerStore>(new LayerStore(*this, std::move(state)));
}

// Waits for the callbacks too: they may use what the caller is about to destroy.
LayerLoad::~LayerLoad() { state_->WaitFinished(state_->num_layers); }

uint32_t LayerLoad::num_layers() const { return state_->num_layers; }

uint32_t LayerLoad::layers_ready() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->layers_done;
}

void LayerLoad::WaitLayer(uint32_t layer) const {
  state_->WaitReady(std::min(layer + 1, state_->num_layers));
}

uint32_t LayerStore::num_layers() const { return state_->num_layers; }

Status LayerStore::LayerComputed(uint32_t layer) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (finished_) return InvalidArgument("layer-wise store: already finished");
    if (layer >= state_->num_layers) {
      return InvalidArgument("layer-wise store: layer " + std::to_string(layer) + " of a " +
                             std::to_string(state_->num_layers) + "-layer model");
    }
    if (state_->reported[layer]) {
      return InvalidArgument("layer-wise store: layer " + std::to_string(layer) + " reported twice");
    }
    state_->reported[layer] = true;
    ++state_->reported_count;
  }
  transfer_.Enqueue(state_, layer);
  return Status::Ok();
}

Result<GatherResult> LayerStore::Finish(const std::function<Status()>& before_commit) {
  if (finished_) return InvalidArgument("layer-wise store: already finished");
  uint32_t reported;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    reported = state_->reported_count;
  }
  // Steps already queued write into the reserved blocks: let them land before either outcome.
  state_->WaitFinished(reported);
  finished_ = true;
  if (reported != state_->num_layers) {
    for (auto& r : state_->reserved) (void)transfer_.cache_.Abort(r);
    return InvalidArgument("layer-wise store: finished with " + std::to_string(reported) + " of " +
                           std::to_string(state_->num_layers) + " layers computed: nothing published");
  }
  if (before_commit) {
    if (Status veto = before_commit(); !veto.ok()) {
      for (auto& r : state_->reserved) (void)transfer_.cache_.Abort(r);
      return veto;
    }
  }
  return CommitAll(transfer_.cache_, state_->reserved, state_->result);
}

LayerStore::~LayerStore() {
  if (finished_) return;
  uint32_t reported;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    reported = state_->reported_count;
  }
  state_->WaitFinished(reported);
  for (auto& r : state_->reserved) (void)transfer_.cache_.Abort(r);
}

}  // namespace cxlkv::transfer
