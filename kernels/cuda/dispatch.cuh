// Dispatch macros: runtime sizes become compile-time constants. The default
// case records a message naming the unsupported value and returns
// cudaErrorInvalidValue from the enclosing launcher.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels_cuda.h"

namespace questkv::kernels::cuda {

void SetLastErrorMessage(std::string message);

inline cudaError_t Unsupported(const char* what, long long value, const char* supported) {
  SetLastErrorMessage(std::string("unsupported ") + what + " = " + std::to_string(value) + " (supported: " +
                      supported + ")");
  return cudaErrorInvalidValue;
}

}  // namespace questkv::kernels::cuda

#define QKV_DISPATCH_CASE(VAR, CONST, VALUE, ...) \
  case VALUE: {                                   \
    constexpr int CONST = VALUE;                  \
    __VA_ARGS__                                   \
    break;                                        \
  }

#define QKV_DISPATCH_HEAD_DIM(head_dim, HEAD_DIM, ...)                                          \
  switch (head_dim) {                                                                          \
    QKV_DISPATCH_CASE(head_dim, HEAD_DIM, 64, __VA_ARGS__)                                     \
    QKV_DISPATCH_CASE(head_dim, HEAD_DIM, 128, __VA_ARGS__)                                    \
    QKV_DISPATCH_CASE(head_dim, HEAD_DIM, 256, __VA_ARGS__)                                    \
    default:                                                                                   \
      return ::questkv::kernels::cuda::Unsupported("head_dim", (head_dim), "64, 128, 256");    \
  }

#define QKV_DISPATCH_PAGE_SIZE(page_size, PAGE_SIZE, ...)                                       \
  switch (page_size) {                                                                         \
    QKV_DISPATCH_CASE(page_size, PAGE_SIZE, 8, __VA_ARGS__)                                    \
    QKV_DISPATCH_CASE(page_size, PAGE_SIZE, 16, __VA_ARGS__)                                   \
    QKV_DISPATCH_CASE(page_size, PAGE_SIZE, 32, __VA_ARGS__)                                   \
    QKV_DISPATCH_CASE(page_size, PAGE_SIZE, 64, __VA_ARGS__)                                   \
    default:                                                                                   \
      return ::questkv::kernels::cuda::Unsupported("page_size", (page_size), "8, 16, 32, 64"); \
  }

#define QKV_DISPATCH_GROUP(group, GROUP, ...)                                                  \
  switch (group) {                                                                            \
    QKV_DISPATCH_CASE(group, GROUP, 1, __VA_ARGS__)                                           \
    QKV_DISPATCH_CASE(group, GROUP, 2, __VA_ARGS__)                                           \
    QKV_DISPATCH_CASE(group, GROUP, 4, __VA_ARGS__)                                           \
    QKV_DISPATCH_CASE(group, GROUP, 8, __VA_ARGS__)                                           \
    default:                                                                                  \
      return ::questkv::kernels::cuda::Unsupported("GQA group", (group), "1, 2, 4, 8");        \
  }

// One dtype's case: DTYPE_T becomes TYPE for the body.
#define QKV_DISPATCH_DTYPE_CASE(ENUM, DTYPE_T, TYPE, ...) \
  case ::questkv::kernels::cuda::DType::ENUM: {           \
    using DTYPE_T = TYPE;                                 \
    __VA_ARGS__                                           \
    break;                                                \
  }

// DTYPE_T becomes float, __half or __nv_bfloat16 (K/V, queries, outputs: e4m3 is
// a summary dtype only, rejected here).
#define QKV_DISPATCH_DTYPE(dtype, DTYPE_T, ...)                                             \
  switch (dtype) {                                                                         \
    QKV_DISPATCH_DTYPE_CASE(kF32, DTYPE_T, float, __VA_ARGS__)                             \
    QKV_DISPATCH_DTYPE_CASE(kF16, DTYPE_T, __half, __VA_ARGS__)                            \
    QKV_DISPATCH_DTYPE_CASE(kBF16, DTYPE_T, __nv_bfloat16, __VA_ARGS__)                    \
    default:                                                                               \
      return ::questkv::kernels::cuda::Unsupported("dtype", int(dtype), "f32, f16, bf16"); \
  }

// Summaries: SUM_T becomes float, __half, __nv_bfloat16 or E4m3Code.
#define QKV_DISPATCH_SUMMARY_DTYPE(dtype, SUM_T, ...)                                                    \
  switch (dtype) {                                                                                      \
    QKV_DISPATCH_DTYPE_CASE(kF32, SUM_T, float, __VA_ARGS__)                                            \
    QKV_DISPATCH_DTYPE_CASE(kF16, SUM_T, __half, __VA_ARGS__)                                           \
    QKV_DISPATCH_DTYPE_CASE(kBF16, SUM_T, __nv_bfloat16, __VA_ARGS__)                                   \
    QKV_DISPATCH_DTYPE_CASE(kE4M3, SUM_T, ::questkv::kernels::cuda::E4m3Code, __VA_ARGS__)              \
    default:                                                                                            \
      return ::questkv::kernels::cuda::Unsupported("summary dtype", int(dtype), "f32, f16, bf16, e4m3"); \
  }
