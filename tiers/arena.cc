#include "tiers/arena.h"

#include "topology/alloc_faults.h"

#include <cassert>
#include <new>
#include <string>

namespace questkv {

Result<std::unique_ptr<SlotArena>> SlotArena::Create(std::size_t slot_elems, uint32_t capacity, const char* name,
                                                     const HostPlacement& placement) {
  if (slot_elems == 0 || capacity == 0)
    return Status::InvalidArgument(std::string(name) + ": arena needs >= 1 slot of >= 1 element");
  auto region = HostRegion::Allocate(slot_elems * capacity * sizeof(float), placement);
  if (!region.ok())
    return Status::ResourceExhausted(std::string(name) + ": cannot reserve " +
                                     std::to_string(slot_elems * capacity * sizeof(float)) +
                                     " bytes: " + region.status().message());
  return std::unique_ptr<SlotArena>(new SlotArena(std::move(*region), slot_elems, capacity, name));
}

SlotArena::SlotArena(HostRegion region, std::size_t slot_elems, uint32_t capacity, const char* name)
    : region_(std::move(region)), slot_elems_(slot_elems), capacity_(capacity), name_(name) {}

Result<uint32_t> SlotArena::Allocate() {
  if (AllocFaults::ShouldFail())
    return Status::ResourceExhausted(std::string(name_) + ": slot allocation failed (injected)");
  uint32_t slot;
  if (!free_.empty()) {
    slot = free_.back();
    free_.pop_back();
  } else if (fresh_ < capacity_) {
    try {
      in_use_.push_back(0);
      // Free never allocates: every slot handed out fits the free list.
      if (free_.capacity() < in_use_.size()) free_.reserve(in_use_.capacity());
    } catch (const std::bad_alloc&) {
      return Status::ResourceExhausted(std::string(name_) + ": out of memory for the bookkeeping of slot " +
                                       std::to_string(fresh_));
    }
    slot = fresh_++;
  } else {
    return Status::ResourceExhausted(std::string(name_) + ": all " + std::to_string(capacity_) + " slots of " +
                                     std::to_string(slot_bytes()) + " bytes are in use");
  }
  in_use_[slot] = 1;
  if (used() > used_peak_) used_peak_ = used();
  return slot;
}

void SlotArena::Free(uint32_t slot) {
  assert(slot < capacity_ && in_use_[slot] && "double free of an arena slot");
  in_use_[slot] = 0;
  free_.push_back(slot);
}

Result<std::unique_ptr<SummarySlab>> SummarySlab::Create(uint32_t max_pages, int kv_heads, int head_dim) {
  const std::size_t elems = 2 * std::size_t(kv_heads) * head_dim;
  auto region = HostRegion::Allocate(elems * max_pages * sizeof(float), {.numa_node = -1, .pin_for_gpu = false});
  if (!region.ok())
    return Status::ResourceExhausted("summary slab: cannot reserve " + std::to_string(elems * max_pages * sizeof(float)) +
                                     " bytes: " + region.status().message());
  return std::unique_ptr<SummarySlab>(new SummarySlab(std::move(*region), elems));
}

}  // namespace questkv
