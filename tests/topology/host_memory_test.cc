// HostRegion: alignment, size, writability, ownership, release, NUMA binding,
// the plain-memory fallback without a GPU, and AllocFaults.
#include "topology/host_memory.h"

#include <gtest/gtest.h>

#include <hwloc.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <thread>
#include <vector>

#include "topology/alloc_faults.h"
#include "topology/gpu_probe.h"
#include "topology/topology.h"

namespace questkv {
namespace {

constexpr HostPlacement kPlain{/*numa_node=*/-1, /*pin_for_gpu=*/false};

int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages_total = 0, pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return pages_resident * sysconf(_SC_PAGESIZE);
}

bool AreaMembindSupported() {
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0) return false;
  bool supported = false;
  if (hwloc_topology_load(topo) == 0) supported = hwloc_topology_get_support(topo)->membind->set_area_membind;
  hwloc_topology_destroy(topo);
  return supported;
}

TEST(HostRegion, IsAlignedSizedAndWritable) {
  for (std::size_t bytes : {std::size_t(1), std::size_t(4095), std::size_t(4097), std::size_t(3) << 20}) {
    auto region = HostRegion::Allocate(bytes, kPlain);
    ASSERT_TRUE(region.ok()) << region.status().ToString();
    EXPECT_EQ(region->bytes(), bytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(region->data()) % 4096, 0u);
    auto* p = static_cast<unsigned char*>(region->data());
    for (std::size_t i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(i * 7 + 1);
    for (std::size_t i = 0; i < bytes; i += 997) ASSERT_EQ(p[i], static_cast<unsigned char>(i * 7 + 1)) << i;
  }
}

TEST(HostRegion, ZeroBytesIsInvalid) {
  auto region = HostRegion::Allocate(0, kPlain);
  EXPECT_EQ(region.status().code(), Code::kInvalidArgument);
}

TEST(HostRegion, MovesOwnership) {
  auto made = HostRegion::Allocate(8192, kPlain);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  HostRegion a = std::move(*made);
  void* data = a.data();
  std::memset(data, 0x5a, 8192);

  HostRegion b(std::move(a));
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(a.bytes(), 0u);
  EXPECT_EQ(b.data(), data);
  EXPECT_EQ(b.bytes(), 8192u);

  auto other = HostRegion::Allocate(4096, kPlain);
  ASSERT_TRUE(other.ok());
  HostRegion c = std::move(*other);
  c = std::move(b);  // c's own 4096 bytes are released here
  EXPECT_EQ(b.data(), nullptr);
  EXPECT_EQ(c.data(), data);
  EXPECT_EQ(static_cast<unsigned char*>(c.data())[8191], 0x5a);
  HostRegion& same = c;
  c = std::move(same);
  EXPECT_EQ(c.data(), data);
}

TEST(HostRegion, ReturnsItsMemoryWhenDestroyed) {
  constexpr std::size_t kBytes = std::size_t(256) << 20;
  const int64_t before = ResidentBytes();
  {
    auto region = HostRegion::Allocate(kBytes, kPlain);
    ASSERT_TRUE(region.ok()) << region.status().ToString();
    std::memset(region->data(), 1, kBytes);
    EXPECT_GE(ResidentBytes(), before + int64_t(kBytes) * 3 / 4);
  }
  EXPECT_LT(ResidentBytes(), before + int64_t(kBytes) / 8);
}

TEST(HostRegion, BindsToARequestedNode) {
  auto topo = DiscoverTopology();
  ASSERT_TRUE(topo.ok()) << topo.status().ToString();
  const int node = topo->nodes[0].os_index;
  auto region = HostRegion::Allocate(1 << 20, {node, /*pin_for_gpu=*/false});
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  if (AreaMembindSupported()) {
    EXPECT_EQ(region->bound_node(), node);
  } else {
    EXPECT_EQ(region->bound_node(), -1);
  }
}

TEST(HostRegion, AMissingNodeIsUnboundNotAnError) {
  auto region = HostRegion::Allocate(4096, {1 << 20, /*pin_for_gpu=*/false});
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  EXPECT_EQ(region->bound_node(), -1);
}

TEST(HostRegion, WithoutAGpuIsPlainMemoryBoundNowhere) {
  if (CurrentGpu() >= 0) GTEST_SKIP() << "a GPU is present";
  auto region = HostRegion::Allocate(1 << 20, HostPlacement{});
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  EXPECT_FALSE(region->pinned());
  // -1 asks for the GPU's node, and there is none.
  EXPECT_EQ(region->bound_node(), -1);
  std::memset(region->data(), 3, region->bytes());
}

TEST(HostRegion, WithAGpuIsPinnedOnItsNode) {
  if (CurrentGpu() < 0) GTEST_SKIP() << "no GPU";
  auto region = HostRegion::Allocate(1 << 20, HostPlacement{});
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  EXPECT_TRUE(region->pinned());
  EXPECT_EQ(region->bound_node(), GpuNumaNode(CurrentGpu()));
  std::memset(region->data(), 3, region->bytes());
  auto plain = HostRegion::Allocate(1 << 20, {-1, /*pin_for_gpu=*/false});
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->pinned());
}

class AllocFaultsTest : public ::testing::Test {
 protected:
  void TearDown() override { AllocFaults::Clear(); }
};

TEST_F(AllocFaultsTest, FailsExactlyTheNthAllocation) {
  AllocFaults::FailAt(3);
  for (int i = 1; i <= 6; ++i) {
    auto region = HostRegion::Allocate(4096, kPlain);
    if (i == 3) {
      EXPECT_EQ(region.status().code(), Code::kResourceExhausted);
      EXPECT_NE(region.status().message().find("injected"), std::string::npos) << region.status().ToString();
    } else {
      EXPECT_TRUE(region.ok()) << "allocation " << i << ": " << region.status().ToString();
    }
  }
}

TEST_F(AllocFaultsTest, ClearDisarms) {
  AllocFaults::FailAt(1);
  AllocFaults::Clear();
  EXPECT_TRUE(HostRegion::Allocate(4096, kPlain).ok());
  AllocFaults::FailAt(0);
  EXPECT_FALSE(AllocFaults::ShouldFail());
  AllocFaults::FailAt(1);
  EXPECT_TRUE(AllocFaults::ShouldFail());
  EXPECT_FALSE(AllocFaults::ShouldFail());
}

TEST_F(AllocFaultsTest, CountsAcrossThreads) {
  AllocFaults::FailAt(150);
  std::atomic<int> failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 100; ++i) failed += AllocFaults::ShouldFail();
    });
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failed.load(), 1);
}

}  // namespace
}  // namespace questkv
