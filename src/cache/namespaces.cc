// Index: the namespace table — registration, layout checks, handle validation.
#include <xxhash.h>

#include <cstring>

#include "cache/index.h"

namespace cxlkv::cache {

namespace {

// "tag\0model\0extra\0": the start of both hashed descriptions.
std::string Described(const char* tag, const KeyNamespace& ns) {
  std::string s = tag;
  for (const std::string* part : {&ns.model_id, &ns.extra_key}) {
    s.push_back('\0');
    s += *part;
  }
  s.push_back('\0');
  return s;
}

uint64_t IdentityHash(const KeyNamespace& ns) {
  std::string id = Described("cxlkv-identity-v1", ns);
  const uint32_t parts[] = {ns.layout.tp_rank, ns.layout.tp_size, ns.layout.pp_stage};
  id.append(reinterpret_cast<const char*>(parts), sizeof parts);
  return XXH3_64bits(id.data(), id.size());
}

BlockKey SeedOf(const KeyNamespace& ns) {
  std::string s = Described("cxlkv-namespace-v1", ns);
  s.append(reinterpret_cast<const char*>(&ns.layout), sizeof ns.layout);
  XXH128_hash_t h = XXH3_128bits(s.data(), s.size());
  return BlockKey{h.low64, h.high64};
}

std::string DescribeLayout(const KvLayoutSignature& l) {
  static const char* const kDtypes[] = {"fp16", "bf16", "fp8", "fp32"};
  return std::string(static_cast<uint32_t>(l.dtype) < 4 ? kDtypes[static_cast<uint32_t>(l.dtype)] : "?") +
         " layers=" + std::to_string(l.num_layers) + " kv_heads=" + std::to_string(l.num_kv_heads) +
         " head_size=" + std::to_string(l.head_size) + " block=" + std::to_string(l.block_size) +
         " tp=" + std::to_string(l.tp_rank) + "/" + std::to_string(l.tp_size) +
         " pp=" + std::to_string(l.pp_stage) + " parts=" + std::to_string(l.kv_parts) +
         " format=" + std::to_string(l.block_format);
}

Status ValidateNamespace(const KeyNamespace& ns) {
  const auto& l = ns.layout;
  if (ns.model_id.empty()) return InvalidArgument("a key namespace needs a model id");
  if (ns.model_id.size() >= sizeof(NamespaceSlot::model_id)) {
    return InvalidArgument("model id of " + std::to_string(ns.model_id.size()) + " bytes exceeds the " +
                           std::to_string(sizeof(NamespaceSlot::model_id) - 1) + "-byte limit");
  }
  if (ns.extra_key.size() >= sizeof(NamespaceSlot::extra_key)) {
    return InvalidArgument("extra key of " + std::to_string(ns.extra_key.size()) + " bytes exceeds the " +
                           std::to_string(sizeof(NamespaceSlot::extra_key) - 1) + "-byte limit");
  }
  if (l.block_size == 0 || l.block_size > 4096) return InvalidArgument("block size must be 1..4096 tokens");
  if (l.tp_size == 0 || l.tp_rank >= l.tp_size) {
    return InvalidArgument("tensor-parallel rank " + std::to_string(l.tp_rank) + " is not below size " +
                           std::to_string(l.tp_size));
  }
  if (static_cast<uint32_t>(l.dtype) > static_cast<uint32_t>(KvDtype::kFp32)) return InvalidArgument("unknown KV dtype");
  if (l.num_layers != 0 && (l.num_kv_heads == 0 || l.head_size == 0 || (l.kv_parts != 1 && l.kv_parts != 2))) {
    return InvalidArgument("a KV layout with layers needs kv heads, a head size and 1 or 2 parts");
  }
  if (l.block_format != kPoolBlockFormat && l.block_format != kPoolBlockFormatHeadMajor) {
    return InvalidArgument("pool block format " + std::to_string(l.block_format) +
                           " is not one this build knows (1: token-major, 2: head-major)");
  }
  if (l.block_format == kPoolBlockFormatHeadMajor && l.kv_parts != 2) {
    return InvalidArgument("pool block format 2 (head-major) is for K and V heads; an MLA latent has format 1");
  }
  return Status::Ok();
}

}  // namespace

Result<NamespaceHandle> Index::RegisterNamespace(const KeyNamespace& ns) {
  CXLKV_RETURN_IF_ERROR(ValidateNamespace(ns));
  const BlockKey seed = SeedOf(ns);
  const uint64_t identity = IdentityHash(ns);
  // A registered slot never changes (its state word is published last, P4), so the common case —
  // the namespace exists — needs no lock: a reader is not held up by a silent lock manager.
  for (uint32_t i = 0; i < kMaxNamespaces; ++i) {
    uint64_t off = layout_.ns_slot(i);
    meta_.Invalidate(off, sizeof(NamespaceSlot));  // P2: another node registered it
    auto s = meta_.ReadStruct<NamespaceSlot>(off);
    if (s.state == 2 && s.seed_lo == seed.lo && s.seed_hi == seed.hi) {
      return NamespaceHandle{i, ns.layout.block_size, s.block_bytes, seed};
    }
  }
  const uint32_t lock = layout_.namespace_lock();
  CXLKV_ASSIGN_OR_RETURN(auto held, node_.AcquireFor(lock, node_.lease() * 4));
  (void)held;
  int64_t free_slot = -1;
  for (uint32_t i = 0; i < kMaxNamespaces; ++i) {
    uint64_t off = layout_.ns_slot(i);
    meta_.Invalidate(off, sizeof(NamespaceSlot));
    auto s = meta_.ReadStruct<NamespaceSlot>(off);
    if (s.state != 2) {
      if (free_slot < 0) free_slot = i;
      continue;
    }
    if (s.seed_lo == seed.lo && s.seed_hi == seed.hi) {
      node_.Release(lock);
      return NamespaceHandle{i, ns.layout.block_size, s.block_bytes, seed};
    }
    if (s.identity_hash == identity) {
      node_.Release(lock);
      return VersionMismatch("model '" + ns.model_id + "' (tp " + std::to_string(ns.layout.tp_rank) + "/" +
                             std::to_string(ns.layout.tp_size) + ", pp " + std::to_string(ns.layout.pp_stage) +
                             ") is registered in this pool with KV layout {" + DescribeLayout(s.layout) +
                             "}, not {" + DescribeLayout(ns.layout) +
                             "}: use the pool's layout, another model id, or a fresh pool");
    }
  }
  if (free_slot < 0) {
    node_.Release(lock);
    return NoSpace("the pool's namespace table is full (" + std::to_string(kMaxNamespaces) + " models/layouts)");
  }
  NamespaceSlot s{};
  s.state = 0;
  s.seed_lo = seed.lo;
  s.seed_hi = seed.hi;
  s.identity_hash = identity;
  s.block_bytes = ns.layout.BlockBytes();
  s.layout = ns.layout;
  std::memcpy(s.model_id, ns.model_id.data(), ns.model_id.size());
  std::memcpy(s.extra_key, ns.extra_key.data(), ns.extra_key.size());
  uint64_t off = layout_.ns_slot(static_cast<uint32_t>(free_slot));
  meta_.WriteStruct(off, s);
  meta_.Flush(off, sizeof s);
  meta_.Publish(off, 2);  // P4: the slot is live from this word on
  node_.Release(lock);
  return NamespaceHandle{static_cast<uint32_t>(free_slot), ns.layout.block_size, s.block_bytes, seed};
}

BlockKey Index::SeedFor(const KeyNamespace& ns) { return SeedOf(ns); }

Result<Index::RegisteredNamespace> Index::NamespaceAt(uint32_t id) {
  if (id >= kMaxNamespaces) return InvalidArgument("namespace " + std::to_string(id) + " is out of range");
  const uint64_t off = layout_.ns_slot(id);
  meta_.Invalidate(off, sizeof(NamespaceSlot));  // P2: registered by another node
  const auto s = meta_.ReadStruct<NamespaceSlot>(off);
  if (s.state != 2) return NotFound("namespace " + std::to_string(id) + " is not registered in this pool");
  // Untrusted like everything read from the region: strings end inside their fields, and the
  // description must hash to the seed it was registered under.
  const auto text = [](const char* field, size_t size) { return std::string(field, strnlen(field, size)); };
  RegisteredNamespace out;
  out.desc.model_id = text(s.model_id, sizeof s.model_id);
  out.desc.extra_key = text(s.extra_key, sizeof s.extra_key);
  out.desc.layout = s.layout;
  out.seed = BlockKey{s.seed_lo, s.seed_hi};
  if (!ValidateNamespace(out.desc).ok() || !(SeedOf(out.desc) == out.seed)) {
    return Corrupted("namespace slot " + std::to_string(id) + " of this pool does not match its seed: the "
                     "region is damaged (run 'cxlkv check')");
  }
  return out;
}

Status Index::CheckHandle(const NamespaceHandle& ns) {
  if (ns.id >= kMaxNamespaces) return InvalidArgument("namespace handle " + std::to_string(ns.id) + " is out of range");
  // A live namespace slot never changes: once verified, a handle is checked locally.
  if (verified_[ns.id].lo.load(std::memory_order_acquire) == ns.seed.lo &&
      verified_[ns.id].hi.load(std::memory_order_acquire) == ns.seed.hi && (ns.seed.lo | ns.seed.hi) != 0) {
    return Status::Ok();
  }
  uint64_t off = layout_.ns_slot(ns.id);
  meta_.Invalidate(off, 24);
  uint64_t w[3];
  meta_.Read(off, w, sizeof w);
  if (w[0] != 2 || w[1] != ns.seed.lo || w[2] != ns.seed.hi) {
    return InvalidArgument("namespace handle " + std::to_string(ns.id) +
                           " is not registered in this pool: obtain it from KvCache::Namespace");
  }
  verified_[ns.id].hi.store(ns.seed.hi, std::memory_order_release);
  verified_[ns.id].lo.store(ns.seed.lo, std::memory_order_release);
  return Status::Ok();
}

}  // namespace cxlkv::cache
