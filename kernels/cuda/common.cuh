// Device helpers shared by the kernels: dtype conversion and 16-byte vectors.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace questkv::kernels::cuda {

template <typename T>
__device__ __forceinline__ float ToFloat(T x);
template <>
__device__ __forceinline__ float ToFloat<float>(float x) { return x; }
template <>
__device__ __forceinline__ float ToFloat<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float ToFloat<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Elements of T in one 16-byte load.
template <typename T>
constexpr int kVec16 = 16 / sizeof(T);

// Converts the 16 bytes at `raw` (kVec16<T> elements) to floats.
template <typename T>
__device__ __forceinline__ void Unpack16(const uint4& raw, float* out) {
  if constexpr (sizeof(T) == 4) {
    out[0] = __uint_as_float(raw.x);
    out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z);
    out[3] = __uint_as_float(raw.w);
  } else {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (sizeof(T) == 2 && std::is_same_v<T, __half>) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
      } else {
        // bf16 -> fp32 is a shift.
        out[2 * i] = __uint_as_float(w[i] << 16);
        out[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
      }
    }
  }
}

__device__ __forceinline__ uint4 Load16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// ---- E4M3 summary codes (core/e4m3.h) --------------------------------------
// Plain storage with no conversions of its own, because two decodes exist:
// e4m3::ToFloat where ±inf must stay ±inf (the append's fold), and the
// hardware conversion, which reads 0x7F / 0xFF as NaN (the score, whose
// NaN is the CPU twin's mark of an infinite bound).
struct E4m3Code {
  uint8_t bits;
};
template <typename T>
constexpr bool kIsE4m3 = std::is_same_v<T, E4m3Code>;

// Two codes (the low byte first) as floats: exact for every finite code.
__device__ __forceinline__ float2 DecodeE4m3x2(uint16_t pair) {
  return __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(pair), __NV_E4M3)));
}

// Eight codes (little-endian) as floats.
__device__ __forceinline__ void UnpackE4m3x8(const uint2& raw, float* out) {
  const uint32_t w[2] = {raw.x, raw.y};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = DecodeE4m3x2(uint16_t(w[i >> 1] >> (16 * (i & 1))));
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// Asynchronous 16-byte global -> shared copies (cp.async, L1 bypassed): with
// `valid` false, the 16 bytes are zero-filled and `src` is not read.
__device__ __forceinline__ void CopyAsync16(void* dst, const void* src, bool valid) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
// Closes the group of the copies issued since the last commit.
__device__ __forceinline__ void CommitCopies() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most `kPending` committed groups of this thread are in flight.
template <int kPending>
__device__ __forceinline__ void WaitCopies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// ---- Quest page scores (eq. 2-3) ---------------------------------------------
// One term for one query head and dimension, rounded exactly as the CPU twin
// (kernels/cpu/score_cpu.cc PageBound) does: acc + q * (q >= 0 ? hi : lo),
// which is acc + max(q * lo, q * hi) whenever lo <= hi (a page's min and max
// key): the product kept is the larger one, and rounding is monotone. The
// sign picks the bound, so a term is a compare, a select and one fma instead
// of two products and a max. With 16-bit q and summaries (kExact) the
// product q * m is exact in float (at most 22 significant bits) unless it
// leaves float's normal range (bf16 values beyond about 1e±19), so one fma
// rounds as __fadd_rn(acc, q * m) does.
template <bool kExact>
__device__ __forceinline__ float ScoreTerm(float acc, float q, float lo, float hi) {
  const float m = q >= 0.f ? hi : lo;
  if constexpr (kExact) return __fmaf_rn(q, m, acc);
  else return __fadd_rn(acc, __fmul_rn(q, m));
}

// The CPU twin's 8 partial sums added in its order, ((0 + 1) + (2 + 3)) +
// ((4 + 5) + (6 + 7)), when lane l of each aligned group of 8 lanes holds
// partial sum l: three butterfly shuffles, every lane of the group ending
// with the same bits.
__device__ __forceinline__ float SumGroup8(float v) {
  v = __fadd_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, 1));
  v = __fadd_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, 2));
  return __fadd_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, 4));
}

// ---- programmatic dependent launch (sm_90) ----------------------------------
// A decode step's layer is a chain of ~9 small kernels (append, score, top-K,
// the resolve's five, attention), each waiting for the one before. Launched
// with LaunchChained, a kernel's blocks may be scheduled while the kernel
// before it in the stream still runs, and start the moment it completes (its
// memory visible) instead of after the launch gap. The rule: a chained
// kernel calls ChainWait() before anything else (it returns once the
// previous kernel has completed, so nothing it reads is stale), then
// ChainRelease() (its own successor may now be scheduled). Both are no-ops
// when the kernel was launched without the attribute: before sm_90, after a
// non-kernel operation (a memset, an event), or with `chain` false (the
// same binary measured both ways).
__device__ __forceinline__ void ChainWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void ChainRelease() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...), chained to the kernel
// before it (see above) when `chain` is true. The kernel must start with
// ChainWait().
template <typename... Params, typename... Args>
cudaError_t LaunchChained(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream,
                          bool chain, Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = chain ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace questkv::kernels::cuda
