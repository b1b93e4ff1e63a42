// Host-side conversion between f32 and the model dtypes, for the few host
// paths of the CUDA backend that touch K/V bytes (rollback's summary rebuild,
// Gather, summaries read back) and for callers that feed the device-pointer
// API from host floats (`questkv run`), and the .npy reader. To f32 is exact:
// f16 through HalfBitsToFloat, bf16 a shift. From f32 rounds to nearest even, the bits of
// CUDA's __float2half_rn / __float2bfloat16_rn (NaN becomes 0x7FFF as there).
#pragma once

#include <bit>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "questkv/config.h"

namespace questkv {

// IEEE 754 binary16 bits -> float, exact for every one of the 65536 patterns
// (NaN payloads are kept in the top mantissa bits).
inline float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf, or NaN with its payload
  } else if (exp != 0) {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;  // ±0
  } else {
    // Subnormal mant·2^-24: normalise so the leading 1 becomes implicit.
    int shift = 0;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      ++shift;
    }
    bits = sign | (uint32_t(127 - 14 - shift) << 23) | ((mant & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(bits);
}

inline float Bf16ToFloat(uint16_t b) {
  const uint32_t bits = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint32_t FloatBits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  return x;
}

inline uint16_t FloatToHalfBits(float f) {
  const uint32_t x = FloatBits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return 0x7FFF;             // NaN
  if (abs >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // >= 65520 rounds to infinity
  const uint32_t exp = abs >> 23;
  if (exp < 113) {  // below 2^-14: a subnormal half (units of 2^-24), or zero
    const uint32_t shift = 126 - exp;  // >= 14
    if (shift > 25) return uint16_t(sign);
    const uint32_t m = (abs & 0x7FFFFFu) | 0x800000u;
    uint32_t h = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1))) ++h;
    return uint16_t(sign | h);
  }
  uint32_t h = ((exp - 112) << 10) | ((abs >> 13) & 0x3FFu);
  const uint32_t rem = abs & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) ++h;  // a carry moves into the exponent
  return uint16_t(sign | h);
}

inline uint16_t FloatToBf16Bits(float f) {
  const uint32_t x = FloatBits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;  // NaN
  return uint16_t((x + 0x7FFFu + ((x >> 16) & 1)) >> 16);
}

// n floats at src to `dtype` at dst.
inline void FromFloats(const float* src, DType dtype, std::size_t n, void* dst) {
  auto* u16 = static_cast<uint16_t*>(dst);
  switch (dtype) {
    case DType::kF32: std::memcpy(dst, src, n * 4); break;
    case DType::kF16:
      for (std::size_t i = 0; i < n; ++i) u16[i] = FloatToHalfBits(src[i]);
      break;
    case DType::kBF16:
      for (std::size_t i = 0; i < n; ++i) u16[i] = FloatToBf16Bits(src[i]);
      break;
    case DType::kE4M3: assert(!"e4m3 holds summaries, never K/V or queries"); break;
  }
}

// n elements of `dtype` at src to floats.
inline void ToFloats(const void* src, DType dtype, std::size_t n, float* dst) {
  const auto* u16 = static_cast<const uint16_t*>(src);
  switch (dtype) {
    case DType::kF32: std::memcpy(dst, src, n * 4); break;
    case DType::kF16:
      for (std::size_t i = 0; i < n; ++i) dst[i] = HalfBitsToFloat(u16[i]);
      break;
    case DType::kBF16:
      for (std::size_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(u16[i]);
      break;
    case DType::kE4M3: assert(!"e4m3 holds summaries, never K/V or queries"); break;
  }
}

}  // namespace questkv
