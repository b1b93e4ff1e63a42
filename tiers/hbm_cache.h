// HbmCache: the "hbm" tier — a fixed arena of head-page slots ([2 (K,V)][S][D]
// each) holding every tail page (pinned) and a cache of sealed head-pages
// (clean copies: eviction never writes back).
//
// The cache is partitioned per (sequence, layer): each partition may hold up
// to an equal share of the unpinned slots, and evicts its own slots before
// anyone else's, so one long sequence cannot evict everyone else. A slot used
// at the current step is never a victim, nor is a pinned (tail) slot.
// Residency is the device-side table of DESIGN.md §3, hbm_slot[PageId][Hkv]
// (-1 when not cached).
//
// Within a partition the victim is chosen by segmented LRU: a slot hit since
// it was filled is protected, up to 3/4 of the partition's slots (or of its
// fair share while it holds fewer; beyond that the least recently hit is
// unprotected again, as the most recent of the unprotected); the least
// recently used unprotected slot goes first, a protected one only when no
// unprotected slot may go. A query
// that pulls in pages once (a Quest topic query: an old span that matters
// again for one step) then displaces its own pages, not the working set the
// recent queries keep hitting. On a Llama-3-8B layer's selections at 128K
// with 4369 slots (bench/cache_policy_sim.cc; results in
// bench/results/2026-11-30-gpu-chained-kernels-eviction.md): 16-28% fewer misses than LRU
// on recent-query steps, 4-13% fewer over all steps (32-256 steps).
//
// Thread-compatible.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "questkv/status.h"
#include "tiers/arena.h"

namespace questkv {

struct HbmStats {
  int64_t hits = 0, misses = 0, evictions = 0, bypasses = 0;
  uint32_t slots_capacity = 0, slots_used = 0, slots_peak = 0, slots_pinned = 0;
};

class HbmCache {
 public:
  static constexpr int32_t kNone = -1;
  // At most this share of a partition's slots is protected (3/4).
  static constexpr uint32_t kProtectedShareNum = 3, kProtectedShareDen = 4;
  static constexpr uint32_t kOrphan = 0;  // holds slots whose partition went away

  // `slots` head-page slots of 2*S*D floats; residency for `pages` x
  // kv_heads at first (GrowPages adds).
  static Result<std::unique_ptr<HbmCache>> Create(uint32_t slots, std::size_t head_page_elems,
                                                  uint32_t pages, int kv_heads);
  // Holds residency for page ids [0, pages) from now on. Throws
  // std::bad_alloc, leaving the table as it was, when memory is short.
  void GrowPages(uint32_t pages) {
    resident_.resize(std::max(resident_.size(), std::size_t(pages) * kv_heads_), kNone);
  }

  // Partitions are named by small integers handed out here.
  uint32_t AddPartition();
  // Evicts the partition's cached slots; its pinned ones move to a shared
  // orphan partition.
  void RemovePartition(uint32_t partition);

  // Slot of (page, head) or kNone.
  int32_t Lookup(uint32_t page, int head) const { return resident_[std::size_t(page) * kv_heads_ + head]; }
  // Marks a resident slot hit at `step`: most recently used, protected (see
  // above), and not a victim this step.
  void Touch(int32_t slot, int64_t step);
  // A slot for (page, head) in `partition`, pinned (tail) or cached (its
  // page not yet hit: unprotected). May evict: first this partition's victim
  // (see above) among its unpinned slots not used at `step`, then that of the
  // partition furthest over its share. ResourceExhausted
  // when nothing can be evicted (the caller may then read from the home in
  // place). The slot's bytes are unspecified.
  Result<int32_t> Insert(uint32_t page, int head, uint32_t partition, int64_t step, bool pinned);
  // Turns a pinned slot into a cached one (a tail page was sealed).
  void Unpin(int32_t slot, int64_t step);
  // Frees every slot of a page (the page died or its data changed).
  void Drop(uint32_t page);

  float* data(int32_t slot) { return arena_->data(uint32_t(slot)); }
  const float* data(int32_t slot) const { return arena_->data(uint32_t(slot)); }
  std::size_t slot_bytes() const { return arena_->slot_bytes(); }

  HbmStats& stats() { return stats_; }
  const HbmStats& stats() const { return stats_; }
  uint32_t partition_slots(uint32_t partition) const { return parts_[partition].count; }

 private:
  struct Slot {
    uint32_t page = 0;
    int32_t prev = kNone, next = kNone;  // its partition's list, head = most recent
    uint32_t partition = 0;
    int64_t last_step = -1;
    uint8_t head = 0;
    bool pinned = false;
    bool guarded = false;  // on the partition's protected list
  };
  struct List {
    int32_t mru = kNone, lru = kNone;
  };
  struct Partition {
    List probation, guarded;  // unprotected / protected slots, each in LRU order
    uint32_t count = 0;  // unpinned slots
    uint32_t guarded_count = 0;  // of which protected
    bool live = false;
  };
  HbmCache(std::unique_ptr<SlotArena> arena, uint32_t max_pages, int kv_heads);
  List& ListOf(const Slot& slot) {
    return slot.guarded ? parts_[slot.partition].guarded : parts_[slot.partition].probation;
  }
  void Link(int32_t slot);
  void Unlink(int32_t slot);
  int32_t VictimIn(uint32_t partition, int64_t step) const;
  int32_t FindVictim(uint32_t partition, int64_t step, bool pinned) const;
  void Evict(int32_t slot);
  uint32_t Share() const;

  std::unique_ptr<SlotArena> arena_;
  int kv_heads_;
  std::vector<int32_t> resident_;  // [page ids held * Hkv]
  std::vector<Slot> slots_;
  std::vector<Partition> parts_;
  std::vector<uint32_t> free_parts_;
  uint32_t live_parts_ = 0;
  HbmStats stats_;
};

}  // namespace questkv
