// Writing corruptions into a region file, as a damaged device or a buggy host would:
// raw bytes, or a superblock rewritten with a valid checksum so that the checks behind the
// checksum are reached. Shared by the validation tests and the fuzz target's regressions.
#ifndef CXLKV_TESTS_SUPPORT_CORRUPT_H_
#define CXLKV_TESTS_SUPPORT_CORRUPT_H_

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <string>

#include "region/superblock.h"

namespace cxlkv::testing {

inline bool PokeBytes(const std::string& path, uint64_t at, const void* bytes, size_t n) {
  int fd = ::open(path.c_str(), O_RDWR);
  if (fd < 0) return false;
  bool ok = ::pwrite(fd, bytes, n, static_cast<off_t>(at)) == static_cast<ssize_t>(n);
  ::close(fd);
  return ok;
}

inline bool PeekBytes(const std::string& path, uint64_t at, void* bytes, size_t n) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return false;
  bool ok = ::pread(fd, bytes, n, static_cast<off_t>(at)) == static_cast<ssize_t>(n);
  ::close(fd);
  return ok;
}

template <typename T>
T Peek(const std::string& path, uint64_t at) {
  T v{};
  PeekBytes(path, at, &v, sizeof v);
  return v;
}

template <typename T>
bool Poke(const std::string& path, uint64_t at, const T& v) {
  return PokeBytes(path, at, &v, sizeof v);
}

// Reads the superblock, lets `edit` change it, recomputes the checksum and writes it back.
template <typename Fn>
bool ForgeSuperblock(const std::string& path, Fn edit) {
  region::Superblock sb{};
  if (!PeekBytes(path, 0, &sb, sizeof sb)) return false;
  edit(sb);
  sb.checksum = region::SuperblockChecksum(sb);
  return PokeBytes(path, 0, &sb, sizeof sb);
}

// The area of `kind` as the file's superblock records it (a zeroed desc when absent).
inline region::AreaDesc AreaOf(const std::string& path, region::AreaKind kind) {
  region::Superblock sb{};
  PeekBytes(path, 0, &sb, sizeof sb);
  const region::AreaDesc* a = region::FindArea(sb, kind);
  return a != nullptr ? *a : region::AreaDesc{};
}

}  // namespace cxlkv::testing

#endif  // CXLKV_TESTS_SUPPORT_CORRUPT_H_
