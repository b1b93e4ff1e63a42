// Inside GpuDecoder (parallel/gpu_decode.h): its device buffers, per-layer
// plans and state, shared by gpu_decode.cc (set-up, loading, plans) and
// gpu_decode_step.cc (the decode steps). Not a public header.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/kernels_cuda.h"
#include "parallel/global_topk.h"
#include "parallel/gpu_decode.h"
#include "parallel/gpu_kernels.h"

namespace questkv::gpu_decode {

namespace kc = kernels::cuda;

Status CudaStatus(const char* what, cudaError_t e);
#define QKV_CUDA(expr)                                                                \
  do {                                                                                \
    const cudaError_t qkv_e_ = (expr);                                                \
    if (qkv_e_ != cudaSuccess) return ::questkv::gpu_decode::CudaStatus(#expr, qkv_e_); \
  } while (0)

// n elements of T in device memory (kDevice) or pinned host memory (kPinned).
enum class Mem : uint8_t { kDevice, kPinned };
template <typename T, Mem M = Mem::kDevice>
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { Free(); }
  // Drops the contents; the new ones are zeroed when `zero`.
  Status Resize(std::size_t n, bool zero = false) {
    Free();
    const std::size_t bytes = std::max<std::size_t>(n, 1) * sizeof(T);
    void* p = nullptr;
    if constexpr (M == Mem::kDevice) {
      QKV_CUDA(cudaMalloc(&p, bytes));
      p_ = static_cast<T*>(p);
      if (zero) QKV_CUDA(cudaMemset(p, 0, bytes));
      // The decoder's stream does not wait for the legacy stream's memset.
      if (zero) QKV_CUDA(cudaStreamSynchronize(nullptr));
    } else {
      QKV_CUDA(cudaMallocHost(&p, bytes));
      p_ = static_cast<T*>(p);
      if (zero) std::memset(p, 0, bytes);
    }
    n_ = n;
    return Status::Ok();
  }
  // Resize(host.size()) and a synchronous upload: for set-up only.
  Status Assign(const std::vector<T>& host) {
    QKV_RETURN_IF_ERROR(Resize(host.size()));
    if (!host.empty()) QKV_CUDA(cudaMemcpy(p_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    // A pageable copy may still be in flight; the decoder's stream would not wait for it.
    QKV_CUDA(cudaStreamSynchronize(nullptr));
    return Status::Ok();
  }
  T* get() const { return p_; }
  std::size_t size() const { return n_; }
  std::size_t bytes() const { return n_ * sizeof(T); }

 private:
  void Free() {
    if (p_ == nullptr) return;
    if constexpr (M == Mem::kDevice) cudaFree(p_);
    else cudaFreeHost(p_);
    p_ = nullptr;
    n_ = 0;
  }
  T* p_ = nullptr;
  std::size_t n_ = 0;
};
template <typename T>
using Pinned = Buffer<T, Mem::kPinned>;

// The first n elements of src to dst, queued on stream.
template <typename T, Mem A, Mem B>
Status CopyAsync(Buffer<T, A>& dst, const Buffer<T, B>& src, std::size_t n, cudaStream_t stream) {
  if (n > 0) QKV_CUDA(cudaMemcpyAsync(dst.get(), src.get(), n * sizeof(T), cudaMemcpyDefault, stream));
  return Status::Ok();
}

inline double MicrosSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

// The device work of one layer's policy, planned at the layer's first step.
struct LayerPlan {
  // kContext: each sequence's policy; the LaunchSelect over the ranked
  // sequences' candidate lists (gpu_decode.cc, PlanContextSelect) and the
  // candidates it yields, [ranked][rows][k].
  std::vector<ContextStepPlan> steps;  // [batch]
  std::vector<int> ranked;             // sequences with k > 0
  int k = 0;
  Buffer<int32_t> list_indptr, list_global, row_offset;
  Buffer<uint32_t> list_ids;
  Buffer<float> q_select;  // [select batch][Hkv * group][D]
  Pinned<float> q_select_host;
  Buffer<DeviceCandidate> cand;
  Pinned<DeviceCandidate> cand_host;
  std::vector<PageCandidate> gathered;  // [R][ranked][rows][k]
  // Both modes: the select.
  kc::SelectShape select_shape;
  kc::SelectPlan select;
  Buffer<int32_t> sel_indptr, sel_pages, sel_slots, sel_count;
  Buffer<char> select_ws;
  Pinned<int32_t> sel_pages_host, sel_count_host;  // kHead: the selection read back
  // kContext: the attention rows (sequence, KV head) over this rank's winners.
  Pinned<int32_t> att_indptr_host, att_slots_host, att_last_host;
  Buffer<int32_t> att_indptr, att_slots, att_last;
  kc::AttendPlan attend;
  Buffer<char> attend_ws;
};

}  // namespace questkv::gpu_decode

namespace questkv {

struct GpuDecoder::Impl {
  template <typename T>
  using Buffer = gpu_decode::Buffer<T>;
  template <typename T>
  using Pinned = gpu_decode::Pinned<T>;
  using LayerPlan = gpu_decode::LayerPlan;

  Geometry g;
  SelectionPolicy p;
  GpuDecodeOptions o;
  int ranks = 1, rank = 0, dev = 0, num_sms = 1;
  std::vector<GpuSequence> batch;
  std::vector<HeadRange> head_ranges;  // kHead: every rank's
  int first_head = 0, heads = 0;       // the KV heads held
  std::vector<int64_t> local_first;    // [batch + 1] CSR of the local pages of each sequence
  std::vector<int32_t> local_global;   // [local pages] global page of each, ascending per sequence
  gpu_decode::PoolShape pool;
  Buffer<__half> slots;                // [local pages][heads][2][S][D]
  Buffer<__half> summaries;            // [local pages + 1 (kContext's dummy)][heads][2][D], exact (keys are f16)
  Buffer<int32_t> lens;                // [local pages] valid tokens
  Buffer<int64_t> page_keys;           // [local pages] FillRandom's key: sequence << 32 | page
  Buffer<int32_t> page_indptr, hbm_slot, last_len;  // kHead's page table: identity ids and slots
  Buffer<uint32_t> page_ids;
  cudaStream_t stream = nullptr;
  cudaEvent_t ev[4] = {};  // select start, end; attend start, end
  // Every layer's plan, made by Create (PlanAll): layers of the same policy
  // (dense flag, page budget) share one. Decode allocates nothing, so a rank
  // never calls cudaMalloc/cudaFree/cudaMallocHost while a peer's NCCL
  // collective is in flight (those calls may wait on every peer GPU: a hang).
  std::map<std::pair<bool, int64_t>, std::unique_ptr<LayerPlan>> plan_store;
  std::map<int, LayerPlan*> plans;
  // Per step.
  Pinned<float> q_host;  // [batch][held query heads][D]
  Buffer<float> q32;
  Buffer<__half> q16, o16;
  Buffer<float> lse;
  Pinned<__half> o_host;
  Pinned<float> lse_host;
  StepExchange exchange;
  TopKMerge merge;
  std::vector<std::vector<std::vector<int32_t>>> winners;  // [batch][rows]
  std::vector<float> mine, all;                            // this rank's and every rank's payload
  GpuStepTimes times;

  ~Impl();
  int batch_size() const { return int(batch.size()); }
  int held_q_heads() const { return heads * g.group(); }

  // gpu_decode.cc
  Status Init();
  Status BuildSummaries();
  Status PlanAll();
  Result<LayerPlan*> PlanFor(int layer);
  Status PlanContextSelect(LayerPlan* lp);
  Status PlanContextAttend(LayerPlan* lp);
  Status PlanHead(int layer, LayerPlan* lp);
  // gpu_decode_step.cc
  StepHeader Header(int tag, int layer, int top_k) const;
  Status Gather(Communicator& comm, const StepHeader& h, const void* payload, std::size_t bytes);
  Status UploadQ(const float* q);
  kernels::cuda::SelectParams SelectArgs(LayerPlan& lp, const float* q, const int32_t* lists_indptr,
                                         const uint32_t* lists_ids, const int32_t* slot_of) const;
  kernels::cuda::AttendParams AttendArgs(LayerPlan& lp, float scale, const int32_t* indptr, const int32_t* count,
                                         const int32_t* slot_ids, const int32_t* last) const;
  Status DecodeContext(Communicator& comm, LayerPlan& lp, int layer, float scale,
                       std::vector<ParallelDecodeOutput>* out);
  Status SelectContext(Communicator& comm, LayerPlan& lp, int layer);
  Status AttendContext(LayerPlan& lp, float scale, const std::vector<ParallelDecodeOutput>& out);
  Status MergeContext(Communicator& comm, int layer, int top_k, std::vector<ParallelDecodeOutput>* out);
  Status DecodeHead(Communicator& comm, LayerPlan& lp, int layer, float scale, std::vector<ParallelDecodeOutput>* out);
  void UnpackHead(const LayerPlan& lp, int ranks_now, std::vector<ParallelDecodeOutput>* out) const;
  void ReadDeviceTimes(bool selected);
};

}  // namespace questkv
