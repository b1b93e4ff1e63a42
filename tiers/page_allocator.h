// PageId allocation with reference counts and generations.
//
// A PageId (u32) names one page (S tokens of one sequence in one layer) for
// as long as it lives, wherever its bytes are. Sealed pages are shared by
// refcount (fork, prefix sharing); an id returns to the free list when its
// count drops to zero, and its generation is bumped so that anything keyed by
// (PageId, generation) — checksums, cached copies — can tell reuse apart.
// The id space is bounded at construction. Thread-compatible.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/status.h"

namespace questkv {

using PageId = uint32_t;
inline constexpr PageId kNoPage = 0xffffffffu;

class PageAllocator {
 public:
  explicit PageAllocator(uint32_t max_pages);

  // A fresh id with refcount 1, or ResourceExhausted when all are live.
  Result<PageId> Allocate();
  // Adds a reference to a live page.
  void Ref(PageId id);
  // Drops a reference; returns true when it was the last (the id is free).
  bool Unref(PageId id);

  bool live(PageId id) const { return id < refs_.size() && refs_[id] > 0; }
  uint32_t refcount(PageId id) const { return refs_[id]; }
  uint32_t generation(PageId id) const { return generation_[id]; }
  uint32_t live_count() const { return live_; }
  uint32_t capacity() const { return uint32_t(refs_.size()); }

 private:
  std::vector<uint32_t> refs_;        // [max_pages]
  std::vector<uint32_t> generation_;  // [max_pages], bumped on free
  std::vector<PageId> free_;          // LIFO, so tests see ids reused promptly
  uint32_t live_ = 0;
};

}  // namespace questkv
