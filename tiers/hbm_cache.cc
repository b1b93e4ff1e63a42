#include "tiers/hbm_cache.h"

#include <algorithm>
#include <cassert>

namespace questkv {

Result<std::unique_ptr<HbmCache>> HbmCache::Create(uint32_t slots, std::size_t head_page_elems, uint32_t pages,
                                                   int kv_heads) {
  QKV_ASSIGN_OR_RETURN(auto arena, SlotArena::Create(head_page_elems, slots, "hbm"));
  return std::unique_ptr<HbmCache>(new HbmCache(std::move(arena), pages, kv_heads));
}

HbmCache::HbmCache(std::unique_ptr<SlotArena> arena, uint32_t pages, int kv_heads)
    : arena_(std::move(arena)), kv_heads_(kv_heads), resident_(std::size_t(pages) * kv_heads, kNone),
      slots_(arena_->capacity()) {
  stats_.slots_capacity = arena_->capacity();
  parts_.emplace_back();
  parts_[kOrphan].live = true;  // never counted in live_parts_ (no share of its own)
}

uint32_t HbmCache::AddPartition() {
  uint32_t id;
  if (!free_parts_.empty()) {
    id = free_parts_.back();
    free_parts_.pop_back();
  } else {
    id = uint32_t(parts_.size());
    parts_.emplace_back();
  }
  parts_[id] = Partition{};
  parts_[id].live = true;
  ++live_parts_;
  return id;
}

// A partition's cached head-pages may belong to pages other sequences still
// share: they are clean, so they are simply evicted. A pinned slot (a full
// page still awaiting its seal, shared by a fork) moves to the orphan
// partition, where it lands when unpinned.
void HbmCache::RemovePartition(uint32_t partition) {
  assert(partition != kOrphan && parts_[partition].live);
  for (List* l : {&parts_[partition].probation, &parts_[partition].guarded})
    while (l->lru != kNone) Evict(l->lru);
  for (Slot& slot : slots_)
    if (slot.pinned && slot.partition == partition) slot.partition = kOrphan;
  parts_[partition].live = false;
  free_parts_.push_back(partition);
  --live_parts_;
}

uint32_t HbmCache::Share() const {
  const uint32_t unpinned = stats_.slots_capacity - stats_.slots_pinned;
  return live_parts_ ? (unpinned + live_parts_ - 1) / live_parts_ : unpinned;
}

// Most recent end of its list (by slot.guarded).
void HbmCache::Link(int32_t s) {
  Slot& slot = slots_[s];
  List& l = ListOf(slot);
  slot.prev = kNone;
  slot.next = l.mru;
  if (l.mru != kNone) slots_[l.mru].prev = s;
  l.mru = s;
  if (l.lru == kNone) l.lru = s;
  ++parts_[slot.partition].count;
  parts_[slot.partition].guarded_count += slot.guarded;
}

void HbmCache::Unlink(int32_t s) {
  Slot& slot = slots_[s];
  List& l = ListOf(slot);
  if (slot.prev != kNone) slots_[slot.prev].next = slot.next; else l.mru = slot.next;
  if (slot.next != kNone) slots_[slot.next].prev = slot.prev; else l.lru = slot.prev;
  slot.prev = slot.next = kNone;
  --parts_[slot.partition].count;
  parts_[slot.partition].guarded_count -= slot.guarded;
}

void HbmCache::Touch(int32_t s, int64_t step) {
  Slot& slot = slots_[s];
  slot.last_step = step;
  if (slot.pinned) return;
  Unlink(s);
  slot.guarded = true;
  Link(s);
  // Over the protected share (of its slots, or of its fair share while it
  // holds fewer): the least recently hit becomes the most recent unprotected.
  Partition& p = parts_[slot.partition];
  if (p.guarded_count * kProtectedShareDen > std::max(p.count, Share()) * kProtectedShareNum) {
    const int32_t demoted = p.guarded.lru;
    Unlink(demoted);
    slots_[demoted].guarded = false;
    Link(demoted);
  }
}

// Each list's LRU end holds its oldest use (if even that was used at `step`,
// all of that list was): the unprotected list's first, then the protected.
int32_t HbmCache::VictimIn(uint32_t partition, int64_t step) const {
  const Partition& p = parts_[partition];
  for (const int32_t s : {p.probation.lru, p.guarded.lru})
    if (s != kNone && slots_[s].last_step < step) return s;
  return kNone;
}

// A partition at its share evicts its own victim. One under its share (the
// arena is full) takes from the largest partition over its share, falling
// back to its own; a tail (pinned) may take from anyone.
int32_t HbmCache::FindVictim(uint32_t partition, int64_t step, bool pinned) const {
  const uint32_t share = Share();
  if (!pinned && parts_[partition].count >= share) return VictimIn(partition, step);
  int32_t best = kNone;
  uint32_t best_count = 0;
  for (uint32_t p = 0; p < parts_.size(); ++p) {
    const Partition& part = parts_[p];
    if (!part.live || part.count <= best_count) continue;
    if (!(pinned || p == partition || part.count > share)) continue;
    if (const int32_t v = VictimIn(p, step); v != kNone) {
      best = v;
      best_count = part.count;
    }
  }
  return best;
}

void HbmCache::Evict(int32_t s) {
  Slot& slot = slots_[s];
  Unlink(s);
  resident_[std::size_t(slot.page) * kv_heads_ + slot.head] = kNone;
  arena_->Free(uint32_t(s));
  --stats_.slots_used;
  ++stats_.evictions;
}

Result<int32_t> HbmCache::Insert(uint32_t page, int head, uint32_t partition, int64_t step, bool pinned) {
  assert(Lookup(page, head) == kNone);
  const bool full = arena_->used() == arena_->capacity();
  if (full || (!pinned && parts_[partition].count >= Share())) {
    const int32_t victim = FindVictim(partition, step, pinned);
    if (victim == kNone)
      return Status::ResourceExhausted("hbm: no evictable head-page slot (of " +
                                       std::to_string(stats_.slots_capacity) +
                                       ", the rest pinned or used this step); raise the hbm budget");
    Evict(victim);
  }
  auto got = arena_->Allocate();
  if (!got.ok()) return got.status();
  const int32_t s = int32_t(*got);
  slots_[s] = Slot{page, kNone, kNone, partition, step, uint8_t(head), pinned, false};
  if (pinned) {
    ++stats_.slots_pinned;
  } else {
    Link(s);
  }
  resident_[std::size_t(page) * kv_heads_ + head] = s;
  if (++stats_.slots_used > stats_.slots_peak) stats_.slots_peak = stats_.slots_used;
  return s;
}

void HbmCache::Unpin(int32_t s, int64_t step) {
  Slot& slot = slots_[s];
  assert(slot.pinned);
  slot.pinned = false;
  slot.guarded = false;
  // Most recent in the LRU order, but not "used this step": only a selection
  // protects a slot from eviction.
  slot.last_step = step - 1;
  --stats_.slots_pinned;
  Link(s);
}

void HbmCache::Drop(uint32_t page) {
  for (int h = 0; h < kv_heads_; ++h) {
    const int32_t s = resident_[std::size_t(page) * kv_heads_ + h];
    if (s == kNone) continue;
    Slot& slot = slots_[s];
    if (slot.pinned) {
      --stats_.slots_pinned;
    } else {
      Unlink(s);
    }
    resident_[std::size_t(page) * kv_heads_ + h] = kNone;
    arena_->Free(uint32_t(s));
    --stats_.slots_used;
  }
}

}  // namespace questkv
