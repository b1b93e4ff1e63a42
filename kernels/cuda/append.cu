// Append + summary (eq. 8) on the device: one block per (touched page, KV head,
// sequence), one thread per head-dim element. Each thread copies its element of
// every new K/V row of that page and folds the keys into the summary in token
// order with the CPU twin's comparison (key < lo ? key : lo), so the result is
// bit for bit AppendTokensHeadsCpu's, signed zeros included. E4M3 summaries
// are folded in float from their codes' exact values and rounded outward
// once: AppendTokensHeadsCpu then SnapSummaryE4m3Cpu, code for code.
#include <cfloat>
#include <mutex>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/kernels_cuda.h"
#include "core/e4m3.h"

namespace questkv::kernels::cuda {
namespace {

thread_local std::string g_last_error;

// A stored bound as a float: e4m3 codes exactly, ±inf included (the
// hardware decode would make them NaN, which no key compares below).
template <typename SumT>
__device__ __forceinline__ float BoundToFloat(SumT x) {
  if constexpr (kIsE4m3<SumT>) return e4m3::ToFloat(x.bits);
  else return ToFloat(x);
}

template <typename KvT, typename SumT>
__global__ void AppendKernel(AppendParams p) {
  ChainWait();
  ChainRelease();
  const int j = blockIdx.x;  // touched page, counted from the first
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int S = p.page_size;
  const int D = p.head_dim;
  const bool inline_header = p.append_indptr == nullptr;
  const int row0 = inline_header ? 0 : p.append_indptr[b];
  const int n = inline_header ? p.max_new_tokens : p.append_indptr[b + 1] - row0;
  if (n <= 0) return;
  const int pos = inline_header ? p.start : p.start_pos[b];
  const int lp = pos / S + j;
  const int t0 = max(pos, lp * S);
  const int t1 = min(pos + n, (lp + 1) * S);
  if (t0 >= t1) return;
  const uint32_t page = p.page_ids[(inline_header ? 0 : p.page_indptr[b]) + lp];
  const long long slot = p.hbm_slot[std::size_t(page) * p.kv_heads + h];
  KvT* k_rows = static_cast<KvT*>(p.slots) + slot * 2 * S * D;
  KvT* v_rows = k_rows + std::size_t(S) * D;
  SumT* lo_row = static_cast<SumT*>(p.summaries) + (std::size_t(page) * p.kv_heads + h) * 2 * D;
  SumT* hi_row = lo_row + D;
  const KvT* k = static_cast<const KvT*>(p.k);
  const KvT* v = static_cast<const KvT*>(p.v);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float lo = BoundToFloat(lo_row[d]);
    float hi = BoundToFloat(hi_row[d]);
    for (int t = t0; t < t1; ++t) {
      const std::size_t src = (std::size_t(row0 + t - pos) * p.kv_heads + h) * D + d;
      const std::size_t dst = std::size_t(t - lp * S) * D + d;
      const KvT key = k[src];
      k_rows[dst] = key;
      v_rows[dst] = v[src];
      const float kf = ToFloat(key);
      lo = kf < lo ? kf : lo;
      hi = kf > hi ? kf : hi;
    }
    if constexpr (kIsE4m3<SumT>) {
      lo_row[d].bits = e4m3::RoundDown(lo);
      hi_row[d].bits = e4m3::RoundUp(hi);
    } else {
      lo_row[d] = FromFloat<SumT>(lo);
      hi_row[d] = FromFloat<SumT>(hi);
    }
  }
}

template <typename SumT>
__global__ void ResetKernel(SumT* summaries, const uint32_t* page_ids, int n, int kv_heads, int head_dim) {
  const std::size_t per_page = std::size_t(kv_heads) * 2 * head_dim;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < per_page * n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    const std::size_t page = page_ids[i / per_page];
    const std::size_t e = i % per_page;
    const bool is_max = (e / head_dim) % 2 == 1;
    if constexpr (kIsE4m3<SumT>) summaries[page * per_page + e].bits = is_max ? e4m3::kNegInf : e4m3::kPosInf;
    else summaries[page * per_page + e] = FromFloat<SumT>(is_max ? -INFINITY : INFINITY);
  }
}

}  // namespace

void SetLastErrorMessage(std::string message) { g_last_error = std::move(message); }
const std::string& LastErrorMessage() { return g_last_error; }

cudaError_t LaunchAppend(const AppendParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.max_new_tokens == 0) return cudaSuccess;
  if (p.batch < 0 || p.kv_heads <= 0 || p.page_size <= 0 || p.head_dim <= 0 || p.kv_heads > 65535 ||
      p.batch > 65535)
    return Unsupported("append batch/kv_heads", p.batch, "1..65535 each");
  if (!p.append_indptr && (p.batch != 1 || p.start < 0 || p.max_new_tokens < 0))
    return Unsupported("append with its header in the launch: batch", p.batch, "1, and start, rows >= 0");
  // A run of n tokens starting anywhere touches at most n / S + 2 pages.
  const dim3 grid(p.max_new_tokens / p.page_size + 2, p.kv_heads, p.batch);
  const int threads = p.head_dim < 256 ? p.head_dim : 256;
  QKV_DISPATCH_DTYPE(p.kv_dtype, KvT, {
    QKV_DISPATCH_SUMMARY_DTYPE(p.summary_dtype, SumT, {
      if (const cudaError_t e = LaunchChained(AppendKernel<KvT, SumT>, grid, dim3(threads), 0, stream, p.chain, p);
          e != cudaSuccess)
        return e;
    })
  })
  return cudaGetLastError();
}

cudaError_t LaunchResetSummaries(void* summaries, DType summary_dtype, const uint32_t* page_ids, int n,
                                 int kv_heads, int head_dim, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  QKV_DISPATCH_SUMMARY_DTYPE(summary_dtype, SumT, {
    ResetKernel<SumT><<<256, 256, 0, stream>>>(static_cast<SumT*>(summaries), page_ids, n, kv_heads,
                                                head_dim);
  })
  return cudaGetLastError();
}

}  // namespace questkv::kernels::cuda
