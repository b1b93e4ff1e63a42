#include "tiers/page_allocator.h"

#include <algorithm>
#include <cassert>
#include <new>
#include <string>

namespace questkv {

PageAllocator::PageAllocator(uint32_t max_pages) : max_pages_(max_pages) {}

Status PageAllocator::Grow(uint32_t need) {
  const uint32_t size = uint32_t(std::min<uint64_t>(max_pages_, std::max<uint64_t>({need, 2 * uint64_t(tables_), 64})));
  try {
    free_.reserve(size);  // every id may be freed at once
    refs_.resize(size, 0);
    generation_.resize(size, 0);
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("page tables: cannot grow to " + std::to_string(size) + " page ids (of max_pages " +
                                     std::to_string(max_pages_) + "): out of memory");
  }
  if (grow_hook_) QKV_RETURN_IF_ERROR(grow_hook_(size));
  tables_ = size;
  return Status::Ok();
}

Result<PageId> PageAllocator::Allocate() {
  PageId id;
  if (!free_.empty()) {
    id = free_.back();
  } else if (fresh_ < max_pages_) {
    id = fresh_;
    if (id >= tables_) QKV_RETURN_IF_ERROR(Grow(id + 1));
  } else {
    return Status::ResourceExhausted("all " + std::to_string(max_pages_) + " page ids are live (raise max_pages)");
  }
  if (free_.empty()) {
    ++fresh_;
  } else {
    free_.pop_back();
  }
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
  free_.push_back(id);  // never reallocates: reserved to the table size
  return true;
}

}  // namespace questkv
