// Built without nvcc: the CUDA backend is not available.
#include "runtime/cuda_backend.h"

namespace questkv {

Result<std::unique_ptr<CudaBackend>> CudaBackend::Create(const Config&, PageAllocator*, TierMover*, SlotArena*) {
  return Status::Unimplemented("the CUDA backend was not built (no nvcc when configured)");
}

}  // namespace questkv
