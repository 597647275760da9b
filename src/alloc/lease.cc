// Allocator: per-node chunk leases (one-chunk objects without the global lock).
#include "alloc/allocator.h"

namespace cxlkv::alloc {

// ---- chunk leases ----------------------------------------------------------------------

uint64_t Allocator::LeaseWord() const {
  return OwnerWord{ChunkKind::kLeased, node_.id(), Inc20(node_.incarnation()), 0}.Encode();
}

void Allocator::NoteLeaseLine(uint32_t region, uint64_t first) {
  for (const ChunkRef& l : lease_hint_) {
    if (l.region == region && l.chunk == first) return;
  }
  lease_hint_.push_back(ChunkRef{region, first});
}

Result<bool> Allocator::TakeFromLeaseLocked(ChunkRef* out) {
  const uint64_t free_word = LeaseWord();
  const uint32_t life20 = Inc20(node_.incarnation());
  const uint64_t object = OwnerWord{ChunkKind::kLeasedObject, node_.id(), life20, 1}.Encode();
  for (size_t i = 0; i < lease_hint_.size();) {
    const ChunkRef line = lease_hint_[i];
    const ChunkTableLayout& t = tables_[line.region];
    auto& m = meta(line.region);
    // P2: another process of this node (behind its own cache in the simulator) may have
    // written this line last. No other node writes it while it is leased.
    m.Invalidate(t.owner(line.chunk), kLeaseLineChunks * 8);
    for (uint64_t k = 0; k < kLeaseLineChunks; ++k) {
      const uint64_t off = t.owner(line.chunk + k);
      if (m.Load(off) != free_word) continue;
      // The word is this life's lease; after a pause past the lease it may be another node's.
      CXLKV_RETURN_IF_ERROR(FenceOwnStore("whole-chunk allocation", life20));
      m.Store(off, object);
      m.Flush(off, 8);  // P1: frees, recovery and `check` on other nodes read it
      *out = ChunkRef{line.region, line.chunk + k};
      return true;
    }
    lease_hint_.erase(lease_hint_.begin() + static_cast<std::ptrdiff_t>(i));  // used up
  }
  return false;
}

void Allocator::ScanLeaseLocked() {
  const uint64_t free_word = LeaseWord();
  for (uint32_t r = 0; r < regions_.size(); ++r) {
    const ChunkTableLayout& t = tables_[r];
    if (!t.valid()) continue;
    auto& m = meta(r);
    const uint64_t lines = t.chunks() / kLeaseLineChunks;
    for (uint64_t l = 0; l < lines; ++l) {
      const uint64_t first = l * kLeaseLineChunks;
      m.Invalidate(t.owner(first), kLeaseLineChunks * 8);
      for (uint64_t k = 0; k < kLeaseLineChunks; ++k) {
        if (m.Load(t.owner(first + k)) == free_word) {
          NoteLeaseLine(r, first);
          break;
        }
      }
    }
  }
}

Status Allocator::RefillLeaseLocked(uint64_t lines) {
  bool first_refill = false;
  if (!lease_scanned_) {
    // Once per process: lines of this node's lease that exited processes of the node left.
    lease_scanned_ = true;
    ScanLeaseLocked();
    if (!lease_hint_.empty()) return Status::Ok();
    first_refill = true;
  }
  CXLKV_RETURN_IF_ERROR(LockAllocator());
  const uint64_t word = LeaseWord();
  uint64_t taken = 0;
  if (first_refill) {
    // What this node's earlier lives still lease (a process killed, or paused past its lease,
    // with no recoverer about): taken over before anything new is leased.
    taken = SettleNodeLeasesLocked(/*adopt=*/true);
  }
  const uint32_t n = static_cast<uint32_t>(regions_.size());
  const uint32_t start = next_region_.fetch_add(1) % n;  // interleave leases across devices
  for (uint32_t i = 0; i < n && taken < lines; ++i) {
    const uint32_t r = (start + i) % n;
    const ChunkTableLayout& t = tables_[r];
    if (!t.valid()) continue;
    uint64_t bits = 0;
    for (uint64_t first = 0; first + kLeaseLineChunks <= t.chunks() && taken < lines; first += kLeaseLineChunks) {
      if (first % 64 == 0) bits = meta(r).Fetch(t.bitmap_word(first));  // P2: others allocate
      if ((bits >> (first % 64)) & 0xff) continue;  // a line with any chunk in use is not leasable
      // One intent per line: every word kLeased with our life, the bits set (P4 via the intent).
      CommitLocked(r, IntentOp::kLease, first, kLeaseLineChunks, word);
      bits |= uint64_t{0xff} << (first % 64);
      NoteLeaseLine(r, first);
      ++taken;
    }
  }
  UnlockAllocator();
  if (taken == 0) return NoSpace("no wholly free line of " + std::to_string(kLeaseLineChunks) + " chunks to lease");
  return Status::Ok();
}

bool Allocator::ReturnLineIfFreeLocked(ChunkRef line, uint64_t free_word) {
  const ChunkTableLayout& t = tables_[line.region];
  auto& m = meta(line.region);
  m.Invalidate(t.owner(line.chunk), kLeaseLineChunks * 8);
  for (uint64_t k = 0; k < kLeaseLineChunks; ++k) {
    if (m.Load(t.owner(line.chunk + k)) != free_word) return false;
  }
  if (!LockAllocator().ok()) return false;
  // We hold heap_mu: no process of this node writes the line meanwhile, and no other node
  // writes a leased line. The lock holder is now its writer (the intent frees all 8).
  CommitLocked(line.region, IntentOp::kFree, line.chunk, kLeaseLineChunks, 0);
  UnlockAllocator();
  return true;
}

Status Allocator::FreeLeasedLocked(ChunkRef chunk, OwnerWord w) {
  const ChunkTableLayout& t = tables_[chunk.region];
  auto& m = meta(chunk.region);
  const uint64_t off = t.owner(chunk.chunk);
  m.Invalidate(t.owner(chunk.chunk / kLeaseLineChunks * kLeaseLineChunks), kLeaseLineChunks * 8);
  if (m.Load(off) != w.Encode()) return InvalidArgument("whole-chunk object is not allocated (double free?)");
  CXLKV_RETURN_IF_ERROR(FenceOwnStore("whole-chunk free", w.incarnation));
  const uint64_t free_word = LeaseWord();
  m.Store(off, free_word);
  m.Flush(off, 8);  // P1: back in the lease
  const ChunkRef line{chunk.region, chunk.chunk / kLeaseLineChunks * kLeaseLineChunks};
  // Keep about one refill's worth of lines; a line wholly free beyond that goes back to the
  // global pool (whole lines only: a line is leased whole or not at all, P5).
  uint64_t others = 0;
  for (const ChunkRef& l : lease_hint_) others += !(l.region == line.region && l.chunk == line.chunk);
  if (others >= lease_lines_ && ReturnLineIfFreeLocked(line, free_word)) {
    for (size_t i = 0; i < lease_hint_.size(); ++i) {
      if (lease_hint_[i].region == line.region && lease_hint_[i].chunk == line.chunk) {
        lease_hint_.erase(lease_hint_.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
    }
    return Status::Ok();
  }
  NoteLeaseLine(line.region, line.chunk);
  return Status::Ok();
}


void Allocator::ReturnFreeLeaseLinesLocked() {
  const uint64_t free_word = LeaseWord();
  for (size_t i = 0; i < lease_hint_.size();) {
    if (ReturnLineIfFreeLocked(lease_hint_[i], free_word)) {
      lease_hint_.erase(lease_hint_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
}

void Allocator::EndLeaseLineLocked(uint32_t r, uint64_t first, uint64_t life) {
  CommitLocked(r, IntentOp::kEndLease, first, kLeaseLineChunks, life);
}

uint64_t Allocator::SettleNodeLeasesLocked(bool adopt) {
  const uint32_t me = node_.id(), life20 = Inc20(node_.incarnation());
  const uint64_t mine = LeaseWord();
  uint64_t adopted = 0;
  for (uint32_t r = 0; r < regions_.size(); ++r) {
    const ChunkTableLayout& t = tables_[r];
    if (!t.valid()) continue;
    auto& m = meta(r);
    for (uint64_t first = 0; first + kLeaseLineChunks <= t.chunks(); first += kLeaseLineChunks) {
      // At most one pass per life the line names (one, unless the table was corrupted).
      for (uint64_t pass = 0; pass < kLeaseLineChunks; ++pass) {
        m.Invalidate(t.owner(first), kLeaseLineChunks * 8);  // P2: the lessee wrote it
        OwnerWord held{};
        bool found = false, whole = true;
        for (uint64_t k = 0; k < kLeaseLineChunks; ++k) {
          const OwnerWord w = OwnerWord::Decode(m.Load(t.owner(first + k)));
          const bool leased = (w.kind == ChunkKind::kLeased || w.kind == ChunkKind::kLeasedObject) && w.node == me &&
                              (!adopt || w.incarnation != life20);
          if (leased && !found) held = w;
          found = found || leased;
          whole = whole && w.kind == ChunkKind::kLeased && w.node == me && w.incarnation == held.incarnation;
        }
        if (!found) break;
        const uint64_t life = OwnerWord{ChunkKind::kLeased, me, held.incarnation, 0}.Encode();
        if (adopt && whole) {
          // Wholly free in an ended life's lease: this life's now (one intent, as a new lease).
          CommitLocked(r, IntentOp::kLease, first, kLeaseLineChunks, mine);
          NoteLeaseLine(r, first);
          ++adopted;
          break;
        }
        EndLeaseLineLocked(r, first, life);
      }
    }
  }
  if (!adopt) lease_hint_.clear();
  return adopted;
}

void Allocator::EndLease() {
  if (!LeaseAllowed()) return;
  sync::LockRobust(&node_.local().header().heap_mu);
  // A node that leases nothing (the common short-lived client) takes no lock trip.
  bool holds = false;
  const uint32_t me = node_.id();
  for (uint32_t r = 0; r < regions_.size() && !holds; ++r) {
    const ChunkTableLayout& t = tables_[r];
    if (!t.valid()) continue;
    for (uint64_t first = 0; first + kLeaseLineChunks <= t.chunks() && !holds; first += kLeaseLineChunks) {
      meta(r).Invalidate(t.owner(first), kLeaseLineChunks * 8);
      for (uint64_t k = 0; k < kLeaseLineChunks && !holds; ++k) {
        const OwnerWord w = OwnerWord::Decode(meta(r).Load(t.owner(first + k)));
        holds = (w.kind == ChunkKind::kLeased || w.kind == ChunkKind::kLeasedObject) && w.node == me;
      }
    }
  }
  if (holds && LockAllocator().ok()) {
    (void)SettleNodeLeasesLocked(/*adopt=*/false);
    UnlockAllocator();
  }
  pthread_mutex_unlock(&node_.local().header().heap_mu);
}

void Allocator::ReturnLease() {
  sync::LockRobust(&node_.local().header().heap_mu);
  if (!lease_hint_.empty()) ReturnFreeLeaseLinesLocked();
  pthread_mutex_unlock(&node_.local().header().heap_mu);
}

}  // namespace cxlkv::alloc
