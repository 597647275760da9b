// EngineKvStore (include/cxlkv/kv_store.h): the engine-keyed batch API over the cache and the
// transfer engine.
#include "cxlkv/kv_store.h"

#include <algorithm>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "kvstore/block_owners.h"
#include "transfer/cuda_transfer.h"
#include "transfer/transfer.h"

namespace cxlkv {

class EngineKvStore::Impl {
 public:
  Impl(KvCache& cache, const NamespaceHandle& ns, const EngineKvLayout& layout, uint32_t threads)
      : cache_(cache), ns_(ns), layout_(layout), transfer_(cache, {.threads = threads}), owners_(layout.num_blocks) {}

  KvCache& cache_;
  const NamespaceHandle ns_;
  const EngineKvLayout layout_;
  std::mutex mu_;  // one call at a time: the transfer engine's workers are this store's
  transfer::CpuTransfer transfer_;
  std::unique_ptr<transfer::CudaTransfer> cuda_;  // set: the tensors are in GPU memory
  kvstore::BlockOwners owners_;  // its own lock: loads forget themselves from any thread

  // The hit's pins → engine blocks, complete on return. REQUIRES: mu_ held, ids validated.
  Status ScatterNow(std::span<const uint32_t> ids, std::span<const BlockPin> pins) {
    if (!cuda_) return transfer_.ScatterRead(layout_, ids, pins);
    CXLKV_RETURN_IF_ERROR(cuda_->ScatterRead(layout_, ids, pins, nullptr));
    return cuda_->Synchronize(nullptr);  // the pins may be released only after the kernel read them
  }
  Result<transfer::GatherResult> GatherNow(std::span<const uint32_t> ids, std::span<const BlockKey> keys) {
    if (!cuda_) return transfer_.GatherWrite(ns_, layout_, ids, keys);
    return cuda_->GatherWrite(ns_, layout_, ids, keys, nullptr);  // waits for the kernel before commit
  }
};

class EngineKvLoad::Impl {
 public:
  Impl(KvCache& cache, kvstore::BlockOwners& owners, LookupResult hit)
      : cache_(cache), owners_(owners), hit_(std::move(hit)) {}
  ~Impl() {
    if (load_) load_->Wait();  // the copy reads the pinned blocks and writes the engine's tensors
    if (ticket_ != 0) owners_.Forget(ticket_);
    load_.reset();
    cache_.Release(hit_.pins);
  }
  KvCache& cache_;
  kvstore::BlockOwners& owners_;
  LookupResult hit_;
  std::shared_ptr<transfer::LayerLoad> load_;  // null when nothing hit; shared with owners_' list
  uint64_t ticket_ = 0;                        // in owners_' list of loads in flight
};

EngineKvLoad::EngineKvLoad(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EngineKvLoad::~EngineKvLoad() = default;
size_t EngineKvLoad::blocks() const { return impl_->hit_.pins.size(); }
void EngineKvLoad::WaitLayer(uint32_t layer) const {
  if (impl_->load_) impl_->load_->WaitLayer(std::min(layer, impl_->load_->num_layers() - 1));
}
void EngineKvLoad::Wait() const {
  if (impl_->load_) impl_->load_->Wait();
}

class EngineKvSave::Impl {
 public:
  std::unique_ptr<transfer::LayerStore> store_;  // a host store: copies each layer as reported
  // A device store: the whole request at Finish, once every layer was reported.
  std::function<Result<PutManyResult>()> finish_whole_;
  // Once the copies are done: whether every source block is still its request's.
  std::function<Status()> still_held_;
  std::vector<bool> reported_;
  bool finished_ = false;
};

EngineKvSave::EngineKvSave(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EngineKvSave::~EngineKvSave() = default;  // the LayerStore aborts what was never finished
Status EngineKvSave::LayerComputed(uint32_t layer) {
  if (impl_->finished_) return InvalidArgument("save: layer reported after Finish");
  if (impl_->store_) return impl_->store_->LayerComputed(layer);
  auto& seen = impl_->reported_;
  if (layer >= seen.size() || seen[layer]) {
    return InvalidArgument("save: layer " + std::to_string(layer) + " is out of range (" +
                           std::to_string(seen.size()) + " layers) or reported twice");
  }
  seen[layer] = true;
  return Status::Ok();
}
Result<PutManyResult> EngineKvSave::Finish() {
  if (impl_->finished_) return InvalidArgument("save: Finish called twice");
  impl_->finished_ = true;
  if (!impl_->store_) {
    for (size_t l = 0; l < impl_->reported_.size(); ++l) {
      if (!impl_->reported_[l]) {
        return InvalidArgument("save: layer " + std::to_string(l) + " was never reported computed: nothing published");
      }
    }
    return impl_->finish_whole_();
  }
  CXLKV_ASSIGN_OR_RETURN(auto g, impl_->store_->Finish(impl_->still_held_));
  return PutManyResult{g.written, g.already_cached};
}

namespace {

Status SameLength(const char* what, size_t keys, size_t ids) {
  if (keys == ids) return Status::Ok();
  return InvalidArgument(std::string(what) + ": " + std::to_string(keys) + " keys but " + std::to_string(ids) +
                         " block ids: give one engine block id per key");
}

// Destinations in range and pairwise distinct (overlapping destinations would race).
Status DistinctBlockIds(const char* what, std::span<const uint32_t> ids, uint32_t num_blocks) {
  std::vector<bool> seen(num_blocks, false);
  for (uint32_t id : ids) {
    if (id >= num_blocks) {
      return InvalidArgument(std::string(what) + ": block id " + std::to_string(id) +
                             " is out of range (the engine has " + std::to_string(num_blocks) + " blocks)");
    }
    if (seen[id]) {
      return InvalidArgument(std::string(what) + ": block id " + std::to_string(id) +
                             " appears twice: the destinations would overlap");
    }
    seen[id] = true;
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<EngineKvStore>> EngineKvStore::Register(KvCache& cache, const NamespaceHandle& ns,
                                                               const EngineKvLayout& layout, uint32_t copy_threads) {
  CXLKV_RETURN_IF_ERROR(layout.Validate());
  if (copy_threads == 0 || copy_threads > 64) {
    return InvalidArgument("register KV buffers: copy_threads " + std::to_string(copy_threads) +
                           " is not in 1..64");
  }
  const uint64_t block_bytes = layout.PoolBlockBytes();
  if (ns.block_bytes != block_bytes) {
    return InvalidArgument("register KV buffers: the namespace's blocks are " + std::to_string(ns.block_bytes) +
                           " bytes, this engine layout's are " + std::to_string(block_bytes) +
                           " (layers x K/V x block_size x heads x head_size x dtype): register the namespace "
                           "with this layout's signature (EngineKvLayout::Signature)");
  }
  if (ns.block_size != layout.block_size) {
    return InvalidArgument("register KV buffers: the namespace has " + std::to_string(ns.block_size) +
                           " tokens per block, the engine layout " + std::to_string(layout.block_size));
  }
  return std::unique_ptr<EngineKvStore>(
      new EngineKvStore(std::make_unique<Impl>(cache, ns, layout, copy_threads)));
}

Result<std::unique_ptr<EngineKvStore>> EngineKvStore::RegisterDevice(Pool& pool, const NamespaceHandle& ns,
                                                                     const EngineKvLayout& layout, int cuda_device) {
  CXLKV_ASSIGN_OR_RETURN(KvCache * cache, pool.Cache());
  CXLKV_ASSIGN_OR_RETURN(auto store, Register(*cache, ns, layout));
  CXLKV_ASSIGN_OR_RETURN(store->impl_->cuda_,
                         transfer::CudaTransfer::Create(*cache, pool.MappedRanges(), {.device = cuda_device}));
  return store;
}

bool EngineKvStore::DeviceBuilt() { return transfer::CudaTransfer::Built(); }

EngineKvStore::EngineKvStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EngineKvStore::~EngineKvStore() = default;

const EngineKvLayout& EngineKvStore::layout() const { return impl_->layout_; }
const NamespaceHandle& EngineKvStore::ns() const { return impl_->ns_; }

Status EngineKvStore::AssignBlocks(BlockOwner owner, std::span<const uint32_t> block_ids) {
  return impl_->owners_.Assign(owner, block_ids);
}
// Under mu_: a synchronous copy in progress finishes before its blocks change hands. Loads in
// flight are waited for inside (their copy thread never takes mu_).
size_t EngineKvStore::ReleaseBlocks(BlockOwner owner, std::span<const uint32_t> block_ids) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return impl_->owners_.Release(owner, block_ids);
}
size_t EngineKvStore::ReleaseOwner(BlockOwner owner) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return impl_->owners_.ReleaseAll(owner);
}

Result<size_t> EngineKvStore::ExistsPrefix(std::span<const BlockKey> keys) {
  return impl_->cache_.Exists(impl_->ns_, keys);
}

Result<PutManyResult> EngineKvStore::PutMany(std::span<const BlockKey> keys, std::span<const uint32_t> block_ids,
                                             BlockOwner owner) {
  CXLKV_RETURN_IF_ERROR(SameLength("put_many", keys.size(), block_ids.size()));
  if (keys.empty()) return PutManyResult{};
  std::lock_guard<std::mutex> lock(impl_->mu_);
  // Copied and committed under mu_, which a release takes too: held at the check, held throughout.
  CXLKV_RETURN_IF_ERROR(impl_->owners_.Check("put_many", owner, block_ids).status());
  CXLKV_ASSIGN_OR_RETURN(auto g, impl_->GatherNow(block_ids, keys));
  return PutManyResult{g.written, g.already_cached};
}

Result<size_t> EngineKvStore::GetManyInto(std::span<const BlockKey> keys, std::span<const uint32_t> block_ids,
                                          BlockOwner owner) {
  CXLKV_RETURN_IF_ERROR(SameLength("get_many_into", keys.size(), block_ids.size()));
  if (keys.empty()) return size_t{0};
  std::lock_guard<std::mutex> lock(impl_->mu_);
  // Validated whole before any pin: a bad block id anywhere fails the call with nothing read.
  CXLKV_RETURN_IF_ERROR(DistinctBlockIds("get_many_into", block_ids, impl_->layout_.num_blocks));
  CXLKV_RETURN_IF_ERROR(impl_->owners_.Check("get_many_into", owner, block_ids).status());
  CXLKV_ASSIGN_OR_RETURN(LookupResult hit, impl_->cache_.Lookup(impl_->ns_, keys));
  Status s = impl_->ScatterNow(block_ids.first(hit.pins.size()), hit.pins);
  impl_->cache_.Release(hit.pins);
  CXLKV_RETURN_IF_ERROR(s);
  return hit.pins.size();
}

Result<std::unique_ptr<EngineKvLoad>> EngineKvStore::StartGetManyInto(std::span<const BlockKey> keys,
                                                                      std::span<const uint32_t> block_ids,
                                                                      BlockOwner owner) {
  CXLKV_RETURN_IF_ERROR(SameLength("get_many_into", keys.size(), block_ids.size()));
  CXLKV_RETURN_IF_ERROR(DistinctBlockIds("get_many_into", block_ids, impl_->layout_.num_blocks));
  std::lock_guard<std::mutex> lock(impl_->mu_);
  CXLKV_RETURN_IF_ERROR(impl_->owners_.Check("get_many_into", owner, block_ids).status());
  LookupResult hit;
  if (!keys.empty()) {
    CXLKV_ASSIGN_OR_RETURN(hit, impl_->cache_.Lookup(impl_->ns_, keys));
  }
  auto load = std::make_unique<EngineKvLoad::Impl>(impl_->cache_, impl_->owners_, std::move(hit));
  const auto dst = block_ids.first(load->hit_.pins.size());
  if (impl_->cuda_ && !load->hit_.pins.empty()) {  // one kernel for the request, complete now
    CXLKV_RETURN_IF_ERROR(impl_->ScatterNow(dst, load->hit_.pins));
  } else if (!load->hit_.pins.empty()) {
    // On failure `load` releases the pins as it goes.
    CXLKV_ASSIGN_OR_RETURN(load->load_, impl_->transfer_.StartLoad(impl_->layout_, dst, load->hit_.pins));
    // Releasing any of these blocks waits for this copy (it writes them).
    load->ticket_ = impl_->owners_.AddLoad(owner, dst, load->load_);
  }
  return std::unique_ptr<EngineKvLoad>(new EngineKvLoad(std::move(load)));
}

Result<std::unique_ptr<EngineKvSave>> EngineKvStore::StartPutMany(std::span<const BlockKey> keys,
                                                                  std::span<const uint32_t> block_ids,
                                                                  BlockOwner owner) {
  CXLKV_RETURN_IF_ERROR(SameLength("put_many", keys.size(), block_ids.size()));
  std::lock_guard<std::mutex> lock(impl_->mu_);
  CXLKV_ASSIGN_OR_RETURN(std::vector<kvstore::HeldBlock> held, impl_->owners_.Check("put_many", owner, block_ids));
  auto save = std::make_unique<EngineKvSave::Impl>();
  if (!held.empty()) {
    save->still_held_ = [owners = &impl_->owners_, owner, held = std::move(held)]() {
      return owners->StillHeld("put_many", owner, held);
    };
  }
  if (impl_->cuda_) {
    CXLKV_RETURN_IF_ERROR(transfer::ValidateGather("put_many", impl_->ns_, impl_->layout_, block_ids, keys));
    save->reported_.assign(impl_->layout_.num_layers(), false);
    // The device path copies the whole request at Finish: the blocks must be the request's then.
    save->finish_whole_ = [this, owner, still_held = save->still_held_,
                           keys = std::vector<BlockKey>(keys.begin(), keys.end()),
                           ids = std::vector<uint32_t>(block_ids.begin(), block_ids.end())]() -> Result<PutManyResult> {
      if (still_held) CXLKV_RETURN_IF_ERROR(still_held());
      return PutMany(keys, ids, owner);
    };
    return std::unique_ptr<EngineKvSave>(new EngineKvSave(std::move(save)));
  }
  CXLKV_ASSIGN_OR_RETURN(save->store_, impl_->transfer_.StartStore(impl_->ns_, impl_->layout_, block_ids, keys));
  return std::unique_ptr<EngineKvSave>(new EngineKvSave(std::move(save)));
}

}  // namespace cxlkv
