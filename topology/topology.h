// Machine topology from hwloc: what the runtime binds memory and threads to.
// Discovery is read-only and thread-safe (each call builds its own topology).
#pragma once

#include <string>

#include "runtime/status.h"

namespace questkv {

struct TopologySummary {
  int numa_nodes = 0;
  int cores = 0;
  int hardware_threads = 0;
  std::string cpu_model;
  // "1 NUMA node, 2 cores, 2 threads (AMD EPYC ...)"
  std::string ToString() const;
};

// IOError when hwloc cannot load the topology.
Result<TopologySummary> DiscoverTopology();

}  // namespace questkv
