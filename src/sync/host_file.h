// A file in /dev/shm that the processes of one host share for as long as any of them holds it
// (the node-local file, the host's wake file). Each holder keeps a shared flock; the last one
// to leave (its exclusive flock is granted) removes the file; a joiner sweeps files nobody holds
// (a process killed with -9 cannot remove its own). A creator builds the file under a staging
// name and renames it into place, so nobody maps a half-written file.
//
// Thread-safety: a HostFile is used by one owner; the file itself is shared by design.
#ifndef CXLKV_SRC_SYNC_HOST_FILE_H_
#define CXLKV_SRC_SYNC_HOST_FILE_H_

#include <cstddef>
#include <functional>
#include <string>

#include "cxlkv/status.h"

namespace cxlkv::sync {

// Takes a shared flock on `fd` without blocking for long: 1 = locked, 0 = still exclusively
// held by someone after ~50 ms (re-open the file by name), < 0 = -errno.
int SharedLockBounded(int fd);

class HostFile {
 public:
  // Makes the file at `path` (staged and renamed into place); sets *made when this call's
  // rename won (another process may have made it first: then use theirs).
  using Creator = std::function<Status(const std::string& path, bool* made)>;

  // Runs on the mapped file in its first user only, before any other joiner can attach.
  using FirstUse = std::function<void(void* base)>;

  // Opens `path`, creating it with `create` when there is none, holds a shared flock on it
  // and maps `size` bytes. `what` names the file in errors ("node-local file").
  static Result<HostFile> Open(const std::string& path, size_t size, const Creator& create, const std::string& what,
                               const FirstUse& first_use = {});
  // Removes every file whose path starts with `prefix` that no process holds, but `except`.
  static void SweepUnused(const std::string& prefix, const std::string& except);

  HostFile(HostFile&& other) noexcept;
  HostFile& operator=(HostFile&& other) = delete;
  HostFile(const HostFile&) = delete;
  // Unmaps; when this process is the last holder, removes the file; drops the flock.
  ~HostFile();

  // True when no other process holds the file (this one's flock becomes exclusive, and the
  // file goes at destruction). Between the check and the exit a joiner may still come: it
  // re-opens by name.
  bool LastUser();

  void* base() const { return base_; }
  const std::string& path() const { return path_; }
  bool created() const { return created_; }        // this process made the file
  bool first_user() const { return first_user_; }  // no other process held it when opened

 private:
  HostFile() = default;
  std::string path_;
  void* base_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
  bool created_ = false;
  bool first_user_ = false;
  bool last_ = false;
};

}  // namespace cxlkv::sync

#endif  // CXLKV_SRC_SYNC_HOST_FILE_H_
