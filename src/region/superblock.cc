#include "region/superblock.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>

#include "region/offset.h"
#include "util/units.h"

namespace cxlkv::region {

namespace {

constexpr uint64_t kAreaAlign = 4096;

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// The region layer's own parameters: everything later code indexes with. Reached only when the
// checksum matched, so a failure here means the superblock was written wrong (or forged with a
// valid checksum), not a stray bit flip.
Status ValidateRegionParams(const Superblock& sb, const std::string& path, const std::string& recreate) {
  auto bad = [&](const std::string& what) {
    return Corrupted("region " + path + " " + what + recreate);
  };
  if (sb.max_nodes < 1 || sb.max_nodes > kMaxNodes) {
    return bad("superblock names " + std::to_string(sb.max_nodes) + " nodes (1.." +
               std::to_string(kMaxNodes) + " allowed)");
  }
  if (sb.chunk_bytes < kAreaAlign || (sb.chunk_bytes & (sb.chunk_bytes - 1)) != 0 ||
      sb.chunk_bytes > sb.region_size) {
    return bad("superblock names a chunk size of " + std::to_string(sb.chunk_bytes) +
               " bytes (a power of two >= 4 KiB, within the region, expected)");
  }
  if (sb.pool_regions < 1 || sb.pool_regions > kMaxPoolRegions || sb.pool_index >= sb.pool_regions) {
    return bad("superblock says it is region " + std::to_string(sb.pool_index) + " of a pool of " +
               std::to_string(sb.pool_regions) + " (at most " + std::to_string(kMaxPoolRegions) + ")");
  }
  for (uint32_t i = 0; i < sb.area_count; ++i) {
    if (sb.areas[i].kind == 0 || sb.areas[i].kind > static_cast<uint32_t>(AreaKind::kData)) {
      return bad("area " + std::to_string(i) + " has unknown kind " + std::to_string(sb.areas[i].kind));
    }
  }
  const AreaDesc* nodes = FindArea(sb, AreaKind::kNodeTable);
  if (nodes == nullptr || nodes->param != sb.max_nodes ||
      nodes->size < uint64_t{sb.max_nodes} * kNodeLineBytes) {
    return bad("area node-table is corrupt: " +
               (nodes == nullptr ? std::string("missing")
                                 : "parameter " + std::to_string(nodes->param) + ", size " +
                                       std::to_string(nodes->size) + " for " +
                                       std::to_string(sb.max_nodes) + " nodes"));
  }
  const AreaDesc* data = FindArea(sb, AreaKind::kData);
  if (data == nullptr || data->offset % sb.chunk_bytes != 0 || data->size % sb.chunk_bytes != 0 ||
      data->param != data->size / sb.chunk_bytes || data->param == 0) {
    return bad("area data is corrupt: " +
               (data == nullptr ? std::string("missing")
                                : "offset " + std::to_string(data->offset) + ", size " +
                                      std::to_string(data->size) + ", parameter " +
                                      std::to_string(data->param) + " chunks of " +
                                      std::to_string(sb.chunk_bytes) + " bytes"));
  }
  return Status::Ok();
}

}  // namespace

std::string_view AreaKindName(AreaKind kind) {
  switch (kind) {
    case AreaKind::kNone: return "none";
    case AreaKind::kNodeTable: return "node-table";
    case AreaKind::kLockArray: return "lock-array";
    case AreaKind::kChunkTable: return "chunk-table";
    case AreaKind::kObjectStore: return "object-store";
    case AreaKind::kIndex: return "index";
    case AreaKind::kData: return "data";
  }
  return "unknown";
}

uint64_t SuperblockChecksum(const Superblock& sb) {
  return XXH3_64bits(&sb, offsetof(Superblock, checksum));
}

Result<Superblock> PlanLayout(uint64_t size, const RegionCreateOptions& options,
                              const std::vector<AreaRequest>& extra) {
  if (options.max_nodes < 1 || options.max_nodes > kMaxNodes) {
    return InvalidArgument("max nodes must be 1.." + std::to_string(kMaxNodes) + ", got " +
                           std::to_string(options.max_nodes));
  }
  uint64_t chunk = options.chunk_bytes;
  if (chunk < kAreaAlign || (chunk & (chunk - 1)) != 0) {
    return InvalidArgument("chunk size must be a power of two >= 4 KiB, got " +
                           util::FormatBytes(chunk));
  }
  Superblock sb{};
  sb.magic = kRegionMagic;
  sb.layout_version = kLayoutVersion;
  sb.header_bytes = sizeof(Superblock);
  sb.region_size = size;
  sb.max_nodes = options.max_nodes;
  sb.chunk_bytes = chunk;
  sb.numa_node = options.numa_node;

  uint64_t cursor = kSuperblockBytes;
  auto add = [&sb, &cursor](AreaKind kind, uint64_t bytes, uint64_t align, uint64_t param) {
    cursor = AlignUp(cursor, align);
    sb.areas[sb.area_count++] = AreaDesc{static_cast<uint32_t>(kind), 0, cursor, bytes, param};
    cursor += bytes;
  };
  add(AreaKind::kNodeTable, AlignUp(uint64_t{options.max_nodes} * kNodeLineBytes, kAreaAlign),
      kAreaAlign, options.max_nodes);
  if (extra.size() + 2 > kMaxAreas) return InvalidArgument("too many areas requested");
  for (const AreaRequest& a : extra) {
    add(a.kind, AlignUp(a.bytes, kAreaAlign), kAreaAlign, a.param);
    if (cursor > size) break;  // reported below as too small
  }

  uint64_t data_start = AlignUp(cursor, chunk);
  if (size < data_start + chunk) {
    return InvalidArgument("region of " + util::FormatBytes(size) +
                           " is too small: its metadata needs " + util::FormatBytes(data_start) +
                           " and the data area at least one " + util::FormatBytes(chunk) +
                           " chunk; use --size " + util::FormatBytes(data_start + chunk) +
                           " or more");
  }
  add(AreaKind::kData, (size - data_start) / chunk * chunk, chunk, (size - data_start) / chunk);
  return sb;
}

Status ValidateSuperblock(const void* raw, uint64_t file_size, const std::string& path,
                          Superblock* out) {
  const std::string recreate = ": re-create it with 'cxlkv init --path " + path + " --size S --force'";
  if (file_size < kSuperblockBytes) {
    return Corrupted("region " + path + " is truncated: " + std::to_string(file_size) +
                     " bytes, smaller than the " + std::to_string(kSuperblockBytes) +
                     "-byte superblock" + recreate);
  }
  Superblock sb;
  std::memcpy(&sb, raw, sizeof(sb));
  if (sb.magic != kRegionMagic) {
    return Corrupted(path + " is not a cxlkv region (bad magic); point --path at a region made by "
                     "'cxlkv init', or create one there with --force");
  }
  if (sb.layout_version != kLayoutVersion) {
    return VersionMismatch("region " + path + " was made by layout version " +
                           std::to_string(sb.layout_version) + ", this build reads version " +
                           std::to_string(kLayoutVersion) + recreate +
                           " (its contents are lost), or use a matching cxlkv build");
  }
  if (sb.header_bytes != sizeof(Superblock) || sb.area_count > kMaxAreas) {
    return Corrupted("region " + path + " has a malformed superblock header" + recreate);
  }
  if (SuperblockChecksum(sb) != sb.checksum) {
    return Corrupted("region " + path + " superblock checksum mismatch (stored " +
                     util::Hex64(sb.checksum) + ", computed " +
                     util::Hex64(SuperblockChecksum(sb)) + "): the header was overwritten" +
                     recreate);
  }
  if (file_size < sb.region_size) {
    return Corrupted("region " + path + " is truncated: the superblock says " +
                     util::FormatBytes(sb.region_size) + " but only " +
                     util::FormatBytes(file_size) + " are there" + recreate);
  }
  uint64_t prev_end = kSuperblockBytes;
  for (uint32_t i = 0; i < sb.area_count; ++i) {
    const AreaDesc& a = sb.areas[i];
    if (a.offset < prev_end || a.offset % kAreaAlign != 0 || a.size > sb.region_size ||
        a.offset > sb.region_size - a.size) {
      return Corrupted("region " + path + " area table is inconsistent at area " +
                       std::to_string(i) + " (" +
                       std::string(AreaKindName(static_cast<AreaKind>(a.kind))) + ")" + recreate);
    }
    prev_end = a.offset + a.size;
  }
  CXLKV_RETURN_IF_ERROR(ValidateRegionParams(sb, path, recreate));
  *out = sb;
  return Status::Ok();
}

const AreaDesc* FindArea(const Superblock& sb, AreaKind kind) {
  for (uint32_t i = 0; i < sb.area_count && i < kMaxAreas; ++i) {
    if (sb.areas[i].kind == static_cast<uint32_t>(kind)) return &sb.areas[i];
  }
  return nullptr;
}

}  // namespace cxlkv::region
