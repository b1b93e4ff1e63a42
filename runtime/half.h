// Host-side conversion of the model dtypes to f32, for the few host paths of
// the CUDA backend that touch K/V bytes (rollback's summary rebuild, Gather,
// summaries read back). Exact: f16 through npy's HalfBitsToFloat, bf16 a shift.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "runtime/config.h"
#include "runtime/npy.h"  // HalfBitsToFloat

namespace questkv {

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
      for (std::size_t i = 0; i < n; ++i) dst[i] = HalfBitsToFloat(u16[i]);
      break;
    case DType::kBF16:
      for (std::size_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(u16[i]);
      break;
  }
}

}  // namespace questkv
