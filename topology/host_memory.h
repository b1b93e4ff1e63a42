// Host memory regions for the tiers: one allocation made at start-up,
// 4096-byte aligned (O_DIRECT), bound to a NUMA node through hwloc, and —
// when the CUDA backend is built and a GPU is present — pinned and mapped
// (cudaHostAlloc) so the GPU can read it directly (zero-copy gather).
// Move-only owner; freeing happens in the destructor.
#pragma once

#include <cstddef>

#include "questkv/status.h"

namespace questkv {

struct HostPlacement {
  int numa_node = -1;     // -1: the GPU's node when known, else no binding
  bool pin_for_gpu = true;  // cudaHostAlloc(mapped) when CUDA and a GPU exist
};

class HostRegion {
 public:
  // ResourceExhausted when the memory cannot be had; binding failures are not
  // errors (reported by bound_node() == -1).
  static Result<HostRegion> Allocate(std::size_t bytes, const HostPlacement& placement);
  HostRegion() = default;
  HostRegion(HostRegion&& other) noexcept;
  HostRegion& operator=(HostRegion&& other) noexcept;
  HostRegion(const HostRegion&) = delete;
  HostRegion& operator=(const HostRegion&) = delete;
  ~HostRegion();

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  bool pinned() const { return pinned_; }
  int bound_node() const { return bound_node_; }

 private:
  void Release();
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  bool pinned_ = false;
  int bound_node_ = -1;
};

}  // namespace questkv
