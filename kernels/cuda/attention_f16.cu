// Attention instantiations for f16 K/V (see attention.cuh).
#include "kernels/cuda/attention.cuh"

namespace questkv::kernels::cuda {

QKV_ATTEND_INSTANCE(__half);

}  // namespace questkv::kernels::cuda
