#include "topology/topology.h"

#include <hwloc.h>

namespace questkv {

std::string TopologySummary::ToString() const {
  std::string s = std::to_string(numa_nodes) + (numa_nodes == 1 ? " NUMA node, " : " NUMA nodes, ") +
                  std::to_string(cores) + " cores, " + std::to_string(hardware_threads) + " threads";
  if (!cpu_model.empty()) s += " (" + cpu_model + ")";
  return s;
}

Result<TopologySummary> DiscoverTopology() {
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0) return Status::IOError("hwloc_topology_init failed");
  if (hwloc_topology_load(topo) != 0) {
    hwloc_topology_destroy(topo);
    return Status::IOError("hwloc_topology_load failed");
  }
  TopologySummary s;
  s.numa_nodes = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
  s.cores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
  s.hardware_threads = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PU);
  if (hwloc_obj_t pkg = hwloc_get_obj_by_type(topo, HWLOC_OBJ_PACKAGE, 0))
    if (const char* model = hwloc_obj_get_info_by_name(pkg, "CPUModel")) s.cpu_model = model;
  hwloc_topology_destroy(topo);
  return s;
}

}  // namespace questkv
