// Plan/run of the sparse decode attention and the merge of split partials
// (the arithmetic of kernels/attention_state.h MergeState, split by split).
#include <algorithm>
#include <string>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/dispatch.cuh"

namespace questkv::kernels::cuda {
namespace {

template <typename T>
__global__ void MergeSplitsKernel(PartialView part, int splits, int group, int head_dim, T* out, float* lse) {
  const int row = blockIdx.x;
  for (int i = threadIdx.x; i < group * head_dim; i += blockDim.x) {
    const int g = i / head_dim, c = i % head_dim;
    float m = -INFINITY, d = 0.f, o = 0.f;
    for (int s = 0; s < splits; ++s) {
      const std::size_t at = (std::size_t(row) * splits + s) * group + g;
      const float d_b = part.d[at];
      if (d_b == 0.f) continue;
      const float m_b = part.m[at];
      const float o_b = part.o[at * head_dim + c];
      if (d == 0.f) {
        m = m_b, d = d_b, o = o_b;
        continue;
      }
      const float mm = fmaxf(m, m_b);
      const float wa = d * __expf(m - mm);
      const float wb = d_b * __expf(m_b - mm);
      o = (o * wa + o_b * wb) / (wa + wb);
      m = mm;
      d = wa + wb;
    }
    out[std::size_t(row) * group * head_dim + i] = FromFloat<T>(o);
    if (lse && c == 0) lse[row * group + g] = d == 0.f ? -INFINITY : m + logf(d);
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
  if (splits > 65535) return fail("too many splits");
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
  QKV_DISPATCH_DTYPE(s.dtype, T, {
    MergeSplitsKernel<T><<<s.rows, threads, 0, stream>>>(part, plan.splits, s.group, s.head_dim,
                                                         static_cast<T*>(p.o), p.lse);
  })
  return cudaGetLastError();
}

}  // namespace questkv::kernels::cuda
