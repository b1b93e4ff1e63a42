#include "parallel/gpu_kernels.h"

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "kernels/cuda/common.cuh"

namespace questkv::gpu_decode {
namespace {

using kernels::cuda::ScoreTerm;
using kernels::cuda::SumGroup8;

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

// Min and max of f16 keys are f16 values: the f16 summaries hold them exactly.
__global__ void SummaryKernel(PoolShape s, const __half* slots, const int32_t* lens, __half* summaries) {
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
    __half* out = summaries + slot * 2 * s.head_dim + d;
    out[0] = __float2half_rn(lo);
    out[s.head_dim] = __float2half_rn(hi);
  }
}

// One warp per candidate. Lane l + 8 * u keeps ScorePagesCpu's partial sum
// l (dimensions j ≡ l mod 8, in order) of query heads u, u + 4, ... with
// the score kernels' ScoreTerm; each group of 8 lanes adds its sums pairwise
// (SumGroup8, the CPU's order), and the heads are aggregated in order: the
// CPU's float arithmetic and order (PageBound, then AggregateGroupScores), so
// the scores equal LaunchSelect's bit for bit. head_dim is a multiple of 8.
constexpr int kHeadsPerPass = 4;  // 32 lanes / 8 partial sums
__global__ void CandidateKernel(CandidateParams p) {
  const int lane = int(threadIdx.x & 31), l = lane & 7, u = lane >> 3;
  const int64_t n = int64_t(p.rows) * p.k;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; i < n; i += warps) {
    const int row = int(i / p.k), j = int(i % p.k);
    DeviceCandidate c{-INFINITY, -1};
    if (j < p.sel_count[row] - 1) {  // the last chosen entry is the dummy (warp-uniform)
      const int b = row / p.kv_heads, h = row % p.kv_heads;
      const int entry = p.page_indptr[b] + p.sel_pages[p.sel_indptr[row] + j];
      const __half* lo = p.summaries + (int64_t(p.page_ids[entry]) * p.kv_heads + h) * 2 * p.head_dim;
      const __half* hi = lo + p.head_dim;
      const float* q = p.q + int64_t(row) * p.group * p.head_dim;
      float agg = 0.f;
      for (int g0 = 0; g0 < p.group; g0 += kHeadsPerPass) {
        const int g = g0 + u;
        float acc = 0.f;
        if (g < p.group)
          for (int d = l; d < p.head_dim; d += 8)
            acc = ScoreTerm<false>(acc, q[int64_t(g) * p.head_dim + d], __half2float(lo[d]), __half2float(hi[d]));
        acc = SumGroup8(acc);  // head g0 + u's bound
        for (int t = 0; t < kHeadsPerPass && g0 + t < p.group; ++t) {
          const float sum = __shfl_sync(0xFFFFFFFFu, acc, t * 8);
          if (g0 + t == 0) agg = sum;
          else agg = p.mean ? __fadd_rn(agg, sum) : (agg < sum ? sum : agg);
        }
      }
      if (p.mean) agg = __fdiv_rn(agg, float(p.group));
      c = {agg, p.global_page[entry]};
    }
    if (lane == 0) p.out[p.row_offset[row] + j] = c;
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

cudaError_t LaunchBuildSummaries(const PoolShape& s, const void* slots, const int32_t* lens, void* summaries,
                                 cudaStream_t stream) {
  const int64_t n = s.pages * s.heads * s.head_dim;
  if (n == 0) return cudaSuccess;
  SummaryKernel<<<Blocks(n), kThreads, 0, stream>>>(s, static_cast<const __half*>(slots), lens,
                                                   static_cast<__half*>(summaries));
  return cudaGetLastError();
}

cudaError_t LaunchCandidateScores(const CandidateParams& p, cudaStream_t stream) {
  const int64_t n = int64_t(p.rows) * p.k;
  if (n == 0) return cudaSuccess;
  if (p.head_dim % 8 != 0) return cudaErrorInvalidValue;
  CandidateKernel<<<Blocks(n * 32), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace questkv::gpu_decode
