// Built without nvcc: the CUDA backend is not available.
#include "runtime/backend.h"

namespace questkv {

Result<std::unique_ptr<DataPlane>> MakeCudaBackend(const Config&, PageAllocator*, TierMover*, SlotArena*) {
  return Status::Unimplemented("the CUDA backend was not built (no nvcc when configured)");
}

}  // namespace questkv
