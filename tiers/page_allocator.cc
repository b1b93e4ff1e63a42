#include "tiers/page_allocator.h"

#include <cassert>
#include <string>

namespace questkv {

PageAllocator::PageAllocator(uint32_t max_pages) : refs_(max_pages, 0), generation_(max_pages, 0) {
  free_.reserve(max_pages);
  for (uint32_t i = max_pages; i > 0; --i) free_.push_back(i - 1);
}

Result<PageId> PageAllocator::Allocate() {
  if (free_.empty())
    return Status::ResourceExhausted("all " + std::to_string(refs_.size()) +
                                     " page ids are live (raise max_pages)");
  const PageId id = free_.back();
  free_.pop_back();
  assert(refs_[id] == 0);
  refs_[id] = 1;
  ++live_;
  return id;
}

void PageAllocator::Ref(PageId id) {
  assert(live(id));
  ++refs_[id];
}

bool PageAllocator::Unref(PageId id) {
  assert(live(id));
  if (--refs_[id] > 0) return false;
  ++generation_[id];
  --live_;
  free_.push_back(id);
  return true;
}

}  // namespace questkv
