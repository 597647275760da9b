// Index: pin tables (docs/protocol.md, "Pins"). A lookup pins its whole chain in one record of
// consecutive pin words of its node's table, published before it probes; an evictor publishes
// EVICTING, then reads every node's table. One contiguous record costs a chain of n keys n/8
// line flushes instead of n scattered ones, and no re-read of the entries.
#include <algorithm>

#include "cache/index.h"

namespace cxlkv::cache {

namespace {
constexpr uint64_t kLineMask = ~uint64_t{63};
}  // namespace

void ReadPinTable(region::MetaAccess& meta, const IndexLayout& l, uint32_t node, bool invalidate,
                  const std::function<void(uint64_t word, uint64_t fingerprint)>& fn) {
  const uint64_t dir = l.pin_dir(node);
  const uint64_t dir_words = l.pin_dir_words();
  if (invalidate) meta.Invalidate(dir, dir_words * 8);
  std::vector<uint64_t> pages;
  for (uint64_t w = 0; w < dir_words; ++w) {
    uint64_t bits = meta.Load(dir + w * 8);
    while (bits != 0) {
      const uint64_t page = w * 64 + static_cast<uint64_t>(__builtin_ctzll(bits));
      bits &= bits - 1;
      if (page < l.h.pin_pages) pages.push_back(l.pin_page(node, static_cast<uint32_t>(page)));
    }
  }
  if (pages.empty()) return;
  if (invalidate) meta.InvalidateEach(pages, kPinPageBytes);  // the misses overlap
  uint64_t words[kPinPageWords];
  for (uint64_t page : pages) {
    meta.Read(page, words, kPinPageBytes);
    for (uint32_t i = 1; i < kPinPageWords; ++i) {
      if (words[i] != 0) fn(page + uint64_t{i} * 8, words[i]);
    }
  }
}

void Index::InvalidateOwnPinRow() {
  // Lines of this row this host cached in an earlier life may predate what recovery wrote.
  // Dropping them is safe for the node's live processes: they flush every line they write.
  meta_.Invalidate(layout_.pin_dir(node_.id()), layout_.pin_dir_words() * 8);
  meta_.Invalidate(layout_.pin_page(node_.id(), 0), uint64_t{layout_.h.pin_pages} * kPinPageBytes);
}

uint64_t Index::PinPageOf(uint64_t word) const {
  return layout_.h.pin_pages_offset + (word - layout_.h.pin_pages_offset) / kPinPageBytes * kPinPageBytes;
}

void Index::SetPinDirBit(uint32_t row, uint32_t page, bool set, std::vector<uint64_t>* lines) {
  const uint64_t off = layout_.pin_dir(row) + uint64_t{page / 64} * 8;
  const uint64_t bit = uint64_t{1} << (page % 64);
  uint64_t old = meta_.Load(off);
  while (!meta_.LocalCompareExchange(off, old, set ? (old | bit) : (old & ~bit))) {
  }
  lines->push_back(off & kLineMask);
}

uint64_t Index::ClaimPinPage(uint32_t row, uint64_t owner, std::vector<uint64_t>* lines) {
  const uint32_t pages = layout_.h.pin_pages;
  const uint64_t dir = layout_.pin_dir(row);
  for (uint32_t k = 0; k < pages; ++k) {
    const uint32_t p = (pin_page_hint_ + k) % pages;
    if (meta_.Load(dir + uint64_t{p / 64} * 8) & (uint64_t{1} << (p % 64))) continue;
    // The owner word is the claim (a local atomic: only this node's processes write its row);
    // the directory bit only tells evictors where to look, so it is set after.
    const uint64_t page = layout_.pin_page(row, p);
    uint64_t expected = 0;
    if (!meta_.LocalCompareExchange(page, expected, owner)) continue;
    SetPinDirBit(row, p, true, lines);
    lines->push_back(page);
    pin_page_hint_ = (p + 1) % pages;
    return page;
  }
  return 0;
}

bool Index::PinPageEmpty(uint64_t page) {
  for (uint32_t i = 1; i < kPinPageWords; ++i) {
    if (meta_.Load(page + uint64_t{i} * 8) != 0) return false;
  }
  return true;
}

void Index::FreePinPage(uint32_t row, uint64_t page, uint64_t owner, std::vector<uint64_t>* lines) {
  const auto p = static_cast<uint32_t>((page - layout_.pin_page(row, 0)) / kPinPageBytes);
  SetPinDirBit(row, p, false, lines);
  uint64_t expected = owner;
  (void)meta_.LocalCompareExchange(page, expected, 0);  // fails only if recovery took it already
  lines->push_back(page);
}

std::vector<uint64_t> Index::WritePinWords(uint32_t row, uint64_t owner, std::span<const BlockKey> keys,
                                           std::vector<uint64_t>* lines) {
  std::vector<uint64_t> words;
  words.reserve(keys.size());
  std::lock_guard<std::mutex> g(pins_mu_);
  OpenPinPage& open = open_pin_pages_[owner];
  // A page recovery took from a life that ended is not this life's any more (the owner word
  // says so): start a new one rather than write into what another life may hold.
  if (open.page != 0 && meta_.Load(open.page) != owner) open = OpenPinPage{};
  for (const BlockKey& key : keys) {
    if (open.page == 0 || open.next == kPinPageWords) {
      if (open.page != 0 && PinPageEmpty(open.page)) {
        open.next = 1;  // every pin of the full page was released: reuse it
      } else {
        open = OpenPinPage{ClaimPinPage(row, owner, lines), 1};
        if (open.page == 0) break;  // the node's table is full: pin fewer keys
      }
    }
    const uint64_t word = open.page + uint64_t{open.next++} * 8;
    meta_.Store(word, PinFingerprint(key.lo, key.hi));
    words.push_back(word);
    if (lines->empty() || lines->back() != (word & kLineMask)) lines->push_back(word & kLineMask);
  }
  return words;
}

void Index::ClearPinWords(uint32_t row, uint64_t owner, std::span<const uint64_t> words, std::vector<uint64_t>* lines) {
  if (words.empty()) return;
  std::lock_guard<std::mutex> g(pins_mu_);
  ClearPinWordsLocked(row, owner, words, lines);
}

void Index::ClearPinWordsLocked(uint32_t row, uint64_t owner, std::span<const uint64_t> words,
                                std::vector<uint64_t>* lines) {
  std::vector<uint64_t> pages;
  for (uint64_t word : words) {
    const uint64_t page = PinPageOf(word);
    if (meta_.Load(page) != owner) continue;  // recovery dropped it: another life's now
    meta_.Store(word, 0);
    if (lines->empty() || lines->back() != (word & kLineMask)) lines->push_back(word & kLineMask);
    if (pages.empty() || pages.back() != page) pages.push_back(page);
  }
  auto open = open_pin_pages_.find(owner);
  for (uint64_t page : pages) {
    if (open != open_pin_pages_.end() && open->second.page == page) continue;  // still taking pins
    if (PinPageEmpty(page)) FreePinPage(row, page, owner, lines);
  }
}

void Index::RememberPins(uint64_t owner, std::span<const BlockPin> pins) {
  std::lock_guard<std::mutex> g(pins_mu_);
  for (const BlockPin& p : pins) held_pins_[{owner, p.slot}].push_back(PinRefWord(p.pin_word));
}

bool Index::OwnPinWord(uint32_t row, uint64_t owner, uint64_t word) {
  const uint64_t first = layout_.pin_page(row, 0);
  const uint64_t end = layout_.pin_page(row, layout_.h.pin_pages);
  if (word < first || word >= end || word % 8 != 0 || (word - first) % kPinPageBytes == 0) return false;
  return meta_.Load(PinPageOf(word)) == owner;
}

uint64_t Index::FindPinWordLocked(uint32_t row, uint64_t owner, const BlockPin& pin) {
  // The pin names its word (taken by this process): the common case. Taken by an earlier life
  // of this process (paused past its lease): recovery gave that life's pages back; nothing to do.
  if (pin.pin_word != 0) {
    const uint64_t word = PinRefWord(pin.pin_word);
    const bool mine = PinRefLife(pin.pin_word) == (WriterInc(owner) & 0xfffff) && OwnPinWord(row, owner, word);
    return mine ? word : 0;
  }
  const uint64_t slot = pin.slot;
  auto it = held_pins_.find({owner, slot});
  if (it != held_pins_.end()) {
    const uint64_t word = it->second.back();
    it->second.pop_back();
    if (it->second.empty()) held_pins_.erase(it);
    return word;
  }
  // A pin that crossed the metadata RPC (a central service remembers the words it took), or one
  // this process did not take (a service that took over for this client): find a word of the
  // owner's pages that holds the pinned entry's key. A pinned entry cannot change, so its key
  // is still in the slot.
  if (slot >= layout_.entries()) return 0;
  const Entry e = ReadEntry(slot);
  const uint64_t fp = PinFingerprint(e.key_lo, e.key_hi);
  uint64_t found = 0;
  ReadPinTable(meta_, layout_, row, !CacheIsTable(), [&](uint64_t word, uint64_t value) {
    if (found == 0 && value == fp && meta_.Load(PinPageOf(word)) == owner) found = word;
  });
  return found;
}

void Index::ReleasePins(std::span<const BlockPin> pins) {
  const uint64_t owner = MyWriterWord();
  const uint32_t row = PinRow();
  std::vector<uint64_t> lines;
  {
    std::lock_guard<std::mutex> g(pins_mu_);
    std::vector<uint64_t> words;
    words.reserve(pins.size());
    for (const BlockPin& p : pins) {
      if (uint64_t w = FindPinWordLocked(row, owner, p); w != 0) words.push_back(w);
    }
    std::sort(words.begin(), words.end());
    ClearPinWordsLocked(row, owner, words, &lines);
  }
  std::sort(lines.begin(), lines.end());
  lines.erase(std::unique(lines.begin(), lines.end()), lines.end());
  meta_.FlushEach(lines, 64);  // P1: evictors read these
  // The last access ends now (LRU by release time). Stamps are hints no protocol relies on:
  // written back with the cheaper clflushopt (InvalidateEach writes a dirty line back).
  const uint64_t stamp = NowStamp();
  std::vector<uint64_t> stamps;
  stamps.reserve(pins.size());
  for (const BlockPin& p : pins) {
    if (p.slot >= layout_.entries()) continue;
    meta_.Store(layout_.stamp(row, p.slot), stamp);
    stamps.push_back(layout_.stamp(row, p.slot));
  }
  if (!CacheIsTable()) meta_.InvalidateEach(stamps, 8);
}

std::vector<uint64_t> Index::PinnedFingerprints() {
  std::vector<uint64_t> fps;
  for (uint32_t node = 0; node < layout_.h.max_nodes; ++node) {
    ReadPinTable(meta_, layout_, node, !CacheIsTable(), [&](uint64_t, uint64_t fp) { fps.push_back(fp); });
  }
  std::sort(fps.begin(), fps.end());
  return fps;
}

bool Index::Pinned(const std::vector<uint64_t>& fingerprints, uint64_t key_lo, uint64_t key_hi) {
  return std::binary_search(fingerprints.begin(), fingerprints.end(), PinFingerprint(key_lo, key_hi));
}

void Index::ReleaseProcessPins() {
  if (central_writer()) return;  // a service's pages are its clients'; their lives end them
  const DeadWriter self{node_.id(), node_.incarnation(), node_.process_slot()};
  DropPinPages(node_.id(), &self);
}

void Index::DropPinPages(uint32_t row, const DeadWriter* dead) {
  const uint32_t pages = layout_.h.pin_pages;
  const uint64_t dir = layout_.pin_dir(row);
  // Every page's owner word is read, not only the directory's: a process that died between its
  // claim and its directory bit left a page only the owner word names.
  std::vector<uint64_t> headers(pages);
  for (uint32_t p = 0; p < pages; ++p) headers[p] = layout_.pin_page(row, p);
  std::lock_guard<std::mutex> g(pins_mu_);
  if (!CacheIsTable()) {
    meta_.Invalidate(dir, layout_.pin_dir_words() * 8);
    meta_.InvalidateEach(headers, 8);
  }
  std::vector<uint64_t> lines;
  static constexpr uint64_t kZeros[kPinPageWords] = {};
  for (uint32_t p = 0; p < pages; ++p) {
    const uint64_t owner = meta_.Load(headers[p]);
    const bool listed = meta_.Load(dir + uint64_t{p / 64} * 8) & (uint64_t{1} << (p % 64));
    if (owner == 0 && !listed) continue;
    if (dead != nullptr && (owner == 0 || !dead->Matches(owner))) continue;
    meta_.Write(headers[p] + 8, kZeros, kPinPageBytes - 8);  // whole lines: no stale word survives
    if (listed) SetPinDirBit(row, p, false, &lines);
    meta_.Store(headers[p], 0);
    for (uint64_t line = headers[p]; line < headers[p] + kPinPageBytes; line += 64) lines.push_back(line);
  }
  // This process's own state of those owners goes too (a metadata service's, for a client).
  for (auto it = open_pin_pages_.begin(); it != open_pin_pages_.end();) {
    const bool drop = WriterNode(it->first) == row && (dead == nullptr || dead->Matches(it->first));
    it = drop ? open_pin_pages_.erase(it) : std::next(it);
  }
  for (auto it = held_pins_.begin(); it != held_pins_.end();) {
    const uint64_t owner = it->first.first;
    const bool drop = WriterNode(owner) == row && (dead == nullptr || dead->Matches(owner));
    it = drop ? held_pins_.erase(it) : std::next(it);
  }
  std::sort(lines.begin(), lines.end());
  lines.erase(std::unique(lines.begin(), lines.end()), lines.end());
  meta_.FlushEach(lines, 64);
}

}  // namespace cxlkv::cache
