// What a rack link serves to the racks that reach it (docs/racks.md, "The link service"): as a
// home rack, the announces its peers send into its directory and the lookups they ask of it; as
// a holder, the fetches of its pool's blocks. It is the UcxLink's request handler.
//
// Identity comes from the handshake, never from a message: an announce is applied under the
// rack the peer proved it is, and only under the life it authenticated with — a batch that
// names another life (a link resumed after its lease expired, still sending under the old one)
// is refused, so nothing is ever announced under a life that is over.
#ifndef CXLKV_SRC_RACK_LINK_SERVICE_H_
#define CXLKV_SRC_RACK_LINK_SERVICE_H_

#include <atomic>
#include <functional>

#include "rack/block_fetch.h"
#include "rack/chain_directory.h"
#include "rack/ucx_link.h"

namespace cxlkv::rack {

struct LinkServiceOptions {
  // Whether this rack is the home or the replica of `chain` now (the home ring over the live
  // racks); announced blocks of other chains are dropped and counted, and lookups of them
  // answered empty. Null: every chain.
  std::function<bool(const BlockKey& chain)> homes;
};

class LinkService {
 public:
  // `fetches` null: this rack serves no fetches (a directory-only link).
  LinkService(ChainDirectory& directory, BlockFetchServer* fetches, LinkServiceOptions options = {})
      : directory_(directory), fetches_(fetches), options_(std::move(options)) {}

  // The link's request handler: answers every request exactly once.
  void Handle(const LinkMessage& m, LinkReply& reply);
  LinkRequestHandler Handler() {
    return [this](const LinkMessage& m, LinkReply& reply) { Handle(m, reply); };
  }

  struct Counters {
    uint64_t announces = 0;       // batches applied
    uint64_t announced = 0;       // blocks in them applied
    uint64_t not_homed = 0;       // announced blocks dropped: their chain is not homed here
    uint64_t wrong_life = 0;      // batches refused: not the life the peer authenticated with
    uint64_t lookups = 0;
    uint64_t lookup_hits = 0;     // lookups that named at least one holder
    uint64_t unserved = 0;        // requests refused: fetches without a pool, unknown requests
  };
  Counters counters() const;

 private:
  void Announce(const LinkMessage& m, const LinkAnnounce& batch, LinkReply& reply);
  bool Homes(const BlockKey& chain) const { return !options_.homes || options_.homes(chain); }

  ChainDirectory& directory_;
  BlockFetchServer* fetches_;
  LinkServiceOptions options_;
  std::atomic<uint64_t> announces_{0}, announced_{0}, not_homed_{0}, wrong_life_{0}, lookups_{0}, lookup_hits_{0},
      unserved_{0};
};

}  // namespace cxlkv::rack

#endif  // CXLKV_SRC_RACK_LINK_SERVICE_H_
