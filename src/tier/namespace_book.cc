#include "tier/namespace_book.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

namespace cxlkv::tier {

namespace {

// More than a pool's namespace table holds: a book never grows without bound across regions.
constexpr size_t kMaxBookEntries = 4096;
constexpr size_t kMaxBookBytes = 4u << 20;

Status WriteError(const std::string& path, const std::string& doing, int err) {
  std::string what = "namespace book: cannot " + doing + " " + path + ": " + std::strerror(err);
  if (err == ENOSPC || err == EDQUOT) {
    return NoSpace(what + "; the file system is full: free space on it or give the SSD tier another one");
  }
  return IoError(what);
}

std::string Hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, v);
  return buf;
}

nlohmann::json ToJson(uint64_t fingerprint, const KeyNamespace& ns) {
  const KvLayoutSignature& l = ns.layout;
  return {{"fingerprint", Hex(fingerprint)},
          {"model_id", ns.model_id},
          {"extra_key", ns.extra_key},
          {"layout",
           {{"dtype", static_cast<uint32_t>(l.dtype)}, {"num_layers", l.num_layers}, {"num_kv_heads", l.num_kv_heads},
            {"head_size", l.head_size}, {"block_size", l.block_size}, {"tp_rank", l.tp_rank}, {"tp_size", l.tp_size},
            {"pp_stage", l.pp_stage}, {"kv_parts", l.kv_parts}, {"block_format", l.block_format}}}};
}

bool U32(const nlohmann::json& j, const char* name, uint32_t* out) {
  auto it = j.find(name);
  if (it == j.end() || !it->is_number_unsigned() || it->get<uint64_t>() > UINT32_MAX) return false;
  *out = static_cast<uint32_t>(it->get<uint64_t>());
  return true;
}

bool Text(const nlohmann::json& j, const char* name, size_t limit, std::string* out) {
  auto it = j.find(name);
  if (it == j.end() || !it->is_string() || it->get_ref<const std::string&>().size() > limit) return false;
  *out = it->get<std::string>();
  return true;
}

// One entry as read back (untrusted): every field present and in range. Whether it hashes to its
// fingerprint is checked where it is registered again.
bool FromJson(const nlohmann::json& j, uint64_t* fingerprint, KeyNamespace* ns) {
  if (!j.is_object()) return false;
  std::string fp;
  if (!Text(j, "fingerprint", 16, &fp) || fp.size() != 16) return false;
  char* end = nullptr;
  *fingerprint = std::strtoull(fp.c_str(), &end, 16);
  if (end != fp.c_str() + fp.size()) return false;
  if (!Text(j, "model_id", 95, &ns->model_id) || ns->model_id.empty() || !Text(j, "extra_key", 63, &ns->extra_key)) {
    return false;
  }
  auto l = j.find("layout");
  if (l == j.end() || !l->is_object()) return false;
  KvLayoutSignature& s = ns->layout;
  uint32_t dtype = 0;
  if (!U32(*l, "dtype", &dtype) || dtype > static_cast<uint32_t>(KvDtype::kFp32)) return false;
  s.dtype = static_cast<KvDtype>(dtype);
  return U32(*l, "num_layers", &s.num_layers) && U32(*l, "num_kv_heads", &s.num_kv_heads) &&
         U32(*l, "head_size", &s.head_size) && U32(*l, "block_size", &s.block_size) &&
         U32(*l, "tp_rank", &s.tp_rank) && U32(*l, "tp_size", &s.tp_size) && U32(*l, "pp_stage", &s.pp_stage) &&
         U32(*l, "kv_parts", &s.kv_parts) && U32(*l, "block_format", &s.block_format);
}

}  // namespace

Result<std::unique_ptr<NamespaceBook>> NamespaceBook::Open(const std::string& base_path) {
  std::unique_ptr<NamespaceBook> book(new NamespaceBook(PathOf(base_path)));
  const int fd = ::open(book->path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return book;  // the first start, or a device no block was spilled to
    return IoError("namespace book: cannot open " + book->path_ + ": " + std::strerror(errno) +
                   "; give the SSD tier a path whose directory this user can read and write");
  }
  std::string text;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0 || text.size() + static_cast<size_t>(n) > kMaxBookBytes) {
      if (n != 0) book->message_ = "unreadable or larger than " + std::to_string(kMaxBookBytes >> 20) + " MiB";
      break;
    }
    text.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  if (book->message_.empty()) {
    const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    const bool object = !j.is_discarded() && j.is_object();
    auto version = object ? j.find("version") : j.end();
    auto list = object ? j.find("namespaces") : j.end();
    // Checked by type before any value is taken: a wrong type must not throw.
    if (!object || version == j.end() || !version->is_number_unsigned() || version->get<uint64_t>() != 1 ||
        list == j.end() || !list->is_array()) {
      book->message_ = "not a namespace book of this version (malformed or damaged)";
    } else {
      size_t bad = 0;
      for (const auto& item : *list) {
        uint64_t fp = 0;
        KeyNamespace ns;
        if (book->entries_.size() < kMaxBookEntries && FromJson(item, &fp, &ns)) {
          book->entries_[fp] = std::move(ns);
        } else {
          ++bad;
        }
      }
      if (bad != 0) book->message_ = std::to_string(bad) + " malformed entr" + (bad == 1 ? "y" : "ies") + " ignored";
    }
  }
  if (!book->message_.empty()) {
    book->message_ = book->path_ + ": " + book->message_ +
                     "; blocks of namespaces it cannot name are not restored into a new region";
  }
  return book;
}

Status NamespaceBook::Record(uint64_t fingerprint, const KeyNamespace& desc) {
  std::lock_guard<std::mutex> g(mu_);
  if (entries_.contains(fingerprint)) return Status::Ok();
  if (entries_.size() >= kMaxBookEntries) {
    return NoSpace("namespace book " + path_ + " holds " + std::to_string(kMaxBookEntries) +
                   " namespaces already: restart the daemon to drop those no block uses");
  }
  entries_[fingerprint] = desc;
  Status s = WriteLocked();
  if (!s.ok()) entries_.erase(fingerprint);
  return s;
}

bool NamespaceBook::Find(uint64_t fingerprint, KeyNamespace* out) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = entries_.find(fingerprint);
  if (it == entries_.end()) return false;
  *out = it->second;
  return true;
}

Status NamespaceBook::Retain(const std::set<uint64_t>& in_use) {
  std::lock_guard<std::mutex> g(mu_);
  const size_t before = entries_.size();
  std::erase_if(entries_, [&](const auto& e) { return !in_use.contains(e.first); });
  return entries_.size() == before ? Status::Ok() : WriteLocked();
}

size_t NamespaceBook::size() const {
  std::lock_guard<std::mutex> g(mu_);
  return entries_.size();
}

Status NamespaceBook::WriteLocked() {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& [fp, ns] : entries_) list.push_back(ToJson(fp, ns));
  const std::string text = nlohmann::json{{"version", 1}, {"namespaces", list}}.dump(1) + "\n";
  const std::string tmp = path_ + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return WriteError(tmp, "create", errno);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      ::close(fd);
      ::unlink(tmp.c_str());
      return WriteError(tmp, "write", err);
    }
    done += static_cast<size_t>(n);
  }
  if (::fdatasync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    return WriteError(tmp, "sync", err);
  }
  ::close(fd);
  // The rename replaces the book whole: a crash leaves the old one or the new one.
  if (::rename(tmp.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return WriteError(path_, "replace", err);
  }
  const std::string dir = std::filesystem::path(path_).parent_path().string();
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);  // best effort: some file systems refuse to sync a directory
    ::close(dfd);
  }
  return Status::Ok();
}

}  // namespace cxlkv::tier
