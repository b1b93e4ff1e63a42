// The two-stage re-rank on the device (SelectionPolicy::rerank;
// selector/select.cc's Selector::Rerank). A row's candidates are the pages a
// select with a widened budget (RerankShape) chose beyond its sink and local
// pages, the top ceil(rerank * k) by the bound. Each gets its exact score,
// the group's aggregate (max or mean over its query heads) of the page's
// largest logit q·k over its valid keys, read from the page's HBM slot or,
// not resident, from its pinned host home over PCIe; a page on neither (on
// disk) keeps its bound. The best k stay, ties toward the lower page, beside
// the sink and local pages. The CPU backend's arithmetic, so the selections
// are the same bits: each logit summed over d in order with a rounding per
// product and per sum, maxima taken in token and head order, the mean's sum
// in order and then divided.
//
// Two launches. ExactKernel: a row's candidates (a contiguous run of its
// ascending list, between the sink and the local pages) split over several
// blocks, a thread per (candidate, token) for its query heads' logits (the
// key row read once, 16 bytes a load; the heads' sums are independent chains
// in flight together), then a thread per candidate for its maxima and
// aggregate, into the workspace. KeepKernel:
// a block per row keeps a candidate when fewer than k others beat it, and
// writes the row (block scans).
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cmath>
#include <string>

#include "core/constants.h"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/kernels_cuda.h"
#include "kernels/cuda/select_common.cuh"

namespace questkv::kernels::cuda {
namespace {

constexpr int kRerankThreads = 256;
constexpr int kSlice = 16;  // candidates an ExactKernel block scores (x page_size threads' work)

// The widened select's budget for a layer's budget: the sink and local pages
// plus ceil(rerank * k) candidates, k = budget - sink - local (select.cc's
// Rerank for rows longer than sink + local; shorter rows take every page).
int64_t WidenedBudget(const SelectShape& s, double rerank) {
  const int64_t fixed = int64_t(s.sink_pages) + std::max(s.local_pages, 1);
  const int64_t k = s.page_budget - fixed;
  if (k <= 0) return s.page_budget;
  return fixed + RerankCandidates(rerank, k, INT64_MAX);
}

template <typename T>
__device__ __forceinline__ const T* KeysOf(const RerankParams& p, uint32_t page, int h, std::size_t piece) {
  const int32_t slot = p.hbm_slot[std::size_t(page) * p.shape.kv_heads + h];
  if (slot >= 0) return reinterpret_cast<const T*>(static_cast<const char*>(p.slots) + std::size_t(slot) * 2 * piece);
  const void* home = p.host_addr[page];
  if (home) return reinterpret_cast<const T*>(static_cast<const char*>(home) + std::size_t(h) * piece);
  return nullptr;
}

// A row's candidates: listed entries [*lo, *hi), those between its sink and
// local pages (the list is ascending).
__device__ __forceinline__ void CandidateRun(const RowPolicy& r, const int32_t* list, int listed, int* lo, int* hi) {
  int a = 0, b = listed;
  while (a < b && list[a] < r.sink) ++a;
  while (b > a && list[b - 1] >= r.n - r.local) --b;
  *lo = a, *hi = b;
}

struct RowView {
  int b, h, n;
  RowPolicy r;
  const int32_t* list;
  int listed;
};
__device__ __forceinline__ RowView ViewRow(const RerankParams& p, int row) {
  const SelectShape& s = p.shape;
  RowView v;
  v.b = row / s.kv_heads, v.h = row % s.kv_heads;
  v.n = p.page_indptr[v.b + 1] - p.page_indptr[v.b];
  v.r = PolicyFor(s, v.n);
  v.list = p.cand_pages + p.cand_indptr[row];
  v.listed = min(p.cand_count[row], p.cand_indptr[row + 1] - p.cand_indptr[row]);
  return v;
}

// Block (row, slice): candidates [lo + slice * kSlice, ...) of the row.
template <typename T, typename SumT, int D, int G>
__global__ void __launch_bounds__(kRerankThreads) ExactKernel(const RerankParams p, float* exact) {
  const SelectShape& s = p.shape;
  const RowView v = ViewRow(p, blockIdx.x);
  if (v.r.all || v.r.k == 0) return;  // nothing to re-rank
  int lo, hi;
  CandidateRun(v.r, v.list, v.listed, &lo, &hi);
  const int c0 = lo + int(blockIdx.y) * kSlice;
  const int cn = min(kSlice, hi - c0);
  if (cn <= 0) return;
  const int S = s.page_size;
  __shared__ float q[G * D];
  extern __shared__ float logit[];  // [kSlice][G][S]
  const T* qg = static_cast<const T*>(p.q) + (std::size_t(v.b) * s.kv_heads * G + std::size_t(v.h) * G) * D;
  for (int i = threadIdx.x; i < G * D; i += blockDim.x) q[i] = ToFloat(qg[i]);
  __syncthreads();
  const uint32_t* ids = p.page_ids + p.page_indptr[v.b];
  const std::size_t piece = std::size_t(S) * D * sizeof(T);
  constexpr int kVec = 16 / sizeof(T);  // key elements a load brings
  for (int w = threadIdx.x; w < cn * S; w += blockDim.x) {
    const int ci = w / S, t = w % S;
    const int pg = v.list[c0 + ci];
    const int len = pg == v.n - 1 ? p.last_len[v.b] : S;
    const T* k = t < len ? KeysOf<T>(p, ids[pg], v.h, piece) : nullptr;
    // -inf past the valid tokens, or with no keys to read (the page keeps its bound).
    float dot[G];
#pragma unroll
    for (int gi = 0; gi < G; ++gi) dot[gi] = k ? 0.f : -INFINITY;
    if (k) {
      const uint4* row = reinterpret_cast<const uint4*>(k + std::size_t(t) * D);
#pragma unroll 4
      for (int d0 = 0; d0 < D; d0 += kVec) {
        const uint4 raw = row[d0 / kVec];
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float x = ToFloat(e[j]);
#pragma unroll
          for (int gi = 0; gi < G; ++gi) dot[gi] = __fadd_rn(dot[gi], __fmul_rn(q[gi * D + d0 + j], x));
        }
      }
    }
#pragma unroll
    for (int gi = 0; gi < G; ++gi) logit[(ci * G + gi) * S + t] = dot[gi];
  }
  __syncthreads();
  for (int ci = threadIdx.x; ci < cn; ci += blockDim.x) {
    const int pg = v.list[c0 + ci];
    const int len = pg == v.n - 1 ? p.last_len[v.b] : S;
    float agg;
    if (!KeysOf<T>(p, ids[pg], v.h, piece)) {  // on disk: its bound, as the select scored it
      const SumT* box = static_cast<const SumT*>(p.summaries) + (std::size_t(ids[pg]) * s.kv_heads + v.h) * 2 * D;
      float bound[G];
      ScoreHeadPage<T, SumT, D, G>(box, qg, bound);
      agg = Aggregate<G>(s.gqa, bound);
    } else {
      agg = s.gqa == GqaMode::kMax ? -INFINITY : 0.f;
#pragma unroll
      for (int gi = 0; gi < G; ++gi) {
        float best = -INFINITY;
        for (int t = 0; t < len; ++t) {
          const float x = logit[(ci * G + gi) * S + t];
          best = best < x ? x : best;  // std::max(best, x): a NaN logit leaves best
        }
        agg = s.gqa == GqaMode::kMax ? (agg < best ? best : agg) : __fadd_rn(agg, __fdiv_rn(best, float(G)));
      }
    }
    exact[p.cand_indptr[blockIdx.x] + c0 + ci] = agg;
  }
}

// A block per row: a candidate stays when fewer than k others beat it (a
// higher key, or the same key at a lower page); then the row in list order,
// its sink and local pages with the kept candidates.
__global__ void __launch_bounds__(kRerankThreads) KeepKernel(const RerankParams p, const float* exact) {
  const int row = blockIdx.x;
  const RowView v = ViewRow(p, row);
  extern __shared__ uint8_t keep[];  // [max_listed]
  int lo = 0, hi = 0;
  if (!v.r.all && v.r.k > 0) CandidateRun(v.r, v.list, v.listed, &lo, &hi);
  const float* e = exact + p.cand_indptr[row];
  for (int i = lo + int(threadIdx.x); i < hi; i += blockDim.x) {
    const uint32_t ki = Key(e[i]);
    int beaten = 0;
    for (int j = lo; j < hi && beaten < v.r.k; ++j) {
      const uint32_t kj = Key(e[j]);
      beaten += kj > ki || (kj == ki && j < i);
    }
    keep[i - lo] = beaten < v.r.k;
  }
  __syncthreads();
  // The row in list order, a block scan a round (one thread emitting it
  // serially waited on a global load per entry: ~0.1 ms a layer).
  using Scan = cub::BlockScan<int, kRerankThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  int32_t* out = p.out_pages + p.out_indptr[row];
  const int cap = p.out_indptr[row + 1] - p.out_indptr[row];
  int m = 0;  // entries emitted before this round (the same in every thread)
  for (int i0 = 0; i0 < v.listed; i0 += kRerankThreads) {
    const int i = i0 + int(threadIdx.x);
    // With k == 0 the widened select chose the sink and local pages only (lo == hi).
    const bool emit = i < v.listed && !(i >= lo && i < hi && !keep[i - lo]);
    int at, total;
    Scan(scan_tmp).ExclusiveSum(int(emit), at, total);
    if (emit && m + at < cap) out[m + at] = v.list[i];
    m += total;
    __syncthreads();  // scan_tmp again
  }
  if (threadIdx.x == 0) p.out_count[row] = min(m, cap);
}

}  // namespace

SelectShape RerankShape(const SelectShape& s, double rerank) {
  SelectShape w = s;
  w.page_budget = WidenedBudget(s, rerank);
  return w;
}

cudaError_t LaunchRerank(const RerankParams& p, cudaStream_t stream) {
  const SelectShape& s = p.shape;
  const int rows = s.batch * s.kv_heads;
  const dim3 grid(rows, std::max(1, (p.max_listed + kSlice - 1) / kSlice));
  const std::size_t logit_bytes = std::size_t(kSlice) * s.group * s.page_size * sizeof(float);
  QKV_DISPATCH_DTYPE(p.kv_dtype, T, {
    QKV_DISPATCH_HEAD_DIM(s.head_dim, D, {
      QKV_DISPATCH_GROUP(s.group, G, {
        auto kernel = p.summary_dtype == DType::kE4M3 ? ExactKernel<T, E4m3Code, D, G> : ExactKernel<T, T, D, G>;
        if (logit_bytes + sizeof(float) * G * D > 48 * 1024) {
          if (const cudaError_t e =
                  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(logit_bytes));
              e != cudaSuccess)
            return e;
        }
        kernel<<<grid, kRerankThreads, logit_bytes, stream>>>(p, p.workspace);
      })
    })
  })
  KeepKernel<<<rows, kRerankThreads, std::max(p.max_listed, 1), stream>>>(p, p.workspace);
  return cudaGetLastError();
}

}  // namespace questkv::kernels::cuda
