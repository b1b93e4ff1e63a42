// Internal to topology/: one loaded hwloc topology, owned and released by
// RAII, so discovery, thread binding and memory binding load it one way.
// Not thread-safe; each caller loads its own.
#pragma once

#include <hwloc.h>

#include "questkv/status.h"

namespace questkv {

class HwlocTopology {
 public:
  // IOError when hwloc cannot build the topology. with_io adds PCI and OS
  // devices (GPUs, disks), which costs a scan of sysfs.
  static Result<HwlocTopology> Load(bool with_io);
  HwlocTopology(HwlocTopology&& other) noexcept : topo_(other.topo_) { other.topo_ = nullptr; }
  HwlocTopology& operator=(HwlocTopology&& other) noexcept;
  HwlocTopology(const HwlocTopology&) = delete;
  HwlocTopology& operator=(const HwlocTopology&) = delete;
  ~HwlocTopology();

  hwloc_topology_t get() const { return topo_; }
  int numa_nodes() const { return hwloc_get_nbobjs_by_type(topo_, HWLOC_OBJ_NUMANODE); }
  // The NUMA node whose OS index is `os_index`, or null.
  hwloc_obj_t NumaNode(int os_index) const;
  // The NUMA node an object (a PCI or OS device, say) is local to: its OS
  // index when its nearest CPU-side ancestor covers exactly one node, else -1.
  int LocalNode(hwloc_obj_t obj) const;

 private:
  explicit HwlocTopology(hwloc_topology_t topo) : topo_(topo) {}
  hwloc_topology_t topo_ = nullptr;
};

}  // namespace questkv
