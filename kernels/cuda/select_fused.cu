// Select's fused short-row kernel (select.cu describes the pipeline): score,
// top-K and emit in one launch, a cluster of blocks a row.
#include <cooperative_groups.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/select_common.cuh"

namespace questkv::kernels::cuda {
namespace {

// Few short rows (kMax/kMean, G <= 4, <= kFuseMaxPages pages, one cluster per
// row fitting in one wave): one launch. A cluster of kFuseBlocks blocks per
// row scores the row's pages (G threads per page, one query head each, with
// ScoreKernel's arithmetic) and writes each key straight into
// the shared key cache of the cluster's first block (distributed shared
// memory); after one cluster barrier that block radix-selects over the cached
// keys and emits the row, as TopKKernel does. No score workspace, no memset.
// (Up to 8192 pages, with a thread per page and SelectShortRow in the first
// block, it was slower than score + top-K at 128K on the H200: 46 vs 38 us
// a layer, bench/results/2026-11-29-gpu-hbm-lists-share-pool.md.) Past kFuseMaxHeadPages
// head-pages in all, the lanes score kernel on every SM then the top-K is
// faster (H200, Llama-3-8B select: b1 32K 24.7 -> 22.6 us, b2 16K 24.6 ->
// 20.4, b2 32K 36.8 -> 26.6; b1 16K stays fused, 17.7 against 18.9;
// bench/results/2026-12-02-gpu-long-row-bin-select.md).
template <typename QT, typename SumT, int D, int G>
__global__ void __cluster_dims__(kFuseBlocks, 1, 1) __launch_bounds__(kTopKThreads, 1)
    FusedSelectKernel(SelectParams p) {
  namespace cg = cooperative_groups;
  extern __shared__ uint32_t cache[];
  __shared__ TopKShared sh;
  const SelectShape& s = p.shape;
  const int row = blockIdx.y;
  const int b = row / s.kv_heads;
  const int h = row % s.kv_heads;
  const int first = p.page_indptr[b];
  const RowPolicy r = PolicyFor(s, p.page_indptr[b + 1] - first);
  const int out0 = p.out_indptr[row];
  const uint32_t* ids = p.page_ids + first;
  auto emit = [&](int i, int pos) { p.out_pages[out0 + pos] = i; };
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned rank = cluster.block_rank();
  if (r.all || r.k == 0) {  // same branch for the whole cluster: no barrier needed
    if (rank != 0) return;
    int count;
    if (r.all) {
      for (int i = threadIdx.x; i < r.n; i += blockDim.x) emit(i, i);
      count = r.n;
    } else {
      count = OrderedPassAll(r.n, sh, [&](int i) { return Skipped(r, i); }, emit);
    }
    __syncthreads();
    EmitSlots(p, ids, h, out0, count);
    if (threadIdx.x == 0) p.out_count[row] = count;
    return;
  }
  // Blocks of a cluster may start at different times: none writes into block
  // 0's shared memory before all have started (arrive now, wait before the
  // first remote write).
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  bool waited = false;
  uint32_t* dst = cluster.map_shared_rank(cache, 0);
  const int chunk = (r.n + kFuseBlocks - 1) / kFuseBlocks;
  const int i0 = int(rank) * chunk;
  const int i1 = min(r.n, i0 + chunk);
  const SumT* slab = static_cast<const SumT*>(p.summaries);
  // G threads per page, one query head each (consecutive lanes); the
  // page's first lane aggregates the G scores in order.
  constexpr int kPerPass = kTopKThreads / G;
  const int g = int(threadIdx.x) % G;
  const QT* q = static_cast<const QT*>(p.q) + (((std::size_t)b * s.kv_heads + h) * G + g) * D;
  for (int base = i0; base < i1; base += kPerPass) {  // same trip count in the whole block
    const int i = base + int(threadIdx.x) / G;
    const bool active = i < i1 && !Skipped(r, i);
    float score = 0.f;
    if (active) ScoreHeadPage<QT, SumT, D, 1>(slab + ((std::size_t)ids[i] * s.kv_heads + h) * 2 * D, q, &score);
    float sc[G];
    sc[0] = score;
#pragma unroll
    for (int gg = 1; gg < G; ++gg) sc[gg] = __shfl_down_sync(0xFFFFFFFFu, score, gg);
    if (!waited) {
      asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
      waited = true;
    }
    if (active && g == 0) dst[CacheSlot(i)] = Key(Aggregate<G>(s.gqa, sc));
  }
  if (!waited) asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
  cluster.sync();  // every key is in block 0's cache
  if (rank != 0) return;
  uint32_t kth = 0;
  int ties = 0, equal = 0;
  const Keys keys{nullptr, cache};
  RadixKth(keys, r, sh, &kth, &ties, &equal);
  __syncthreads();
  auto eq = [&](int i) { return !Skipped(r, i) && keys(i) == kth; };
  auto take = [&](int i, int eq_rank) {
    if (Skipped(r, i)) return true;
    const uint32_t key = keys(i);
    return key > kth || (key == kth && eq_rank < ties);
  };
  const int count = ties == equal ? OrderedPassAll(r.n, sh, [&](int i) { return take(i, 0); }, emit)
                                  : OrderedPass(r.n, sh, eq, take, emit);
  __syncthreads();
  EmitSlots(p, ids, h, out0, count);
  if (threadIdx.x == 0) p.out_count[row] = count;
}

}  // namespace

cudaError_t LaunchFusedSelect(const SelectPlan& plan, const SelectParams& p, cudaStream_t stream) {
  const SelectShape& s = p.shape;
  const int rows = s.batch * s.kv_heads;
  const std::size_t smem = std::size_t(plan.key_cache + plan.key_cache / 32 + 1) * sizeof(uint32_t);
  const dim3 grid(kFuseBlocks, rows);
  QKV_DISPATCH_DTYPE(p.q_dtype, T, {
    QKV_DISPATCH_HEAD_DIM(s.head_dim, D, {
      QKV_DISPATCH_GROUP(s.group, G, {
        // (G > 4 never gets here; naming only G <= 4 keeps nvcc from
        // wanting a G = 8 instantiation's stub.)
        constexpr int kG = G <= 4 ? G : 4;
        if constexpr (G <= 4) {
          if (p.summary_dtype == DType::kE4M3) {
            FusedSelectKernel<T, E4m3Code, D, kG><<<grid, kTopKThreads, smem, stream>>>(p);
          } else {
            FusedSelectKernel<T, T, D, kG><<<grid, kTopKThreads, smem, stream>>>(p);
          }
        }
      })
    })
  })
  return cudaGetLastError();
}

}  // namespace questkv::kernels::cuda
