// Plan/run of the sparse decode attention and the merge of split partials
// (the arithmetic of kernels/attention_state.h MergeState, split by split).
#include <algorithm>
#include <string>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/dispatch.cuh"

namespace questkv::kernels::cuda {
namespace {

// One block per row. The splits' weights d_s * exp(m_s - M) are computed in
// parallel into shared memory first, so the o sums below issue independent
// loads (a sequential MergeState chain was latency-bound: ~0.7 us per split).
template <typename T>
__global__ void MergeSplitsKernel(PartialView part, int splits, int group, int head_dim, T* out, float* lse) {
  extern __shared__ float w[];  // [G][splits] weights, then [G] max, [G] sum
  float* m_max = w + group * splits;
  float* w_sum = m_max + group;
  const int row = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const std::size_t at0 = std::size_t(row) * splits * group;  // [splits][G] of this row
  for (int g = warp; g < group; g += warps) {
    float mm = -INFINITY;
    for (int s = lane; s < splits; s += 32)
      if (part.d[at0 + s * group + g] != 0.f) mm = fmaxf(mm, part.m[at0 + s * group + g]);
    for (int off = 16; off; off >>= 1) mm = fmaxf(mm, __shfl_xor_sync(0xFFFFFFFFu, mm, off));
    float sum = 0.f;
    for (int s = lane; s < splits; s += 32) {
      const float d = part.d[at0 + s * group + g];
      const float ws = d == 0.f ? 0.f : d * __expf(part.m[at0 + s * group + g] - mm);
      w[g * splits + s] = ws;
      sum += ws;
    }
    for (int off = 16; off; off >>= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, off);
    if (lane == 0) m_max[g] = mm, w_sum[g] = sum;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < group * head_dim; i += blockDim.x) {
    const int g = i / head_dim, c = i % head_dim;
    float o = 0.f;
#pragma unroll 8
    for (int s = 0; s < splits; ++s) o += w[g * splits + s] * part.o[(at0 + std::size_t(s) * group + g) * head_dim + c];
    const float sum = w_sum[g];
    out[std::size_t(row) * group * head_dim + i] = FromFloat<T>(sum == 0.f ? 0.f : o / sum);
    if (lse && c == 0) lse[row * group + g] = sum == 0.f ? -INFINITY : m_max[g] + logf(sum);
  }
}

bool Supported(int v, std::initializer_list<int> ok) { return std::find(ok.begin(), ok.end(), v) != ok.end(); }

}  // namespace

bool PlanAttend(const AttendShape& s, int max_pages, int num_sms, AttendPlan* plan, std::string* error) {
  auto fail = [&](std::string m) {
    if (error) *error = "PlanAttend: " + std::move(m);
    return false;
  };
  if (s.rows < 1) return fail("rows = " + std::to_string(s.rows) + ", must be >= 1");
  if (s.kv_heads < 1 || s.rows % s.kv_heads != 0)
    return fail("rows = " + std::to_string(s.rows) + " is not a multiple of kv_heads = " + std::to_string(s.kv_heads));
  if (!Supported(s.group, {1, 2, 4, 8})) return fail("GQA group = " + std::to_string(s.group) + " (supported: 1, 2, 4, 8)");
  if (!Supported(s.head_dim, {64, 128, 256}))
    return fail("head_dim = " + std::to_string(s.head_dim) + " (supported: 64, 128, 256)");
  if (!Supported(s.page_size, {8, 16, 32, 64}))
    return fail("page_size = " + std::to_string(s.page_size) + " (supported: 8, 16, 32, 64)");
  if (max_pages < 0) return fail("max_pages = " + std::to_string(max_pages));
  plan->shape = s;
  plan->max_pages = max_pages;
  // Enough blocks for about four per multiprocessor; a row is split only
  // when the rows alone cannot fill the chip.
  const long long target = 4LL * std::max(1, num_sms);
  int splits = s.rows >= target ? 1 : int((target + s.rows - 1) / s.rows);
  splits = std::max(1, std::min(splits, std::max(1, max_pages)));
  int pps = std::max(1, (max_pages + splits - 1) / splits);
  splits = std::max(1, (max_pages + pps - 1) / pps);
  if (std::size_t(splits) * s.group * 4 > 40 * 1024) return fail("too many splits: " + std::to_string(splits));
  plan->splits = splits;
  plan->pages_per_split = pps;
  plan->workspace_bytes =
      splits > 1 ? std::size_t(s.rows) * splits * s.group * (s.head_dim + 2) * sizeof(float) : 0;
  return true;
}

cudaError_t RunAttend(const AttendPlan& plan, const AttendParams& p, cudaStream_t stream) {
  const AttendShape& s = plan.shape;
  cudaError_t e = cudaSuccess;
  QKV_DISPATCH_DTYPE(s.dtype, T, { e = LaunchAttendTyped<T>(plan, p, stream); })
  if (e != cudaSuccess || plan.splits == 1) return e;
  const PartialView part = Partials(p.workspace, s.rows, plan.splits, s.group, s.head_dim);
  const int threads = std::min(1024, s.group * s.head_dim);
  const std::size_t smem = (std::size_t(s.group) * plan.splits + 2 * s.group) * sizeof(float);
  QKV_DISPATCH_DTYPE(s.dtype, T, {
    MergeSplitsKernel<T><<<s.rows, threads, smem, stream>>>(part, plan.splits, s.group, s.head_dim,
                                                         static_cast<T*>(p.o), p.lse);
  })
  return cudaGetLastError();
}

}  // namespace questkv::kernels::cuda
