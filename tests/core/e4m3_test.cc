// The outward-rounded E4M3 summary codec (core/e4m3.h) against a brute
// force over the format's value table, built here from its definition.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/e4m3.h"

namespace questkv {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// OCP E4M3: value of sign s, exponent e (bias 7), mantissa m; (15, 7) is
// the format's NaN, which the summaries use for ±inf.
double Value(int s, int e, int m) {
  const double mag = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return s ? -mag : mag;
}

// Every value a summary can hold, ascending: -inf, the 253 finite values
// (one zero per sign, so -0 and +0 compare equal and both appear), +inf.
struct Grid {
  std::vector<std::pair<double, uint8_t>> values;
  Grid() {
    for (int c = 0; c < 256; ++c) {
      const int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
      values.push_back({e == 15 && m == 7 ? (s ? -double(kInf) : double(kInf)) : Value(s, e, m), uint8_t(c)});
    }
    std::sort(values.begin(), values.end());
  }
  // Largest grid value <= x; +inf only for x = +inf.
  double Down(float x) const {
    double best = -double(kInf);
    for (const auto& [v, c] : values)
      if (v <= x && (v != double(kInf) || x == kInf)) best = std::max(best, v);
    return best;
  }
  double Up(float x) const {
    double best = double(kInf);
    for (const auto& [v, c] : values)
      if (v >= x && (v != -double(kInf) || x == -kInf)) best = std::min(best, v);
    return best;
  }
};

uint32_t Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

TEST(E4m3, DecodesEveryCodeAsTheFormatDefines) {
  for (int c = 0; c < 256; ++c) {
    const int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
    const float got = e4m3::ToFloat(uint8_t(c));
    if (e == 15 && m == 7) {
      EXPECT_EQ(got, s ? -kInf : kInf) << c;
      continue;
    }
    EXPECT_EQ(double(got), Value(s, e, m)) << "code " << c;
    EXPECT_EQ(std::signbit(got), s == 1) << "code " << c;
  }
  EXPECT_EQ(e4m3::ToFloat(0x7E), 448.f);
  EXPECT_EQ(e4m3::ToFloat(0x01), std::ldexp(1.f, -9));
}

TEST(E4m3, EveryCodeValueRoundsToItself) {
  for (int c = 0; c < 256; ++c) {
    const float v = e4m3::ToFloat(uint8_t(c));
    EXPECT_EQ(e4m3::RoundDown(v), c) << c;
    EXPECT_EQ(e4m3::RoundUp(v), c) << c;
  }
}

// Down/up against the brute force on the values where rounding turns: each
// grid value and its float neighbours, the range's edges, and random floats
// over every exponent E4M3 reaches and beyond.
TEST(E4m3, RoundsOutwardToTheNearestGridValue) {
  const Grid grid;
  std::vector<float> xs = {0.f, -0.f, 448.f, -448.f, 449.f, -449.f, 480.f, 512.f, 1e30f, -1e30f, kInf, -kInf,
                           std::ldexp(1.f, -10), -std::ldexp(1.f, -10), std::numeric_limits<float>::denorm_min(),
                           -std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max()};
  for (const auto& [v, c] : grid.values)
    if (std::isfinite(v)) {
      const float f = float(v);
      xs.insert(xs.end(), {f, std::nextafter(f, kInf), std::nextafter(f, -kInf)});
    }
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> exponent(-14.f, 11.f), mantissa(1.f, 2.f);
  for (int i = 0; i < 20000; ++i) {
    const float x = std::ldexp(mantissa(rng), int(std::floor(exponent(rng))));
    xs.push_back(i % 2 ? x : -x);
  }
  for (const float x : xs) {
    const float down = e4m3::ToFloat(e4m3::RoundDown(x));
    const float up = e4m3::ToFloat(e4m3::RoundUp(x));
    ASSERT_EQ(double(down), grid.Down(x)) << "x = " << x;
    ASSERT_EQ(double(up), grid.Up(x)) << "x = " << x;
    ASSERT_LE(down, x);
    ASSERT_GE(up, x);
    if (x == 0.f) {  // a zero keeps its sign: folding signed zeros matches the f32 summaries
      ASSERT_EQ(std::signbit(down), std::signbit(x));
      ASSERT_EQ(std::signbit(up), std::signbit(x));
    }
  }
}

TEST(E4m3, BeyondTheRangeIsInfiniteOutwardAndSaturatesInward) {
  EXPECT_EQ(e4m3::RoundUp(448.5f), e4m3::kPosInf);
  EXPECT_EQ(e4m3::RoundDown(448.5f), 0x7E);
  EXPECT_EQ(e4m3::RoundDown(-448.5f), e4m3::kNegInf);
  EXPECT_EQ(e4m3::RoundUp(-448.5f), 0xFE);
  EXPECT_EQ(e4m3::RoundDown(kInf), e4m3::kPosInf);  // the empty box's min
  EXPECT_EQ(e4m3::RoundUp(-kInf), e4m3::kNegInf);   // and its max
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(e4m3::RoundDown(nan), e4m3::kNegInf);
  EXPECT_EQ(e4m3::RoundUp(nan), e4m3::kPosInf);
}

// Monotone and idempotent over a dense sweep: the properties that make
// "fold, then round" equal to "round the exact min/max".
TEST(E4m3, MonotoneAndIdempotent) {
  float prev_down = -kInf, prev_up = -kInf;
  auto check = [&](uint32_t b) {
    float x;
    std::memcpy(&x, &b, 4);
    const float down = e4m3::SnapDown(x), up = e4m3::SnapUp(x);
    ASSERT_GE(down, prev_down) << x;
    ASSERT_GE(up, prev_up) << x;
    ASSERT_EQ(e4m3::SnapDown(down), down);
    ASSERT_EQ(e4m3::SnapUp(up), up);
    prev_down = down, prev_up = up;
  };
  // -1000 up to -0, then +0 up to 1000, by 2^10 ulps (negative floats' bits fall as they rise).
  for (uint32_t b = Bits(-1000.f); b >= (1u << 31); b -= 1u << 10) check(b);
  for (uint32_t b = 0; b <= Bits(1000.f); b += 1u << 10) check(b);
}

}  // namespace
}  // namespace questkv
