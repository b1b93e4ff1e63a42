// Host-side conversions of the model dtypes to and from f32, for the few host
// paths of the CUDA backend that touch K/V bytes (rollback's summary rebuild,
// Gather). Round to nearest even, like the device's __float2half_rn and
// __float2bfloat16_rn; NaN stays NaN.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "runtime/config.h"

namespace questkv {

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  float f;
  if (exp == 0) {
    f = std::ldexp(float(man), -24);  // zero or subnormal
  } else if (exp == 31) {
    f = man ? NAN : INFINITY;
  } else {
    const uint32_t bits = ((exp + 112) << 23) | (man << 13);
    std::memcpy(&f, &bits, 4);
  }
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits |= sign;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float Bf16ToFloat(uint16_t b) {
  const uint32_t bits = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// n elements of `dtype` at src to floats.
inline void ToFloats(const void* src, DType dtype, std::size_t n, float* dst) {
  const auto* u16 = static_cast<const uint16_t*>(src);
  switch (dtype) {
    case DType::kF32: std::memcpy(dst, src, n * 4); break;
    case DType::kF16:
      for (std::size_t i = 0; i < n; ++i) dst[i] = HalfToFloat(u16[i]);
      break;
    case DType::kBF16:
      for (std::size_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(u16[i]);
      break;
  }
}

}  // namespace questkv
