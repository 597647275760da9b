#include "tier/catalog.h"

#include <fcntl.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <filesystem>

#include "tier/crc32c.h"

namespace cxlkv::tier {

namespace {

static_assert(std::endian::native == std::endian::little, "the catalog's format is little-endian");

constexpr uint16_t kRecordMagic = 0x4B43;                    // "CK"
// Version 2: a slot is a device's first granule of the block's extent (version 1 numbered
// fixed-size slots; its records are not read, so an older catalog's blocks are not restored).
constexpr uint8_t kRecordVersion = 2;
constexpr uint8_t kOpBase = 1;                              // the log's first record: what it follows
constexpr uint64_t kCheckpointMagic = 0x31544143564B5843ull;  // "CXKVCAT1"
constexpr uint16_t kCheckpointVersion = 2;
constexpr size_t kCrcCovered = 60;                          // every image: CRC-32C of [0, 60) at 60
constexpr size_t kChunkRecords = 4096;                      // 256 KiB per read/write
constexpr int kMaxRetries = 64;                             // EINTR/EAGAIN, as the SSD engine
constexpr uint64_t kMaxSlots = uint64_t{1} << 40;           // granules; the map holds live ones only

// A log or checkpoint record as it lies on disk (naturally aligned: no padding).
struct RecordImage {
  uint16_t magic;
  uint8_t op;
  uint8_t version;
  uint16_t tier_kind;
  uint16_t flags;
  uint64_t seq, slot, key_lo, key_hi, ns, generation;
  uint32_t bytes;
  uint32_t crc;
};
// The checkpoint header: it names the entries that follow and carries their CRC.
struct HeaderImage {
  uint64_t magic;
  uint16_t version;
  uint16_t header_bytes;
  uint32_t record_bytes;
  uint64_t seq, count, slot_count;
  uint32_t body_crc;
  uint32_t reserved[4];
  uint32_t crc;
};
static_assert(sizeof(RecordImage) == kCatalogRecordBytes && offsetof(RecordImage, crc) == kCrcCovered);
static_assert(sizeof(HeaderImage) == kCatalogRecordBytes && offsetof(HeaderImage, crc) == kCrcCovered);

template <typename Image>
void Seal(Image& im, std::byte* out) {
  im.crc = Crc32c(&im, kCrcCovered);
  std::memcpy(out, &im, sizeof im);
}

void EncodeRecord(uint8_t op, uint64_t seq, const CatalogEntry& e, std::byte* out) {
  RecordImage im{kRecordMagic, op, kRecordVersion, e.tier_kind, e.flags, seq, e.slot, e.key.lo, e.key.hi, e.ns,
                 e.generation, e.bytes, 0};
  Seal(im, out);
}

// False for anything but an intact record of a known op: every field is untrusted until the CRC
// over all of them holds. (check_crc=false only inside a checkpoint, whose entries' CRC covers it.)
bool DecodeRecord(const std::byte* in, uint8_t* op, uint64_t* seq, CatalogEntry* e, bool check_crc = true) {
  RecordImage im;
  std::memcpy(&im, in, sizeof im);
  if (check_crc && im.crc != Crc32c(&im, kCrcCovered)) return false;
  if (im.magic != kRecordMagic || im.version != kRecordVersion) return false;
  if (im.op != kOpBase && im.op != uint8_t(CatalogOp::kPut) && im.op != uint8_t(CatalogOp::kFree)) return false;
  *op = im.op;
  *seq = im.seq;
  *e = CatalogEntry{im.slot, {im.key_lo, im.key_hi}, im.ns, im.generation, im.bytes, im.tier_kind, im.flags};
  return true;
}

bool DecodeHeader(const std::byte* in, HeaderImage* h) {
  std::memcpy(h, in, sizeof *h);
  return h->crc == Crc32c(h, kCrcCovered) && h->magic == kCheckpointMagic && h->version == kCheckpointVersion &&
         h->header_bytes == kCatalogRecordBytes && h->record_bytes == kCatalogRecordBytes;
}

// Moves len bytes at `off` (pwrite or pread), continuing short transfers and retrying EINTR/EAGAIN. Returns 0 or -errno; *done is what moved.
// A read stops early at the end of the file; a write that moves nothing is -EIO.
int Transfer(IoPlatform& io, bool write, int fd, std::byte* buf, size_t len, uint64_t off, size_t* done) {
  *done = 0;
  for (int retries = 0; *done < len;) {
    ssize_t n = write ? io.Pwrite(fd, buf + *done, len - *done, off + *done)
                      : io.Pread(fd, buf + *done, len - *done, off + *done);
    if (n == -EINTR || n == -EAGAIN) {
      if (++retries <= kMaxRetries) continue;
    }
    if (n < 0) return static_cast<int>(n);
    if (n == 0) return write ? -EIO : 0;
    *done += static_cast<size_t>(n);
  }
  return 0;
}

Status FileError(const std::string& path, const std::string& doing, int rc) {
  std::string what = "catalog: cannot " + doing + " " + path + ": " + IoErrnoText(rc);
  switch (-rc) {
    case ENOENT:
    case ENOTDIR:
      return NotFound(what + "; its directory does not exist: create it or give the SSD tier another path");
    case EACCES:
    case EPERM:
    case EROFS:
      return PermissionDenied(what + "; give the SSD tier a path whose directory this user can write");
    case ENOSPC:
    case EDQUOT:
      return NoSpace(what + "; the file system is full: free space on it or give the SSD tier another one");
    default:
      return IoError(what);
  }
}

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

std::string Catalog::CheckpointPath(const std::string& base_path, int copy) {
  return base_path + (copy == 0 ? ".catalog" : ".catalog.1");
}
std::string Catalog::LogPath(const std::string& base_path) { return base_path + ".log"; }

Catalog::Catalog(IoPlatform& io, std::string base, uint64_t slot_count, const CatalogOptions& options)
    : io_(io), base_(std::move(base)), slot_count_(slot_count), options_(options) {}

Catalog::~Catalog() {
  for (int fd : ckpt_fd_) {
    if (fd >= 0) io_.Close(fd);
  }
  if (log_fd_ >= 0) io_.Close(log_fd_);
}

void Catalog::Apply(const CatalogRecord& r) {
  const uint64_t s = r.entry.slot;
  if (r.op == CatalogOp::kPut) {
    table_[s] = r.entry;
  } else {
    table_.erase(s);
  }
}

// Checkpoint: the newest copy whose header and entries both pass their CRC. Log: applied over it
// only when it provably continues from it — its base record names a sequence <= the checkpoint's,
// or (base record lost) its first record is at most one past it. Otherwise the log follows a
// checkpoint we no longer have, the map would be a past state, and everything is dropped.
Status Catalog::Replay() {
  const auto t0 = std::chrono::steady_clock::now();
  table_.clear();
  ReplayStats& st = replay_;
  std::vector<std::byte> buf(kChunkRecords * kCatalogRecordBytes);
  auto note = [&](const std::string& m) { st.message += (st.message.empty() ? "" : "; ") + m; };
  struct File {
    IoPlatform& io;
    int fd = -1;
    uint64_t size = 0;
    ~File() {
      if (fd >= 0) io.Close(fd);
    }
  };
  auto open = [&](File& f, const std::string& path) -> Status {
    f.fd = io_.Open(path, O_RDONLY, 0);
    if (f.fd == -ENOENT) return Status::Ok();  // not there: the first start
    DeviceFileFacts facts;
    int rc = f.fd < 0 ? f.fd : io_.Fstat(f.fd, &facts);
    f.size = facts.size;
    return rc < 0 ? FileError(path, "open", rc) : Status::Ok();
  };
  // Reads up to n records at `off` into buf; returns how many whole ones it got.
  auto read = [&](File& f, const std::string& path, size_t n, uint64_t off, Status* s) -> size_t {
    size_t got = 0;
    int rc = Transfer(io_, false, f.fd, buf.data(), n * kCatalogRecordBytes, off, &got);
    if (rc < 0) *s = FileError(path, "read", rc);
    return rc < 0 ? 0 : got / kCatalogRecordBytes;
  };

  File copy[2] = {{io_}, {io_}};
  HeaderImage h[2] = {};
  bool valid[2] = {false, false};
  Status s;
  for (int c = 0; c < 2; ++c) {
    const std::string path = CheckpointPath(base_, c);
    CXLKV_RETURN_IF_ERROR(open(copy[c], path));
    if (copy[c].size == 0) continue;  // absent, or created and never written: nothing was lost
    // The count is checked against the file's size before it is used.
    valid[c] = read(copy[c], path, 1, 0, &s) == 1 && DecodeHeader(buf.data(), &h[c]) &&
               h[c].count <= copy[c].size / kCatalogRecordBytes - 1;
    CXLKV_RETURN_IF_ERROR(s);
    if (!valid[c]) {
      ++st.checkpoint_copies_dropped;
      uint64_t magic = 0;
      uint16_t version = 0;
      std::memcpy(&magic, buf.data(), sizeof magic);
      std::memcpy(&version, buf.data() + sizeof magic, sizeof version);
      if (magic == kCheckpointMagic && version != kCheckpointVersion) {
        note(path + " is of catalog format " + std::to_string(version) + " (this cxlkv reads " +
             std::to_string(kCheckpointVersion) + "): dropped, and the blocks it named are not restored");
      } else {
        note(path + " has a torn or corrupt header: dropped");
      }
    }
  }
  // Newest first; a copy whose entries fail their CRC is dropped and the older one tried. Entries
  // are applied as they are read and all taken back if the CRC over them fails at the end.
  const int newer = valid[1] && (!valid[0] || h[1].seq > h[0].seq) ? 1 : 0;
  uint64_t ckpt_seq = 0;
  for (int c : {newer, 1 - newer}) {
    if (!valid[c]) continue;
    const std::string path = CheckpointPath(base_, c);
    bool ok = true;
    Crc32cState crc;
    uint64_t out_of_range = 0;
    for (uint64_t done = 0; ok && done < h[c].count;) {
      const size_t n = std::min<uint64_t>(kChunkRecords, h[c].count - done);
      ok = read(copy[c], path, n, (1 + done) * kCatalogRecordBytes, &s) == n;
      CXLKV_RETURN_IF_ERROR(s);
      crc.Update(buf.data(), n * kCatalogRecordBytes);
      for (size_t i = 0; ok && i < n; ++i) {
        CatalogRecord r;
        uint8_t op;
        uint64_t seq;
        ok = DecodeRecord(&buf[i * kCatalogRecordBytes], &op, &seq, &r.entry, false) &&
             op == uint8_t(CatalogOp::kPut);
        if (ok && r.entry.slot >= slot_count_) {
          ++out_of_range;  // the device shrank: that entry only
        } else if (ok) {
          Apply(r);
        }
      }
      done += n;
    }
    if (ok && crc.Finish() == h[c].body_crc) {
      base_copy_ = c;
      ckpt_seq = base_seq_ = h[c].seq;
      st.dropped_records += out_of_range;
      break;
    }
    ++st.checkpoint_copies_dropped;
    note(path + " has torn or corrupt entries: dropped");
    table_.clear();
  }
  st.checkpoint_sequence = last_seq_ = ckpt_seq;
  st.checkpoint_entries = table_.size();

  enum class Link { kUnknown, kYes, kNo } link = Link::kUnknown;
  const std::string path = LogPath(base_);
  File log{io_};
  CXLKV_RETURN_IF_ERROR(open(log, path));
  uint64_t last_in_log = 0;  // sequences must increase within the log
  uint64_t unlinked = 0;
  bool more = true;
  for (uint64_t off = 0; more && off + kCatalogRecordBytes <= log.size;) {
    const size_t n = std::min<uint64_t>(kChunkRecords, (log.size - off) / kCatalogRecordBytes);
    const size_t got = read(log, path, n, off, &s);
    CXLKV_RETURN_IF_ERROR(s);
    more = got == n;  // else the file shrank under us
    for (size_t i = 0; i < got; ++i, off += kCatalogRecordBytes) {
      CatalogRecord r;
      uint8_t op;
      uint64_t seq;
      if (!DecodeRecord(&buf[i * kCatalogRecordBytes], &op, &seq, &r.entry)) {
        ++st.dropped_records;
        continue;
      }
      last_seq_ = std::max(last_seq_, seq);
      if (op == kOpBase && off != 0) {
        ++st.dropped_records;  // a base record belongs at the start only
        continue;
      }
      if (link == Link::kUnknown) {
        link = seq <= ckpt_seq + (op == kOpBase ? 0 : 1) ? Link::kYes : Link::kNo;
        if (link == Link::kNo) {
          note(path + (op == kOpBase ? " follows checkpoint sequence " : " lost its base record and starts at ") +
               std::to_string(seq) + ", past the newest valid checkpoint's " + std::to_string(ckpt_seq));
        }
      }
      if (op == kOpBase) {
        last_in_log = seq;
      } else if (link == Link::kNo) {
        ++unlinked;
      } else if (seq <= last_in_log) {
        ++st.dropped_records;  // sequence not increasing (e.g. left past the end of a failed Append)
      } else {
        last_in_log = seq;
        if (seq <= ckpt_seq) {
          ++st.covered_records;
        } else if (r.entry.slot >= slot_count_) {
          ++st.dropped_records;  // a slot the device no longer has
        } else {
          r.op = CatalogOp(op);
          Apply(r);
          ++st.log_records;
        }
      }
    }
  }
  if (log.size % kCatalogRecordBytes != 0) ++st.dropped_records;  // a torn tail: ignored
  // An empty log proves nothing when a checkpoint copy was lost: the lost one may be the newest.
  if (link == Link::kUnknown && st.checkpoint_copies_dropped > 0) {
    link = Link::kNo;
    note(path + " is empty or lost its base record: it cannot prove the checkpoint used is the newest");
  }
  if (link == Link::kNo) {
    st.dropped_records += unlinked + st.log_records + st.covered_records;
    st.log_records = st.covered_records = st.checkpoint_entries = 0;
    st.started_empty = true;
    table_.clear();
    note("nothing can be proven current: the SSD tier starts empty");
  }
  if (st.dropped_records > 0) note(std::to_string(st.dropped_records) + " record(s) dropped");
  st.replay_seconds = Since(t0);
  return Status::Ok();
}

Result<ReplayStats> Catalog::Inspect(IoPlatform& io, const std::string& base_path, uint64_t slot_count) {
  if (slot_count > kMaxSlots) return InvalidArgument("catalog: " + std::to_string(slot_count) + " slots is too many");
  Catalog c(io, base_path, slot_count, CatalogOptions{});
  CXLKV_RETURN_IF_ERROR(c.Replay());
  return c.replay_;
}

Result<std::unique_ptr<Catalog>> Catalog::Open(IoPlatform& io, const std::string& base_path, uint64_t slot_count,
                                               const CatalogOptions& options) {
  if (base_path.empty()) return InvalidArgument("catalog: no path given: give the SSD tier's path");
  if (slot_count > kMaxSlots) {
    return InvalidArgument("catalog " + base_path + ": " + std::to_string(slot_count) +
                           " slots is more than the catalog holds (2^32): use larger slots");
  }
  std::unique_ptr<Catalog> c(new Catalog(io, base_path, slot_count, options));
  CXLKV_RETURN_IF_ERROR(c->Replay());
  std::lock_guard<std::mutex> lock(c->mu_);
  bool created = false;
  for (int i = 0; i < 2; ++i) {
    const std::string path = CheckpointPath(base_path, i);
    DeviceFileFacts facts;
    int rc = io.Stat(path, &facts);
    if (rc < 0) return FileError(path, "stat", rc);
    created |= !facts.exists;
    int fd = io.Open(path, O_RDWR | O_CREAT, 0600);
    if (fd < 0) return FileError(path, "open for writing", fd);
    c->ckpt_fd_[i] = fd;
  }
  // Fold what was replayed into a checkpoint: the log then follows a checkpoint this catalog
  // wrote, whatever was dropped stays dropped, and the next Open replays only newer records.
  CXLKV_RETURN_IF_ERROR(c->CheckpointLocked());
  if (created) {
    // New directory entries are durable only once the directory is synced (power loss, not kill -9).
    std::string dir = std::filesystem::path(base_path).parent_path().string();
    int dfd = io.Open(dir.empty() ? "." : dir, O_RDONLY | O_DIRECTORY, 0);
    if (dfd >= 0) {
      io.Fdatasync(dfd);  // best effort: some file systems refuse to sync a directory
      io.Close(dfd);
    }
  }
  return c;
}

Status Catalog::Append(std::span<const CatalogRecord> records) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const CatalogRecord& r : records) {
    if (r.entry.slot >= slot_count_ || (r.op != CatalogOp::kPut && r.op != CatalogOp::kFree)) {
      return InvalidArgument("catalog " + base_ + ": record for slot " + std::to_string(r.entry.slot) + " of " +
                             std::to_string(slot_count_) + " (op " + std::to_string(int(r.op)) +
                             ") refused; nothing was written");
    }
  }
  if (records.empty()) return Status::Ok();
  if (!log_broken_.ok()) CXLKV_RETURN_IF_ERROR(RestartLogLocked());
  std::vector<std::byte> buf(records.size() * kCatalogRecordBytes);
  for (size_t i = 0; i < records.size(); ++i) {
    EncodeRecord(uint8_t(records[i].op), last_seq_ + 1 + i, records[i].entry, &buf[i * kCatalogRecordBytes]);
  }
  // The sequences are spent even if this fails: a later Append writes over this one's place with
  // larger ones, so a record of this one left past its end replays as "not increasing" — dropped.
  last_seq_ += records.size();
  size_t done = 0;
  const std::string path = LogPath(base_);
  int rc = Transfer(io_, true, log_fd_, buf.data(), buf.size(), log_end_, &done);
  if (rc == 0) rc = io_.Fdatasync(log_fd_);
  if (rc < 0) {
    // Best effort: blank what did reach the file, so a crash now does not replay records the
    // caller was told failed. (If it did, the slots' own headers still validate each read.)
    if (done > 0) {
      std::vector<std::byte> zeros(done);
      size_t ignored;
      if (Transfer(io_, true, log_fd_, zeros.data(), done, log_end_, &ignored) == 0) io_.Fdatasync(log_fd_);
    }
    Status s = FileError(path, "append " + std::to_string(records.size()) + " record(s) to", rc);
    return Status(s.code(), s.message() + " (not recorded: do not index these blocks)");
  }
  log_end_ += buf.size();
  for (const CatalogRecord& r : records) Apply(r);
  if (options_.log_limit_bytes > 0 && log_end_ >= next_auto_checkpoint_) {
    // The records are durable whatever happens here; a failed checkpoint is retried one log limit on.
    if (!CheckpointLocked().ok()) next_auto_checkpoint_ = log_end_ + options_.log_limit_bytes;
  }
  return Status::Ok();
}

Status Catalog::Checkpoint() {
  std::lock_guard<std::mutex> lock(mu_);
  return CheckpointLocked();
}

// Crash argument: the copy written is never base_copy_ (the newest durable one), so until its
// header and entries are synced a crash leaves base_copy_ + the untouched log, which replays to
// the present map. Once synced, the new copy is the newest valid one and covers every record in
// the log (its sequence is last_seq_), so the old log's records are "covered" whether or not the
// restart below happened; after the restart the log follows the new copy.
Status Catalog::CheckpointLocked() {
  // A log left unrestarted by a failed checkpoint may still depend on the copy about to be
  // overwritten: make it follow the newest copy first.
  if (!log_broken_.ok() && !RestartLogLocked().ok()) return last_checkpoint_ = log_broken_;
  const int t = base_copy_ == 0 ? 1 : 0;
  const int fd = ckpt_fd_[t];
  const std::string path = CheckpointPath(base_, t);
  std::vector<std::byte> buf(kChunkRecords * kCatalogRecordBytes);
  Crc32cState crc;
  HeaderImage h{kCheckpointMagic, kCheckpointVersion, kCatalogRecordBytes, kCatalogRecordBytes, last_seq_, 0,
                slot_count_, 0, {}, 0};
  size_t fill = 0, done = 0;
  uint64_t off = kCatalogRecordBytes;  // the entries; the header goes last, at 0
  int rc = 0;
  auto flush = [&] {
    crc.Update(buf.data(), fill);
    rc = Transfer(io_, true, fd, buf.data(), fill, off, &done);
    off += fill;
    fill = 0;
  };
  for (auto it = table_.begin(); it != table_.end() && rc == 0; ++it) {
    EncodeRecord(uint8_t(CatalogOp::kPut), h.seq, it->second, &buf[fill]);
    fill += kCatalogRecordBytes;
    ++h.count;
    if (fill == buf.size()) flush();
  }
  if (rc == 0 && fill > 0) flush();
  if (rc == 0) {
    h.body_crc = crc.Finish();
    Seal(h, buf.data());
    rc = Transfer(io_, true, fd, buf.data(), kCatalogRecordBytes, 0, &done);
  }
  if (rc == 0) rc = io_.Fdatasync(fd);
  if (rc < 0) return last_checkpoint_ = FileError(path, "write checkpoint", rc);
  base_copy_ = t;
  base_seq_ = h.seq;
  last_checkpoint_ = RestartLogLocked();
  return last_checkpoint_;
}

Status Catalog::RestartLogLocked() {
  const std::string path = LogPath(base_);
  if (log_fd_ >= 0) io_.Close(log_fd_);
  log_end_ = 0;
  log_fd_ = io_.Open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
  int rc = log_fd_;
  std::byte rec[kCatalogRecordBytes];
  size_t done = 0;
  if (rc >= 0) {
    EncodeRecord(kOpBase, base_seq_, CatalogEntry{}, rec);
    rc = Transfer(io_, true, log_fd_, rec, sizeof rec, 0, &done);
  }
  if (rc >= 0) rc = io_.Fdatasync(log_fd_);
  if (rc < 0) {
    log_broken_ = FileError(path, "restart the log", rc);
    return log_broken_;
  }
  log_end_ = kCatalogRecordBytes;
  next_auto_checkpoint_ = options_.log_limit_bytes;
  log_broken_ = Status::Ok();
  return log_broken_;
}

std::vector<CatalogEntry> Catalog::Live() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<CatalogEntry> out;
  out.reserve(table_.size());
  for (const auto& [slot, e] : table_) out.push_back(e);
  return out;
}

bool Catalog::Find(uint64_t slot, CatalogEntry* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = table_.find(slot);
  if (it == table_.end()) return false;
  *out = it->second;
  return true;
}

namespace {

std::vector<std::string> CatalogFiles(const std::string& base) {
  return {Catalog::LogPath(base), Catalog::CheckpointPath(base, 0), Catalog::CheckpointPath(base, 1)};
}

}  // namespace

Result<ReplayCost> MeasureReplayCost(IoPlatform& io, const std::string& base_path, uint64_t records) {
  if (records == 0) return InvalidArgument("catalog replay cost: give at least one record");
  for (const auto& p : CatalogFiles(base_path)) io.Unlink(p);
  ReplayCost cost;
  cost.records = records;
  const double per_million = 1e6 / static_cast<double>(records);
  CatalogOptions o;
  o.log_limit_bytes = 0;  // keep every record in the log
  auto measure = [&](bool from_log, double* warm, double* cold) -> Status {
    for (double* out : {warm, cold}) {
      for (const auto& p : out == cold ? CatalogFiles(base_path) : std::vector<std::string>{}) {
        int fd = io.Open(p, O_RDONLY, 0);
        if (fd < 0) continue;
        io.DropCache(fd, 0, 0);  // the pages are clean (synced): this evicts them
        io.Close(fd);
      }
      auto st = Catalog::Inspect(io, base_path, records);
      if (!st.ok()) return st.status();
      if ((from_log ? st->log_records : st->checkpoint_entries) != records) {
        return Internal("catalog replay cost: replayed " + std::to_string(st->log_records) + " log records and " +
                        std::to_string(st->checkpoint_entries) + " checkpoint entries, expected " +
                        std::to_string(records) + (st->message.empty() ? "" : ": " + st->message));
      }
      *out = st->replay_seconds * per_million;
    }
    return Status::Ok();
  };
  Status s = [&]() -> Status {
    {
      CXLKV_ASSIGN_OR_RETURN(auto c, Catalog::Open(io, base_path, records, o));
      std::vector<CatalogRecord> batch;
      for (uint64_t i = 0; i < records; ++i) {
        batch.push_back({CatalogOp::kPut, {i, {i * 0x9E3779B97F4A7C15ull, ~i}, 7, 1, 256 << 10, 2, 0}});
        if (batch.size() == kChunkRecords || i + 1 == records) {
          CXLKV_RETURN_IF_ERROR(c->Append(batch));
          batch.clear();
        }
      }
    }
    CXLKV_RETURN_IF_ERROR(measure(true, &cost.log_warm_s_per_million, &cost.log_cold_s_per_million));
    {
      CXLKV_ASSIGN_OR_RETURN(auto c, Catalog::Open(io, base_path, records, o));  // folds the log
      const auto t0 = std::chrono::steady_clock::now();
      CXLKV_RETURN_IF_ERROR(c->Checkpoint());
      cost.checkpoint_write_s_per_million = Since(t0) * per_million;
    }
    return measure(false, &cost.checkpoint_warm_s_per_million, &cost.checkpoint_cold_s_per_million);
  }();
  for (const auto& p : CatalogFiles(base_path)) io.Unlink(p);
  if (!s.ok()) return s;
  return cost;
}

}  // namespace cxlkv::tier
