// The small kernels around the decode step (kernels/cuda/tables.cu) that no
// step test reaches on every path: ints carried in a launch's parameters.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "tests/kernels_cuda/cuda_test_util.h"

namespace questkv::kernels::cuda::test {
namespace {

// Every parameter-block size and its edges; what lies past n stays.
TEST(WriteIntsTest, EachSizeWritesExactlyN) {
  QKV_REQUIRE_GPU();
  for (int n : {1, 63, 64, 65, 256, 257, 999, kLaunchInts}) {
    std::vector<int32_t> src(n);
    std::iota(src.begin(), src.end(), -n / 2);
    src[0] = INT32_MIN;
    std::vector<int32_t> want(kLaunchInts + 8, 0x5a5a5a5a);
    DeviceBuffer dst;
    Upload(dst, want);
    QKV_CUDA_OK(LaunchWriteInts(dst.as<int32_t>(), src.data(), n, nullptr));
    std::copy(src.begin(), src.end(), want.begin());
    EXPECT_EQ(Download<int32_t>(dst, want.size()), want) << "n = " << n;
  }
}

// More than a launch carries, or no buffers: refused, nothing launched (no
// GPU needed).
TEST(WriteIntsTest, RefusesWhatALaunchCannotCarry) {
  std::vector<int32_t> src(kLaunchInts + 1, 7);
  int32_t* dst = reinterpret_cast<int32_t*>(uintptr_t(256));  // never written: refused first
  EXPECT_EQ(LaunchWriteInts(dst, src.data(), kLaunchInts + 1, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchWriteInts(nullptr, src.data(), 4, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchWriteInts(dst, nullptr, 4, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchWriteInts(nullptr, nullptr, 0, nullptr), cudaSuccess);
}

}  // namespace
}  // namespace questkv::kernels::cuda::test
