// PageId allocation with reference counts and generations.
//
// A PageId (u32) names one page (S tokens of one sequence in one layer) for
// as long as it lives, wherever its bytes are. Sealed pages are shared by
// refcount (fork, prefix sharing); an id returns to the free list when its
// count drops to zero, and its generation is bumped so that anything keyed by
// (PageId, generation) — checksums, cached copies — can tell reuse apart.
// The id space is bounded at construction; the per-id tables grow with the
// highest id handed out (doubling), not with the bound, so a generous
// max_pages costs nothing until it is used. Thread-compatible.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "questkv/status.h"

namespace questkv {

using PageId = uint32_t;
inline constexpr PageId kNoPage = 0xffffffffu;

class PageAllocator {
 public:
  explicit PageAllocator(uint32_t max_pages);

  // Called when the tables grow to hold ids [0, pages): the owner grows its
  // own per-id tables alongside. An error refuses the growth.
  using GrowHook = std::function<Status(uint32_t pages)>;
  void SetGrowHook(GrowHook hook) { grow_hook_ = std::move(hook); }

  // A fresh id with refcount 1, or ResourceExhausted when all are live or
  // the tables cannot grow (nothing changes then).
  Result<PageId> Allocate();
  // Adds a reference to a live page.
  void Ref(PageId id);
  // Drops a reference; returns true when it was the last (the id is free).
  bool Unref(PageId id);

  bool live(PageId id) const { return id < refs_.size() && refs_[id] > 0; }
  uint32_t refcount(PageId id) const { return refs_[id]; }
  uint32_t generation(PageId id) const { return generation_[id]; }
  uint32_t live_count() const { return live_; }
  uint32_t capacity() const { return max_pages_; }
  // Ids the tables hold now (ids handed out so far fit below it).
  uint32_t table_size() const { return tables_; }

 private:
  Status Grow(uint32_t need);

  uint32_t max_pages_;
  std::vector<uint32_t> refs_;        // [table_size()]
  std::vector<uint32_t> generation_;  // [table_size()], bumped on free
  std::vector<PageId> free_;          // freed ids, LIFO, so tests see ids reused promptly
  uint32_t fresh_ = 0;                // ids >= this were never handed out
  uint32_t tables_ = 0;               // ids the tables (and the hook's) hold
  uint32_t live_ = 0;
  GrowHook grow_hook_;
};

}  // namespace questkv
