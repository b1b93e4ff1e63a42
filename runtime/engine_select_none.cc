// Built without nvcc: runtime/engine_select.h is not available.
#include "runtime/engine_select.h"

namespace questkv {

namespace {
Status NoCuda() { return Status::Unimplemented("questkv was built without CUDA (no nvcc when configured)"); }
}  // namespace

Status DeviceUpdateSummaries(const DeviceSummaryArgs&, void*) { return NoCuda(); }
Status DeviceSelectPages(const DeviceSelectArgs&, const std::function<int32_t*(int)>&, void*) { return NoCuda(); }

}  // namespace questkv
