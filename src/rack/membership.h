// Rack membership in etcd (DESIGN.md, "Scale beyond one rack"; docs/racks.md).
//
// A rack's link registers one member key, /cxlkv/<cluster>/racks/<rack>, holding JSON
// {rack, life, link_address, capacity_bytes, namespaces}, under one etcd lease of its own: when
// the link dies or stops renewing, etcd deletes the key when the lease runs out, and every
// watcher sees the rack leave. The lease is renewed by a thread that does nothing else (no pool,
// no I/O, no other rack), every TTL/3.
//
// Lives. Each registration is a *life*, numbered by a counter key /cxlkv/<cluster>/lives/<rack>
// (no lease, so numbers never repeat) that the registration increments in the same transaction
// that creates the member key. A lost lease (etcd answers TTL 0, e.g. after this process was
// paused past it) ends the life: the link registers again as life + 1 and tells its owner
// (on_new_life: re-announce what it holds), and never acts on the old life again. Fence() is the
// check every action that speaks for the rack makes first: it refuses unless the lease is known to
// be alive now — the last renewal's send time plus its TTL, less a margin, is still ahead — and
// this life is still the registered one. A second link of the same rack cannot register while
// the first one's key lives (Join waits up to the lease's TTL for it to go, then says who holds it);
// a link whose key was taken over by another life steps down for good (superseded).
//
// The view. A watch thread reads the whole prefix at a revision R, then watches from R + 1; after
// an idle stream or a clean end it resumes from the last revision it saw; after an error or a
// compaction of the revision it needed it reads the whole prefix again (a resync), so a view
// never misses a put or a delete. Member values are untrusted: one that does not parse is left
// out of the view and counted (malformed_values()).
//
// Thread-safety: every public method may be called from any thread.
#ifndef CXLKV_SRC_RACK_MEMBERSHIP_H_
#define CXLKV_SRC_RACK_MEMBERSHIP_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cxlkv/status.h"
#include "rack/etcd_client.h"

namespace cxlkv::rack {

struct RackMember {
  std::string rack;
  int64_t life = 0;
  std::string link_address;  // where its rack link listens (UCX / TCP address)
  uint64_t capacity_bytes = 0;
  std::vector<std::string> namespaces;
  int64_t lease = 0;         // the etcd lease its key lives under
  int64_t mod_revision = 0;  // etcd revision of its last registration
};

struct MembershipOptions {
  EtcdOptions etcd;
  std::string cluster = "default";  // [A-Za-z0-9._-]{1,64}: racks of one fleet share it
  // This rack's registration (Join only).
  std::string rack;  // [A-Za-z0-9._-]{1,64}
  std::string link_address;
  uint64_t capacity_bytes = 0;
  std::vector<std::string> namespaces;
  int64_t ttl_seconds = 5;  // the lease's TTL; etcd's minimum is 2 s with its default timings
  // How long Join waits for another link's key of the same rack to go (its lease to run out)
  // before it refuses. Default: the TTL plus a second.
  std::chrono::milliseconds join_wait{0};
  // Called on the keep-alive thread after a new life registered (not for the first one).
  std::function<void(int64_t life)> on_new_life;
  // Called on the watch thread after every change of the view.
  std::function<void(const std::vector<RackMember>& members)> on_members;
};

class RackMembership {
 public:
  // Registers options.rack (life = previous life + 1) and starts renewing and watching.
  // Errors: kInvalidArgument (a bad name or TTL), kUnavailable (no etcd), kAlreadyExists (another
  // live link holds the rack past join_wait; the message names its life and address).
  static Result<std::unique_ptr<RackMembership>> Join(MembershipOptions options);
  // Watches the members without registering (an operator's view: `cxlkv racks`).
  static Result<std::unique_ptr<RackMembership>> Observe(MembershipOptions options);
  // Leaves (revokes the lease: the key is gone at once) if still a member, and stops the threads.
  ~RackMembership();

  // The life under which this process may act for its rack now: its lease is alive by the last
  // renewal, with a margin, and nobody superseded it. Tag what is written with the life returned.
  // Otherwise kLeaseExpired (the lease ran out or cannot be renewed; a new life follows when etcd
  // answers) or kAlreadyExists (superseded: another link holds the rack).
  Result<int64_t> Fence() const;
  // The current life (0 for an observer or while between lives).
  int64_t life() const;
  // The members in the watch's view, by rack name.
  std::vector<RackMember> Members() const;
  // Waits until `pred(Members())` holds or `timeout` passes. Returns whether it held.
  bool WaitFor(const std::function<bool(const std::vector<RackMember>&)>& pred,
               std::chrono::milliseconds timeout) const;
  // Revokes the lease now (the member key vanishes at once) and stops renewing. Idempotent.
  Status Leave();

  // How often the view was rebuilt from a full read (the first read counts).
  uint64_t resyncs() const;
  // Member values that did not parse and were left out of the view.
  uint64_t malformed_values() const;

  // Test hooks: hold the watch disconnected (as a lost connection would) until resumed.
  void PauseWatchForTest();
  void ResumeWatchForTest();

  const std::string& members_prefix() const { return members_prefix_; }

 private:
  RackMembership(MembershipOptions options, std::unique_ptr<EtcdClient> etcd);
  // Registers a new life under a new lease. kAlreadyExists when another link's key holds the rack.
  Status Register();
  void KeepAliveLoop();
  void WatchLoop();
  // Rebuilds the view from a full read. Returns the revision to watch from.
  Result<int64_t> Resync();
  void Apply(const std::vector<EtcdEvent>& events);
  void NotifyMembers();
  // Sleeps up to `d` unless stopping; returns false when stopping.
  bool SleepUnlessStopping(std::chrono::milliseconds d);

  MembershipOptions options_;
  std::unique_ptr<EtcdClient> etcd_;
  std::string members_prefix_;
  std::string member_key_;
  std::string lives_key_;
  std::chrono::milliseconds margin_;
  int64_t watch_from_ = 0;  // the revision the watch thread starts from (set before it starts)

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;  // stop, view changes, the watch hook
  bool stopping_ = false;
  bool left_ = false;
  int64_t life_ = 0;
  int64_t lease_ = 0;
  std::chrono::steady_clock::time_point valid_until_{};
  Status superseded_;
  std::map<std::string, RackMember> view_;  // by member key
  uint64_t resyncs_ = 0;
  uint64_t malformed_ = 0;
  bool watch_paused_ = false;
  bool watch_parked_ = false;

  std::thread keepalive_;
  std::thread watch_;
};

// Parses a member key's value (untrusted). `rack` is the name the key ends in.
Result<RackMember> ParseMember(const std::string& rack, const std::string& value);
std::string EncodeMember(const RackMember& m);

}  // namespace cxlkv::rack

#endif  // CXLKV_SRC_RACK_MEMBERSHIP_H_
