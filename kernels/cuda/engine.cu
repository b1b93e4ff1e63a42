// Kernels for an engine that owns its paged KV cache (python/ops.cc's
// update_summaries and select_pages on CUDA tensors): the summaries of listed
// pages rebuilt from the engine's key cache, and a select's CSR rows turned
// into the engine's page ids, padded with -1.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/kernels_cuda.h"

namespace questkv::kernels::cuda {
namespace {

// One block per (listed page, KV head), threads over the head dimension.
// min/max as RebuildSummaryHeadsCpu folds them: from the empty box, a key
// below lo (above hi) replaces it, so a NaN key never enters a summary.
template <typename T>
__global__ void SummariesFromCacheKernel(SummariesFromCacheParams p) {
  const int i = int(blockIdx.x) / p.kv_heads, h = int(blockIdx.x) % p.kv_heads;
  const long long page = p.pages[i];
  const int len = p.lens[i];
  const T* k = static_cast<const T*>(p.k_cache);
  T* sum = static_cast<T*>(p.summaries) + (page * p.kv_heads + h) * 2LL * p.head_dim;
  for (int d = int(threadIdx.x); d < p.head_dim; d += int(blockDim.x)) {
    float lo = INFINITY, hi = -INFINITY;
    for (int t = 0; t < len; ++t) {
      const long long at = p.nhd ? ((page * p.page_size + t) * p.kv_heads + h) * p.head_dim + d
                                 : ((page * p.kv_heads + h) * p.page_size + t) * p.head_dim + d;
      const float x = ToFloat(k[at]);
      if (x < lo) lo = x;
      if (x > hi) hi = x;
    }
    sum[d] = FromFloat<T>(lo);  // exact: lo and hi are values of T (or the empty box's infinities)
    sum[p.head_dim + d] = FromFloat<T>(hi);
  }
}

__global__ void PaddedPageIdsKernel(PaddedPageIdsParams p) {
  const long long n = (long long)p.rows * p.width;
  for (long long x = (long long)blockIdx.x * blockDim.x + threadIdx.x; x < n; x += (long long)gridDim.x * blockDim.x) {
    const int r = int(x / p.width), j = int(x % p.width);
    const int b = r / p.kv_heads;
    p.out[x] = j < p.sel_count[r] ? p.indices[p.indptr[b] + p.sel_pages[p.sel_indptr[r] + j]] : -1;
  }
}

}  // namespace

cudaError_t LaunchSummariesFromCache(const SummariesFromCacheParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  if (p.n < 0 || p.kv_heads < 1 || p.head_dim < 1 || p.page_size < 1 || (long long)p.n * p.kv_heads > INT32_MAX)
    return Unsupported("summaries from cache: pages x heads", (long long)p.n * p.kv_heads, "1 .. 2^31 - 1");
  const int threads = p.head_dim < 256 ? ((p.head_dim + 31) / 32) * 32 : 256;
  QKV_DISPATCH_DTYPE(p.dtype, T, {
    SummariesFromCacheKernel<T><<<p.n * p.kv_heads, threads, 0, stream>>>(p);
  });
  return cudaGetLastError();
}

cudaError_t LaunchPaddedPageIds(const PaddedPageIdsParams& p, cudaStream_t stream) {
  const long long n = (long long)p.rows * p.width;
  if (n == 0) return cudaSuccess;
  const long long blocks = (n + 255) / 256;
  PaddedPageIdsKernel<<<int(blocks < 1024 ? blocks : 1024), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace questkv::kernels::cuda
