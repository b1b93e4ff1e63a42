// Attention instantiations for bf16 K/V (see attention.cuh).
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/dispatch.cuh"

namespace questkv::kernels::cuda {

template <>
cudaError_t LaunchAttendTyped<__nv_bfloat16>(const AttendPlan& plan, const AttendParams& p, cudaStream_t stream) {
  const AttendShape& s = plan.shape;
  const dim3 grid(s.rows, plan.splits);
  const PartialView part = Partials(p.workspace, s.rows, plan.splits, s.group, s.head_dim);
  QKV_DISPATCH_HEAD_DIM(s.head_dim, D, {
    QKV_DISPATCH_PAGE_SIZE(s.page_size, S, {
      QKV_DISPATCH_GROUP(s.group, G, {
        AttendKernel<__nv_bfloat16, D, S, G><<<grid, kAttendWarps * 32, 0, stream>>>(p, s.kv_heads, plan.pages_per_split,
                                                                          plan.splits, part);
      })
    })
  })
  return cudaGetLastError();
}

}  // namespace questkv::kernels::cuda
