#include "rack/etcd_client.h"

#include <httplib.h>
#include <openssl/evp.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>

#include <nlohmann/json.hpp>

#include "util/host_port.h"

namespace cxlkv::rack {

using json = nlohmann::json;

struct EtcdClient::Endpoint {
  std::string url;  // as given, for messages
  std::string host;
  int port = 0;
};

namespace {

// gRPC status codes etcd's gateway answers with.
constexpr int kGrpcInvalidArgument = 3;
constexpr int kGrpcDeadlineExceeded = 4;
constexpr int kGrpcNotFound = 5;
constexpr int kGrpcUnavailable = 14;

// A watch stream that sends more than this without a line break is not etcd's.
constexpr size_t kMaxWatchMessageBytes = 16 << 20;

// etcd's 64-bit integers arrive as JSON strings ("revision":"5"); proto3 leaves zeros out.
Result<int64_t> IntField(const json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end()) return int64_t{0};
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) {
    const std::string& s = it->get_ref<const std::string&>();
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(s.c_str(), &end, 10);
    if (!s.empty() && end == s.c_str() + s.size() && errno == 0) return static_cast<int64_t>(v);
  }
  return Corrupted(std::string("etcd answered a field '") + name + "' that is not an integer: " + it->dump());
}

Result<std::string> BytesField(const json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end()) return std::string();
  if (!it->is_string()) return Corrupted(std::string("etcd answered a field '") + name + "' that is not a string");
  return Base64Decode(it->get_ref<const std::string&>());
}

Result<EtcdKv> ParseKv(const json& j) {
  if (!j.is_object()) return Corrupted("etcd answered a key-value that is not an object");
  EtcdKv kv;
  CXLKV_ASSIGN_OR_RETURN(kv.key, BytesField(j, "key"));
  CXLKV_ASSIGN_OR_RETURN(kv.value, BytesField(j, "value"));
  CXLKV_ASSIGN_OR_RETURN(kv.create_revision, IntField(j, "create_revision"));
  CXLKV_ASSIGN_OR_RETURN(kv.mod_revision, IntField(j, "mod_revision"));
  CXLKV_ASSIGN_OR_RETURN(kv.lease, IntField(j, "lease"));
  return kv;
}

Result<json> ParseObject(const std::string& body, const std::string& what) {
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Corrupted("etcd's answer to " + what + " is not a JSON object (" + std::to_string(body.size()) +
                     " bytes): is the endpoint an etcd v3 client URL?");
  }
  return j;
}

Result<int64_t> HeaderRevision(const json& j) {
  auto h = j.find("header");
  if (h == j.end() || !h->is_object()) return int64_t{0};
  return IntField(*h, "revision");
}

Result<EtcdRange> ParseRange(const std::string& body) {
  CXLKV_ASSIGN_OR_RETURN(json j, ParseObject(body, "a range"));
  EtcdRange r;
  CXLKV_ASSIGN_OR_RETURN(r.revision, HeaderRevision(j));
  auto kvs = j.find("kvs");
  if (kvs != j.end()) {
    if (!kvs->is_array()) return Corrupted("etcd answered a range whose kvs is not an array");
    for (const json& e : *kvs) {
      CXLKV_ASSIGN_OR_RETURN(EtcdKv kv, ParseKv(e));
      r.kvs.push_back(std::move(kv));
    }
  }
  return r;
}

}  // namespace

std::string Base64Encode(const std::string& bytes) {
  std::string out(4 * ((bytes.size() + 2) / 3), '\0');
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<int>(bytes.size()));
  out.resize(static_cast<size_t>(n));
  return out;
}

Result<std::string> Base64Decode(const std::string& text) {
  if (text.size() % 4 != 0) return Corrupted("etcd answered bytes that are not base64 (length " +
                                             std::to_string(text.size()) + ")");
  std::string out(text.size() / 4 * 3, '\0');
  const int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(text.data()), static_cast<int>(text.size()));
  if (n < 0) return Corrupted("etcd answered bytes that are not base64");
  // EVP_DecodeBlock counts the padding as zero bytes.
  size_t pad = 0;
  if (!text.empty() && text.back() == '=') pad = text.size() >= 2 && text[text.size() - 2] == '=' ? 2 : 1;
  out.resize(static_cast<size_t>(n) - pad);
  return out;
}

std::string PrefixEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    if (static_cast<unsigned char>(end.back()) < 0xff) {
      end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key (etcd's "\0" range end)
}

Result<std::unique_ptr<EtcdClient>> EtcdClient::Create(EtcdOptions options) {
  if (options.endpoints.empty()) return InvalidArgument("no etcd endpoint given: pass --etcd http://HOST:PORT[,...]");
  if (options.request_timeout.count() <= 0) return InvalidArgument("etcd request timeout must be positive");
  std::vector<Endpoint> targets;
  for (const std::string& url : options.endpoints) {
    std::string rest = url;
    if (rest.rfind("https://", 0) == 0) {
      return NotSupported("etcd endpoint " + url + ": TLS to etcd is not supported by this build; use http://");
    }
    if (rest.rfind("http://", 0) == 0) rest = rest.substr(7);
    while (!rest.empty() && rest.back() == '/') rest.pop_back();
    auto hp = util::ParseHostPort(rest, "etcd endpoint");
    if (!hp.ok() || hp->host.empty() || hp->port <= 0) {
      return InvalidArgument("etcd endpoint '" + url + "' is not http://HOST:PORT (e.g. http://127.0.0.1:2379)");
    }
    targets.push_back(Endpoint{url, hp->host, hp->port});
  }
  return std::unique_ptr<EtcdClient>(new EtcdClient(std::move(options), std::move(targets)));
}

EtcdClient::EtcdClient(EtcdOptions options, std::vector<Endpoint> targets)
    : options_(std::move(options)), endpoints_(options_.endpoints), targets_(std::move(targets)) {}

EtcdClient::~EtcdClient() { StopWatches(); }

Result<std::string> EtcdClient::Call(const std::string& path, const std::string& body) {
  const size_t n = targets_.size();
  const size_t first = preferred_.load() % n;
  std::string tried;
  for (size_t i = 0; i < n; ++i) {
    const size_t k = (first + i) % n;
    const Endpoint& e = targets_[k];
    httplib::Client client(e.host, e.port);
    client.set_connection_timeout(options_.request_timeout);
    client.set_read_timeout(options_.request_timeout);
    client.set_write_timeout(options_.request_timeout);
    httplib::Result res = client.Post(path, body, "application/json");
    if (!tried.empty()) tried += "; ";
    if (!res) {
      tried += e.url + ": " + httplib::to_string(res.error());
      continue;
    }
    if (res->status == 200) {
      preferred_.store(k);
      return std::move(res->body);
    }
    // An error answer: {"error": ..., "code": N, "message": ...}.
    json j = json::parse(res->body, nullptr, false);
    int code = 0;
    std::string message = "HTTP " + std::to_string(res->status);
    if (j.is_object()) {
      if (j.contains("code") && j["code"].is_number_integer()) code = j["code"].get<int>();
      if (j.contains("message") && j["message"].is_string()) message = j["message"].get<std::string>();
    }
    tried += e.url + ": " + message;
    if (code == kGrpcUnavailable || code == kGrpcDeadlineExceeded || res->status == 503) continue;  // another member may serve
    const std::string what = "etcd " + path + " at " + e.url + ": " + message;
    if (code == kGrpcNotFound) return NotFound(what);
    if (code == kGrpcInvalidArgument) return InvalidArgument(what);
    return IoError(what);
  }
  return Unavailable("no etcd endpoint answered " + path + " (" + tried +
                     "): start etcd, or check the endpoints given with --etcd");
}

Result<int64_t> EtcdClient::Put(const std::string& key, const std::string& value, int64_t lease) {
  json req = {{"key", Base64Encode(key)}, {"value", Base64Encode(value)}};
  if (lease != 0) req["lease"] = std::to_string(lease);
  CXLKV_ASSIGN_OR_RETURN(std::string body, Call("/v3/kv/put", req.dump()));
  CXLKV_ASSIGN_OR_RETURN(json j, ParseObject(body, "a put"));
  return HeaderRevision(j);
}

Result<EtcdRange> EtcdClient::Get(const std::string& key) {
  json req = {{"key", Base64Encode(key)}};
  CXLKV_ASSIGN_OR_RETURN(std::string body, Call("/v3/kv/range", req.dump()));
  return ParseRange(body);
}

Result<EtcdRange> EtcdClient::GetPrefix(const std::string& prefix) {
  json req = {{"key", Base64Encode(prefix)}, {"range_end", Base64Encode(PrefixEnd(prefix))}};
  CXLKV_ASSIGN_OR_RETURN(std::string body, Call("/v3/kv/range", req.dump()));
  return ParseRange(body);
}

Result<int64_t> EtcdClient::Delete(const std::string& key) {
  json req = {{"key", Base64Encode(key)}};
  CXLKV_ASSIGN_OR_RETURN(std::string body, Call("/v3/kv/deleterange", req.dump()));
  CXLKV_ASSIGN_OR_RETURN(json j, ParseObject(body, "a delete"));
  return IntField(j, "deleted");
}

Result<bool> EtcdClient::PutIfAbsent(const std::string& key, const std::string& value, int64_t lease) {
  return PutIfUnchanged(key, value, 0, lease);
}

Result<bool> EtcdClient::PutIfUnchanged(const std::string& key, const std::string& value, int64_t mod_revision,
                                        int64_t lease) {
  return Txn({EtcdCompare{key, EtcdCompare::Target::kMod, mod_revision}}, {EtcdPut{key, value, lease}});
}

Result<bool> EtcdClient::Txn(const std::vector<EtcdCompare>& compares, const std::vector<EtcdPut>& puts) {
  json cmp = json::array();
  for (const EtcdCompare& c : compares) {
    const bool mod = c.target == EtcdCompare::Target::kMod;
    cmp.push_back({{"key", Base64Encode(c.key)},
                   {"target", mod ? "MOD" : "CREATE"},
                   {"result", "EQUAL"},
                   {mod ? "mod_revision" : "create_revision", std::to_string(c.revision)}});
  }
  json success = json::array();
  for (const EtcdPut& p : puts) {
    json put = {{"key", Base64Encode(p.key)}, {"value", Base64Encode(p.value)}};
    if (p.lease != 0) put["lease"] = std::to_string(p.lease);
    success.push_back({{"request_put", put}});
  }
  json req = {{"compare", cmp}, {"success", success}};
  CXLKV_ASSIGN_OR_RETURN(std::string body, Call("/v3/kv/txn", req.dump()));
  CXLKV_ASSIGN_OR_RETURN(json j, ParseObject(body, "a transaction"));
  auto it = j.find("succeeded");
  return it != j.end() && it->is_boolean() && it->get<bool>();
}

Result<int64_t> EtcdClient::LeaseGrant(int64_t ttl_seconds) {
  if (ttl_seconds <= 0) return InvalidArgument("an etcd lease needs a TTL of at least 1 s");
  json req = {{"TTL", std::to_string(ttl_seconds)}};
  CXLKV_ASSIGN_OR_RETURN(std::string body, Call("/v3/lease/grant", req.dump()));
  CXLKV_ASSIGN_OR_RETURN(json j, ParseObject(body, "a lease grant"));
  CXLKV_ASSIGN_OR_RETURN(int64_t id, IntField(j, "ID"));
  if (id == 0) return Corrupted("etcd granted a lease without an ID");
  return id;
}

Result<int64_t> EtcdClient::LeaseKeepAlive(int64_t lease) {
  json req = {{"ID", std::to_string(lease)}};
  CXLKV_ASSIGN_OR_RETURN(std::string body, Call("/v3/lease/keepalive", req.dump()));
  // The gateway streams one result per request: {"result": {"ID": ..., "TTL": ...}}; a lease
  // that no longer exists answers without a TTL.
  const size_t eol = body.find('\n');
  CXLKV_ASSIGN_OR_RETURN(json j, ParseObject(eol == std::string::npos ? body : body.substr(0, eol), "a keep-alive"));
  auto r = j.find("result");
  if (r == j.end() || !r->is_object()) {
    auto err = j.find("error");
    if (err != j.end()) return Unavailable("etcd refused a keep-alive: " + err->dump());
    return Corrupted("etcd answered a keep-alive without a result");
  }
  return IntField(*r, "TTL");
}

Result<int64_t> EtcdClient::LeaseTimeToLive(int64_t lease) {
  json req = {{"ID", std::to_string(lease)}};
  CXLKV_ASSIGN_OR_RETURN(std::string body, Call("/v3/lease/timetolive", req.dump()));
  CXLKV_ASSIGN_OR_RETURN(json j, ParseObject(body, "a lease time-to-live"));
  return IntField(j, "TTL");
}

Status EtcdClient::LeaseRevoke(int64_t lease) {
  json req = {{"ID", std::to_string(lease)}};
  auto body = Call("/v3/lease/revoke", req.dump());
  if (!body.ok() && body.status().code() != StatusCode::kNotFound) return body.status();
  return Status::Ok();
}

Status EtcdClient::Compact(int64_t revision) {
  json req = {{"revision", std::to_string(revision)}, {"physical", true}};
  return Call("/v3/kv/compaction", req.dump()).status();
}

void EtcdClient::StopWatches() {
  watches_stopped_.store(true);
  std::lock_guard<std::mutex> lock(watches_mu_);
  for (void* c : watches_) static_cast<httplib::Client*>(c)->stop();
}

Result<EtcdWatchEnd> EtcdClient::Watch(const std::string& prefix, int64_t start_revision, const EventsFn& on_events,
                                       std::chrono::milliseconds idle) {
  EtcdWatchEnd end;
  json create = {{"key", Base64Encode(prefix)}, {"range_end", Base64Encode(PrefixEnd(prefix))}};
  if (start_revision > 0) create["start_revision"] = std::to_string(start_revision);
  const std::string body = json{{"create_request", create}}.dump();
  const size_t n = targets_.size();
  const size_t first = preferred_.load() % n;
  std::string tried;
  for (size_t i = 0; i < n; ++i) {
    if (watches_stopped_.load()) return end;
    const Endpoint& e = targets_[(first + i) % n];
    httplib::Client client(e.host, e.port);
    client.set_connection_timeout(options_.request_timeout);
    client.set_read_timeout(idle);
    {
      std::lock_guard<std::mutex> lock(watches_mu_);
      if (watches_stopped_.load()) return end;
      watches_.insert(&client);
    }
    std::string pending;
    bool created = false;
    Status bad;  // a message that is not etcd's ends the watch with this
    httplib::Request req;
    req.method = "POST";
    req.path = "/v3/watch";
    req.body = body;
    req.set_header("Content-Type", "application/json");
    req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) -> bool {
      pending.append(data, len);
      size_t eol;
      while ((eol = pending.find('\n')) != std::string::npos) {
        const std::string line = pending.substr(0, eol);
        pending.erase(0, eol + 1);
        if (line.find_first_not_of(" \r\t") == std::string::npos) continue;
        auto msg = ParseObject(line, "a watch");
        if (!msg.ok()) {
          bad = msg.status();
          return false;
        }
        auto r = msg->find("result");
        if (r == msg->end() || !r->is_object()) {
          bad = Unavailable("etcd ended a watch with an error: " + msg->dump());
          return false;
        }
        auto compact = IntField(*r, "compact_revision");
        if (!compact.ok()) {
          bad = compact.status();
          return false;
        }
        if (*compact != 0) {
          end.compact_revision = *compact;
          return false;
        }
        if (r->value("canceled", false)) return false;
        if (r->value("created", false)) created = true;
        auto evs = r->find("events");
        if (evs == r->end()) continue;
        if (!evs->is_array()) {
          bad = Corrupted("etcd sent watch events that are not an array");
          return false;
        }
        std::vector<EtcdEvent> events;
        int64_t rev = 0;
        for (const json& ev : *evs) {
          if (!ev.is_object() || !ev.contains("kv")) {
            bad = Corrupted("etcd sent a watch event without a key-value");
            return false;
          }
          auto kv = ParseKv(ev["kv"]);
          if (!kv.ok()) {
            bad = kv.status();
            return false;
          }
          EtcdEvent event;
          event.type = ev.value("type", std::string("PUT")) == "DELETE" ? EtcdEvent::Type::kDelete : EtcdEvent::Type::kPut;
          event.kv = std::move(kv).value();
          rev = std::max(rev, event.kv.mod_revision);
          events.push_back(std::move(event));
        }
        if (events.empty()) continue;
        end.last_revision = std::max(end.last_revision, rev);
        if (!on_events(events, rev)) return false;
      }
      if (pending.size() > kMaxWatchMessageBytes) {
        bad = Corrupted("etcd's watch stream sent a message of more than 16 MiB");
        return false;
      }
      return !watches_stopped_.load();
    };
    httplib::Response res;
    httplib::Error err = httplib::Error::Success;
    const bool sent = client.send(req, res, err);
    {
      std::lock_guard<std::mutex> lock(watches_mu_);
      watches_.erase(&client);
    }
    if (!bad.ok()) return bad;
    // etcd ends every message with a newline: bytes left over are not etcd speaking.
    if (!created && pending.find_first_not_of(" \r\t\n") != std::string::npos) {
      auto msg = ParseObject(pending, "a watch");
      if (!msg.ok()) return msg.status();
    }
    if (created || end.compact_revision != 0 || end.last_revision != 0 || watches_stopped_.load()) return end;
    if (sent && res.status != 200) {
      if (!tried.empty()) tried += "; ";
      tried += e.url + ": HTTP " + std::to_string(res.status);
      continue;
    }
    if (!sent && err == httplib::Error::Read) return end;  // silent for `idle` before it was created: resume
    if (!tried.empty()) tried += "; ";
    tried += e.url + ": " + (sent ? std::string("the stream ended") : httplib::to_string(err));
  }
  return Unavailable("no etcd endpoint accepted a watch of " + prefix + " (" + tried +
                     "): start etcd, or check the endpoints given with --etcd");
}

}  // namespace cxlkv::rack
