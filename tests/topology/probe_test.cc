// The measurements behind `questkv probe` that live in topology/: host memcpy
// bandwidth, and the GPU list and host<->GPU timing on machines without a GPU.
#include <gtest/gtest.h>

#include <vector>

#include "topology/alloc_faults.h"
#include "topology/gpu_probe.h"
#include "topology/memory_probe.h"

namespace questkv {
namespace {

TEST(MemcpyProbe, CountsWholeSlicesFromEveryThread) {
  auto bw = MeasureMemcpyBandwidth(std::size_t(4) << 20, 2, 0.05);
  ASSERT_TRUE(bw.ok()) << bw.status().ToString();
  EXPECT_EQ(bw->threads, 2);
  EXPECT_EQ(bw->slice_bytes, std::size_t(2) << 20);
  EXPECT_GT(bw->bytes_copied, 0);
  EXPECT_EQ(bw->bytes_copied % int64_t(bw->slice_bytes), 0);
  EXPECT_GT(bw->gb_per_s, 0.0);
}

TEST(MemcpyProbe, RejectsSlicesUnderACacheLine) {
  EXPECT_EQ(MeasureMemcpyBandwidth(100, 2, 0.01).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(MeasureMemcpyBandwidth(4096, 0, 0.01).status().code(), Code::kInvalidArgument);
}

TEST(MemcpyProbe, ReportsAFailedAllocation) {
  AllocFaults::FailAt(2);
  auto bw = MeasureMemcpyBandwidth(1 << 20, 1, 0.01);
  AllocFaults::Clear();
  EXPECT_EQ(bw.status().code(), Code::kResourceExhausted) << bw.status().ToString();
}

TEST(GpuProbe, WithoutAGpuTheListSaysWhy) {
  const GpuList gpus = ListGpus();
  if (!gpus.devices.empty()) GTEST_SKIP() << gpus.devices.size() << " GPUs present";
  EXPECT_FALSE(gpus.none_reason.empty());
  EXPECT_EQ(CurrentGpu(), -1);
  std::vector<char> host(1 << 20);
  const Status s = MeasureHostDeviceBandwidth(0, host.data(), host.size(), 0.01).status();
  EXPECT_EQ(s.code(), CudaBuilt() ? Code::kFailedPrecondition : Code::kUnimplemented) << s.ToString();
}

TEST(GpuProbe, EveryGpuHasABusId) {
  const GpuList gpus = ListGpus();
  if (gpus.devices.empty()) GTEST_SKIP() << gpus.none_reason;
  for (const GpuDevice& d : gpus.devices) {
    EXPECT_FALSE(d.pci_bus_id.empty());
    EXPECT_GT(d.memory_bytes, 0u);
  }
  EXPECT_GE(CurrentGpu(), 0);
}

}  // namespace
}  // namespace questkv
