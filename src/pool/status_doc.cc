// Status documents (status_doc.h).
#include "pool/status_doc.h"

#include "pool/pool_internal.h"
#include "region/offset.h"
#include "region/region_internal.h"

namespace cxlkv::pool {

namespace {

constexpr uint64_t kTextOffset = 16;

}  // namespace

Status PublishStatus(Pool& pool, const std::string& name, const nlohmann::json& doc) {
  const std::string text = doc.dump();
  if (text.size() > kStatusDocBytes - kTextOffset) {
    return InvalidArgument("status document '" + name + "' of " + std::to_string(text.size()) + " bytes exceeds " +
                           std::to_string(kStatusDocBytes - kTextOffset));
  }
  Pool::Impl& im = pool.impl();
  const std::string root = kStatusRootPrefix + name;
  uint64_t object = 0;
  if (auto r = im.roots->Get(root); r.ok() && r->size == kStatusDocBytes &&
                                    im.allocator->Contains(alloc::ObjectOffset(r->offset), kStatusDocBytes)) {
    object = r->offset;  // an earlier writer's: this one takes over
  } else {
    CXLKV_ASSIGN_OR_RETURN(alloc::ObjectOffset off, im.allocator->Alloc(kStatusDocBytes));
    object = off.raw();
    const region::Offset<void> at(object);
    region::MetaAccess& meta = im.regions[at.region_index()]->impl().meta();
    meta.Publish(at.byte_offset(), 0);
    meta.Publish(at.byte_offset() + 8, 0);
    if (Status s = im.roots->Put(root, object, kStatusDocBytes); !s.ok()) {
      (void)im.allocator->Free(off);
      return s;
    }
  }
  const region::Offset<void> at(object);
  region::MetaAccess& meta = im.regions[at.region_index()]->impl().meta();
  const uint64_t base = at.byte_offset();
  const uint64_t odd = meta.Fetch(base) | 1;
  meta.Publish(base, odd);                  // odd: being rewritten
  meta.Write(base + kTextOffset, text.data(), text.size());
  meta.Store(base + 8, text.size());
  meta.Flush(base + 8, kTextOffset - 8 + text.size());
  meta.Publish(base, odd + 1);              // even: complete (P4: published after the text)
  return Status::Ok();
}

nlohmann::json ReadStatusDocs(std::vector<std::unique_ptr<Region>>& regions) {
  nlohmann::json out = nlohmann::json::object();
  if (regions.empty()) return out;
  objstore::ObjectStore store(*regions[0], nullptr);
  const std::string prefix = kStatusRootPrefix;
  for (const auto& r : store.List()) {
    if (r.name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string name = r.name.substr(prefix.size());
    const region::Offset<void> at(r.offset);
    if (r.size != kStatusDocBytes || at.region_index() >= regions.size() ||
        at.byte_offset() + kStatusDocBytes > regions[at.region_index()]->info().region_size) {
      out[name] = {{"unreadable", "its object lies outside the pool"}};
      continue;
    }
    region::MetaAccess& meta = regions[at.region_index()]->impl().meta();
    const uint64_t base = at.byte_offset();
    std::string why = "it was being rewritten";
    for (int attempt = 0; attempt < 3; ++attempt) {
      const uint64_t before = meta.Fetch(base);
      if (before & 1) continue;
      meta.Invalidate(base + 8, kStatusDocBytes - 8);
      const uint64_t len = meta.Load(base + 8);
      if (len > kStatusDocBytes - kTextOffset) {
        why = "its length word is " + std::to_string(len);
        break;
      }
      std::string text(len, '\0');
      meta.Read(base + kTextOffset, text.data(), len);
      if (meta.Fetch(base) != before) continue;
      auto doc = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
      if (doc.is_discarded()) {
        why = "its text is not JSON";
        break;
      }
      out[name] = doc;
      why.clear();
      break;
    }
    if (!why.empty()) out[name] = {{"unreadable", why}};
  }
  return out;
}

}  // namespace cxlkv::pool
