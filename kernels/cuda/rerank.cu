// The two-stage re-rank on the device (SelectionPolicy::rerank;
// selector/select.cc's Selector::Rerank). A row's candidates are the pages a
// select with a widened budget (PlanRerank) chose beyond its sink and local
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
// A block per row. Candidates go through shared memory a chunk at a time: a
// thread per (candidate, query head, token) logit, then a thread per
// (candidate, query head) maximum, then a thread per candidate aggregate.
// The ranking counts, for each candidate, the candidates that beat it.
#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/kernels_cuda.h"
#include "kernels/cuda/select_common.cuh"

namespace questkv::kernels::cuda {
namespace {

constexpr int kRerankThreads = 256;
constexpr int kLogitFloats = 8192;  // a chunk's logits in shared memory (32 KiB)

// The widened select's budget for a layer's budget: the sink and local pages
// plus ceil(rerank * k) candidates, k = budget - sink - local (select.cc's
// Rerank for rows longer than sink + local; shorter rows take every page).
int64_t WidenedBudget(const SelectShape& s, double rerank) {
  const int64_t fixed = int64_t(s.sink_pages) + std::max(s.local_pages, 1);
  const int64_t k = s.page_budget - fixed;
  if (k <= 0) return s.page_budget;
  return fixed + int64_t(std::ceil(rerank * double(k)));
}

template <typename T>
__device__ __forceinline__ const T* KeysOf(const RerankParams& p, uint32_t page, int h, std::size_t piece) {
  const int32_t slot = p.hbm_slot[std::size_t(page) * p.shape.kv_heads + h];
  if (slot >= 0) return reinterpret_cast<const T*>(static_cast<const char*>(p.slots) + std::size_t(slot) * 2 * piece);
  const void* home = p.host_addr[page];
  if (home) return reinterpret_cast<const T*>(static_cast<const char*>(home) + std::size_t(h) * piece);
  return nullptr;
}

template <typename T, typename SumT, int D, int G>
__global__ void __launch_bounds__(kRerankThreads) RerankKernel(const RerankParams p) {
  const SelectShape& s = p.shape;
  const int row = blockIdx.x, b = row / s.kv_heads, h = row % s.kv_heads;
  const int n = p.page_indptr[b + 1] - p.page_indptr[b];
  const RowPolicy r = PolicyFor(s, n);
  const int32_t* cand = p.cand_pages + p.cand_indptr[row];
  const int listed = min(p.cand_count[row], p.cand_indptr[row + 1] - p.cand_indptr[row]);
  int32_t* out = p.out_pages + p.out_indptr[row];
  const int cap = p.out_indptr[row + 1] - p.out_indptr[row];
  if (r.all || r.k == 0) {  // every page, or sink and local only: the widened select's row is the answer
    int m = 0;
    for (int i = 0; i < listed; ++i) {
      const int pg = cand[i];
      if (!r.all && !Skipped(r, pg)) continue;
      if (threadIdx.x == 0 && m < cap) out[m] = pg;
      ++m;
    }
    if (threadIdx.x == 0) p.out_count[row] = min(m, cap);
    return;
  }
  extern __shared__ float smem[];
  const int S = s.page_size;
  const int chunk = max(1, kLogitFloats / (G * S));
  float* logit = smem;                      // [chunk][G][S]
  float* exact = logit + kLogitFloats;      // [listed] (candidates in list order; fixed pages hold nothing)
  int32_t* index = reinterpret_cast<int32_t*>(exact + p.max_listed);  // candidate -> list position
  __shared__ int count;
  __shared__ float q[G * D];
  const T* qg = static_cast<const T*>(p.q) + (std::size_t(b) * s.kv_heads * G + std::size_t(h) * G) * D;
  for (int i = threadIdx.x; i < G * D; i += blockDim.x) q[i] = ToFloat(qg[i]);
  if (threadIdx.x == 0) {
    int c = 0;
    for (int i = 0; i < listed; ++i)
      if (!Skipped(r, cand[i])) index[c++] = i;
    count = c;
  }
  __syncthreads();
  const int c = count;
  const uint32_t* ids = p.page_ids + p.page_indptr[b];
  const std::size_t piece = std::size_t(S) * D * sizeof(T);
  for (int c0 = 0; c0 < c; c0 += chunk) {
    const int cn = min(chunk, c - c0);
    for (int w = threadIdx.x; w < cn * G * S; w += blockDim.x) {
      const int ci = w / (G * S), gi = (w / S) % G, t = w % S;
      const int pg = cand[index[c0 + ci]];
      const int len = pg == n - 1 ? p.last_len[b] : S;
      float dot = -INFINITY;  // past the valid tokens, or no keys to read (the page keeps its bound)
      const T* k = t < len ? KeysOf<T>(p, ids[pg], h, piece) : nullptr;
      if (k) {
        dot = 0.f;
        k += std::size_t(t) * D;
        for (int d = 0; d < D; ++d) dot = __fadd_rn(dot, __fmul_rn(q[gi * D + d], ToFloat(k[d])));
      }
      logit[w] = dot;
    }
    __syncthreads();
    for (int ci = threadIdx.x; ci < cn; ci += blockDim.x) {
      const int pg = cand[index[c0 + ci]];
      const int len = pg == n - 1 ? p.last_len[b] : S;
      const bool readable = KeysOf<T>(p, ids[pg], h, piece) != nullptr;
      float best[G];
#pragma unroll
      for (int gi = 0; gi < G; ++gi) {
        float m = -INFINITY;
        for (int t = 0; t < len; ++t) {
          const float x = logit[(ci * G + gi) * S + t];
          m = m < x ? x : m;  // std::max(m, x): a NaN logit leaves m
        }
        best[gi] = m;
      }
      float agg;
      if (!readable) {  // on disk: its bound, as the select scored it
        const SumT* lo = static_cast<const SumT*>(p.summaries) + (std::size_t(ids[pg]) * s.kv_heads + h) * 2 * D;
        float bound[G];
        ScoreHeadPage<T, SumT, D, G>(lo, qg, bound);
        agg = Aggregate<G>(s.gqa, bound);
      } else if (s.gqa == GqaMode::kMax) {
        agg = -INFINITY;
#pragma unroll
        for (int gi = 0; gi < G; ++gi) agg = agg < best[gi] ? best[gi] : agg;
      } else {
        agg = 0.f;
#pragma unroll
        for (int gi = 0; gi < G; ++gi) agg = __fadd_rn(agg, __fdiv_rn(best[gi], float(G)));
      }
      exact[c0 + ci] = agg;
    }
    __syncthreads();
  }
  // Keep the k best: a candidate stays when fewer than k beat it (higher key,
  // or the same key at a lower page). Then the row in list order.
  uint8_t* keep = reinterpret_cast<uint8_t*>(logit);
  for (int i = threadIdx.x; i < c; i += blockDim.x) {
    const uint32_t ki = Key(exact[i]);
    int beaten = 0;
    for (int j = 0; j < c && beaten < r.k; ++j) {
      const uint32_t kj = Key(exact[j]);
      beaten += kj > ki || (kj == ki && j < i);
    }
    keep[i] = beaten < r.k;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int m = 0, ci = 0;
    for (int i = 0; i < listed; ++i) {
      const int pg = cand[i];
      const bool fixed = Skipped(r, pg);
      if (!fixed && !keep[ci++]) continue;
      if (m < cap) out[m] = pg;
      ++m;
    }
    p.out_count[row] = min(m, cap);
  }
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
  const std::size_t smem = kLogitFloats * sizeof(float) + std::size_t(p.max_listed) * (sizeof(float) + sizeof(int32_t));
  QKV_DISPATCH_DTYPE(p.kv_dtype, T, {
    QKV_DISPATCH_HEAD_DIM(s.head_dim, D, {
      QKV_DISPATCH_GROUP(s.group, G, {
        auto kernel = p.summary_dtype == DType::kE4M3 ? RerankKernel<T, E4m3Code, D, G> : RerankKernel<T, T, D, G>;
        if (smem + sizeof(float) * G * D > 48 * 1024) {
          if (const cudaError_t e =
                  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
              e != cudaSuccess)
            return e;
        }
        kernel<<<rows, kRerankThreads, smem, stream>>>(p);
      })
    })
  })
  return cudaGetLastError();
}

}  // namespace questkv::kernels::cuda
