// Attention instantiations for bf16 K/V (see attention.cuh).
#include "kernels/cuda/attention.cuh"

namespace questkv::kernels::cuda {

QKV_ATTEND_INSTANCE(__nv_bfloat16);

}  // namespace questkv::kernels::cuda
