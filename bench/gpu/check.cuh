// CHECK(cuda call) for the GPU bench drivers: a failed call prints where, why
// (with the kernels' own last message) and exits.
#pragma once

#include <cstdio>
#include <cstdlib>

#include "kernels/cuda/kernels_cuda.h"

#define CHECK(x)                                                                                        \
  do {                                                                                                  \
    cudaError_t e_ = (x);                                                                               \
    if (e_ != cudaSuccess) {                                                                            \
      std::fprintf(stderr, "%s:%d %s: %s %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_),         \
                   questkv::kernels::cuda::LastErrorMessage().c_str());                                 \
      std::exit(1);                                                                                     \
    }                                                                                                   \
  } while (0)
