#include "parallel/gpu_kernels.h"

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

namespace questkv::gpu_decode {
namespace {

constexpr int kThreads = 256;

int Blocks(int64_t items) { return int(std::min<int64_t>((items + kThreads - 1) / kThreads, 1 << 20)); }

__device__ __forceinline__ uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Irwin-Hall of four 16-bit uniforms, centred and scaled to unit variance.
__device__ __forceinline__ float NormalFrom(uint64_t h) {
  float sum = 0.f;
  for (int i = 0; i < 4; ++i) sum += float((h >> (16 * i)) & 0xFFFFu) * (1.f / 65536.f);
  return (sum - 2.f) * 1.7320508f;
}

__global__ void FillRandomKernel(PoolShape s, const int64_t* page_keys, uint64_t seed, __half* slots) {
  const int64_t per_page = int64_t(s.heads) * 2 * s.page_size * s.head_dim;
  const int64_t n = s.pages * per_page;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t p = i / per_page;
    int64_t rem = i % per_page;  // [heads][2][S][D]
    const int hl = int(rem / (2 * s.page_size * s.head_dim));
    rem %= 2 * s.page_size * s.head_dim;
    const uint64_t key = (uint64_t(page_keys[p]) * uint64_t(s.total_heads) + uint64_t(s.first_head + hl)) *
                             uint64_t(2 * s.page_size * s.head_dim) + uint64_t(rem);
    slots[i] = __float2half_rn(NormalFrom(SplitMix64(seed ^ SplitMix64(key))));
  }
}

__global__ void SummaryKernel(PoolShape s, const __half* slots, const int32_t* lens, float* summaries) {
  const int64_t n = s.pages * s.heads * s.head_dim;
  const int64_t head_page = int64_t(2) * s.page_size * s.head_dim;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t slot = i / s.head_dim;  // p * heads + hl
    const int d = int(i % s.head_dim);
    const __half* k = slots + slot * head_page + d;
    float lo = INFINITY, hi = -INFINITY;
    const int len = lens[slot / s.heads];
    for (int t = 0; t < len; ++t) {
      const float v = __half2float(k[int64_t(t) * s.head_dim]);
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
    }
    float* out = summaries + slot * 2 * s.head_dim + d;
    out[0] = lo;
    out[s.head_dim] = hi;
  }
}

// ScorePagesCpu's PageBound: eight partial sums over j ≡ l (mod 8), added in
// order, then the dimensions past the last multiple of eight.
__device__ float PageBound(const float* q, const float* lo, const float* hi, int head_dim) {
  float acc[8] = {};
  int j = 0;
  for (; j + 8 <= head_dim; j += 8)
    for (int l = 0; l < 8; ++l) {
      const float a = __fmul_rn(q[j + l], lo[j + l]);
      const float b = __fmul_rn(q[j + l], hi[j + l]);
      acc[l] = __fadd_rn(acc[l], a > b ? a : b);
    }
  float sum = 0.f;
  for (int l = 0; l < 8; ++l) sum = __fadd_rn(sum, acc[l]);
  for (; j < head_dim; ++j) {
    const float a = __fmul_rn(q[j], lo[j]);
    const float b = __fmul_rn(q[j], hi[j]);
    sum = __fadd_rn(sum, a > b ? a : b);
  }
  return sum;
}

__global__ void CandidateKernel(CandidateParams p) {
  const int64_t n = int64_t(p.rows) * p.k;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int row = int(i / p.k), j = int(i % p.k);
    DeviceCandidate c{-INFINITY, -1};
    if (j < p.sel_count[row] - 1) {  // the last chosen entry is the dummy
      const int b = row / p.kv_heads, h = row % p.kv_heads;
      const int entry = p.page_indptr[b] + p.sel_pages[p.sel_indptr[row] + j];
      const float* lo = p.summaries + (int64_t(p.page_ids[entry]) * p.kv_heads + h) * 2 * p.head_dim;
      const float* q = p.q + int64_t(row) * p.group * p.head_dim;
      float agg = PageBound(q, lo, lo + p.head_dim, p.head_dim);
      for (int g = 1; g < p.group; ++g) {
        const float s = PageBound(q + int64_t(g) * p.head_dim, lo, lo + p.head_dim, p.head_dim);
        agg = p.mean ? __fadd_rn(agg, s) : (agg < s ? s : agg);
      }
      if (p.mean) agg = __fdiv_rn(agg, float(p.group));
      c = {agg, p.global_page[entry]};
    }
    p.out[p.row_offset[row] + j] = c;
  }
}

}  // namespace

cudaError_t LaunchFillRandom(const PoolShape& s, const int64_t* page_keys, uint64_t seed, void* slots,
                             cudaStream_t stream) {
  const int64_t n = s.pages * s.heads * 2 * s.page_size * s.head_dim;
  if (n == 0) return cudaSuccess;
  FillRandomKernel<<<Blocks(n), kThreads, 0, stream>>>(s, page_keys, seed, static_cast<__half*>(slots));
  return cudaGetLastError();
}

cudaError_t LaunchBuildSummaries(const PoolShape& s, const void* slots, const int32_t* lens, float* summaries,
                                 cudaStream_t stream) {
  const int64_t n = s.pages * s.heads * s.head_dim;
  if (n == 0) return cudaSuccess;
  SummaryKernel<<<Blocks(n), kThreads, 0, stream>>>(s, static_cast<const __half*>(slots), lens, summaries);
  return cudaGetLastError();
}

cudaError_t LaunchCandidateScores(const CandidateParams& p, cudaStream_t stream) {
  const int64_t n = int64_t(p.rows) * p.k;
  if (n == 0) return cudaSuccess;
  CandidateKernel<<<Blocks(n), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace questkv::gpu_decode
