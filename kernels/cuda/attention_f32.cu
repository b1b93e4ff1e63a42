// Attention instantiations for f32 K/V (see attention.cuh).
#include "kernels/cuda/attention.cuh"

namespace questkv::kernels::cuda {

QKV_ATTEND_INSTANCE(float);

}  // namespace questkv::kernels::cuda
