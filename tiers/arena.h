// Fixed-size slot arenas: the CPU backend's bounded "hbm" page arena and the
// summary slab. Memory is reserved once at construction (the OS commits it on
// first touch); running out of slots is ResourceExhausted, never growth. The
// slot bookkeeping grows with the slots handed out, not with the capacity.
// Thread-compatible.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "questkv/status.h"
#include "topology/host_memory.h"

namespace questkv {

// `capacity` slots of `slot_elems` floats each, handed out by a free list.
class SlotArena {
 public:
  // The memory is one HostRegion (4096-aligned, NUMA-bound, pinned for the
  // GPU when asked and possible). ResourceExhausted when it cannot be had.
  static Result<std::unique_ptr<SlotArena>> Create(std::size_t slot_elems, uint32_t capacity, const char* name,
                                                   const HostPlacement& placement = {.numa_node = -1,
                                                                                     .pin_for_gpu = false});

  Result<uint32_t> Allocate();
  void Free(uint32_t slot);

  float* data(uint32_t slot) { return base() + std::size_t(slot) * slot_elems_; }
  const float* data(uint32_t slot) const { return base() + std::size_t(slot) * slot_elems_; }
  float* base() const { return static_cast<float*>(region_.data()); }
  const HostRegion& region() const { return region_; }
  std::size_t bytes() const { return slot_bytes() * capacity_; }
  uint32_t capacity() const { return capacity_; }
  uint32_t used() const { return fresh_ - uint32_t(free_.size()); }
  uint32_t used_peak() const { return used_peak_; }
  std::size_t slot_bytes() const { return slot_elems_ * sizeof(float); }

 private:
  SlotArena(HostRegion region, std::size_t slot_elems, uint32_t capacity, const char* name);
  HostRegion region_;
  std::size_t slot_elems_;
  uint32_t capacity_;
  uint32_t used_peak_ = 0;
  uint32_t fresh_ = 0;            // slots >= this were never handed out
  std::vector<uint32_t> free_;    // handed out before, free again (LIFO)
  std::vector<uint8_t> in_use_;   // [fresh_]
  const char* name_;
};

// Per-PageId key summaries, [PageId][Hkv][2 (min,max)][D], resident always
// (DESIGN.md §3). Indexed directly by PageId, so it needs no allocator.
class SummarySlab {
 public:
  static Result<std::unique_ptr<SummarySlab>> Create(uint32_t max_pages, int kv_heads, int head_dim);
  float* page(uint32_t id) { return base() + std::size_t(id) * elems_; }
  const float* page(uint32_t id) const { return base() + std::size_t(id) * elems_; }
  float* base() const { return static_cast<float*>(region_.data()); }
  std::size_t page_bytes() const { return elems_ * sizeof(float); }

 private:
  SummarySlab(HostRegion region, std::size_t elems) : region_(std::move(region)), elems_(elems) {}
  HostRegion region_;
  std::size_t elems_;
};

}  // namespace questkv
