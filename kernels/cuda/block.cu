// A block of positions of one sequence in one decode step: its rows select
// on their own (causal views of one list) or share their list's selection
// (BlockShare), the resolve runs once per list over the union of their
// selections, and each row attends the slots its own selection resolved
// to. Small kernels around the resolve.
#include <cub/block/block_scan.cuh>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels_cuda.h"

namespace questkv::kernels::cuda {
namespace {

constexpr int kBlockThreads = 256;
using Scan = cub::BlockScan<int, kBlockThreads>;

// Entries of a row: min(count, capacity).
__device__ __forceinline__ int32_t RowEntries(const int32_t* indptr, const int32_t* count, int row) {
  const int32_t cap = indptr[row + 1] - indptr[row];
  return count ? min(count[row], cap) : cap;
}

// A block per union row (list u, head h): the member rows' entries in
// member order, each page kept at its first appearance, found with a bitmap
// of the list's pages in shared memory. A row's pages are distinct, so
// within a member no entry can hide another: members go one after another.
__global__ void BlockUnionKernel(BlockUnionParams p) {
  extern __shared__ uint32_t seen[];  // [words]
  __shared__ typename Scan::TempStorage scan;
  __shared__ int base;
  const int ur = blockIdx.x;
  const int u = ur / p.kv_heads, h = ur % p.kv_heads;
  const int32_t m0 = p.members_indptr[u], m1 = p.members_indptr[u + 1];
  const int words = (p.max_pages + 31) / 32;
  for (int w = threadIdx.x; w < words; w += blockDim.x) seen[w] = 0;
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  int32_t* out = p.out_pages + p.out_indptr[ur];
  const int32_t cap = p.out_indptr[ur + 1] - p.out_indptr[ur];
  for (int32_t m = m0; m < m1; ++m) {
    const int row = p.members[m] * p.kv_heads + h;
    const int32_t n = RowEntries(p.sel_indptr, p.sel_count, row);
    const int32_t* pages = p.sel_pages + p.sel_indptr[row];
    for (int32_t i0 = 0; i0 < n; i0 += kBlockThreads) {
      const int32_t i = i0 + threadIdx.x;
      int keep = 0;
      int32_t page = 0;
      if (i < n) {
        page = pages[i];
        if (page >= 0 && page < p.max_pages) {
          const uint32_t bit = 1u << (page % 32);
          keep = !(atomicOr(&seen[page / 32], bit) & bit);
        }
      }
      int at = 0, kept = 0;
      Scan(scan).ExclusiveSum(keep, at, kept);
      if (keep && base + at < cap) out[base + at] = page;
      __syncthreads();  // every thread read base
      if (threadIdx.x == 0) base += kept;
      __syncthreads();
    }
  }
  if (threadIdx.x == 0) p.out_count[ur] = min(base, cap);
}

// A block per row: its entries' slots (hbm_slot after the resolve) in entry
// order, those without one left out.
__global__ void BlockSlotsKernel(BlockSlotsParams p) {
  __shared__ typename Scan::TempStorage scan;
  __shared__ int base;
  const int r = blockIdx.x;
  const int b = r / p.kv_heads, h = r % p.kv_heads;
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  const int32_t n = RowEntries(p.sel_indptr, p.sel_count, r);
  const int32_t* pages = p.sel_pages + p.sel_indptr[r];
  const uint32_t* ids = p.page_ids + p.page_indptr[b];
  int32_t* out = p.out_slots + p.sel_indptr[r];
  for (int32_t i0 = 0; i0 < n; i0 += kBlockThreads) {
    const int32_t i = i0 + threadIdx.x;
    int32_t slot = -1;
    if (i < n) slot = p.hbm_slot[std::size_t(ids[pages[i]]) * p.kv_heads + h];
    const int keep = slot >= 0;
    int at = 0, kept = 0;
    Scan(scan).ExclusiveSum(keep, at, kept);
    if (keep) out[base + at] = slot;
    __syncthreads();
    if (threadIdx.x == 0) base += kept;
    __syncthreads();
  }
  if (threadIdx.x == 0) p.out_count[r] = base;
}

// A block per row: the shared entries below the row's local window (in
// order, so a prefix when ascending), then the window.
__global__ void BlockShareKernel(BlockShareParams p) {
  __shared__ typename Scan::TempStorage scan;
  __shared__ int base;
  const int r = blockIdx.x;
  const int b = r / p.kv_heads, h = r % p.kv_heads;
  const int lr = p.list_of[b] * p.kv_heads + h;
  const int32_t n = p.page_indptr[b + 1] - p.page_indptr[b];
  const int32_t local_start = n - min(max(p.local_pages, 1), n);
  const int32_t m = RowEntries(p.shared_indptr, p.shared_count, lr);
  const int32_t* shared = p.shared_pages + p.shared_indptr[lr];
  const int32_t cap = p.out_indptr[r + 1] - p.out_indptr[r];
  int32_t* out = p.out_pages + p.out_indptr[r];
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  for (int32_t i0 = 0; i0 < m; i0 += kBlockThreads) {
    const int32_t i = i0 + threadIdx.x;
    const int32_t page = i < m ? shared[i] : -1;
    const int keep = page >= 0 && page < local_start;
    int at = 0, kept = 0;
    Scan(scan).ExclusiveSum(keep, at, kept);
    if (keep && base + at < cap) out[base + at] = page;
    __syncthreads();
    if (threadIdx.x == 0) base += kept;
    __syncthreads();
  }
  for (int32_t i = threadIdx.x; i < n - local_start; i += kBlockThreads)
    if (base + i < cap) out[base + i] = local_start + i;
  if (threadIdx.x == 0) p.out_count[r] = min(base + n - local_start, cap);
}

}  // namespace

cudaError_t LaunchBlockShare(const BlockShareParams& p, cudaStream_t stream) {
  if (p.rows <= 0) return cudaSuccess;
  if (p.kv_heads <= 0 || !p.page_indptr || !p.list_of || !p.shared_indptr || !p.shared_pages || !p.out_indptr ||
      !p.out_pages || !p.out_count)
    return cudaErrorInvalidValue;
  BlockShareKernel<<<p.rows, kBlockThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchBlockUnion(const BlockUnionParams& p, cudaStream_t stream) {
  if (p.lists <= 0) return cudaSuccess;
  if (p.kv_heads <= 0 || p.max_pages < 0 || !p.members_indptr || !p.members || !p.sel_indptr || !p.sel_pages || !p.out_indptr ||
      !p.out_pages || !p.out_count)
    return cudaErrorInvalidValue;
  const std::size_t smem = std::size_t((p.max_pages + 31) / 32) * 4;
  if (smem > 48 * 1024) {
    if (const cudaError_t e = cudaFuncSetAttribute(BlockUnionKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   int(smem));
        e != cudaSuccess)
      return e;
  }
  BlockUnionKernel<<<p.lists * p.kv_heads, kBlockThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchBlockSlots(const BlockSlotsParams& p, cudaStream_t stream) {
  if (p.rows <= 0) return cudaSuccess;
  if (p.kv_heads <= 0 || !p.sel_indptr || !p.sel_pages || !p.page_indptr || !p.page_ids || !p.hbm_slot ||
      !p.out_slots || !p.out_count)
    return cudaErrorInvalidValue;
  BlockSlotsKernel<<<p.rows, kBlockThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace questkv::kernels::cuda
