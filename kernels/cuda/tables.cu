// Small kernels the CUDA backend (runtime/cuda/) needs around the
// decode-step kernels: batched edits of the device tables, a page's rows
// gathered for a rollback, the seal copy (tail slots -> pinned host home,
// the mirror of the resolve gather), the step report (what the host reads of
// a step, one call later), a batch's page tables gathered, and dtype
// conversion of host-API inputs and outputs.
#include <cstring>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/kernels_cuda.h"

namespace questkv::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void TableUpdateKernel(const TableUpdate* __restrict__ ups, int n, DeviceTables t) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const TableUpdate u = ups[i];
    switch (u.op) {
      case TableOp::kSet8: *reinterpret_cast<uint8_t*>(u.addr) = uint8_t(u.value); break;
      case TableOp::kSet32: *reinterpret_cast<int32_t*>(u.addr) = int32_t(u.value); break;
      case TableOp::kSet64: *reinterpret_cast<int64_t*>(u.addr) = u.value; break;
      case TableOp::kDropPage: {
        const uint32_t page = uint32_t(u.value);
        for (int h = 0; h < t.kv_heads; ++h) {
          int32_t* cell = t.hbm_slot + std::size_t(page) * t.kv_heads + h;
          const int32_t s = *cell;
          if (s < 0) continue;
          *cell = -1;
          if (t.slot_page[s] == page) {
            t.slot_page[s] = kEmptySlot;
            t.slot_last_use[s] = -1;
          }
        }
        break;
      }
      case TableOp::kReleaseSlot: {
        const int32_t s = int32_t(u.value);
        const uint32_t page = t.slot_page[s];
        if (page != kEmptySlot) {
          int32_t* cell = t.hbm_slot + std::size_t(page) * t.kv_heads + t.slot_head[s];
          if (*cell == s) *cell = -1;
        }
        t.slot_page[s] = kEmptySlot;
        t.slot_last_use[s] = -1;
        t.slot_pinned[s] = 0;
        break;
      }
    }
  }
}

// Block (t, h): row t of head h's K and V, 16 bytes a thread.
__global__ void PageRowsKernel(const PageRowsParams p) {
  const int t = blockIdx.x, h = blockIdx.y;
  const int32_t slot = p.hbm_slot[std::size_t(p.page) * p.kv_heads + h];
  if (slot < 0) return;  // (the caller holds the page's slots: never)
  const char* k = static_cast<const char*>(p.slots) + std::size_t(slot) * 2 * p.piece_bytes + t * p.row_bytes;
  const char* v = k + p.piece_bytes;
  const std::size_t out = (std::size_t(t) * p.kv_heads + h) * p.row_bytes;
  for (std::size_t i = threadIdx.x; i < p.row_bytes / 16; i += blockDim.x) {
    reinterpret_cast<uint4*>(static_cast<char*>(p.k_out) + out)[i] = reinterpret_cast<const uint4*>(k)[i];
    reinterpret_cast<uint4*>(static_cast<char*>(p.v_out) + out)[i] = reinterpret_cast<const uint4*>(v)[i];
  }
}

// Each job: the slot's K piece to k_dst and its V piece to v_dst, 16 bytes a
// thread, striped over the grid (stores to mapped host memory go over PCIe).
__global__ void SealCopyKernel(const SealJob* __restrict__ jobs, int n, uint32_t piece_vecs) {
  const uint32_t job_vecs = 2 * piece_vecs;
  const uint64_t total = uint64_t(n) * job_vecs;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < total;
       i += uint64_t(gridDim.x) * blockDim.x) {
    const SealJob& j = jobs[i / job_vecs];
    const uint32_t within = uint32_t(i % job_vecs);
    const uint4 v = Load16(static_cast<const uint4*>(j.slot) + within);
    uint4* dst = within < piece_vecs ? static_cast<uint4*>(j.k_dst) + within
                                     : static_cast<uint4*>(j.v_dst) + (within - piece_vecs);
    *dst = v;
  }
}

// Block r < rows: row r's page ids and count; block rows: the cold queue.
__global__ void StepReportKernel(StepReportParams p) {
  const int r = blockIdx.x;
  if (r < p.rows) {
    const int32_t begin = p.sel_indptr[r], cap = p.sel_indptr[r + 1] - begin;
    const int32_t n = p.sel_count ? min(p.sel_count[r], cap) : cap;
    if (threadIdx.x == 0) p.counts[r] = n;
    if (!p.pages || (p.first_head_only && r % p.kv_heads)) return;
    const uint32_t* ids = p.page_ids + p.page_indptr[r / p.kv_heads];
    for (int32_t i = threadIdx.x; i < n; i += blockDim.x) p.pages[begin + i] = ids[p.sel_pages[begin + i]];
    return;
  }
  const int32_t total = *p.cold_count;
  if (threadIdx.x == 0) *p.cold_out_count = total;
  const int32_t n = min(total, p.cold_cap);
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) p.cold_out[i] = p.cold[i];
}

// A block per sequence: its page ids from src[b] to dst at indptr[b].
__global__ void GatherPageIdsKernel(const uint32_t* const* src, const int32_t* indptr, uint32_t* dst) {
  const int b = blockIdx.x;
  const int32_t first = indptr[b], n = indptr[b + 1] - first;
  const uint32_t* from = src[b];
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) dst[first + i] = from[i];
}

template <typename From, typename To>
__global__ void ConvertKernel(const From* __restrict__ src, To* __restrict__ dst, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    dst[i] = FromFloat<To>(ToFloat(src[i]));
}

int GridFor(std::size_t work) {
  const std::size_t blocks = (work + kThreads - 1) / kThreads;
  return int(blocks < 1024 ? (blocks ? blocks : 1) : 1024);
}

template <int N>
struct LaunchedInts {
  int32_t v[N];
};

template <int N>
__global__ void WriteIntsKernel(int32_t* __restrict__ dst, int n, const LaunchedInts<N> src) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src.v[i];
}

template <int N>
cudaError_t WriteInts(int32_t* dst, const int32_t* src, int n, cudaStream_t stream) {
  LaunchedInts<N> a{};
  std::memcpy(a.v, src, std::size_t(n) * 4);
  WriteIntsKernel<N><<<1, kThreads, 0, stream>>>(dst, n, a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchTableUpdates(const TableUpdate* updates, int n, const DeviceTables& tables,
                               cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  TableUpdateKernel<<<GridFor(std::size_t(n)), kThreads, 0, stream>>>(updates, n, tables);
  return cudaGetLastError();
}

cudaError_t LaunchSealCopy(const SealJob* jobs, int n, std::size_t piece_bytes, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (piece_bytes % 16) return Unsupported("seal copy piece_bytes", (long long)piece_bytes, "multiples of 16");
  SealCopyKernel<<<GridFor(std::size_t(n) * 2 * (piece_bytes / 16)), kThreads, 0, stream>>>(
      jobs, n, uint32_t(piece_bytes / 16));
  return cudaGetLastError();
}

cudaError_t LaunchPageRows(const PageRowsParams& p, cudaStream_t stream) {
  if (p.len <= 0) return cudaSuccess;
  if (!p.slots || !p.hbm_slot || !p.k_out || !p.v_out || p.kv_heads <= 0 ||
      p.piece_bytes < std::size_t(p.len) * p.row_bytes)
    return cudaErrorInvalidValue;
  if (p.row_bytes == 0 || p.row_bytes % 16)
    return Unsupported("page rows row_bytes", (long long)p.row_bytes, "multiples of 16");
  PageRowsKernel<<<dim3(p.len, p.kv_heads), 64, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchStepReport(const StepReportParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.cold_cap < 0 || !p.counts || !p.cold_out_count || !p.cold_count || !p.sel_indptr)
    return cudaErrorInvalidValue;
  StepReportKernel<<<p.rows + 1, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchWriteInts(int32_t* dst, const int32_t* src, int n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (!dst || !src || n > kLaunchInts) return cudaErrorInvalidValue;
  // The smallest parameter block that holds them: a launch copies all of it.
  if (n <= 64) return WriteInts<64>(dst, src, n, stream);
  if (n <= 256) return WriteInts<256>(dst, src, n, stream);
  return WriteInts<kLaunchInts>(dst, src, n, stream);
}

cudaError_t LaunchGatherPageIds(const uint32_t* const* src, const int32_t* indptr, int batch, uint32_t* dst,
                                cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  if (!src || !indptr || !dst) return cudaErrorInvalidValue;
  GatherPageIdsKernel<<<batch, kThreads, 0, stream>>>(src, indptr, dst);
  return cudaGetLastError();
}

cudaError_t LaunchConvert(const void* src, DType from, void* dst, DType to, std::size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  QKV_DISPATCH_DTYPE(from, From, {
    QKV_DISPATCH_DTYPE(to, To, {
      ConvertKernel<From, To><<<GridFor(n), kThreads, 0, stream>>>(static_cast<const From*>(src),
                                                                   static_cast<To*>(dst), n);
    })
  })
  return cudaGetLastError();
}

}  // namespace questkv::kernels::cuda
