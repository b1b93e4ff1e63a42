#include "topology/gpu_probe.h"

#if QUESTKV_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace questkv {

#if QUESTKV_HAVE_CUDA

namespace {

std::string CudaMessage(const char* what, cudaError_t e) { return std::string(what) + ": " + cudaGetErrorString(e); }

// The device count, or a reason there is none. A failing call also sets the
// thread's last CUDA error; it is cleared so a machine without a driver does
// not surface as an error in some later, unrelated check.
int DeviceCount(std::string* none_reason) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    *none_reason = "no usable GPU (" + CudaMessage("cudaGetDeviceCount", e) + ")";
    return 0;
  }
  if (n == 0) *none_reason = "no GPU (cudaGetDeviceCount = 0)";
  return n;
}

Result<GpuDevice> DescribeDevice(int device) {
  GpuDevice d;
  d.device = device;
  char bus_id[32] = {};
  if (cudaError_t e = cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, device); e != cudaSuccess)
    return Status::IOError(CudaMessage("cudaDeviceGetPCIBusId", e));
  d.pci_bus_id = bus_id;
  cudaDeviceProp prop{};
  if (cudaError_t e = cudaGetDeviceProperties(&prop, device); e != cudaSuccess)
    return Status::IOError(CudaMessage("cudaGetDeviceProperties", e));
  d.name = prop.name;
  d.memory_bytes = prop.totalGlobalMem;
  return d;
}

// Device buffer, stream and events of one measurement, released together.
struct CopyRig {
  void* device_buffer = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  ~CopyRig() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (stream) cudaStreamDestroy(stream);
    if (device_buffer) cudaFree(device_buffer);
  }
};

Status MakeRig(std::size_t bytes, CopyRig* rig) {
  if (cudaError_t e = cudaMalloc(&rig->device_buffer, bytes); e != cudaSuccess) {
    cudaGetLastError();
    return Status::ResourceExhausted(CudaMessage("cudaMalloc", e));
  }
  if (cudaError_t e = cudaStreamCreateWithFlags(&rig->stream, cudaStreamNonBlocking); e != cudaSuccess)
    return Status::IOError(CudaMessage("cudaStreamCreate", e));
  if (cudaError_t e = cudaEventCreate(&rig->start); e != cudaSuccess)
    return Status::IOError(CudaMessage("cudaEventCreate", e));
  if (cudaError_t e = cudaEventCreate(&rig->stop); e != cudaSuccess)
    return Status::IOError(CudaMessage("cudaEventCreate", e));
  return Status::Ok();
}

// One copy timed by events on the rig's stream, in milliseconds.
Result<float> TimeOneCopy(const CopyRig& rig, void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
  cudaEventRecord(rig.start, rig.stream);
  if (cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, rig.stream); e != cudaSuccess)
    return Status::IOError(CudaMessage("cudaMemcpyAsync", e));
  cudaEventRecord(rig.stop, rig.stream);
  if (cudaError_t e = cudaEventSynchronize(rig.stop); e != cudaSuccess)
    return Status::IOError(CudaMessage("cudaEventSynchronize", e));
  float ms = 0;
  if (cudaError_t e = cudaEventElapsedTime(&ms, rig.start, rig.stop); e != cudaSuccess)
    return Status::IOError(CudaMessage("cudaEventElapsedTime", e));
  return ms;
}

// Copies until `seconds` of copy time have passed; one untimed warm-up first
// so first-touch and lazy context costs stay out of the figure.
Status TimeCopies(const CopyRig& rig, void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind,
                  double seconds, double* gb_per_s, int* copies) {
  QKV_RETURN_IF_ERROR(TimeOneCopy(rig, dst, src, bytes, kind).status());
  double total_ms = 0;
  *copies = 0;
  while (*copies == 0 || total_ms < seconds * 1e3) {
    QKV_ASSIGN_OR_RETURN(float ms, TimeOneCopy(rig, dst, src, bytes, kind));
    total_ms += ms;
    ++*copies;
  }
  *gb_per_s = total_ms > 0 ? double(bytes) * *copies / (total_ms * 1e-3) / 1e9 : 0;
  return Status::Ok();
}

}  // namespace

bool CudaBuilt() { return true; }

GpuList ListGpus() {
  GpuList list;
  const int n = DeviceCount(&list.none_reason);
  for (int device = 0; device < n; ++device) {
    auto d = DescribeDevice(device);
    if (d.ok()) list.devices.push_back(std::move(*d));
  }
  if (n > 0 && list.devices.empty()) list.none_reason = "GPUs present but none could be described";
  return list;
}

int CurrentGpu() {
  std::string none_reason;
  if (DeviceCount(&none_reason) == 0) return -1;
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return device;
}

Result<HostDeviceBandwidth> MeasureHostDeviceBandwidth(int device, void* host, std::size_t bytes, double seconds) {
  std::string none_reason;
  const int n = DeviceCount(&none_reason);
  if (n == 0) return Status::FailedPrecondition(none_reason);
  if (device < 0 || device >= n)
    return Status::FailedPrecondition("GPU " + std::to_string(device) + " does not exist (" + std::to_string(n) +
                                      " present)");
  if (host == nullptr || bytes == 0) return Status::InvalidArgument("host buffer is empty");
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
    return Status::IOError(CudaMessage("cudaSetDevice", e));
  CopyRig rig;
  QKV_RETURN_IF_ERROR(MakeRig(bytes, &rig));
  HostDeviceBandwidth bw;
  bw.bytes = bytes;
  QKV_RETURN_IF_ERROR(TimeCopies(rig, rig.device_buffer, host, bytes, cudaMemcpyHostToDevice, seconds,
                                 &bw.h2d_gb_per_s, &bw.copies_h2d));
  QKV_RETURN_IF_ERROR(TimeCopies(rig, host, rig.device_buffer, bytes, cudaMemcpyDeviceToHost, seconds,
                                 &bw.d2h_gb_per_s, &bw.copies_d2h));
  return bw;
}

#else  // !QUESTKV_HAVE_CUDA

bool CudaBuilt() { return false; }

GpuList ListGpus() {
  GpuList list;
  list.none_reason = "built without CUDA";
  return list;
}

int CurrentGpu() { return -1; }

Result<HostDeviceBandwidth> MeasureHostDeviceBandwidth(int, void*, std::size_t, double) {
  return Status::Unimplemented("host<->GPU bandwidth: built without CUDA");
}

#endif

}  // namespace questkv
