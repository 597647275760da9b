// The namespaces an SSD tier's blocks belong to, kept next to the device so that its blocks
// survive the loss of the shared region (a host reboot with the pool in /dev/shm, or a pool
// re-created with `cxlkv init`): a slot names its namespace by fingerprint — the low 64 bits of
// the namespace's seed, which hashes the model id, extra key and KV layout, the same in every
// region — and this book maps each fingerprint back to the description a fresh region needs to
// register it again (docs/tiers.md, "Warm restart into a new region").
//
// File P.namespaces (P: the SSD tier's path), JSON, rewritten whole for each new namespace —
// once per model and layout, never per block: written to P.namespaces.tmp, fdatasync'ed, renamed
// over, the directory synced. Read back as untrusted input: a description counts only if its
// fields are valid and it hashes to its fingerprint (KvCache registration recomputes the seed),
// so a damaged file costs the blocks it described, never wrong data.
//
// Thread-safety: every method is safe from any thread (one mutex).
#ifndef CXLKV_SRC_TIER_NAMESPACE_BOOK_H_
#define CXLKV_SRC_TIER_NAMESPACE_BOOK_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "cxlkv/cache.h"
#include "cxlkv/status.h"

namespace cxlkv::tier {

// How a block on a capacity device names its namespace (slot header and catalog): the same for
// one model and layout in every region.
inline uint64_t NamespaceFingerprint(const BlockKey& seed) { return seed.lo; }

class NamespaceBook {
 public:
  // Reads P.namespaces. A missing file is an empty book; an unreadable or malformed one is an
  // empty book too, with message() saying so (its blocks cannot be re-registered, and are freed).
  // Errors: none but kIoError for a file that exists and cannot be opened at all.
  static Result<std::unique_ptr<NamespaceBook>> Open(const std::string& base_path);

  // Makes `desc` findable under `fingerprint` durably (a no-op when it is). kNoSpace / kIoError
  // when the file cannot be written: the caller must not put blocks of that namespace on the
  // device's catalog, since a later start could not name them.
  Status Record(uint64_t fingerprint, const KeyNamespace& desc);
  bool Find(uint64_t fingerprint, KeyNamespace* out) const;
  // Forgets the fingerprints not in `in_use` (rewriting the file when any goes).
  Status Retain(const std::set<uint64_t>& in_use);
  size_t size() const;
  const std::string& message() const { return message_; }
  static std::string PathOf(const std::string& base_path) { return base_path + ".namespaces"; }

 private:
  explicit NamespaceBook(std::string path) : path_(std::move(path)) {}
  Status WriteLocked();  // REQUIRES: mu_ held.

  const std::string path_;
  std::string message_;
  mutable std::mutex mu_;
  std::map<uint64_t, KeyNamespace> entries_;  // GUARDED_BY(mu_)
};

}  // namespace cxlkv::tier

#endif  // CXLKV_SRC_TIER_NAMESPACE_BOOK_H_
