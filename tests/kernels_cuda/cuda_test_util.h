// Helpers for the CUDA kernel tests: skip without a GPU, device buffers,
// host-side fp16/bf16 conversions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda/kernels_cuda.h"

namespace questkv::kernels::cuda::test {

// Empty when a device is usable, else why not.
inline std::string NoGpuReason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) return std::string("no usable CUDA device: cudaGetDeviceCount: ") + cudaGetErrorString(e);
  if (n == 0) return "no CUDA device";
  return "";
}

#define QKV_REQUIRE_GPU()                                           \
  do {                                                              \
    const std::string why = ::questkv::kernels::cuda::test::NoGpuReason(); \
    if (!why.empty()) GTEST_SKIP() << why;                          \
  } while (0)

#define QKV_CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << LastErrorMessage()

inline int NumSms() {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms;
}

// Owns a device allocation of `bytes`.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes) { Resize(bytes); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void Resize(std::size_t bytes) {
    cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = bytes;
    if (bytes) cudaMalloc(&ptr_, bytes);
  }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  void* get() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

template <typename T>
void Upload(DeviceBuffer& buf, const std::vector<T>& host) {
  buf.Resize(host.size() * sizeof(T));
  if (!host.empty()) cudaMemcpy(buf.get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
}

template <typename T>
std::vector<T> Download(const DeviceBuffer& buf, std::size_t n) {
  std::vector<T> host(n);
  if (n) cudaMemcpy(host.data(), buf.get(), n * sizeof(T), cudaMemcpyDeviceToHost);
  return host;
}

// Floats in `dtype`'s storage, as raw bytes.
inline std::vector<uint8_t> Encode(const std::vector<float>& x, DType dtype) {
  std::vector<uint8_t> out(x.size() * DTypeBytes(dtype));
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(out.data() + 4 * i, &x[i], 4);
    } else if (dtype == DType::kF16) {
      const __half h = __float2half_rn(x[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    } else {
      const __nv_bfloat16 h = __float2bfloat16_rn(x[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

inline std::vector<float> Decode(const std::vector<uint8_t>& raw, DType dtype) {
  const std::size_t n = raw.size() / DTypeBytes(dtype);
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(&out[i], raw.data() + 4 * i, 4);
    } else if (dtype == DType::kF16) {
      __half h;
      std::memcpy(&h, raw.data() + 2 * i, 2);
      out[i] = __half2float(h);
    } else {
      __nv_bfloat16 h;
      std::memcpy(&h, raw.data() + 2 * i, 2);
      out[i] = __bfloat162float(h);
    }
  }
  return out;
}

// Rounds x to dtype and back, as the device sees it.
inline std::vector<float> RoundTo(const std::vector<float>& x, DType dtype) { return Decode(Encode(x, dtype), dtype); }

}  // namespace questkv::kernels::cuda::test
