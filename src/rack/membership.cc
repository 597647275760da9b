#include "rack/membership.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>

#include <nlohmann/json.hpp>

namespace cxlkv::rack {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr size_t kMaxNameBytes = 64;
constexpr size_t kMaxNamespaces = 1024;
// A registration retries its transaction this often when another writer moved the counter.
constexpr int kRegisterAttempts = 8;
constexpr std::chrono::milliseconds kJoinRetry{100};
constexpr std::chrono::milliseconds kBackoffMin{100};
constexpr std::chrono::milliseconds kBackoffMax{1000};

bool ValidName(const std::string& s) {
  if (s.empty() || s.size() > kMaxNameBytes) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == '-';
  });
}

Result<int64_t> ParseCounter(const std::string& key, const std::string& value) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(value.c_str(), &end, 10);
  if (value.empty() || end != value.c_str() + value.size() || errno != 0 || v < 0) {
    return Corrupted("etcd key " + key + " holds '" + value.substr(0, 32) +
                     "', not a life counter: delete it (etcdctl del " + key + ") if no link of this rack runs");
  }
  return static_cast<int64_t>(v);
}

}  // namespace

std::string EncodeMember(const RackMember& m) {
  return json{{"rack", m.rack},
              {"life", m.life},
              {"link_address", m.link_address},
              {"capacity_bytes", m.capacity_bytes},
              {"namespaces", m.namespaces}}
      .dump();
}

Result<RackMember> ParseMember(const std::string& rack, const std::string& value) {
  json j = json::parse(value, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Corrupted("member value of rack " + rack + " is not a JSON object");
  RackMember m;
  auto str = [&](const char* name, std::string* out) -> Status {
    auto it = j.find(name);
    if (it == j.end() || !it->is_string()) {
      return Corrupted("member value of rack " + rack + " has no string '" + name + "'");
    }
    *out = it->get<std::string>();
    return Status::Ok();
  };
  CXLKV_RETURN_IF_ERROR(str("rack", &m.rack));
  if (m.rack != rack) return Corrupted("member key of rack " + rack + " names rack '" + m.rack.substr(0, 64) + "'");
  CXLKV_RETURN_IF_ERROR(str("link_address", &m.link_address));
  auto life = j.find("life");
  if (life == j.end() || !life->is_number_integer() || life->get<int64_t>() <= 0) {
    return Corrupted("member value of rack " + rack + " has no positive 'life'");
  }
  m.life = life->get<int64_t>();
  auto cap = j.find("capacity_bytes");
  if (cap == j.end() || !cap->is_number_unsigned()) {
    return Corrupted("member value of rack " + rack + " has no 'capacity_bytes'");
  }
  m.capacity_bytes = cap->get<uint64_t>();
  auto ns = j.find("namespaces");
  if (ns == j.end() || !ns->is_array() || ns->size() > kMaxNamespaces) {
    return Corrupted("member value of rack " + rack + " has no 'namespaces' list (at most 1024)");
  }
  for (const json& n : *ns) {
    if (!n.is_string()) return Corrupted("member value of rack " + rack + " has a namespace that is not a string");
    m.namespaces.push_back(n.get<std::string>());
  }
  return m;
}

RackMembership::RackMembership(MembershipOptions options, std::unique_ptr<EtcdClient> etcd)
    : options_(std::move(options)), etcd_(std::move(etcd)) {
  members_prefix_ = "/cxlkv/" + options_.cluster + "/racks/";
  member_key_ = members_prefix_ + options_.rack;
  lives_key_ = "/cxlkv/" + options_.cluster + "/lives/" + options_.rack;
  // Act only while at least a quarter of the TTL (at most a second) of the lease is left: an
  // action fenced just before expiry still lands inside the lease.
  margin_ = std::min<std::chrono::milliseconds>(std::chrono::milliseconds(options_.ttl_seconds * 1000 / 4),
                                                std::chrono::milliseconds(1000));
}

Result<std::unique_ptr<RackMembership>> RackMembership::Observe(MembershipOptions options) {
  if (!ValidName(options.cluster)) {
    return InvalidArgument("cluster name '" + options.cluster.substr(0, 80) + "' is not 1-64 of [A-Za-z0-9._-]");
  }
  options.rack.clear();
  CXLKV_ASSIGN_OR_RETURN(std::unique_ptr<EtcdClient> etcd, EtcdClient::Create(options.etcd));
  std::unique_ptr<RackMembership> m(new RackMembership(std::move(options), std::move(etcd)));
  // The first read is done here so an unreachable etcd is an error of the caller, not a silence.
  CXLKV_ASSIGN_OR_RETURN(m->watch_from_, m->Resync());
  m->watch_ = std::thread([p = m.get()] { p->WatchLoop(); });
  return m;
}

Result<std::unique_ptr<RackMembership>> RackMembership::Join(MembershipOptions options) {
  if (!ValidName(options.rack)) {
    return InvalidArgument("rack name '" + options.rack.substr(0, 80) + "' is not 1-64 of [A-Za-z0-9._-]");
  }
  if (!ValidName(options.cluster)) {
    return InvalidArgument("cluster name '" + options.cluster.substr(0, 80) + "' is not 1-64 of [A-Za-z0-9._-]");
  }
  if (options.ttl_seconds < 2 || options.ttl_seconds > 3600) {
    return InvalidArgument("rack lease TTL " + std::to_string(options.ttl_seconds) +
                           " s is outside 2..3600 (etcd refuses less than 2 s with its default timings)");
  }
  if (options.join_wait.count() <= 0) options.join_wait = std::chrono::milliseconds(options.ttl_seconds * 1000 + 1000);
  CXLKV_ASSIGN_OR_RETURN(std::unique_ptr<EtcdClient> etcd, EtcdClient::Create(options.etcd));
  std::unique_ptr<RackMembership> m(new RackMembership(std::move(options), std::move(etcd)));
  const Clock::time_point deadline = Clock::now() + m->options_.join_wait;
  for (;;) {
    Status s = m->Register();
    if (s.ok()) break;
    if (s.code() != StatusCode::kAlreadyExists || Clock::now() >= deadline) return s;
    std::this_thread::sleep_for(kJoinRetry);
  }
  CXLKV_ASSIGN_OR_RETURN(m->watch_from_, m->Resync());
  m->keepalive_ = std::thread([p = m.get()] { p->KeepAliveLoop(); });
  m->watch_ = std::thread([p = m.get()] { p->WatchLoop(); });
  return m;
}

RackMembership::~RackMembership() {
  if (!options_.rack.empty()) (void)Leave();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    watch_paused_ = false;
  }
  cv_.notify_all();
  etcd_->StopWatches();
  if (keepalive_.joinable()) keepalive_.join();
  if (watch_.joinable()) watch_.join();
}

Status RackMembership::Register() {
  const Clock::time_point sent = Clock::now();
  CXLKV_ASSIGN_OR_RETURN(int64_t lease, etcd_->LeaseGrant(options_.ttl_seconds));
  Status last;
  for (int attempt = 0; attempt < kRegisterAttempts; ++attempt) {
    auto lives = etcd_->Get(lives_key_);
    auto holder = lives.ok() ? etcd_->Get(member_key_) : Result<EtcdRange>(lives.status());
    if (!holder.ok()) {
      last = holder.status();
      break;
    }
    if (!holder->kvs.empty()) {
      const EtcdKv& kv = holder->kvs.front();
      auto who = ParseMember(options_.rack, kv.value);
      last = AlreadyExists("rack " + options_.rack + " is registered by another link (" +
                           (who.ok() ? "life " + std::to_string(who->life) + " at " + who->link_address
                                     : std::string("a value that does not parse")) +
                           ", etcd lease " + std::to_string(kv.lease) +
                           "): stop that link, or wait for its lease to run out");
      break;
    }
    int64_t previous = 0;
    int64_t counter_rev = 0;
    if (!lives->kvs.empty()) {
      auto counter = ParseCounter(lives_key_, lives->kvs.front().value);
      if (!counter.ok()) {
        last = counter.status();
        break;
      }
      previous = *counter;
      counter_rev = lives->kvs.front().mod_revision;
    }
    RackMember me;
    me.rack = options_.rack;
    me.life = previous + 1;
    me.link_address = options_.link_address;
    me.capacity_bytes = options_.capacity_bytes;
    me.namespaces = options_.namespaces;
    auto applied = etcd_->Txn({EtcdCompare{lives_key_, EtcdCompare::Target::kMod, counter_rev},
                               EtcdCompare{member_key_, EtcdCompare::Target::kCreate, 0}},
                              {EtcdPut{lives_key_, std::to_string(me.life), 0},
                               EtcdPut{member_key_, EncodeMember(me), lease}});
    if (!applied.ok()) {
      last = applied.status();
      break;
    }
    if (*applied) {
      std::unique_lock<std::mutex> lock(mu_);
      if (left_ || stopping_) {
        // Left while registering: the new life must not outlive the leave.
        lock.unlock();
        (void)etcd_->LeaseRevoke(lease);
        return LeaseExpired("rack " + options_.rack + " left while registering a new life");
      }
      life_ = me.life;
      lease_ = lease;
      // etcd may raise a TTL, never lower it: the requested one is a safe bound.
      valid_until_ = sent + std::chrono::seconds(options_.ttl_seconds);
      return Status::Ok();
    }
    last = Busy("rack " + options_.rack + ": another registration moved the life counter " + std::to_string(attempt + 1) +
                " times in a row");
  }
  (void)etcd_->LeaseRevoke(lease);
  return last;
}

Result<int64_t> RackMembership::Fence() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!superseded_.ok()) return superseded_;
  if (left_) return LeaseExpired("rack " + options_.rack + " left the membership");
  if (life_ == 0) return LeaseExpired("rack " + options_.rack + " is between lives: its etcd lease was lost");
  const Clock::time_point now = Clock::now();
  if (now + margin_ >= valid_until_) {
    const auto late = std::chrono::duration_cast<std::chrono::milliseconds>(now + margin_ - valid_until_).count();
    return LeaseExpired("rack " + options_.rack + " life " + std::to_string(life_) +
                        ": its etcd lease is not known to be alive (renewal " + std::to_string(late) +
                        " ms overdue, margin included); it acts again once etcd answers");
  }
  return life_;
}

int64_t RackMembership::life() const {
  std::lock_guard<std::mutex> lock(mu_);
  return life_;
}

std::vector<RackMember> RackMembership::Members() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<RackMember> out;
  for (const auto& [key, m] : view_) out.push_back(m);
  return out;
}

bool RackMembership::WaitFor(const std::function<bool(const std::vector<RackMember>&)>& pred,
                             std::chrono::milliseconds timeout) const {
  const Clock::time_point deadline = Clock::now() + timeout;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    std::vector<RackMember> now;
    for (const auto& [key, m] : view_) now.push_back(m);
    if (pred(now)) return true;
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
      now.clear();
      for (const auto& [key, m] : view_) now.push_back(m);
      return pred(now);
    }
  }
}

Status RackMembership::Leave() {
  int64_t lease;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (left_ || options_.rack.empty()) return Status::Ok();
    left_ = true;
    lease = lease_;
    life_ = 0;
    lease_ = 0;
  }
  cv_.notify_all();
  if (lease == 0) return Status::Ok();
  return etcd_->LeaseRevoke(lease);
}

uint64_t RackMembership::resyncs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return resyncs_;
}

uint64_t RackMembership::malformed_values() const {
  std::lock_guard<std::mutex> lock(mu_);
  return malformed_;
}

bool RackMembership::SleepUnlessStopping(std::chrono::milliseconds d) {
  std::unique_lock<std::mutex> lock(mu_);
  return !cv_.wait_for(lock, d, [&] { return stopping_; });
}

void RackMembership::KeepAliveLoop() {
  const auto beat = std::chrono::milliseconds(options_.ttl_seconds * 1000 / 3);
  bool warned = false;
  while (SleepUnlessStopping(beat)) {
    int64_t lease;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (left_ || !superseded_.ok()) return;
      lease = lease_;
    }
    if (lease == 0) {
      // Between lives: register the next one.
      Status s = Register();
      if (s.code() == StatusCode::kAlreadyExists) {
        std::lock_guard<std::mutex> lock(mu_);
        superseded_ = AlreadyExists("rack " + options_.rack + " stepped down: " + s.message());
        return;
      }
      if (!s.ok()) {
        if (!warned) std::fprintf(stderr, "cxlkv: rack %s: registering a new life: %s\n", options_.rack.c_str(),
                                  s.ToString().c_str());
        warned = true;
        continue;
      }
      warned = false;
      if (options_.on_new_life) options_.on_new_life(life());
      continue;
    }
    const Clock::time_point sent = Clock::now();
    auto ttl = etcd_->LeaseKeepAlive(lease);
    if (!ttl.ok()) {
      // The fence closes by itself when the lease can no longer be known alive.
      if (!warned) std::fprintf(stderr, "cxlkv: rack %s: renewing its etcd lease: %s\n", options_.rack.c_str(),
                                ttl.status().ToString().c_str());
      warned = true;
      continue;
    }
    warned = false;
    if (*ttl == 0) {
      // The lease ran out (this process was paused, or etcd was unreachable past it): the life is
      // over and its key is gone. Register the next life at once.
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (lease_ == lease) {
          life_ = 0;
          lease_ = 0;
        }
      }
      Status s = Register();
      if (s.code() == StatusCode::kAlreadyExists) {
        std::lock_guard<std::mutex> lock(mu_);
        superseded_ = AlreadyExists("rack " + options_.rack + " stepped down: " + s.message());
        return;
      }
      if (s.ok() && options_.on_new_life) options_.on_new_life(life());
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (lease_ == lease) valid_until_ = sent + std::chrono::seconds(*ttl);
    }
    // The key must still be this life's: anything else means another link took the rack.
    auto mine = etcd_->Get(member_key_);
    if (mine.ok() && (mine->kvs.empty() || mine->kvs.front().lease != lease)) {
      std::lock_guard<std::mutex> lock(mu_);
      if (lease_ == lease) {
        superseded_ = AlreadyExists("rack " + options_.rack + " life " + std::to_string(life_) +
                                    " stepped down: its member key was deleted or taken by another link");
        (void)etcd_->LeaseRevoke(lease);
        return;
      }
    }
  }
}

Result<int64_t> RackMembership::Resync() {
  CXLKV_ASSIGN_OR_RETURN(EtcdRange range, etcd_->GetPrefix(members_prefix_));
  std::map<std::string, RackMember> view;
  uint64_t malformed = 0;
  for (const EtcdKv& kv : range.kvs) {
    auto m = ParseMember(kv.key.substr(members_prefix_.size()), kv.value);
    if (!m.ok()) {
      ++malformed;
      continue;
    }
    m->lease = kv.lease;
    m->mod_revision = kv.mod_revision;
    view[kv.key] = std::move(m).value();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    view_ = std::move(view);
    malformed_ += malformed;
    ++resyncs_;
  }
  NotifyMembers();
  return range.revision + 1;
}

void RackMembership::Apply(const std::vector<EtcdEvent>& events) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const EtcdEvent& e : events) {
      if (e.kv.key.compare(0, members_prefix_.size(), members_prefix_) != 0) continue;
      if (e.type == EtcdEvent::Type::kDelete) {
        view_.erase(e.kv.key);
        continue;
      }
      // A put replaces what the view held for the key, whatever it was (a changed value must
      // never leave the old one cached).
      auto m = ParseMember(e.kv.key.substr(members_prefix_.size()), e.kv.value);
      if (!m.ok()) {
        view_.erase(e.kv.key);
        ++malformed_;
        continue;
      }
      m->lease = e.kv.lease;
      m->mod_revision = e.kv.mod_revision;
      view_[e.kv.key] = std::move(m).value();
    }
  }
  NotifyMembers();
}

void RackMembership::NotifyMembers() {
  cv_.notify_all();
  if (options_.on_members) options_.on_members(Members());
}

void RackMembership::WatchLoop() {
  // Join or Observe read the view first; watch from just past that read.
  int64_t from = watch_from_;
  bool need_resync = false;
  std::chrono::milliseconds backoff = kBackoffMin;
  const auto idle = std::chrono::milliseconds(std::max<int64_t>(options_.ttl_seconds, 2) * 3000);
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (watch_paused_) {
        watch_parked_ = true;
        cv_.notify_all();
        cv_.wait(lock, [&] { return !watch_paused_ || stopping_; });
        watch_parked_ = false;
      }
      if (stopping_) return;
    }
    if (need_resync) {
      auto r = Resync();
      if (!r.ok()) {
        if (!SleepUnlessStopping(backoff)) return;
        backoff = std::min(backoff * 2, kBackoffMax);
        continue;
      }
      from = *r;
      need_resync = false;
    }
    auto end = etcd_->Watch(
        members_prefix_, from,
        [&](const std::vector<EtcdEvent>& events, int64_t revision) {
          Apply(events);
          from = std::max(from, revision + 1);
          return true;
        },
        idle);
    if (!end.ok()) {
      // The connection is gone: events may have been missed on the way, read everything again.
      need_resync = true;
      if (!SleepUnlessStopping(backoff)) return;
      backoff = std::min(backoff * 2, kBackoffMax);
      continue;
    }
    backoff = kBackoffMin;
    if (end->compact_revision != 0) {
      need_resync = true;  // the revisions it needed are gone
      continue;
    }
    if (end->last_revision != 0) from = std::max(from, end->last_revision + 1);
  }
}

void RackMembership::PauseWatchForTest() {
  std::unique_lock<std::mutex> lock(mu_);
  watch_paused_ = true;
  lock.unlock();
  etcd_->StopWatches();
  lock.lock();
  cv_.wait(lock, [&] { return watch_parked_ || stopping_; });
  lock.unlock();
  etcd_->ResumeWatches();
}

void RackMembership::ResumeWatchForTest() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    watch_paused_ = false;
  }
  cv_.notify_all();
}

}  // namespace cxlkv::rack
