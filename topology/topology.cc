#include "topology/topology.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "topology/gpu_probe.h"
#include "topology/hwloc_topology.h"

namespace questkv {

// ---- HwlocTopology ------------------------------------------------------------

Result<HwlocTopology> HwlocTopology::Load(bool with_io) {
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0) return Status::IOError("hwloc_topology_init failed");
  if (with_io) hwloc_topology_set_io_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  if (hwloc_topology_load(topo) != 0) {
    hwloc_topology_destroy(topo);
    return Status::IOError("hwloc_topology_load failed");
  }
  return HwlocTopology(topo);
}

HwlocTopology& HwlocTopology::operator=(HwlocTopology&& other) noexcept {
  if (this != &other) {
    if (topo_) hwloc_topology_destroy(topo_);
    topo_ = other.topo_;
    other.topo_ = nullptr;
  }
  return *this;
}

HwlocTopology::~HwlocTopology() {
  if (topo_) hwloc_topology_destroy(topo_);
}

hwloc_obj_t HwlocTopology::NumaNode(int os_index) const {
  if (os_index < 0) return nullptr;
  return hwloc_get_numanode_obj_by_os_index(topo_, unsigned(os_index));
}

int HwlocTopology::LocalNode(hwloc_obj_t obj) const {
  hwloc_obj_t cpu_side = hwloc_get_non_io_ancestor_obj(topo_, obj);
  if (!cpu_side || !cpu_side->nodeset || hwloc_bitmap_weight(cpu_side->nodeset) != 1) return -1;
  return hwloc_bitmap_first(cpu_side->nodeset);
}

// ---- discovery ----------------------------------------------------------------

namespace {

std::string Gib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GiB", double(bytes) / double(uint64_t(1) << 30));
  return buf;
}

std::string NodeText(int node) { return node < 0 ? "NUMA node unknown" : "NUMA node " + std::to_string(node); }

// First integer in a sysfs file, or `fallback` when it cannot be read.
int64_t ReadSysfsInt(const std::filesystem::path& path, int64_t fallback) {
  std::ifstream in(path);
  int64_t v = fallback;
  if (!(in >> v)) return fallback;
  return v;
}

// The kernel's NUMA node of a sysfs device: the first `numa_node` file found
// walking up from it (block devices inherit their controller's). -1: none.
int SysfsDeviceNode(const std::filesystem::path& device) {
  std::error_code ec;
  std::filesystem::path p = std::filesystem::canonical(device, ec);
  if (ec) return -1;
  for (; p.has_relative_path() && p != "/sys/devices"; p = p.parent_path()) {
    const int64_t node = ReadSysfsInt(p / "numa_node", -2);
    if (node != -2) return int(node);
  }
  return -1;
}

uint64_t BlockDeviceBytes(const std::string& name) {
  // /sys/block/<dev>/size counts 512-byte sectors whatever the device's own sector size.
  const int64_t sectors = ReadSysfsInt(std::filesystem::path("/sys/block") / name / "size", 0);
  return sectors > 0 ? uint64_t(sectors) * 512 : 0;
}

// "0000:65:00.0" in the kernel's spelling, from CUDA's (which may pad the
// domain to 8 digits or use upper case). Empty when it does not parse.
std::string CanonicalBusId(const std::string& bus_id) {
  unsigned domain = 0, bus = 0, dev = 0, func = 0;
  if (std::sscanf(bus_id.c_str(), "%x:%x:%x.%x", &domain, &bus, &dev, &func) != 4) return "";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%04x:%02x:%02x.%x", domain, bus, dev, func);
  return buf;
}

int PciNode(const HwlocTopology& topo, const std::string& bus_id) {
  const std::string canonical = CanonicalBusId(bus_id);
  if (canonical.empty()) return -1;
  if (hwloc_obj_t pci = hwloc_get_pcidev_by_busidstring(topo.get(), canonical.c_str())) {
    if (int node = topo.LocalNode(pci); node >= 0) return node;
  }
  return SysfsDeviceNode(std::filesystem::path("/sys/bus/pci/devices") / canonical);
}

std::vector<NumaNodeInfo> ListNodes(const HwlocTopology& topo) {
  std::vector<NumaNodeInfo> nodes;
  hwloc_obj_t obj = nullptr;
  while ((obj = hwloc_get_next_obj_by_type(topo.get(), HWLOC_OBJ_NUMANODE, obj))) {
    NumaNodeInfo n;
    n.os_index = int(obj->os_index);
    n.memory_bytes = obj->attr->numanode.local_memory;
    n.cores = hwloc_get_nbobjs_inside_cpuset_by_type(topo.get(), obj->cpuset, HWLOC_OBJ_CORE);
    n.hardware_threads = hwloc_get_nbobjs_inside_cpuset_by_type(topo.get(), obj->cpuset, HWLOC_OBJ_PU);
    nodes.push_back(n);
  }
  return nodes;
}

std::vector<BlockDeviceInfo> HwlocBlockDevices(const HwlocTopology& topo) {
  std::vector<BlockDeviceInfo> out;
  hwloc_obj_t obj = nullptr;
  while ((obj = hwloc_get_next_osdev(topo.get(), obj))) {
    if (obj->attr->osdev.type != HWLOC_OBJ_OSDEV_BLOCK || !obj->name) continue;
    out.push_back({obj->name, BlockDeviceBytes(obj->name), topo.LocalNode(obj), "hwloc"});
  }
  return out;
}

// Devices backed by hardware have a `device` link; loop, zram and
// device-mapper entries do not, and are not where pages should go.
std::vector<BlockDeviceInfo> SysfsBlockDevices() {
  std::vector<BlockDeviceInfo> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/sys/block", ec)) {
    const std::filesystem::path device = entry.path() / "device";
    if (!std::filesystem::exists(device, ec)) continue;
    const std::string name = entry.path().filename().string();
    out.push_back({name, BlockDeviceBytes(name), SysfsDeviceNode(device), "sysfs"});
  }
  return out;
}

std::vector<GpuInfo> LocateGpus(const HwlocTopology& topo, std::string* none_reason) {
  GpuList list = ListGpus();
  *none_reason = list.none_reason;
  std::vector<GpuInfo> gpus;
  for (const GpuDevice& d : list.devices)
    gpus.push_back({d.device, d.pci_bus_id, d.name, d.memory_bytes, PciNode(topo, d.pci_bus_id)});
  return gpus;
}

// On a single-node machine every device is local to that node, whatever the
// firmware failed to say.
void FillSingleNodeLocality(TopologySummary* s) {
  if (s->nodes.size() != 1) return;
  const int only = s->nodes[0].os_index;
  for (GpuInfo& g : s->gpus)
    if (g.numa_node < 0) g.numa_node = only;
  for (BlockDeviceInfo& b : s->block_devices)
    if (b.numa_node < 0) b.numa_node = only;
}

}  // namespace

std::string TopologySummary::ToString() const {
  std::string s = std::to_string(numa_nodes) + (numa_nodes == 1 ? " NUMA node, " : " NUMA nodes, ") +
                  std::to_string(cores) + " cores, " + std::to_string(hardware_threads) + " threads";
  if (!cpu_model.empty()) s += " (" + cpu_model + ")";
  return s;
}

std::string TopologySummary::Describe() const {
  std::string s = ToString() + "\n";
  for (const NumaNodeInfo& n : nodes)
    s += "  node " + std::to_string(n.os_index) + ": " + Gib(n.memory_bytes) + ", " + std::to_string(n.cores) +
         " cores, " + std::to_string(n.hardware_threads) + " threads\n";
  if (gpus.empty()) s += "  GPUs: none (" + gpus_none_reason + ")\n";
  for (const GpuInfo& g : gpus)
    s += "  GPU " + std::to_string(g.device) + ": " + g.name + ", " + Gib(g.memory_bytes) + ", PCI " + g.pci_bus_id +
         ", " + NodeText(g.numa_node) + "\n";
  if (block_devices.empty()) s += "  block devices: none found\n";
  for (const BlockDeviceInfo& b : block_devices)
    s += "  disk " + b.name + ": " + (b.size_bytes ? Gib(b.size_bytes) : std::string("size unknown")) + ", " +
         NodeText(b.numa_node) + " (" + b.found_by + ")\n";
  return s;
}

Result<TopologySummary> DiscoverTopology() {
  QKV_ASSIGN_OR_RETURN(HwlocTopology topo, HwlocTopology::Load(/*with_io=*/true));
  TopologySummary s;
  s.numa_nodes = topo.numa_nodes();
  s.cores = hwloc_get_nbobjs_by_type(topo.get(), HWLOC_OBJ_CORE);
  s.hardware_threads = hwloc_get_nbobjs_by_type(topo.get(), HWLOC_OBJ_PU);
  if (hwloc_obj_t pkg = hwloc_get_obj_by_type(topo.get(), HWLOC_OBJ_PACKAGE, 0))
    if (const char* model = hwloc_obj_get_info_by_name(pkg, "CPUModel")) s.cpu_model = model;
  s.nodes = ListNodes(topo);
  s.gpus = LocateGpus(topo, &s.gpus_none_reason);
  s.block_devices = HwlocBlockDevices(topo);
  if (s.block_devices.empty()) s.block_devices = SysfsBlockDevices();
  FillSingleNodeLocality(&s);
  return s;
}

Status BindCurrentThreadToNode(int node) {
  if (node < 0) return Status::Ok();
  QKV_ASSIGN_OR_RETURN(HwlocTopology topo, HwlocTopology::Load(/*with_io=*/false));
  hwloc_obj_t obj = topo.NumaNode(node);
  if (!obj) return Status::InvalidArgument("NUMA node " + std::to_string(node) + " does not exist");
  if (topo.numa_nodes() <= 1) return Status::Ok();
  if (hwloc_set_cpubind(topo.get(), obj->cpuset, HWLOC_CPUBIND_THREAD) != 0)
    return Status::IOError("binding thread to NUMA node " + std::to_string(node) + ": " + std::strerror(errno));
  return Status::Ok();
}

int GpuNumaNode(int device) {
  auto topo = DiscoverTopology();
  if (!topo.ok()) return -1;
  for (const GpuInfo& g : topo->gpus)
    if (g.device == device) return g.numa_node;
  return -1;
}

}  // namespace questkv
