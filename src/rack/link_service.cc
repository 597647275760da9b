#include "rack/link_service.h"

namespace cxlkv::rack {

void LinkService::Handle(const LinkMessage& m, LinkReply& reply) {
  auto refuse = [&](StatusCode code, const std::string& why) {
    unserved_.fetch_add(1);
    reply.Send(LinkMessage{m.id, LinkError{code, why}});
  };
  if (const auto* batch = std::get_if<LinkAnnounce>(&m.body)) return Announce(m, *batch, reply);
  if (const auto* lookup = std::get_if<LinkLookup>(&m.body)) {
    lookups_.fetch_add(1);
    LinkLookupAnswer answer;
    if (Homes(lookup->keys[0])) answer = directory_.Lookup(lookup->keys);
    if (!answer.holders.empty()) lookup_hits_.fetch_add(1);
    reply.Send(LinkMessage{m.id, std::move(answer)});
    return;
  }
  if (std::holds_alternative<LinkFetch>(m.body)) {
    if (fetches_ != nullptr && fetches_->Serve(m, reply)) return;
    return refuse(StatusCode::kNotSupported, "this rack link serves no fetches (it has no pool)");
  }
  refuse(StatusCode::kInvalidArgument, "not a request a rack link serves");
}

void LinkService::Announce(const LinkMessage& m, const LinkAnnounce& batch, LinkReply& reply) {
  if (batch.life != reply.peer_life()) {
    wrong_life_.fetch_add(1);
    reply.Send(LinkMessage{m.id, LinkError{StatusCode::kPermissionDenied,
                                           "an announce of rack " + reply.peer_rack() + " under life " +
                                               std::to_string(batch.life) + ", but it authenticated as life " +
                                               std::to_string(reply.peer_life()) + ": reconnect under the new life"}});
    return;
  }
  LinkAnnounce homed{batch.life, {}};
  homed.blocks.reserve(batch.blocks.size());
  for (const AnnouncedBlock& b : batch.blocks) {
    if (Homes(b.chain)) homed.blocks.push_back(b);
  }
  const uint32_t dropped = static_cast<uint32_t>(batch.blocks.size() - homed.blocks.size());
  not_homed_.fetch_add(dropped);
  directory_.Apply(reply.peer_rack(), homed);
  announces_.fetch_add(1);
  announced_.fetch_add(homed.blocks.size());
  reply.Send(LinkMessage{m.id, LinkAnnounceAck{static_cast<uint32_t>(homed.blocks.size()), dropped}});
}

LinkService::Counters LinkService::counters() const {
  Counters c;
  c.announces = announces_.load(), c.announced = announced_.load(), c.not_homed = not_homed_.load();
  c.wrong_life = wrong_life_.load(), c.lookups = lookups_.load(), c.lookup_hits = lookup_hits_.load();
  c.unserved = unserved_.load();
  return c;
}

}  // namespace cxlkv::rack
