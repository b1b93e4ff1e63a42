// Adaptive budgets on the device (SelectionPolicy::unread_bound_mass;
// selector/select.cc's Selector::AdaptiveK), after a select that kept its
// scores. A block per row:
//  1. the largest score of its ranked pages (neither sink nor local; a NaN
//     never replaces it, as std::max(top, s) keeps top) and their bound mass
//     exp((s - top) / sqrt(D)) summed in double, NaN scores left out;
//  2. its winners (the select's top-k, ascending between the sink and the
//     local pages) sorted best first, ties toward the lower page, NaN last;
//  3. their masses' prefix sums: the row takes the fewest winners, at least
//     the floor's, after which at most e of the total is unread;
//  4. the row written again in place, ascending: sink, the winners taken,
//     local; and its count.
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cfloat>
#include <climits>
#include <cmath>
#include <string>

#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/kernels_cuda.h"
#include "kernels/cuda/select_common.cuh"

namespace questkv::kernels::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kItems = kAdaptiveMaxPages / kThreads;  // winners a thread holds

struct MaxOf {
  __device__ float operator()(float a, float b) const { return a < b ? b : a; }
};
struct MinOf {
  __device__ int operator()(int a, int b) const { return a < b ? a : b; }
};

// Thread 0: the row's choice into the counters.
__device__ void Count(AdaptiveCounters* c, int pages, int cap) {
  atomicAdd(&c->rankings, 1ull);
  atomicAdd(&c->pages, (unsigned long long)pages);
  atomicMax(&c->pages_max, (unsigned long long)pages);
  if (pages == cap) atomicAdd(&c->cap_hits, 1ull);
  atomicAdd(&c->hist[pages < kAdaptiveHistPages ? pages : kAdaptiveHistPages], 1ull);
}

__global__ void __launch_bounds__(kThreads) AdaptiveKernel(AdaptiveParams p) {
  using Sort = cub::BlockRadixSort<unsigned long long, kThreads, kItems, int>;
  using ScanD = cub::BlockScan<double, kThreads>;
  using ScanI = cub::BlockScan<int, kThreads>;
  using ReduceF = cub::BlockReduce<float, kThreads>;
  using ReduceD = cub::BlockReduce<double, kThreads>;
  using ReduceI = cub::BlockReduce<int, kThreads>;
  __shared__ union {
    typename Sort::TempStorage sort;
    typename ScanD::TempStorage scan_d;
    typename ScanI::TempStorage scan_i;
    typename ReduceF::TempStorage reduce_f;
    typename ReduceD::TempStorage reduce_d;
    typename ReduceI::TempStorage reduce_i;
  } tmp;
  __shared__ float s_top;
  __shared__ double s_total;
  __shared__ int s_take;
  __shared__ uint8_t taken[kAdaptiveMaxPages];

  const SelectShape& s = p.shape;
  const int row = blockIdx.x, b = row / s.kv_heads, h = row % s.kv_heads;
  const int n = p.page_indptr[b + 1] - p.page_indptr[b];
  if (s.dense || s.page_budget >= n) return;  // every page: nothing ranked (select.cc returns first)
  const RowPolicy r = PolicyFor(s, n);
  const long long budget_k = s.page_budget - r.fixed;
  const int cap = budget_k > 0 ? int(budget_k) : 0;
  const int ranked = n - r.fixed;
  const long long floor_pages = p.floor_tokens / s.page_size - r.fixed;
  const int floor_k = floor_pages < 0 ? 0 : floor_pages > cap ? cap : int(floor_pages);
  const float* sc = p.scores + std::size_t(p.page_indptr[b]) * s.kv_heads + std::size_t(h) * n;
  const float scale = 1.f / sqrtf(float(s.head_dim));
  // A padded group's mean back to the model's: x * group is exact (a power of two).
  const bool unpad = p.mean_heads > 0 && p.mean_heads != s.group;
  auto score = [&](int i) { return unpad ? __fdiv_rn(sc[i] * float(s.group), float(p.mean_heads)) : sc[i]; };

  float top = -INFINITY;
  for (int i = threadIdx.x; i < n; i += kThreads)
    if (!Skipped(r, i)) top = MaxOf()(top, score(i));
  top = ReduceF(tmp.reduce_f).Reduce(top, MaxOf());
  if (threadIdx.x == 0) s_top = top;
  __syncthreads();
  top = s_top;
  int32_t* out = p.out_pages + p.out_indptr[row];
  const int listed = min(p.out_count[row], p.out_indptr[row + 1] - p.out_indptr[row]);
  const int got = listed - r.fixed;  // the winners: out[r.sink, r.sink + got)
  if (!isfinite(top)) {  // no mass to weigh: the row keeps its k
    if (threadIdx.x == 0) Count(p.counters, min(cap, ranked), cap);
    return;
  }
  double total = 0;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const float x = score(i);
    if (!Skipped(r, i) && !isnan(x)) total += exp(double(x - top) * double(scale));
  }
  total = ReduceD(tmp.reduce_d).Sum(total);
  if (threadIdx.x == 0) s_total = total;
  __syncthreads();
  total = s_total;

  // Best first: the score's key above the complement of the page index.
  unsigned long long key[kItems];
  int at[kItems];
  for (int u = 0; u < kItems; ++u) {
    const int j = threadIdx.x * kItems + u;
    at[u] = j;
    key[u] = j < got ? (static_cast<unsigned long long>(Key(score(out[r.sink + j]))) << 32) |
                           uint32_t(~uint32_t(out[r.sink + j]))
                     : 0ull;
  }
  Sort(tmp.sort).SortDescending(key, at);
  __syncthreads();
  double mass[kItems], read[kItems];
  for (int u = 0; u < kItems; ++u) {
    const int rank = threadIdx.x * kItems + u;
    const float x = rank < got ? score(out[r.sink + at[u]]) : NAN;
    mass[u] = isnan(x) ? 0.0 : exp(double(x - top) * double(scale));
  }
  ScanD(tmp.scan_d).InclusiveSum(mass, read);
  __syncthreads();
  // Taking rank + 1 winners leaves total - read[rank] unread.
  const double limit = p.unread_bound_mass * total;
  int take = (floor_k == 0 && total <= limit) ? 0 : got;
  for (int u = 0; u < kItems; ++u) {
    const int rank = threadIdx.x * kItems + u;
    if (rank < got && rank + 1 >= floor_k && total - read[u] <= limit) take = min(take, rank + 1);
  }
  take = ReduceI(tmp.reduce_i).Reduce(take, MinOf());
  if (threadIdx.x == 0) {
    s_take = take;
    Count(p.counters, take, cap);
  }
  __syncthreads();
  take = s_take;
  if (take == got) return;  // the select's row as it is

  for (int u = 0; u < kItems; ++u) {
    const int rank = threadIdx.x * kItems + u;
    if (rank < got) taken[at[u]] = rank < take;
  }
  __syncthreads();
  // The winners taken, in their ascending order, then the local pages.
  int keep[kItems], page[kItems];
  for (int u = 0; u < kItems; ++u) {
    const int j = threadIdx.x * kItems + u;
    keep[u] = j < got && taken[j];
    page[u] = j < got ? out[r.sink + j] : 0;
  }
  int slot[kItems];
  ScanI(tmp.scan_i).ExclusiveSum(keep, slot);
  __syncthreads();  // every winner read before any is overwritten
  for (int u = 0; u < kItems; ++u)
    if (keep[u]) out[r.sink + slot[u]] = page[u];
  const int locals = listed - r.sink - got;
  for (int c = 0; c < locals; c += kThreads) {  // moved toward the front: read a chunk, then write it
    const int j = c + threadIdx.x;
    const int v = j < locals ? out[r.sink + got + j] : 0;
    __syncthreads();
    if (j < locals) out[r.sink + take + j] = v;
    __syncthreads();
  }
  if (threadIdx.x == 0) p.out_count[row] = r.fixed + take;
}

}  // namespace

cudaError_t LaunchAdaptive(const AdaptiveParams& p, cudaStream_t stream) {
  const SelectShape& s = p.shape;
  if (s.batch <= 0 || s.dense) return cudaSuccess;
  if (!p.scores || !p.page_indptr || !p.out_indptr || !p.out_pages || !p.out_count || !p.counters)
    return cudaErrorInvalidValue;
  if (!(p.unread_bound_mass > 0 && p.unread_bound_mass < 1)) {
    SetLastErrorMessage("unsupported adaptive unread_bound_mass = " + std::to_string(p.unread_bound_mass) +
                        " (supported: (0, 1))");
    return cudaErrorInvalidValue;
  }
  if (s.gqa == GqaMode::kUnion || s.positions != 1 || !s.keep_scores)
    return Unsupported("adaptive select: gqa union, positions > 1 or scores not kept", s.positions, "kMax/kMean, 1");
  if (s.page_budget > kAdaptiveMaxPages) return Unsupported("adaptive page budget", s.page_budget, "1..2048 pages");
  if (p.mean_heads < 0 || p.mean_heads > s.group || (p.mean_heads > 0 && s.gqa != GqaMode::kMean))
    return Unsupported("adaptive mean_heads (kMean only, <= the group)", p.mean_heads, "0..group");
  AdaptiveKernel<<<s.batch * s.kv_heads, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace questkv::kernels::cuda
