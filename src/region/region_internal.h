// What code under src/ sees of a Region: its mapping, its validated superblock, and the
// metadata accessor every layer above uses (DESIGN.md rule 1).
#ifndef CXLKV_SRC_REGION_REGION_INTERNAL_H_
#define CXLKV_SRC_REGION_REGION_INTERNAL_H_

#include <memory>
#include <string>

#include "cxlkv/region.h"
#include "region/mapping.h"
#include "region/meta.h"
#include "region/offset.h"
#include "region/platform.h"
#include "region/superblock.h"

namespace cxlkv {

class Region::Impl {
 public:
  Impl(region::Mapping mapping, const region::Superblock& sb, RegionInfo info,
       CoherenceMode coherence);

  uint8_t* base() const { return mapping_.base(); }
  uint64_t size() const { return sb_.region_size; }
  const region::Superblock& superblock() const { return sb_; }
  const RegionInfo& info() const { return info_; }
  region::MetaAccess& meta() { return meta_; }

  // The area of `kind`. REQUIRES: the layout has one (every area of kLayoutVersion exists).
  const region::AreaDesc& area(region::AreaKind kind) const;
  // The area of `kind`, or nullptr when this region has none.
  const region::AreaDesc* find_area(region::AreaKind kind) const {
    return region::FindArea(sb_, kind);
  }

  // Pointer to payload bytes (never metadata: that goes through meta()). Bounds-checked in
  // debug builds; aborts on an offset outside the region.
  uint8_t* PayloadPtr(uint64_t byte_offset, uint64_t len) const;

 private:
  region::Mapping mapping_;
  region::Superblock sb_;
  RegionInfo info_;
  region::MetaAccess meta_;
};

namespace region {

// Create/Attach with an explicit Platform (tests inject faults through it).
// `areas`: the areas the layers above need (placed between the node table and the data area).
// `pool`: the pool this region is part of; null: a pool of one with a fresh random id.
Result<std::unique_ptr<Region>> CreateRegion(const std::string& path,
                                             const RegionCreateOptions& options,
                                             Platform& platform,
                                             const std::vector<AreaRequest>& areas = {},
                                             const PoolIdentity* pool = nullptr);
// A fresh random pool id.
PoolIdentity NewPoolIdentity(uint32_t regions);
Result<std::unique_ptr<Region>> AttachRegion(const std::string& path,
                                             const RegionAttachOptions& options,
                                             Platform& platform);

}  // namespace region
}  // namespace cxlkv

#endif  // CXLKV_SRC_REGION_REGION_INTERNAL_H_
