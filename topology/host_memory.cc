#include "topology/host_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <string>

#include "topology/alloc_faults.h"
#include "topology/gpu_probe.h"
#include "topology/hwloc_topology.h"
#include "topology/topology.h"

#if QUESTKV_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace questkv {

namespace {

// Whole OS pages, at least 4096 bytes each (the O_DIRECT alignment), so a
// NUMA binding covers only this region and never a neighbour's page.
std::size_t MappedBytes(std::size_t bytes) {
  const long page_bytes = sysconf(_SC_PAGESIZE);
  const std::size_t unit = std::max<std::size_t>(4096, page_bytes > 0 ? std::size_t(page_bytes) : 0);
  return (bytes + unit - 1) / unit * unit;
}

// The node a placement asks for: the explicit one, else the GPU's, else none.
int TargetNode(const HostPlacement& placement) {
  if (placement.numa_node >= 0) return placement.numa_node;
  const int gpu = CurrentGpu();
  return gpu < 0 ? -1 : GpuNumaNode(gpu);
}

// The topology needed to bind, or none when there is nothing to bind to.
std::optional<HwlocTopology> TopologyFor(int node) {
  if (node < 0) return std::nullopt;
  auto topo = HwlocTopology::Load(/*with_io=*/false);
  if (!topo.ok()) return std::nullopt;
  return std::move(*topo);
}

// Non-strict binding (a preference): a node that fills up spills to another
// instead of failing later, at some first touch deep in the hot path.
bool BindArea(const std::optional<HwlocTopology>& topo, void* data, std::size_t bytes, int node) {
  if (!topo) return false;
  hwloc_obj_t obj = topo->NumaNode(node);
  return obj && hwloc_set_area_membind(topo->get(), data, bytes, obj->nodeset, HWLOC_MEMBIND_BIND,
                                       HWLOC_MEMBIND_BYNODESET) == 0;
}

// Anonymous pages, placed at first touch under the binding set right after.
Result<void*> MapPlain(std::size_t mapped_bytes) {
  void* data = mmap(nullptr, mapped_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED)
    return Status::ResourceExhausted("host region of " + std::to_string(mapped_bytes) +
                                     " bytes: mmap: " + std::strerror(errno));
  return data;
}

#if QUESTKV_HAVE_CUDA

// cudaHostAlloc faults and locks its pages inside the call, so the calling
// thread's memory policy during the call decides their node; a binding set
// afterwards would not move locked pages. Restores the previous policy.
class ScopedThreadMembind {
 public:
  ScopedThreadMembind(const std::optional<HwlocTopology>& topo, int node) : topo_(topo) {
    hwloc_obj_t obj = topo_ ? topo_->NumaNode(node) : nullptr;
    if (!obj) return;
    saved_ = hwloc_bitmap_alloc();
    const int flags = HWLOC_MEMBIND_THREAD | HWLOC_MEMBIND_BYNODESET;
    had_policy_ = hwloc_get_membind(topo_->get(), saved_, &saved_policy_, flags) == 0;
    bound_ = hwloc_set_membind(topo_->get(), obj->nodeset, HWLOC_MEMBIND_BIND, flags) == 0;
  }
  ~ScopedThreadMembind() {
    if (!saved_) return;
    const int flags = HWLOC_MEMBIND_THREAD | HWLOC_MEMBIND_BYNODESET;
    if (bound_) {
      if (had_policy_) {
        hwloc_set_membind(topo_->get(), saved_, saved_policy_, flags);
      } else {
        hwloc_set_membind(topo_->get(), hwloc_topology_get_topology_nodeset(topo_->get()), HWLOC_MEMBIND_DEFAULT,
                          flags);
      }
    }
    hwloc_bitmap_free(saved_);
  }
  ScopedThreadMembind(const ScopedThreadMembind&) = delete;
  ScopedThreadMembind& operator=(const ScopedThreadMembind&) = delete;
  bool bound() const { return bound_; }

 private:
  const std::optional<HwlocTopology>& topo_;
  hwloc_bitmap_t saved_ = nullptr;
  hwloc_membind_policy_t saved_policy_ = HWLOC_MEMBIND_DEFAULT;
  bool had_policy_ = false;
  bool bound_ = false;
};

// Pinned and mapped into the device address space (zero-copy reads by
// kernels), portable so every device sees it as pinned.
Result<void*> AllocPinned(std::size_t mapped_bytes, const std::optional<HwlocTopology>& topo, int node,
                          bool* bound) {
  ScopedThreadMembind membind(topo, node);
  void* data = nullptr;
  const cudaError_t e = cudaHostAlloc(&data, mapped_bytes, cudaHostAllocMapped | cudaHostAllocPortable);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return Status::ResourceExhausted("host region of " + std::to_string(mapped_bytes) +
                                     " bytes: cudaHostAlloc: " + cudaGetErrorString(e));
  }
  *bound = membind.bound();
  return data;
}

void FreeMemory(void* data, std::size_t mapped_bytes, bool pinned) {
  if (pinned) {
    cudaFreeHost(data);
  } else {
    munmap(data, mapped_bytes);
  }
}

#else  // !QUESTKV_HAVE_CUDA

Result<void*> AllocPinned(std::size_t, const std::optional<HwlocTopology>&, int, bool*) {
  return Status::Unimplemented("pinned host memory: built without CUDA");
}

void FreeMemory(void* data, std::size_t mapped_bytes, bool pinned) { munmap(data, mapped_bytes); }

#endif

}  // namespace

Result<HostRegion> HostRegion::Allocate(std::size_t bytes, const HostPlacement& placement) {
  if (AllocFaults::ShouldFail())
    return Status::ResourceExhausted("host region of " + std::to_string(bytes) +
                                     " bytes: allocation failure injected by AllocFaults");
  if (bytes == 0) return Status::InvalidArgument("host region of 0 bytes");
  const std::size_t mapped_bytes = MappedBytes(bytes);
  const int node = TargetNode(placement);
  const std::optional<HwlocTopology> topo = TopologyFor(node);
  HostRegion region;
  region.bytes_ = bytes;
  bool bound = false;
  if (placement.pin_for_gpu && CurrentGpu() >= 0) {
    QKV_ASSIGN_OR_RETURN(region.data_, AllocPinned(mapped_bytes, topo, node, &bound));
    region.pinned_ = true;
  } else {
    QKV_ASSIGN_OR_RETURN(region.data_, MapPlain(mapped_bytes));
    bound = BindArea(topo, region.data_, mapped_bytes, node);
  }
  region.bound_node_ = bound ? node : -1;
  return region;
}

HostRegion::HostRegion(HostRegion&& other) noexcept { *this = std::move(other); }

HostRegion& HostRegion::operator=(HostRegion&& other) noexcept {
  if (this == &other) return *this;
  Release();
  data_ = std::exchange(other.data_, nullptr);
  bytes_ = std::exchange(other.bytes_, 0);
  pinned_ = std::exchange(other.pinned_, false);
  bound_node_ = std::exchange(other.bound_node_, -1);
  return *this;
}

HostRegion::~HostRegion() { Release(); }

void HostRegion::Release() {
  if (data_) FreeMemory(data_, MappedBytes(bytes_), pinned_);
  data_ = nullptr;
  bytes_ = 0;
  pinned_ = false;
  bound_node_ = -1;
}

}  // namespace questkv
