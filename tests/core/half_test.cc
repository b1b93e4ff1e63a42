// f32 -> f16 / bf16 rounding on the host (core/half.h) against a brute
// force reference: the nearest value of the target type by search over all
// of its finite values, ties to the even encoding, past the largest finite
// value plus half an ulp to infinity.
#include "core/half.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <utility>
#include <vector>

namespace questkv {
namespace {

// All finite non-negative values of a 16-bit type, ascending, with their bits.
class Nearest {
 public:
  explicit Nearest(float (*decode)(uint16_t)) {
    for (uint32_t b = 0; b < 0x8000u; ++b) {
      const float f = decode(uint16_t(b));
      if (std::isfinite(f)) values_.push_back({double(f), uint16_t(b)});
    }
    std::sort(values_.begin(), values_.end());
    const double max = values_.back().first, below = values_[values_.size() - 2].first;
    overflow_ = max + (max - below) / 2;  // a tie there goes to infinity (max has an odd encoding)
  }
  uint16_t operator()(float f) const {
    const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
    const double a = std::fabs(double(f));
    if (a >= overflow_) return sign | inf_bits_;
    auto hi = std::lower_bound(values_.begin(), values_.end(), std::make_pair(a, uint16_t(0)));
    if (hi == values_.end()) --hi;
    auto lo = hi == values_.begin() ? hi : hi - 1;
    const double dlo = a - lo->first, dhi = hi->first - a;
    uint16_t bits;
    if (dlo < dhi) bits = lo->second;
    else if (dhi < dlo) bits = hi->second;
    else bits = (lo->second & 1) ? hi->second : lo->second;
    return sign | bits;
  }
  void set_inf(uint16_t bits) { inf_bits_ = bits; }
  const std::vector<std::pair<double, uint16_t>>& values() const { return values_; }

 private:
  std::vector<std::pair<double, uint16_t>> values_;
  double overflow_ = 0;
  uint16_t inf_bits_ = 0;
};

float Half(uint16_t b) { return HalfBitsToFloat(b); }
float Bf16(uint16_t b) { return Bf16ToFloat(b); }

// Edge cases, midpoints between neighbouring values (and one float ulp either
// side), and random bit patterns.
std::vector<float> Probes(const Nearest& ref) {
  std::vector<float> xs = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.99f, 65520.0f, 65536.0f, 1e-8f, 2.98023224e-8f,
                           5.96046448e-8f, 6.1035156e-5f, 6.09755516e-5f, std::numeric_limits<float>::max(),
                           std::numeric_limits<float>::min(), std::numeric_limits<float>::denorm_min(),
                           std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
  const auto& v = ref.values();
  for (std::size_t i = 0; i + 1 < v.size(); i += 7) {
    const float mid = float((v[i].first + v[i + 1].first) / 2);
    xs.push_back(mid);
    xs.push_back(std::nextafter(mid, 0.0f));
    xs.push_back(std::nextafter(mid, std::numeric_limits<float>::infinity()));
    xs.push_back(-mid);
  }
  std::mt19937_64 rng(20261129);
  for (int i = 0; i < 400000; ++i) {
    const uint32_t bits = uint32_t(rng());
    float f;
    std::memcpy(&f, &bits, 4);
    if (!std::isnan(f)) xs.push_back(f);
  }
  return xs;
}

TEST(HostRounding, FloatToHalfIsNearestEven) {
  Nearest ref(Half);
  ref.set_inf(0x7C00);
  for (float x : Probes(ref)) ASSERT_EQ(FloatToHalfBits(x), ref(x)) << "x = " << x;
  EXPECT_EQ(FloatToHalfBits(std::numeric_limits<float>::quiet_NaN()), 0x7FFF);
  // Every half survives the round trip.
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    if ((b & 0x7C00u) == 0x7C00u && (b & 0x3FFu) != 0) continue;  // NaNs
    ASSERT_EQ(FloatToHalfBits(HalfBitsToFloat(uint16_t(b))), b);
  }
}

TEST(HostRounding, FloatToBf16IsNearestEven) {
  Nearest ref(Bf16);
  ref.set_inf(0x7F80);
  for (float x : Probes(ref)) ASSERT_EQ(FloatToBf16Bits(x), ref(x)) << "x = " << x;
  EXPECT_EQ(FloatToBf16Bits(std::numeric_limits<float>::quiet_NaN()), 0x7FFF);
}

TEST(HostRounding, FromFloatsConvertsEachDtype) {
  const std::vector<float> x = {1.0f / 3, -2.5f, 1e-6f, 70000.0f};
  std::vector<uint16_t> h(x.size()), b(x.size());
  std::vector<float> f(x.size()), back(x.size());
  FromFloats(x.data(), DType::kF16, x.size(), h.data());
  FromFloats(x.data(), DType::kBF16, x.size(), b.data());
  FromFloats(x.data(), DType::kF32, x.size(), f.data());
  for (std::size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(h[i], FloatToHalfBits(x[i]));
    EXPECT_EQ(b[i], FloatToBf16Bits(x[i]));
    EXPECT_EQ(f[i], x[i]);
  }
  ToFloats(h.data(), DType::kF16, h.size(), back.data());
  EXPECT_FLOAT_EQ(back[1], -2.5f);
  EXPECT_TRUE(std::isinf(back[3]));
}

}  // namespace
}  // namespace questkv
