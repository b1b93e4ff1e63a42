// Machine topology from hwloc: what the runtime binds memory and threads to.
// NUMA nodes with their memory and cores, the GPUs (located by PCI bus id)
// and the block devices, each with the NUMA node it hangs off when known.
// Discovery is read-only and thread-safe (each call builds its own topology).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "questkv/status.h"

namespace questkv {

struct NumaNodeInfo {
  int os_index = -1;          // the kernel's node number
  uint64_t memory_bytes = 0;  // local memory
  int cores = 0;
  int hardware_threads = 0;
};

struct GpuInfo {
  int device = -1;            // CUDA ordinal
  std::string pci_bus_id;     // "0000:65:00.0"
  std::string name;
  uint64_t memory_bytes = 0;
  int numa_node = -1;         // -1: unknown
};

struct BlockDeviceInfo {
  std::string name;           // "nvme0n1", "vda"
  uint64_t size_bytes = 0;    // 0: unknown
  int numa_node = -1;         // -1: unknown (virtio disks often have no PCI locality)
  std::string found_by;       // "hwloc", or "sysfs" when hwloc listed no block device
};

struct TopologySummary {
  int numa_nodes = 0;
  int cores = 0;
  int hardware_threads = 0;
  std::string cpu_model;
  std::vector<NumaNodeInfo> nodes;
  std::vector<GpuInfo> gpus;
  std::string gpus_none_reason;  // why `gpus` is empty: "built without CUDA", ...
  std::vector<BlockDeviceInfo> block_devices;

  // "1 NUMA node, 2 cores, 2 threads (AMD EPYC ...)"
  std::string ToString() const;
  // Several lines, one per node, GPU and block device, for `questkv probe`.
  std::string Describe() const;
};

// IOError when hwloc cannot load the topology. A machine without a GPU (or a
// build without CUDA) is not an error: `gpus` is empty and says why.
Result<TopologySummary> DiscoverTopology();

// Binds the calling thread's CPUs to NUMA node `node` (its OS index), for I/O
// and copy threads that should run beside the GPU's memory. OK and a no-op
// when node < 0 or the machine has a single node; InvalidArgument when no such
// node exists; IOError when hwloc or the OS refuses the binding.
Status BindCurrentThreadToNode(int node);

// The NUMA node (OS index) of CUDA device `device`, found by its PCI bus id;
// -1 when unknown, without CUDA, or without such a GPU.
int GpuNumaNode(int device);

}  // namespace questkv
