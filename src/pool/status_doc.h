// Status documents: a small JSON document that a long-lived process (cxlkvd) publishes in the pool
// for inspectors that do not join it (`cxlkv stat`): what only that process knows, such as its
// capacity devices, their I/O paths and every fallback taken (docs/tiers.md).
//
// Each document is one pool object named by the root "cxlkv.status.<name>" and rewritten in place
// by its one writer (the process that publishes that name; a successor reuses the object):
//
//   word 0   sequence: odd while being rewritten, even when complete (rule P4: published last)
//   word 1   length of the JSON text
//   16 ...   the JSON text (at most kStatusDocBytes − 16)
//
// A reader invalidates, reads the sequence, the text and the sequence again; a document that
// changed under it, or whose length or text is not valid, is reported as unreadable — never
// trusted (values read from the region are untrusted).
// Thread-safety: PublishStatus from one thread per name; ReadStatusDocs from anywhere.
#ifndef CXLKV_SRC_POOL_STATUS_DOC_H_
#define CXLKV_SRC_POOL_STATUS_DOC_H_

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cxlkv/pool.h"
#include "cxlkv/region.h"

namespace cxlkv::pool {

inline constexpr uint64_t kStatusDocBytes = 16 << 10;
inline constexpr char kStatusRootPrefix[] = "cxlkv.status.";

// Publishes `doc` under `name` (creating its object and root on first use). kInvalidArgument when
// the document is larger than the object holds.
Status PublishStatus(Pool& pool, const std::string& name, const nlohmann::json& doc);

// Every status document of the pool: {name: document}, or {name: {"unreadable": why}}.
nlohmann::json ReadStatusDocs(std::vector<std::unique_ptr<Region>>& regions);

}  // namespace cxlkv::pool

#endif  // CXLKV_SRC_POOL_STATUS_DOC_H_
