// The score kernels decode E4M3 summary codes with the hardware conversion
// (cvt.rn.f16x2.e4m3x2, through cuda_fp8.h's __nv_cvt_fp8x2_to_halfraw2). The
// same header's host emulation of it must agree with core/e4m3.h's ToFloat
// on every finite code and read the ±inf codes 0x7F / 0xFF as NaN, the CPU
// twin's mark of an infinite bound (ScorePagesCpu with e4m3). No GPU needed.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "kernels/cuda/kernels_cuda.h"
#include "core/e4m3.h"

namespace questkv::kernels::cuda::test {
namespace {

uint32_t Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

float HalfFloat(uint16_t raw) {
  __half_raw h;
  h.x = raw;
  return __half2float(__half(h));
}

TEST(E4m3DecodeTest, HostEmulationMatchesCodecOnAll256Codes) {
  int finite = 0;
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = uint8_t(c);
    const float hw = HalfFloat(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(code), __NV_E4M3).x);
    const float want = e4m3::ToFloat(code);
    if (code == e4m3::kPosInf || code == e4m3::kNegInf) {
      EXPECT_TRUE(std::isnan(hw)) << "code " << c << " decodes to " << hw;
      EXPECT_TRUE(std::isinf(want)) << "code " << c;
    } else {
      // Bits, so that 0x80 must be -0 on both sides.
      EXPECT_EQ(Bits(hw), Bits(want)) << "code " << c << ": " << hw << " vs " << want;
      ++finite;
    }
  }
  EXPECT_EQ(finite, 254);
}

// The kernels decode codes in pairs, the lower-addressed (low) byte first.
TEST(E4m3DecodeTest, PairDecodeTakesTheLowByteFirst) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t lo = uint8_t(c), hi = uint8_t(c * 37 + 11);
    const __half2_raw pair = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(lo | hi << 8), __NV_E4M3);
    EXPECT_EQ(pair.x, __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(lo), __NV_E4M3).x) << "low code " << c;
    EXPECT_EQ(pair.y, __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(hi), __NV_E4M3).x) << "high code " << int(hi);
  }
}

TEST(E4m3DecodeTest, SummaryDtypeNameAndSize) {
  EXPECT_EQ(std::string(DTypeName(DType::kE4M3)), "e4m3");
  EXPECT_EQ(DTypeBytes(DType::kE4M3), 1u);
}

}  // namespace
}  // namespace questkv::kernels::cuda::test
