// The GPUs the CUDA runtime sees, and host<->device copy bandwidth.
//
// Together with host_memory.cc this is the only topology code that calls CUDA.
// Built against cudart when QUESTKV_HAVE_CUDA, as stubs otherwise, so callers
// need no #if. A machine without a GPU or a driver is not an error: it is an
// empty list with the reason.
// Thread safety: all functions may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "questkv/status.h"

namespace questkv {

struct GpuDevice {
  int device = -1;           // CUDA ordinal
  std::string pci_bus_id;    // "0000:65:00.0"
  std::string name;          // "NVIDIA H200"
  uint64_t memory_bytes = 0;
};

struct GpuList {
  std::vector<GpuDevice> devices;
  std::string none_reason;   // why `devices` is empty ("built without CUDA", ...)
};

// True when this build has the CUDA backend.
bool CudaBuilt();

// Every GPU with its PCI bus id; never fails (see GpuList::none_reason).
GpuList ListGpus();

// The device the calling thread uses, or -1 without a usable GPU.
int CurrentGpu();

struct HostDeviceBandwidth {
  double h2d_gb_per_s = 0;
  double d2h_gb_per_s = 0;
  std::size_t bytes = 0;     // one copy
  int copies_h2d = 0, copies_d2h = 0;
};

// Times whole-buffer cudaMemcpyAsync copies between `host` (ideally pinned)
// and a device buffer of the same size, with events, for about `seconds` per
// direction (at least one copy each). Unimplemented without CUDA;
// FailedPrecondition without a usable GPU; ResourceExhausted when the device
// buffer cannot be had.
Result<HostDeviceBandwidth> MeasureHostDeviceBandwidth(int device, void* host, std::size_t bytes, double seconds);

}  // namespace questkv
