// Workload::Tokens on the GPU: the synthetic K/V of `questkv run` (see
// tools/workload.h, bench/WORKLOADS.md) generated straight into device
// memory, bit for bit the values the CPU generator gives.
//
// Every operation of the CPU generator is repeated on the device with the
// same IEEE rounding: explicit __fmul_rn/__fadd_rn/__dsqrt_rn..., so nvcc
// fuses nothing into FMAs, and double sums in the CPU's sequential order.
// The exceptions are FillNormal's libm calls, logf(u1) and sinf/cosf(angle)
// (g++ emits one sincosf), whose inputs take 2^24 values each. The device
// evaluates them in double and rounds to float; Create compares that with
// the host's libm at all 2^24 inputs, once per process (a fraction of a
// second), and uploads the inputs where they differ with the host's values
// (with glibc 2.36: 0.7 % of logf inputs, 2.6 % of sin/cos inputs; a 4 MiB
// bitmap and the values per function). So the device reproduces the libm
// this process links, and the bits match provided workload.cc is compiled as
// CMake builds it: x86-64 without FMA contraction (no -march). Where bits
// would differ anyway, the values still agree to a few float ulps: with no
// libm patch at all, a host emulation of these kernels differs from the CPU
// on 5 % of elements, by at most 7.2e-7 absolute-or-relative
// (|d - c| / max(1, |c|)).
//
// The structured workload's tables (spans, special runs, directions, stream
// keys: Workload::TokenTables) are uploaded once at Create; topic anchors
// are computed on the device per call, for the knots the call spans, in a
// stream-ordered scratch (cudaMallocAsync), so Tokens does no host work per
// token and no host synchronisation.
//
// This header is included from C++20 host code and from the C++17 .cu.
// Thread safety: immutable after Create; Tokens may run concurrently on
// different streams. Built only with CUDA (tools/workload_cuda.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "questkv/config.h"
#include "questkv/status.h"
#include "tools/workload.h"

namespace questkv {

class DeviceWorkload {
 public:
  // Uploads `workload`'s tables to the current device (which Tokens must
  // then be called with). FailedPrecondition without a usable GPU or one
  // without stream-ordered allocation; ResourceExhausted when device memory
  // cannot be had.
  static Result<std::unique_ptr<DeviceWorkload>> Create(const Workload& workload);
  ~DeviceWorkload();
  DeviceWorkload(const DeviceWorkload&) = delete;
  DeviceWorkload& operator=(const DeviceWorkload&) = delete;

  const Workload& workload() const;

  // Enqueues on `stream` the K and V of tokens [begin, begin + n) of `layer`,
  // token-major [n][Hkv][D] in `dtype` (f16/bf16 the f32 values rounded to
  // nearest even), into device memory at k_dev and v_dev: what
  // Workload::Tokens writes, converted. Returns after launching.
  // InvalidArgument for a layer or range outside the workload or null
  // outputs (n > 0); FailedPrecondition when another device is current;
  // Internal when a launch fails.
  Status Tokens(int layer, int64_t begin, int64_t n, void* k_dev, void* v_dev, DType dtype,
                cudaStream_t stream) const;

  // Inputs of logf and of sin/cos (2^24 each) at which the device's own
  // evaluation differs from the host's libm and the host value is used.
  struct LibmPatches {
    int64_t log = 0;
    int64_t sincos = 0;
  };
  LibmPatches libm_patches() const;

 private:
  struct Impl;
  explicit DeviceWorkload(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace questkv
