#include "meta/protocol.h"

namespace cxlkv::meta {

void WireWriter::Handle(const NamespaceHandle& h) {
  Put(h.id);
  Put(h.block_size);
  Put(h.block_bytes);
  Key(h.seed);
}

bool WireReader::Text(std::string* s, size_t max) {
  uint16_t n = 0;
  if (!Get(&n) || n > max || n > remaining()) return false;
  s->assign(reinterpret_cast<const char*>(in_.data() + at_), n);
  at_ += n;
  return true;
}

bool WireReader::Handle(NamespaceHandle* h) {
  return Get(&h->id) && Get(&h->block_size) && Get(&h->block_bytes) && Key(&h->seed);
}

void PutPin(WireWriter& w, const BlockPin& p) {
  w.Put(p.slot);
  w.Put(p.tier);
  w.Put(p.generation);
  w.Put(p.offset);
  w.Put(p.bytes);
  w.Put(p.checksum);
}

bool GetPin(WireReader& r, BlockPin* p) {
  return r.Get(&p->slot) && r.Get(&p->tier) && r.Get(&p->generation) && r.Get(&p->offset) && r.Get(&p->bytes) &&
         r.Get(&p->checksum);
}

void PutReservation(WireWriter& w, const Reservation& r) {
  w.Put(r.slot);
  w.Put(uint32_t{0});
  w.Put(r.generation);
  w.Put(r.offset);
  w.Put(r.bytes);
}

bool GetReservation(WireReader& r, Reservation* out) {
  uint32_t pad = 0;
  return r.Get(&out->slot) && r.Get(&pad) && r.Get(&out->generation) && r.Get(&out->offset) && r.Get(&out->bytes);
}

void PutKeys(WireWriter& w, std::span<const BlockKey> keys) {
  w.Put(static_cast<uint32_t>(keys.size()));
  for (const BlockKey& k : keys) w.Key(k);
}

bool GetKeys(WireReader& r, std::vector<BlockKey>* keys) {
  uint32_t n = 0;
  if (!r.Count(&n, kKeyBytes)) return false;
  keys->resize(n);
  for (BlockKey& k : *keys) r.Key(&k);
  return true;
}

void PutNamespace(WireWriter& w, const KeyNamespace& ns) {
  w.Text(ns.model_id, 255);
  w.Text(ns.extra_key, 255);
  w.Put(ns.layout);
}

bool GetNamespace(WireReader& r, KeyNamespace* ns) {
  return r.Text(&ns->model_id, 255) && r.Text(&ns->extra_key, 255) && r.Get(&ns->layout);
}

}  // namespace cxlkv::meta
