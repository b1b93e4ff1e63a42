// Discovery on whatever machine runs the tests: at least one node and core,
// per-node figures that add up, GPUs either located or absent with a reason,
// and a readable summary.
#include "topology/topology.h"

#include <gtest/gtest.h>

#include <thread>

#include "topology/gpu_probe.h"

namespace questkv {
namespace {

TEST(Topology, FindsNodesAndCores) {
  auto topo = DiscoverTopology();
  ASSERT_TRUE(topo.ok()) << topo.status().ToString();
  EXPECT_GE(topo->numa_nodes, 1);
  EXPECT_GE(topo->cores, 1);
  EXPECT_GE(topo->hardware_threads, topo->cores);
  ASSERT_EQ(topo->nodes.size(), std::size_t(topo->numa_nodes));
  int threads = 0;
  for (const NumaNodeInfo& n : topo->nodes) {
    EXPECT_GE(n.os_index, 0);
    threads += n.hardware_threads;
  }
  // A node may have no CPUs (memory-only), but every thread sits on some node.
  EXPECT_EQ(threads, topo->hardware_threads);
}

TEST(Topology, GpusAreLocatedOrAbsentWithAReason) {
  auto topo = DiscoverTopology();
  ASSERT_TRUE(topo.ok()) << topo.status().ToString();
  if (topo->gpus.empty()) {
    EXPECT_FALSE(topo->gpus_none_reason.empty());
    EXPECT_EQ(GpuNumaNode(0), -1);
  }
  if (!CudaBuilt()) {
    EXPECT_TRUE(topo->gpus.empty());
  }
  for (const GpuInfo& g : topo->gpus) {
    EXPECT_FALSE(g.pci_bus_id.empty());
    EXPECT_EQ(GpuNumaNode(g.device), g.numa_node);
  }
}

TEST(Topology, SingleNodeMachinesPlaceEveryDeviceOnIt) {
  auto topo = DiscoverTopology();
  ASSERT_TRUE(topo.ok()) << topo.status().ToString();
  if (topo->nodes.size() != 1) GTEST_SKIP() << "machine has " << topo->nodes.size() << " NUMA nodes";
  for (const BlockDeviceInfo& b : topo->block_devices) {
    EXPECT_EQ(b.numa_node, topo->nodes[0].os_index) << b.name;
    EXPECT_FALSE(b.found_by.empty());
  }
  for (const GpuInfo& g : topo->gpus) EXPECT_EQ(g.numa_node, topo->nodes[0].os_index);
}

TEST(Topology, SummaryNamesEveryPart) {
  auto topo = DiscoverTopology();
  ASSERT_TRUE(topo.ok()) << topo.status().ToString();
  const std::string line = topo->ToString();
  EXPECT_NE(line.find("NUMA node"), std::string::npos) << line;
  EXPECT_NE(line.find("cores"), std::string::npos) << line;
  const std::string text = topo->Describe();
  EXPECT_EQ(text.rfind(line, 0), 0u) << text;
  EXPECT_NE(text.find("node " + std::to_string(topo->nodes[0].os_index) + ":"), std::string::npos) << text;
  EXPECT_NE(text.find("GPU"), std::string::npos) << text;
  for (const BlockDeviceInfo& b : topo->block_devices)
    EXPECT_NE(text.find("disk " + b.name), std::string::npos) << text;
}

TEST(Topology, BindsAThreadToAnExistingNode) {
  EXPECT_TRUE(BindCurrentThreadToNode(-1).ok());
  auto topo = DiscoverTopology();
  ASSERT_TRUE(topo.ok()) << topo.status().ToString();
  // On a thread of its own, so the binding does not outlive the test.
  Status s;
  std::thread([&] { s = BindCurrentThreadToNode(topo->nodes[0].os_index); }).join();
  EXPECT_TRUE(s.ok()) << s.ToString();
}

TEST(Topology, BindingToAMissingNodeIsInvalid) {
  const Status s = BindCurrentThreadToNode(1 << 20);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
}

}  // namespace
}  // namespace questkv
