// 8-bit summaries: FP8 E4M3 codes rounded outward (DESIGN.md §3, seed §3).
//
// A summary kept in 8 bits must stay a box around its keys, or U_p(q) stops
// being an upper bound and a page holding the best key can lose to one that
// does not. So a page's min is rounded down (the largest code <= it) and its
// max up (the smallest code >= it). Both roundings are monotone and leave a
// code's own value unchanged, so folding a key into a rounded summary and
// rounding again gives exactly the rounding of the exact min/max: appends,
// rebuilds and resets all land on the same codes, on the CPU and the GPU.
//
// Codes are OCP E4M3 ("e4m3fn": 1 sign, 4 exponent bits of bias 7, 3 mantissa
// bits; finite values up to ±448, subnormals down to 2^-9), except for the
// two codes that format spends on NaN: here 0x7F is +inf and 0xFF is -inf.
// They mark the empty box (min +inf, max -inf) and a bound beyond the range
// (a min below -448 rounds down to -inf, a max above 448 up to +inf); no NaN
// is ever stored (a NaN key never enters a summary: key < lo is false).
//
// Scoring (ScorePagesCpu with summaries on this grid, and the CUDA kernels,
// which decode with the hardware conversion that reads 0x7F/0xFF as NaN): a
// term whose chosen bound is ±inf makes the head-page's score NaN, and a NaN
// score is replaced by +inf, so such a head-page is always selected. That
// keeps the bound (the page's true logits are finite) at the cost of a read.
//
// Header-only and usable from host and device code alike.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define QKV_HD __host__ __device__ __forceinline__
#else
#define QKV_HD inline
#endif

namespace questkv::e4m3 {

inline constexpr uint8_t kPosInf = 0x7F;  // also the empty box's min
inline constexpr uint8_t kNegInf = 0xFF;  // also the empty box's max
inline constexpr float kMaxFinite = 448.f;

QKV_HD uint32_t FloatBits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

QKV_HD float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

// Magnitude codes (sign bit clear) of a finite or infinite a >= 0: the
// largest code <= a (saturating at 448, 0x7E) and the smallest code >= a
// (0x7F, +inf, past 448). Codes 0..0x7E are ordered as their values, so
// "one code up" is the next value, across exponents too.
QKV_HD uint32_t MagnitudeDown(uint32_t bits, bool* inexact) {
  const uint32_t exp = bits >> 23;  // bits has no sign
  uint32_t code;
  if (exp >= 127 - 6) {  // >= 2^-6: normal in E4M3, 3 of float's 23 mantissa bits kept
    const uint32_t e = exp - 120;   // E4M3's biased exponent
    if (e > 15 || (e == 15 && ((bits >> 20) & 7) == 7)) {  // >= 480: past 448
      *inexact = true;
      return 0x7E;
    }
    code = (e << 3) | ((bits >> 20) & 7);
    *inexact = (bits & 0xFFFFF) != 0;
  } else {  // below 2^-6: multiples of 2^-9, exactly a * 512 (a power-of-two scale)
    const float scaled = BitsFloat(bits) * 512.f;
    code = uint32_t(scaled);  // truncation: floor for a >= 0
    *inexact = float(code) != scaled;
  }
  return code;
}

// The largest value on the grid <= x (min of a box). +inf stays +inf (the
// empty box), anything below -448 is -inf, NaN is -inf (the safe side).
QKV_HD uint8_t RoundDown(float x) {
  const uint32_t bits = FloatBits(x);
  const uint32_t mag = bits & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return kNegInf;  // NaN
  bool inexact = false;
  if (!(bits >> 31)) {
    if (mag == 0x7F800000u) return kPosInf;
    return uint8_t(MagnitudeDown(mag, &inexact));
  }
  const uint32_t down = MagnitudeDown(mag, &inexact);  // ceil of the magnitude
  const uint32_t up = inexact ? down + 1 : down;        // 0x7F: -inf
  return uint8_t(0x80u | up);
}

// The smallest value on the grid >= x (max of a box): RoundDown's mirror,
// since the grid is symmetric and the sign is the code's top bit (so -inf
// stays -inf, anything past 448 is +inf, NaN is +inf).
QKV_HD uint8_t RoundUp(float x) { return uint8_t(RoundDown(-x) ^ 0x80u); }

// The value of a code: ±inf for 0x7F / 0xFF, -0 for 0x80.
QKV_HD float ToFloat(uint8_t c) {
  const uint32_t sign = uint32_t(c & 0x80) << 24;
  const uint32_t mag = c & 0x7F;
  if (mag == 0x7F) return BitsFloat(sign | 0x7F800000u);
  const uint32_t e = mag >> 3, m = mag & 7;
  // Subnormal: m * 2^-9; normal: (8 + m) * 2^(e - 10). Both exact in float.
  const float v = e == 0 ? float(m) * (1.f / 512.f) : float(8 + m) * BitsFloat((e + 117u) << 23);
  return BitsFloat(sign | FloatBits(v));
}

// A summary bound rounded outward onto the grid and read back as a float.
QKV_HD float SnapDown(float x) { return ToFloat(RoundDown(x)); }
QKV_HD float SnapUp(float x) { return ToFloat(RoundUp(x)); }

}  // namespace questkv::e4m3
