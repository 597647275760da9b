#include "daemon/kv_front.h"

#include <cstring>

namespace cxlkv::daemon {
namespace {

template <typename T>
void Append(std::vector<uint8_t>& out, T v) {
  const size_t at = out.size();
  out.resize(at + sizeof v);
  std::memcpy(out.data() + at, &v, sizeof v);
}

}  // namespace

Result<NamespaceHandle> KvFront::NamespaceOf(const std::string& model) {
  if (auto it = namespaces_.find(model); it != namespaces_.end()) return it->second;
  CXLKV_ASSIGN_OR_RETURN(KvCache * cache, pool_.Cache());
  KeyNamespace ns;
  ns.model_id = model;
  ns.layout.block_size = 1;  // a key is one block; blocks of any size (as the CLI's)
  CXLKV_ASSIGN_OR_RETURN(NamespaceHandle h, cache->Namespace(ns));
  namespaces_.emplace(model, h);  // bounded by the index's namespace table
  return h;
}

Result<std::vector<uint8_t>> KvFront::Handle(uint32_t op, std::span<const uint8_t> request) {
  CXLKV_ASSIGN_OR_RETURN(rpc::KvRequest req, rpc::DecodeKvRequest(op, request));
  CXLKV_ASSIGN_OR_RETURN(KvCache * cache, pool_.Cache());
  CXLKV_ASSIGN_OR_RETURN(NamespaceHandle ns, NamespaceOf(req.model));
  std::vector<BlockKey> keys;
  keys.reserve(req.keys.size());
  for (const auto& k : req.keys) keys.push_back(KvCache::KeyFromEngineHash(ns, k));
  std::vector<uint8_t> out;
  switch (op) {
    case rpc::kKvPut:
      CXLKV_RETURN_IF_ERROR(cache->Put(ns, keys[0], req.block.data(), req.block.size()));
      return out;
    case rpc::kKvGet: {
      CXLKV_ASSIGN_OR_RETURN(LookupResult hit, cache->Lookup(ns, keys));
      if (hit.hit_blocks == 0) return NotFound("the key is not cached");
      out.resize(hit.pins[0].bytes);
      Status s = cache->Read(hit.pins[0], 0, out.data(), out.size());
      cache->Release(hit.pins);
      CXLKV_RETURN_IF_ERROR(s);
      return out;
    }
    case rpc::kKvExists: {
      CXLKV_ASSIGN_OR_RETURN(size_t n, cache->Exists(ns, keys));
      Append(out, static_cast<uint32_t>(n));
      return out;
    }
    default: {  // kKvEvict (DecodeKvRequest refused every other opcode)
      CXLKV_ASSIGN_OR_RETURN(uint64_t n, cache->Evict(ns, keys));
      Append(out, n);
      return out;
    }
  }
}

}  // namespace cxlkv::daemon
