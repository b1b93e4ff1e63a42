#include "parallel/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace questkv {

namespace {

static_assert(sizeof(ncclUniqueId) == sizeof(NcclId::bytes), "NCCL_UNIQUE_ID_BYTES changed");

Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  (void)cudaGetLastError();  // reported here: not left for the next caller's cudaGetLastError
  return Status::Internal(std::string(what) + ": " + cudaGetErrorString(e));
}

Status NcclStatus(ncclResult_t r, ncclComm_t comm, const char* what) {
  if (r == ncclSuccess) return Status::Ok();
  std::string m = std::string(what) + ": " + ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') m += std::string(" (") + last + ")";
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) return Status::InvalidArgument(m);
  if (r == ncclSystemError || r == ncclRemoteError) return Status::IOError(m);
  return Status::Internal(m);
}

// Whether the GPU can use p as it is (device or managed memory).
bool OnDevice(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();  // an unknown pointer is host memory
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

}  // namespace

struct NcclCommunicator::Impl {
  int rank = 0;
  int size = 0;
  int device = 0;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  char* staging = nullptr;  // [staging_bytes] device
  std::size_t staging_bytes = 0;
  float* flag = nullptr;  // one device float for Barrier
  Status closed;          // OK while usable

  ~Impl() {
    cudaSetDevice(device);
    if (comm != nullptr) ncclCommDestroy(comm);
    if (staging != nullptr) cudaFree(staging);
    if (flag != nullptr) cudaFree(flag);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  Status Usable() const {
    if (!closed.ok()) return Status::FailedPrecondition("NCCL communicator closed: " + closed.ToString());
    return CudaStatus(cudaSetDevice(device), "cudaSetDevice");
  }

  // Device views of a call's buffers: device memory as it is, host memory
  // through the staging area (the send copied in now, on the stream).
  Status Stage(const void* send, std::size_t send_bytes, void* recv, std::size_t recv_bytes, const void** dsend,
               void** drecv) {
    const bool send_dev = OnDevice(send), recv_dev = OnDevice(recv);
    const std::size_t need = (send_dev ? 0 : send_bytes) + (recv_dev ? 0 : recv_bytes);
    if (need > staging_bytes)
      return Status::ResourceExhausted("NCCL communicator: host buffers need " + std::to_string(need) +
                                       " staging bytes, the communicator has " + std::to_string(staging_bytes));
    char* at = staging;
    *drecv = recv_dev ? recv : at;
    if (!recv_dev) at += recv_bytes;
    *dsend = send;
    if (!send_dev) {
      QKV_RETURN_IF_ERROR(
          CudaStatus(cudaMemcpyAsync(at, send, send_bytes, cudaMemcpyHostToDevice, stream), "staging send"));
      *dsend = at;
    }
    return Status::Ok();
  }

  // Copies a staged recv back to the host, waits for the stream and reports
  // any error NCCL met meanwhile.
  Status Finish(void* recv, const void* drecv, std::size_t recv_bytes) {
    if (drecv != recv)
      QKV_RETURN_IF_ERROR(
          CudaStatus(cudaMemcpyAsync(recv, drecv, recv_bytes, cudaMemcpyDeviceToHost, stream), "unstaging recv"));
    QKV_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize"));
    ncclResult_t async = ncclSuccess;
    QKV_RETURN_IF_ERROR(NcclStatus(ncclCommGetAsyncError(comm, &async), comm, "ncclCommGetAsyncError"));
    return NcclStatus(async, comm, "NCCL collective");
  }

  Status AllGather(const void* send, std::size_t bytes, void* recv) {
    const void* dsend = nullptr;
    void* drecv = nullptr;
    QKV_RETURN_IF_ERROR(Stage(send, bytes, recv, bytes * size, &dsend, &drecv));
    QKV_RETURN_IF_ERROR(NcclStatus(ncclAllGather(dsend, drecv, bytes, ncclChar, comm, stream), comm, "ncclAllGather"));
    return Finish(recv, drecv, bytes * size);
  }

  Status AllReduceSum(const float* send, float* recv, std::size_t count) {
    const void* dsend = nullptr;
    void* drecv = nullptr;
    const std::size_t bytes = count * sizeof(float);
    QKV_RETURN_IF_ERROR(Stage(send, bytes, recv, bytes, &dsend, &drecv));
    QKV_RETURN_IF_ERROR(
        NcclStatus(ncclAllReduce(dsend, drecv, count, ncclFloat, ncclSum, comm, stream), comm, "ncclAllReduce"));
    return Finish(recv, drecv, bytes);
  }

  Status Barrier() {
    QKV_RETURN_IF_ERROR(NcclStatus(ncclAllReduce(flag, flag, 1, ncclFloat, ncclMax, comm, stream), comm, "barrier"));
    return Finish(flag, flag, sizeof(float));
  }
};

NcclCommunicator::NcclCommunicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

NcclCommunicator::~NcclCommunicator() = default;

Result<NcclId> NcclCommunicator::NewId() {
  // Also here, not only in Create: NewId is usually called before the rank
  // threads start, and setenv while another thread reads the environment
  // (CUDA and NCCL initialising in Create) is a data race. Once set, the
  // setenv in Create changes nothing.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  ncclUniqueId uid;
  const ncclResult_t r = ncclGetUniqueId(&uid);
  if (r != ncclSuccess) return Status::IOError(std::string("ncclGetUniqueId: ") + ncclGetErrorString(r));
  NcclId id;
  std::memcpy(id.bytes.data(), &uid, sizeof(uid));
  return id;
}

Result<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(const NcclId& id, int rank, int size,
                                                                   const NcclOptions& options) {
  if (size < 1 || rank < 0 || rank >= size)
    return Status::InvalidArgument("NCCL communicator: rank " + std::to_string(rank) + " of size " +
                                   std::to_string(size));
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  if (options.device < 0 || options.device >= devices)
    return Status::InvalidArgument("NCCL communicator: device " + std::to_string(options.device) + " of " +
                                   std::to_string(devices) + " CUDA devices");
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  auto impl = std::make_unique<Impl>();
  impl->rank = rank;
  impl->size = size;
  impl->device = options.device;
  impl->staging_bytes = options.staging_bytes;
  QKV_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(options.device), "cudaSetDevice"));
  QKV_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  if (options.staging_bytes > 0)
    QKV_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&impl->staging, options.staging_bytes), "cudaMalloc staging"));
  QKV_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&impl->flag, sizeof(float)), "cudaMalloc"));
  QKV_RETURN_IF_ERROR(CudaStatus(cudaMemset(impl->flag, 0, sizeof(float)), "cudaMemset"));
  ncclUniqueId uid;
  std::memcpy(&uid, id.bytes.data(), sizeof(uid));
  QKV_RETURN_IF_ERROR(NcclStatus(ncclCommInitRank(&impl->comm, size, uid, rank), nullptr, "ncclCommInitRank"));
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(std::move(impl)));
}

int NcclCommunicator::rank() const { return impl_->rank; }
int NcclCommunicator::size() const { return impl_->size; }
void* NcclCommunicator::stream() const { return impl_->stream; }

// Each collective: usable? then run; any failure closes this rank's side.
Status NcclCommunicator::AllGather(const void* send, std::size_t bytes, void* recv) {
  QKV_RETURN_IF_ERROR(impl_->Usable());
  if (bytes == 0) return Status::Ok();
  Status st = impl_->AllGather(send, bytes, recv);
  if (!st.ok()) Abort(st);
  return st;
}

Status NcclCommunicator::AllReduceSum(const float* send, float* recv, std::size_t count) {
  QKV_RETURN_IF_ERROR(impl_->Usable());
  if (count == 0) return Status::Ok();
  Status st = impl_->AllReduceSum(send, recv, count);
  if (!st.ok()) Abort(st);
  return st;
}

Status NcclCommunicator::Barrier() {
  QKV_RETURN_IF_ERROR(impl_->Usable());
  Status st = impl_->Barrier();
  if (!st.ok()) Abort(st);
  return st;
}

void NcclCommunicator::Abort(const Status& reason) {
  if (!impl_->closed.ok()) return;
  impl_->closed = reason.ok() ? Status::FailedPrecondition("aborted") : reason;
  if (impl_->comm != nullptr) {
    cudaSetDevice(impl_->device);
    ncclCommAbort(impl_->comm);
    impl_->comm = nullptr;
  }
}

}  // namespace questkv
