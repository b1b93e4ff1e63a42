// The CUDA backend (DESIGN.md §4, §7): the DataPlane (runtime/backend.h) the
// runtime hands to the GPU when Config::backend is kCuda. Policy stays in the
// runtime —
// PageIds, page lists, refcounts, the host and disk tiers (TierMover) — and
// this class keeps the device side:
//   * the slot pool (head-pages [2][S][D] in the model dtype) in device memory:
//     per (sequence, layer) partition Hkv pinned tail slots and an LRU list of
//     cached slots that the device resolve reorders; a few staging slots
//     through which prefill chunks pass on their way to their host homes;
//   * the summary slab (model dtype: exact for keys stored in it; always
//     resident), the residency table
//     hbm_slot[PageId][Hkv], the slot tables and host_addr[PageId] (device
//     pointers to the pinned host homes, mirrored from TierMover's listener);
//   * a device mirror of each partition's page list;
// and runs append + seal copy, and the decode step select -> resolve (zero-
// copy gather of misses, cold misses to the host) -> sparse attention.
//
// Each partition's list always holds at least as many slots as its sequence
// can select in one call (DecodeStep grows it from the free pool first), so
// the resolve never has to bypass: every selected page is attended from HBM.
// When the pool cannot give that much, the call fails with ResourceExhausted
// before launching anything (hbm_bytes too small for the budget and the dense
// layers).
//
// Synchronisation: every call is ordered on one CUDA stream (stream()). A
// decode step on device pointers returns as soon as it is enqueued when
// nothing on the host has to wait for it: no disk tier (so no host home can
// move, be reused or be freed under a kernel that reads it — without a disk
// host homes live as long as their pages, and a freed home is only rewritten
// by later work on the same stream), no selections asked for, no phase
// timing. It reads nothing back: the next wait checks the device's
// cumulative count of selected head-pages that found no slot, and such a
// fault comes back from the next call or from Synchronize(). Every other call
// returns with the device idle, so with a disk tier the host-side tiers may
// move homes between calls without racing a kernel. Within a step nothing
// waits on the host except cold misses under `strict`.
//
// Thread-compatible; one CUDA stream.
//
// Plain C++ against the CUDA runtime API; every kernel comes from kernels/cuda.
#include "runtime/backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cassert>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <unordered_map>

#include "kernels/cpu/kernels_cpu.h"
#include "kernels/cuda/kernels_cuda.h"
#include "prefetch/tier_mover.h"
#include "runtime/half.h"
#include "tiers/arena.h"

namespace questkv {

namespace {

namespace kc = kernels::cuda;

static_assert(int(kc::DType::kF32) == int(DType::kF32) && int(kc::DType::kF16) == int(DType::kF16) &&
              int(kc::DType::kBF16) == int(DType::kBF16));
static_assert(int(kc::GqaAgg::kMax) == int(GqaMode::kMax) && int(kc::GqaAgg::kMean) == int(GqaMode::kMean) &&
              int(kc::GqaAgg::kUnion) == int(GqaMode::kUnion));

constexpr uint32_t kEmptySlot = 0xFFFFFFFFu;
constexpr int kStagingPages = 64;  // pages a prefill chunk passes through at once

Status CudaStatus(const char* what, cudaError_t e) {
  std::string m = std::string(what) + ": " + cudaGetErrorString(e);
  if (e == cudaErrorInvalidValue && !kc::LastErrorMessage().empty()) m += " (" + kc::LastErrorMessage() + ")";
  if (e == cudaErrorMemoryAllocation) return Status::ResourceExhausted(m);
  return Status::Internal(m);
}
#define QKV_CUDA(expr)                                              \
  do {                                                              \
    const cudaError_t qkv_e_ = (expr);                              \
    if (qkv_e_ != cudaSuccess) return CudaStatus(#expr, qkv_e_);    \
  } while (0)

bool EnvIsOne(const char* name) {
  const char* v = std::getenv(name);
  return v && v[0] == '1';
}
// Misses fetched by the attention (kc::ResolveShape::fill_in_attention)
// unless QUESTKV_GATHER_MISSES=1 asks for the resolve's own gather kernel
// (the same binary measured both ways; the outputs are bit for bit equal).
bool FillInAttention() {
  static const bool on = !EnvIsOne("QUESTKV_GATHER_MISSES");
  return on;
}
// With it, misses staged while the resolve chooses victims
// (kc::ResolveShape::stage_pages) unless QUESTKV_NO_STAGING=1.
constexpr std::size_t kStageBytes = std::size_t(16) << 20;
bool StageMisses() {
  static const bool on = !EnvIsOne("QUESTKV_NO_STAGING");
  return on;
}

// Bumped by every device or pinned allocation of this backend: a captured
// step graph bakes pointers in, so a new allocation retires the graphs.
uint64_t g_alloc_epoch = 0;

// A device allocation that only grows. Growing frees the old block: callers
// grow only what no queued work still reads, or synchronise first.
class DevBuf {
 public:
  DevBuf() = default;
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf(DevBuf&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DevBuf& operator=(DevBuf&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~DevBuf() { cudaFree(p_); }
  Status Reserve(std::size_t bytes) {
    if (bytes <= n_) return Status::Ok();
    if (p_) QKV_CUDA(cudaDeviceSynchronize());  // queued work may still read the old block
    cudaFree(p_);
    p_ = nullptr;
    n_ = 0;
    QKV_CUDA(cudaMalloc(&p_, bytes));
    n_ = bytes;
    ++g_alloc_epoch;
    return Status::Ok();
  }
  template <typename T = void>
  T* as() const { return static_cast<T*>(p_); }
  std::size_t bytes() const { return n_; }

 private:
  void* p_ = nullptr;
  std::size_t n_ = 0;
};

std::size_t Align256(std::size_t x) { return (x + 255) & ~std::size_t(255); }

// Selected head-pages that found no slot: the partition lists always hold a
// step's selection, so this is a fault, never a policy outcome.
Status NoSlotFault(uint64_t n) {
  return Status::Internal(std::to_string(n) + " selected head-pages found no slot (partition lists too short)");
}

// Host-side time of DecodeStep's phases, summed; printed to stderr at exit
// when QUESTKV_PROFILE is set (to see what the host adds to a step).
enum HostPhase { kPlan, kGrow, kBuffers, kFlush, kLaunch, kDeviceWait, kReadback, kHostPhases };
constexpr const char* kHostPhaseNames[kHostPhases] = {"plan",   "grow lists",  "buffers",  "table flush",
                                                      "launch", "device wait", "readback"};
struct HostProfile {
  double us[kHostPhases] = {};
  int64_t calls = 0;
  // Calls whose phase took over 100 us, and those calls' time in it: a
  // few one-off costs (first growth, graph capture) or a steady one.
  int64_t slow_calls[kHostPhases] = {};
  double slow_us[kHostPhases] = {};
};
class HostClock {
 public:
  explicit HostClock(HostProfile& p) : p_(p), last_(std::chrono::steady_clock::now()) { ++p_.calls; }
  void Mark(int phase) {
    const auto now = std::chrono::steady_clock::now();
    const double us = std::chrono::duration<double, std::micro>(now - last_).count();
    p_.us[phase] += us;
    if (us > 100) {
      ++p_.slow_calls[phase];
      p_.slow_us[phase] += us;
    }
    last_ = now;
  }

 private:
  HostProfile& p_;
  std::chrono::steady_clock::time_point last_;
};

// Device counters, accumulated since creation.
struct CudaCounters {
  int64_t selected = 0, hits = 0, misses_host = 0, misses_disk = 0, evictions = 0, bytes_host_to_hbm = 0;
  int64_t cold_stalls = 0, pages_skipped = 0;
  uint64_t slots_capacity = 0, slots_used = 0, slots_peak = 0, slot_bytes = 0;
};

class CudaBackendImpl final : public DataPlane {
 public:
  CudaBackendImpl(const Config& c, PageAllocator* ids, TierMover* mover, SlotArena* host)
      : c_(c), g_(c.geometry), ids_(ids), mover_(mover), host_(host) {}
  ~CudaBackendImpl() override {
    if (std::getenv("QUESTKV_PROFILE") && prof_.calls) {
      std::string line;
      for (int i = 0; i < kHostPhases; ++i) {
        char part[64];
        std::snprintf(part, sizeof(part), "%s%s %.1f (%lld over 100 us: %.0f us)", i ? ", " : "", kHostPhaseNames[i],
                      prof_.us[i] / prof_.calls, (long long)prof_.slow_calls[i], prof_.slow_us[i]);
        line += part;
      }
      std::fprintf(stderr, "questkv cuda decode host profile (%lld calls, us/call): %s; %lld step graphs captured\n",
                   (long long)prof_.calls, line.c_str(), (long long)graphs_captured_);
    }
    if (stream_) cudaStreamSynchronize(stream_);
    for (cudaEvent_t e : ev_)
      if (e) cudaEventDestroy(e);
    if (stage_) cudaFreeHost(stage_);
    ClearGraphs();
    if (io_) cudaFreeHost(io_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  Status Init();

  Result<uint32_t> AddPartition() override;
  void RemovePartition(uint32_t part) override;
  void PageDied(PageId page) override {
    clears_.push_back({nullptr, int64_t(page), kc::TableOp::kDropPage, 0});
    if (auto it = tail_owner_.find(page); it != tail_owner_.end()) {
      parts_[it->second].tail_page = kNoPage;  // the id may come back as anyone's page
      tail_owner_.erase(it);
    }
  }
  void SetHome(PageId page, const void* home) override {
    const void* dev = home ? host_dev_ + (static_cast<const char*>(home) - host_base_) : nullptr;
    Set(host_addr_.as<const void*>() + page, int64_t(reinterpret_cast<uintptr_t>(dev)), kc::TableOp::kSet64);
  }
  Status SetPages(uint32_t part, std::span<const PageId> pages) override;
  Status Append(uint32_t part, PageList& list, const void* k, const void* v, int64_t n, bool host_f32,
                int64_t step) override;
  Status CopyTail(uint32_t src_part, PageId src, uint32_t dst_part, PageId dst, int len, int64_t) override;
  Status TailFromHost(uint32_t part, PageId dst, const void* page, int len, int64_t) override;
  Status TruncateTail(uint32_t part, PageId tail, int len) override;
  Status ReadPage(uint32_t part, PageId page, void* dst, int64_t step) override {
    if (!mover_->sealed(page)) return ReadTail(part, page, dst);
    return mover_->ReadPage(page, ids_->generation(page), dst, step);
  }
  Status ReadSummaries(std::span<const PageId> pages, float* dst) override;
  std::size_t summary_elem_bytes() const override { return g_.summary_elem_bytes(); }
  Status DecodeStep(const Step& s) override;
  bool on_device() const override { return true; }
  Status Synchronize() override {
    QKV_RETURN_IF_ERROR(Sync());
    return std::exchange(async_error_, Status::Ok());
  }
  void* stream() const override { return stream_; }
  Result<double> TimeDenseOffload(std::span<const PageList* const> lists, std::size_t max_bytes, int reps,
                                  int64_t* bytes) override;
  BackendCounters counters() override;

 private:
  // The step as RunStep takes it: the phase timings and counts to add to.
  struct StepArgs {
    std::span<const uint32_t> partitions;
    std::span<const PageList* const> lists;
    int layer = 0;
    bool dense = false;
    const void* q = nullptr;
    void* out = nullptr;
    bool host_f32 = true;
    int64_t step = 0;
    std::vector<PageSelection>* selections = nullptr;
    double* select_us = nullptr;
    double* resolve_us = nullptr;
    double* attend_us = nullptr;
    int64_t* selected = nullptr;
    int64_t* graphs_captured = nullptr;
  };
  Status RunStep(const StepArgs& s);
  Status ReadTail(uint32_t part, PageId tail, void* dst);
  CudaCounters device_counters();
  struct Partition {
    bool live = false;
    std::vector<int32_t> tail;       // [Hkv] pinned slots of the page being filled
    PageId tail_page = kNoPage;      // the page whose head-pages the tail slots hold
    std::vector<int32_t> owned;      // the list's slots, as a set (order lives on the device)
    DevBuf list;                     // [owned.size()] LRU first, reordered by the resolve
    DevBuf pages;                    // device mirror of the page list
    int64_t pages_len = 0;
    int64_t last_need = 0;           // slots its last step could select: what it keeps
  };

  std::size_t piece() const { return g_.head_page_elems() * DTypeBytes(g_.dtype); }
  // Summaries are kept in the model dtype: the min and max of keys stored in
  // that dtype are values of it, so nothing is rounded and scores (computed
  // in f32) are the same bits as from f32 summaries — at half the bytes the
  // select reads, for f16/bf16. Or as E4M3 codes rounded outward, half again.
  bool e4m3() const { return g_.e4m3_summaries(); }
  kc::DType sum_dtype() const { return e4m3() ? kc::DType::kE4M3 : kc::DType(g_.dtype); }
  std::size_t summary_bytes() const { return g_.summary_elems() * g_.summary_elem_bytes(); }
  char* slot_ptr(int32_t s) const { return pool_.as<char>() + std::size_t(s) * 2 * piece(); }
  int32_t* hbm_cell(PageId p, int h) const { return hbm_slot_.as<int32_t>() + std::size_t(p) * g_.kv_heads + h; }
  void* home_dev(const void* home) const { return host_dev_ + (static_cast<const char*>(home) - host_base_); }

  // Table edits, applied in order of FlushUpdates: every clear, then every
  // set (the last set of an address wins).
  void Set(const void* addr, int64_t value, kc::TableOp op) {
    auto [it, fresh] = set_index_.try_emplace(addr, sets_.size());
    if (fresh) {
      sets_.push_back({const_cast<void*>(addr), value, op, 0});
    } else {
      sets_[it->second] = {const_cast<void*>(addr), value, op, 0};
    }
  }
  void SetSlot(int32_t s, PageId page, int h) {
    Set(hbm_cell(page, h), s, kc::TableOp::kSet32);
    Set(slot_page_.as<uint32_t>() + s, int64_t(page), kc::TableOp::kSet32);
    Set(slot_head_.as<int32_t>() + s, h, kc::TableOp::kSet32);
  }
  Status FlushUpdates();
  void* StageAlloc(std::size_t bytes);        // pinned, mapped; valid until the next Sync
  void* StageDev(const void* p) const { return stage_dev_ + (static_cast<const char*>(p) - stage_); }
  Status Upload(void* dev_dst, const void* src, std::size_t bytes);  // via the stage
  // Waits for the stream; after asynchronous steps, checks the device's
  // cumulative bypass count (a fault is kept in async_error_); resets the
  // staging.
  Status Sync();
  Status GrowPages(Partition& P, int64_t len);
  Status GrowList(uint32_t part);  // to its last_need, and toward its Target
  Status Shrink(uint32_t part, int64_t k);
  // Frees slots until `want` are free (at least `must`), taking from lists
  // other than `except`.
  Status Reclaim(int64_t must, int64_t want, uint32_t except);
  // An equal share of the pool's slots among live lists, and the slots a
  // list aims to hold with it (see GrowList).
  int64_t Share() const;
  static int64_t Target(const Partition& P, int64_t share) {
    return std::max(P.last_need, std::min(4 * P.last_need, share));
  }
  Status ExtendList(uint32_t part, const std::vector<int32_t>& slots);
  Status AssignTail(uint32_t part, PageId page);
  Status RebuildSummary(const void* k_heads_host, PageId page, int len);
  Status LaunchAppendRange(Partition& P, int64_t t0, int64_t t1, int64_t total_pages, const void* k,
                           const void* v);
  Status ConvertIn(const void* host_f32, std::size_t elems, DevBuf& f32, DevBuf& out, const void** dev);

  Config c_;
  Geometry g_;
  PageAllocator* ids_;
  TierMover* mover_;
  SlotArena* host_;
  const char* host_base_ = nullptr;
  char* host_dev_ = nullptr;
  int sms_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ev_[4] = {};

  // Device state.
  DevBuf pool_, summaries_, hbm_slot_, host_addr_, slot_page_, slot_head_, slot_last_use_, slot_pinned_;
  DevBuf counters_, scratch_counters_;
  int64_t slots_ = 0;
  std::vector<int32_t> free_;     // free slots (not staging, not in any partition)
  std::vector<int32_t> staging_;  // [kStagingPages][Hkv]
  uint64_t slots_peak_ = 0;
  std::vector<Partition> parts_;
  std::vector<uint32_t> free_parts_;
  int64_t extra_bytes_ = 0, extra_evictions_ = 0;  // moved by strict re-resolves
  HostProfile prof_;

  // Per-call buffers.
  DevBuf summary_f32_, header_, batch_pages_, q_f32_, q_, o_, o_f32_, kv_f32_, kv_in_, v_in_, sel_pages_, sel_count_, res_slots_,
      res_count_, queues_, sel_ws_, res_ws_, att_ws_;
  std::size_t att_ws_zeroed_ = 0;

  // Pinned, mapped staging (uploads, table edits, seal jobs), reset by Sync.
  char* stage_ = nullptr;
  char* stage_dev_ = nullptr;
  std::size_t stage_cap_ = 0, stage_used_ = 0;
  // Asynchronous steps since the last wait, and the bypasses counted by then:
  // a selected head-page without a slot is a fault (the lists always hold a
  // step's selection), reported from the next call or Synchronize().
  bool unchecked_async_ = false;
  uint64_t bypasses_seen_ = 0;
  Status async_error_;  // the first such fault, until returned

  // Offsets in io_ of what a synchronous step reads back.
  struct IoLayout {
    std::size_t out = 0, counts = 0, totals = 0, sel_pages = 0, sel_count = 0, bytes = 0;
  };
  Status ReserveIo(std::size_t bytes) {
    if (bytes <= io_cap_) return Status::Ok();
    QKV_RETURN_IF_ERROR(Sync());
    if (io_) cudaFreeHost(io_);
    io_ = nullptr;
    io_cap_ = std::max(bytes, 2 * io_cap_);
    QKV_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&io_), io_cap_, cudaHostAllocPortable));
    ++g_alloc_epoch;
    return Status::Ok();
  }
  // The instantiated graph of a step shape, captured by `enqueue` on first use.
  Result<cudaGraphExec_t> GraphFor(const std::vector<int64_t>& key, const std::function<Status()>& enqueue) {
    if (graphs_epoch_ != g_alloc_epoch || graphs_.size() > 512) {
      ClearGraphs();
      graphs_epoch_ = g_alloc_epoch;
    }
    if (auto it = graphs_.find(key); it != graphs_.end()) return it->second;
    cudaGraph_t graph = nullptr;
    QKV_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
    const Status st = enqueue();
    const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
    QKV_RETURN_IF_ERROR(st);
    QKV_CUDA(end);
    cudaGraphExec_t exec = nullptr;
    const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    QKV_CUDA(inst);
    ++graphs_captured_;
    graphs_[key] = exec;
    return exec;
  }
  void ClearGraphs() {
    for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
    graphs_.clear();
  }

  char* io_ = nullptr;       // pinned
  std::size_t io_cap_ = 0;
  std::map<std::vector<int64_t>, cudaGraphExec_t> graphs_;
  uint64_t graphs_epoch_ = 0;
  int64_t graphs_captured_ = 0;
  std::unordered_map<PageId, uint32_t> tail_owner_;  // page in some partition's tail slots -> partition
  std::vector<kc::TableUpdate> clears_, sets_;
  std::unordered_map<const void*, std::size_t> set_index_;
};

Status CudaBackendImpl::Init() {
  const int H = g_.kv_heads;
  if (g_.head_dim != 64 && g_.head_dim != 128 && g_.head_dim != 256)
    return Status::InvalidArgument("the CUDA backend supports head_dim 64, 128, 256, not " + std::to_string(g_.head_dim));
  if (g_.page_size != 8 && g_.page_size != 16 && g_.page_size != 32 && g_.page_size != 64)
    return Status::InvalidArgument("the CUDA backend supports page_size 8, 16, 32, 64, not " + std::to_string(g_.page_size));
  const int G = g_.group();
  if (G != 1 && G != 2 && G != 4 && G != 8)
    return Status::InvalidArgument("the CUDA backend supports GQA groups 1, 2, 4, 8, not " + std::to_string(G));
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return Status::FailedPrecondition("no usable CUDA device");
  if (!host_->region().pinned())
    return Status::FailedPrecondition("the host tier is not pinned and mapped for the GPU");
  int dev = 0;
  QKV_CUDA(cudaGetDevice(&dev));
  QKV_CUDA(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, dev));
  QKV_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  for (cudaEvent_t& e : ev_) QKV_CUDA(cudaEventCreate(&e));
  void* hd = nullptr;
  host_base_ = reinterpret_cast<const char*>(host_->base());
  QKV_CUDA(cudaHostGetDevicePointer(&hd, host_->base(), 0));
  host_dev_ = static_cast<char*>(hd);

  const std::size_t slot_bytes = 2 * piece();
  const int64_t want = c_.hbm_bytes ? int64_t(c_.hbm_bytes / slot_bytes)
                                    : int64_t(c_.max_pages) * H + int64_t(kStagingPages) * H;
  const int64_t min_slots = int64_t(kStagingPages) * H + 2 * H;
  if (want < min_slots)
    return Status::InvalidArgument("hbm_bytes holds " + std::to_string(want) + " head-page slots; the CUDA backend needs " +
                                   std::to_string(min_slots) + " or more (prefill staging plus one tail)");
  if (want >= INT32_MAX) return Status::InvalidArgument("hbm_bytes holds more than 2^31 head-page slots");
  slots_ = want;
  const std::size_t P = c_.max_pages;
  QKV_RETURN_IF_ERROR(pool_.Reserve(std::size_t(slots_) * slot_bytes));
  QKV_RETURN_IF_ERROR(summaries_.Reserve(P * summary_bytes()));
  QKV_RETURN_IF_ERROR(hbm_slot_.Reserve(P * H * sizeof(int32_t)));
  QKV_RETURN_IF_ERROR(host_addr_.Reserve(P * sizeof(void*)));
  QKV_RETURN_IF_ERROR(slot_page_.Reserve(slots_ * sizeof(uint32_t)));
  QKV_RETURN_IF_ERROR(slot_head_.Reserve(slots_ * sizeof(int32_t)));
  QKV_RETURN_IF_ERROR(slot_last_use_.Reserve(slots_ * sizeof(int64_t)));
  QKV_RETURN_IF_ERROR(slot_pinned_.Reserve(slots_));
  QKV_RETURN_IF_ERROR(counters_.Reserve(sizeof(kc::ResolveCounters)));
  QKV_RETURN_IF_ERROR(scratch_counters_.Reserve(sizeof(kc::ResolveCounters)));
  QKV_CUDA(cudaMemsetAsync(hbm_slot_.as(), 0xFF, hbm_slot_.bytes(), stream_));
  QKV_CUDA(cudaMemsetAsync(host_addr_.as(), 0, host_addr_.bytes(), stream_));
  QKV_CUDA(cudaMemsetAsync(slot_page_.as(), 0xFF, slot_page_.bytes(), stream_));
  QKV_CUDA(cudaMemsetAsync(slot_head_.as(), 0, slot_head_.bytes(), stream_));
  QKV_CUDA(cudaMemsetAsync(slot_last_use_.as(), 0xFF, slot_last_use_.bytes(), stream_));
  QKV_CUDA(cudaMemsetAsync(slot_pinned_.as(), 0, slot_pinned_.bytes(), stream_));
  QKV_CUDA(cudaMemsetAsync(counters_.as(), 0, counters_.bytes(), stream_));
  // Staging slots are pinned (never victims, never in a list).
  for (int64_t s = 0; s < int64_t(kStagingPages) * H; ++s) staging_.push_back(int32_t(s));
  QKV_CUDA(cudaMemsetAsync(slot_pinned_.as(), 1, staging_.size(), stream_));
  for (int64_t s = slots_ - 1; s >= int64_t(staging_.size()); --s) free_.push_back(int32_t(s));
  stage_cap_ = 64u << 20;
  QKV_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&stage_), stage_cap_, cudaHostAllocMapped | cudaHostAllocPortable));
  void* sd = nullptr;
  QKV_CUDA(cudaHostGetDevicePointer(&sd, stage_, 0));
  stage_dev_ = static_cast<char*>(sd);
  parts_.emplace_back();  // partition 0 is never handed out
  return Sync();
}

void* CudaBackendImpl::StageAlloc(std::size_t bytes) {
  bytes = Align256(std::max<std::size_t>(bytes, 1));
  if (stage_used_ + bytes > stage_cap_) {
    if (!Sync().ok()) return nullptr;
    if (bytes > stage_cap_) {
      cudaFreeHost(stage_);
      stage_ = nullptr;
      stage_cap_ = std::max(bytes, 2 * stage_cap_);
      if (cudaHostAlloc(reinterpret_cast<void**>(&stage_), stage_cap_, cudaHostAllocMapped | cudaHostAllocPortable) !=
          cudaSuccess)
        return nullptr;
      void* sd = nullptr;
      cudaHostGetDevicePointer(&sd, stage_, 0);
      stage_dev_ = static_cast<char*>(sd);
    }
  }
  void* p = stage_ + stage_used_;
  stage_used_ += bytes;
  return p;
}

Status CudaBackendImpl::Sync() {
  kc::ResolveCounters c{};
  if (unchecked_async_)
    QKV_CUDA(cudaMemcpyAsync(&c, counters_.as(), sizeof(c), cudaMemcpyDeviceToHost, stream_));
  QKV_CUDA(cudaStreamSynchronize(stream_));
  stage_used_ = 0;
  if (unchecked_async_) {
    unchecked_async_ = false;
    if (c.bypasses > bypasses_seen_ && async_error_.ok()) async_error_ = NoSlotFault(c.bypasses - bypasses_seen_);
    bypasses_seen_ = c.bypasses;
  }
  return Status::Ok();
}

Status CudaBackendImpl::Upload(void* dev_dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return Status::Ok();
  void* st = StageAlloc(bytes);
  if (!st) return Status::ResourceExhausted("pinned staging of " + std::to_string(bytes) + " bytes");
  std::memcpy(st, src, bytes);
  QKV_CUDA(cudaMemcpyAsync(dev_dst, st, bytes, cudaMemcpyHostToDevice, stream_));
  return Status::Ok();
}

Status CudaBackendImpl::FlushUpdates() {
  const kc::DeviceTables t{hbm_slot_.as<int32_t>(), slot_page_.as<uint32_t>(), slot_head_.as<int32_t>(),
                           slot_last_use_.as<int64_t>(), slot_pinned_.as<uint8_t>(), g_.kv_heads};
  for (std::vector<kc::TableUpdate>* ops : {&clears_, &sets_}) {
    if (ops->empty()) continue;
    auto* st = static_cast<kc::TableUpdate*>(StageAlloc(ops->size() * sizeof(kc::TableUpdate)));
    if (!st) return Status::ResourceExhausted("pinned staging for table updates");
    std::memcpy(st, ops->data(), ops->size() * sizeof(kc::TableUpdate));
    QKV_CUDA(kc::LaunchTableUpdates(static_cast<kc::TableUpdate*>(StageDev(st)), int(ops->size()), t, stream_));
    ops->clear();
  }
  // clear() sweeps every bucket, and prefill leaves millions of them: at 1M
  // tokens that sweep cost each decode call hundreds of µs. A large index is
  // dropped instead.
  if (set_index_.bucket_count() > 4096)
    set_index_ = {};
  else
    set_index_.clear();
  return Status::Ok();
}

// ---- partitions ------------------------------------------------------------------

Result<uint32_t> CudaBackendImpl::AddPartition() {
  const int H = g_.kv_heads;
  QKV_RETURN_IF_ERROR(Reclaim(H, H, 0));
  if (int64_t(free_.size()) < H)
    return Status::ResourceExhausted("hbm: no free slots for a new tail (" + std::to_string(slots_) + " slots)");
  uint32_t id;
  if (!free_parts_.empty()) {
    id = free_parts_.back();
    free_parts_.pop_back();
  } else {
    id = uint32_t(parts_.size());
    parts_.emplace_back();
  }
  Partition& P = parts_[id];
  P = Partition{};
  P.live = true;
  for (int h = 0; h < H; ++h) {
    P.tail.push_back(free_.back());
    free_.pop_back();
    Set(slot_pinned_.as<uint8_t>() + P.tail.back(), 1, kc::TableOp::kSet8);
  }
  slots_peak_ = std::max<uint64_t>(slots_peak_, uint64_t(slots_ - int64_t(free_.size())));
  // Now: a queued set would land after a later release of these slots.
  QKV_RETURN_IF_ERROR(FlushUpdates());
  return id;
}

void CudaBackendImpl::RemovePartition(uint32_t part) {
  Partition& P = parts_[part];
  for (int32_t s : P.tail) clears_.push_back({nullptr, s, kc::TableOp::kReleaseSlot, 0});
  for (int32_t s : P.owned) clears_.push_back({nullptr, s, kc::TableOp::kReleaseSlot, 0});
  // A set still queued for these slots (e.g. the pinned flag) must not land after the release.
  (void)FlushUpdates();
  (void)Sync();
  if (P.tail_page != kNoPage) tail_owner_.erase(P.tail_page);
  free_.insert(free_.end(), P.tail.begin(), P.tail.end());
  free_.insert(free_.end(), P.owned.begin(), P.owned.end());
  P = Partition{};
  free_parts_.push_back(part);
}

Status CudaBackendImpl::GrowPages(Partition& P, int64_t len) {
  if (int64_t(P.pages.bytes() / 4) >= len) return Status::Ok();
  DevBuf bigger;
  QKV_RETURN_IF_ERROR(bigger.Reserve(std::size_t(std::max<int64_t>(2 * len, 64)) * 4));
  if (P.pages_len)
    QKV_CUDA(cudaMemcpyAsync(bigger.as(), P.pages.as(), P.pages_len * 4, cudaMemcpyDeviceToDevice, stream_));
  QKV_RETURN_IF_ERROR(Sync());  // the old block may still be read by queued work
  P.pages = std::move(bigger);
  return Status::Ok();
}

Status CudaBackendImpl::SetPages(uint32_t part, std::span<const PageId> pages) {
  Partition& P = parts_[part];
  QKV_RETURN_IF_ERROR(GrowPages(P, int64_t(pages.size())));
  QKV_RETURN_IF_ERROR(Upload(P.pages.as(), pages.data(), pages.size() * 4));
  P.pages_len = int64_t(pages.size());
  return Status::Ok();
}

// The list must hold `last_need` slots. A growing list also aims at its
// Target: up to three times as many more, so that it grows rarely and caches
// beyond one step's selection, within an equal share of the pool (as the
// tier model, tiers/hbm_cache.h, shares it). It takes free slots first, then
// what other lists hold beyond their targets (pages left resident by
// prefill: without this, the first layers prefilled kept the whole pool and
// every later layer got exactly one step's selection, no cache at all), and
// only for its need what others hold beyond their last step's need; least
// recently used first.
int64_t CudaBackendImpl::Share() const {
  const int64_t live = int64_t(parts_.size()) - 1 - int64_t(free_parts_.size());  // partition 0 is never live
  return (slots_ - int64_t(staging_.size())) / std::max<int64_t>(live, 1);
}

Status CudaBackendImpl::GrowList(uint32_t part) {
  Partition& P = parts_[part];
  const int64_t need = P.last_need;
  const int64_t have = int64_t(P.owned.size());
  if (have >= need) return Status::Ok();
  const int64_t add = need - have;
  const int64_t want = std::max(add, Target(P, Share()) - have);
  QKV_RETURN_IF_ERROR(Reclaim(add, want, part));
  if (int64_t(free_.size()) < add)
    return Status::ResourceExhausted("hbm too small: a (sequence, layer) needs " + std::to_string(need) +
                                     " head-page slots for one step's selection, " + std::to_string(have) +
                                     " held and " + std::to_string(free_.size()) + " free of " +
                                     std::to_string(slots_) + " (raise hbm_bytes or lower the budget)");
  const int64_t take = std::min<int64_t>(int64_t(free_.size()), want);
  std::vector<int32_t> fresh(free_.end() - take, free_.end());
  free_.resize(free_.size() - take);
  DevBuf list;
  QKV_RETURN_IF_ERROR(list.Reserve(std::size_t(have + take) * 4));
  QKV_RETURN_IF_ERROR(Upload(list.as(), fresh.data(), fresh.size() * 4));
  if (have)
    QKV_CUDA(cudaMemcpyAsync(list.as<int32_t>() + take, P.list.as(), have * 4, cudaMemcpyDeviceToDevice, stream_));
  QKV_RETURN_IF_ERROR(Sync());
  P.list = std::move(list);
  P.owned.insert(P.owned.end(), fresh.begin(), fresh.end());
  slots_peak_ = std::max<uint64_t>(slots_peak_, uint64_t(slots_ - int64_t(free_.size())));
  return Status::Ok();
}

// Slots (already holding pages) join the list at its most recently used end.
Status CudaBackendImpl::ExtendList(uint32_t part, const std::vector<int32_t>& slots) {
  if (slots.empty()) return Status::Ok();
  Partition& P = parts_[part];
  const int64_t have = int64_t(P.owned.size());
  DevBuf list;
  QKV_RETURN_IF_ERROR(list.Reserve(std::size_t(have + slots.size()) * 4));
  if (have) QKV_CUDA(cudaMemcpyAsync(list.as(), P.list.as(), have * 4, cudaMemcpyDeviceToDevice, stream_));
  QKV_RETURN_IF_ERROR(Upload(list.as<int32_t>() + have, slots.data(), slots.size() * 4));
  QKV_RETURN_IF_ERROR(Sync());
  P.list = std::move(list);
  P.owned.insert(P.owned.end(), slots.begin(), slots.end());
  slots_peak_ = std::max<uint64_t>(slots_peak_, uint64_t(slots_ - int64_t(free_.size())));
  return Status::Ok();
}

// Until `want` slots are free: lists give back what they hold beyond their
// targets; then, until `must` are, what they hold beyond their last step's
// need (pages cached on the side).
Status CudaBackendImpl::Reclaim(int64_t must, int64_t want, uint32_t except) {
  const int64_t share = Share();
  for (const bool beyond_target : {true, false}) {
    const int64_t goal = beyond_target ? want : must;
    for (uint32_t q = 1; q < parts_.size() && int64_t(free_.size()) < goal; ++q) {
      const Partition& Q = parts_[q];
      if (q == except || !Q.live) continue;
      const int64_t surplus = int64_t(Q.owned.size()) - (beyond_target ? Target(Q, share) : Q.last_need);
      if (surplus > 0) QKV_RETURN_IF_ERROR(Shrink(q, std::min<int64_t>(surplus, goal - int64_t(free_.size()))));
    }
  }
  return Status::Ok();
}

// The k least recently used slots of a list go back to the free pool (their
// pages lose residency). Only between steps: nothing of the list is in use.
Status CudaBackendImpl::Shrink(uint32_t part, int64_t k) {
  Partition& P = parts_[part];
  const int64_t n = int64_t(P.owned.size());
  std::vector<int32_t> lru(k);
  QKV_RETURN_IF_ERROR(FlushUpdates());
  QKV_CUDA(cudaMemcpyAsync(lru.data(), P.list.as(), k * 4, cudaMemcpyDeviceToHost, stream_));
  DevBuf list;
  QKV_RETURN_IF_ERROR(list.Reserve(std::size_t(std::max<int64_t>(n - k, 1)) * 4));
  if (n > k)
    QKV_CUDA(cudaMemcpyAsync(list.as(), P.list.as<int32_t>() + k, (n - k) * 4, cudaMemcpyDeviceToDevice, stream_));
  QKV_RETURN_IF_ERROR(Sync());
  P.list = std::move(list);
  for (int32_t s : lru) clears_.push_back({nullptr, s, kc::TableOp::kReleaseSlot, 0});
  QKV_RETURN_IF_ERROR(FlushUpdates());
  std::sort(lru.begin(), lru.end());
  std::erase_if(P.owned, [&](int32_t s) { return std::binary_search(lru.begin(), lru.end(), s); });
  free_.insert(free_.end(), lru.begin(), lru.end());
  return Status::Ok();
}

// The tail slots take `page`; the page they held loses its residency.
Status CudaBackendImpl::AssignTail(uint32_t part, PageId page) {
  Partition& P = parts_[part];
  for (int h = 0; h < g_.kv_heads; ++h) {
    if (P.tail_page != kNoPage && P.tail_page != page) Set(hbm_cell(P.tail_page, h), -1, kc::TableOp::kSet32);
    SetSlot(P.tail[h], page, h);
  }
  if (P.tail_page != kNoPage) tail_owner_.erase(P.tail_page);
  P.tail_page = page;
  tail_owner_[page] = part;
  return Status::Ok();
}

// ---- append --------------------------------------------------------------------------

Status CudaBackendImpl::ConvertIn(const void* host_f32, std::size_t elems, DevBuf& f32, DevBuf& out,
                                  const void** dev) {
  const std::size_t bytes = elems * DTypeBytes(g_.dtype);
  QKV_RETURN_IF_ERROR(out.Reserve(bytes));
  if (g_.dtype == DType::kF32) {
    QKV_RETURN_IF_ERROR(Upload(out.as(), host_f32, bytes));
  } else {
    QKV_RETURN_IF_ERROR(f32.Reserve(elems * 4));
    QKV_RETURN_IF_ERROR(Upload(f32.as(), host_f32, elems * 4));
    QKV_CUDA(kc::LaunchConvert(f32.as(), kc::DType::kF32, out.as(), kc::DType(g_.dtype), elems, stream_));
  }
  *dev = out.as();
  return Status::Ok();
}

// Tokens [t0, t1) of the list's token positions, K/V rows at k, v (device,
// model dtype); every page they touch already has its slots.
Status CudaBackendImpl::LaunchAppendRange(Partition& P, int64_t t0, int64_t t1, int64_t total_pages, const void* k,
                                          const void* v) {
  // Flush first: a later StageAlloc may recycle the stage once synchronised.
  QKV_RETURN_IF_ERROR(FlushUpdates());
  const int32_t hdr[5] = {0, int32_t(t1 - t0), int32_t(t0), 0, int32_t(total_pages)};
  auto* st = static_cast<int32_t*>(StageAlloc(sizeof(hdr)));
  if (!st) return Status::ResourceExhausted("pinned staging");
  std::memcpy(st, hdr, sizeof(hdr));
  const int32_t* d = static_cast<const int32_t*>(StageDev(st));
  kc::AppendParams p;
  p.kv_dtype = kc::DType(g_.dtype);
  p.summary_dtype = sum_dtype();
  p.batch = 1;
  p.kv_heads = g_.kv_heads;
  p.page_size = g_.page_size;
  p.head_dim = g_.head_dim;
  p.max_new_tokens = int(t1 - t0);
  p.append_indptr = d;
  p.start_pos = d + 2;
  p.page_indptr = d + 3;
  p.page_ids = P.pages.as<uint32_t>();
  p.hbm_slot = hbm_slot_.as<int32_t>();
  p.k = k;
  p.v = v;
  p.slots = pool_.as();
  p.summaries = summaries_.as();
  QKV_CUDA(kc::LaunchAppend(p, stream_));
  return Status::Ok();
}

Status CudaBackendImpl::Append(uint32_t part, PageList& list, const void* k, const void* v, int64_t n, bool host_f32,
                               int64_t step) {
  Partition& P = parts_[part];
  const int S = g_.page_size, H = g_.kv_heads;
  const std::size_t row = std::size_t(H) * g_.head_dim;
  const int64_t old_tokens = list.tokens, end = old_tokens + n;
  const std::size_t old_pages = list.pages.size();
  const int64_t total_pages = (end + S - 1) / S;
  if (total_pages > INT32_MAX / 2) return Status::OutOfRange("sequence too long for one layer's page table");

  // Everything that can fail on the host comes first: ids, then host homes
  // for every page this call fills.
  std::vector<PageId> fresh;
  auto drop_fresh = [&] {
    for (PageId id : fresh) ids_->Unref(id);
  };
  for (int64_t p = int64_t(old_pages); p < total_pages; ++p) {
    auto id = ids_->Allocate();
    if (!id.ok()) {
      drop_fresh();
      return id.status();
    }
    fresh.push_back(*id);
  }
  auto page_at = [&](int64_t p) { return p < int64_t(old_pages) ? list.pages[p] : fresh[p - old_pages]; };
  struct Sealing {
    PageId page;
    int64_t logical;
    void* home;
  };
  std::vector<Sealing> sealing;
  for (int64_t p = old_tokens / S; p < end / S; ++p) {
    const PageId id = page_at(p);
    auto home = mover_->SealBegin(id, ids_->generation(id), step);
    if (!home.ok()) {
      for (const Sealing& s : sealing) mover_->Drop(s.page);
      drop_fresh();
      return home.status();
    }
    sealing.push_back({id, p, *home});
  }

  // Device work. The page mirror first.
  QKV_RETURN_IF_ERROR(GrowPages(P, total_pages));
  QKV_RETURN_IF_ERROR(Upload(P.pages.as<uint32_t>() + old_pages, fresh.data(), fresh.size() * 4));
  P.pages_len = total_pages;
  std::size_t next_seal = 0;
  // Full pages of the chunk keep free slots (they stay resident, joining the
  // list at the end) while the pool has them; the rest pass through staging.
  std::unordered_map<PageId, std::size_t> resident_at;  // page -> index of its Hkv slots in `resident`
  std::vector<int32_t> resident;
  auto seal_through = [&](int64_t last_logical, const std::vector<int32_t>& staged_base, int64_t first_staged) -> Status {
    std::vector<kc::SealJob> jobs;
    for (; next_seal < sealing.size() && sealing[next_seal].logical <= last_logical; ++next_seal) {
      const Sealing& s = sealing[next_seal];
      char* home = static_cast<char*>(home_dev(s.home));
      for (int h = 0; h < H; ++h) {
        const auto r = resident_at.find(s.page);
        const int32_t slot = s.page == P.tail_page    ? P.tail[h]
                             : r != resident_at.end() ? resident[r->second + h]
                                                      : staged_base[(s.logical - first_staged) * H + h];
        jobs.push_back({slot_ptr(slot), home + std::size_t(h) * piece(), home + std::size_t(H + h) * piece()});
      }
    }
    if (jobs.empty()) return Status::Ok();
    auto* st = static_cast<kc::SealJob*>(StageAlloc(jobs.size() * sizeof(kc::SealJob)));
    if (!st) return Status::ResourceExhausted("pinned staging for seal jobs");
    std::memcpy(st, jobs.data(), jobs.size() * sizeof(kc::SealJob));
    QKV_CUDA(kc::LaunchSealCopy(static_cast<kc::SealJob*>(StageDev(st)), int(jobs.size()), piece(), stream_));
    return Status::Ok();
  };
  auto rows_at = [&](const void* base, int64_t t, int64_t count, DevBuf& f32, DevBuf& conv,
                     const void** dev) -> Status {
    const std::size_t off = std::size_t(t - old_tokens) * row;
    if (!host_f32) {
      *dev = static_cast<const char*>(base) + off * DTypeBytes(g_.dtype);
      return Status::Ok();
    }
    return ConvertIn(static_cast<const float*>(base) + off, std::size_t(count) * row, f32, conv, dev);
  };
  // Segment A: the old tail, in its tail slots, up to its page boundary.
  int64_t t = old_tokens;
  if (old_tokens % S) {
    const int64_t t1 = std::min(end, (old_tokens / S + 1) * S);
    const void *kd, *vd;
    QKV_RETURN_IF_ERROR(rows_at(k, t, t1 - t, kv_f32_, kv_in_, &kd));
    QKV_RETURN_IF_ERROR(rows_at(v, t, t1 - t, kv_f32_, v_in_, &vd));
    QKV_RETURN_IF_ERROR(LaunchAppendRange(P, t, t1, total_pages, kd, vd));
    QKV_RETURN_IF_ERROR(seal_through(t1 / S - 1, staging_, 0));
    t = t1;
  }
  // Segment B: fresh pages, kStagingPages at a time; a partial last page takes the tail slots.
  const int64_t first_fresh = int64_t(old_pages);
  for (int64_t p0 = first_fresh; p0 < total_pages; p0 += kStagingPages) {
    const int64_t p1 = std::min<int64_t>(total_pages, p0 + kStagingPages);
    std::vector<PageId> chunk;
    for (int64_t p = p0; p < p1; ++p) {
      const PageId id = fresh[p - first_fresh];
      chunk.push_back(id);
      const bool partial_last = p == total_pages - 1 && end % S != 0;
      if (partial_last) {
        QKV_RETURN_IF_ERROR(AssignTail(part, id));
      } else if (int64_t(free_.size()) >= H) {
        resident_at[id] = resident.size();
        for (int h = 0; h < H; ++h) {
          resident.push_back(free_.back());
          free_.pop_back();
          SetSlot(resident.back(), id, h);
        }
      } else {
        for (int h = 0; h < H; ++h) Set(hbm_cell(id, h), staging_[(p - p0) * H + h], kc::TableOp::kSet32);
      }
    }
    QKV_RETURN_IF_ERROR(FlushUpdates());
    QKV_CUDA(kc::LaunchResetSummaries(summaries_.as(), sum_dtype(), P.pages.as<uint32_t>() + p0, int(p1 - p0), H,
                                      g_.head_dim, stream_));
    const int64_t t1 = std::min(end, p1 * S);
    const void *kd, *vd;
    QKV_RETURN_IF_ERROR(rows_at(k, t, t1 - t, kv_f32_, kv_in_, &kd));
    QKV_RETURN_IF_ERROR(rows_at(v, t, t1 - t, kv_f32_, v_in_, &vd));
    QKV_RETURN_IF_ERROR(LaunchAppendRange(P, t, t1, total_pages, kd, vd));
    QKV_RETURN_IF_ERROR(seal_through(p1 - 1, staging_, p0));
    // Staged pages leave the staging slots (their homes hold them now).
    for (PageId id : chunk)
      if (id != P.tail_page && !resident_at.count(id))
        for (int h = 0; h < H; ++h) Set(hbm_cell(id, h), -1, kc::TableOp::kSet32);
    t = t1;
  }
  QKV_RETURN_IF_ERROR(FlushUpdates());
  QKV_RETURN_IF_ERROR(ExtendList(part, resident));
  if (!sealing.empty()) {
    QKV_RETURN_IF_ERROR(Sync());  // the homes hold their bytes now
    for (const Sealing& s : sealing) mover_->SealEnd(s.page);
  }  // else nothing the host reads changed: the next call on the stream sees the tokens
  list.pages.insert(list.pages.end(), fresh.begin(), fresh.end());
  list.tokens = end;
  return Status::Ok();
}

// ---- fork, rollback, reads ----------------------------------------------------------

// Rebuilds a page's summary from the first `len` keys of its heads (host
// bytes [Hkv][S][D] in the model dtype) with the CPU twin, and uploads it.
Status CudaBackendImpl::RebuildSummary(const void* k_heads_host, PageId page, int len) {
  const int H = g_.kv_heads;
  const std::size_t hp = g_.head_page_elems();
  std::vector<float> keys(H * hp), summary(g_.summary_elems());
  ToFloats(k_heads_host, g_.dtype, keys.size(), keys.data());
  const float* heads[kernels::kMaxKvHeads];
  for (int h = 0; h < H; ++h) heads[h] = keys.data() + h * hp;
  kernels::RebuildSummaryHeadsCpu(heads, summary.data(), H, g_.head_dim, len);
  char* dst = summaries_.as<char>() + std::size_t(page) * summary_bytes();
  if (e4m3()) {  // rounded outward on the host, as the append kernel rounds
    std::vector<uint8_t> codes(summary.size());
    kernels::EncodeSummaryE4m3Cpu(summary.data(), H, g_.head_dim, codes.data());
    return Upload(dst, codes.data(), codes.size());
  }
  // Through f32 on the device, converted exactly (the values are keys' values).
  QKV_RETURN_IF_ERROR(summary_f32_.Reserve(summary.size() * sizeof(float)));
  QKV_RETURN_IF_ERROR(Upload(summary_f32_.as(), summary.data(), summary.size() * sizeof(float)));
  QKV_CUDA(kc::LaunchConvert(summary_f32_.as(), kc::DType::kF32, dst, sum_dtype(), summary.size(), stream_));
  return Status::Ok();
}

Status CudaBackendImpl::CopyTail(uint32_t src_part, PageId src, uint32_t dst_part, PageId dst, int len, int64_t) {
  Partition &A = parts_[src_part], &B = parts_[dst_part];
  assert(A.tail_page == src);
  QKV_RETURN_IF_ERROR(AssignTail(dst_part, dst));
  QKV_RETURN_IF_ERROR(FlushUpdates());
  for (int h = 0; h < g_.kv_heads; ++h)
    QKV_CUDA(cudaMemcpyAsync(slot_ptr(B.tail[h]), slot_ptr(A.tail[h]), 2 * piece(), cudaMemcpyDeviceToDevice, stream_));
  const std::size_t sb = summary_bytes();
  QKV_CUDA(cudaMemcpyAsync(summaries_.as<char>() + std::size_t(dst) * sb, summaries_.as<char>() + std::size_t(src) * sb,
                           sb, cudaMemcpyDeviceToDevice, stream_));
  (void)len;  // the summary of the first len tokens is the source's: the tail holds exactly len
  return Sync();
}

Status CudaBackendImpl::TailFromHost(uint32_t part, PageId dst, const void* page, int len, int64_t) {
  Partition& P = parts_[part];
  const int H = g_.kv_heads;
  QKV_RETURN_IF_ERROR(AssignTail(part, dst));
  QKV_RETURN_IF_ERROR(FlushUpdates());
  const char* bytes = static_cast<const char*>(page);
  for (int h = 0; h < H; ++h) {
    QKV_RETURN_IF_ERROR(Upload(slot_ptr(P.tail[h]), bytes + std::size_t(h) * piece(), piece()));
    QKV_RETURN_IF_ERROR(Upload(slot_ptr(P.tail[h]) + piece(), bytes + std::size_t(H + h) * piece(), piece()));
  }
  QKV_RETURN_IF_ERROR(RebuildSummary(bytes, dst, len));
  return Sync();
}

Status CudaBackendImpl::TruncateTail(uint32_t part, PageId tail, int len) {
  Partition& P = parts_[part];
  assert(P.tail_page == tail);
  std::vector<char> k(std::size_t(g_.kv_heads) * piece());
  QKV_RETURN_IF_ERROR(FlushUpdates());
  for (int h = 0; h < g_.kv_heads; ++h)
    QKV_CUDA(cudaMemcpyAsync(k.data() + h * piece(), slot_ptr(P.tail[h]), piece(), cudaMemcpyDeviceToHost, stream_));
  QKV_RETURN_IF_ERROR(Sync());
  QKV_RETURN_IF_ERROR(RebuildSummary(k.data(), tail, len));
  return Sync();
}

Status CudaBackendImpl::ReadTail(uint32_t part, PageId tail, void* dst) {
  Partition& P = parts_[part];
  if (P.tail_page != tail) return Status::Internal("page " + std::to_string(tail) + " is not the partition's tail");
  QKV_RETURN_IF_ERROR(FlushUpdates());
  char* out = static_cast<char*>(dst);
  const int H = g_.kv_heads;
  for (int h = 0; h < H; ++h) {
    QKV_CUDA(cudaMemcpyAsync(out + std::size_t(h) * piece(), slot_ptr(P.tail[h]), piece(), cudaMemcpyDeviceToHost, stream_));
    QKV_CUDA(cudaMemcpyAsync(out + std::size_t(H + h) * piece(), slot_ptr(P.tail[h]) + piece(), piece(),
                             cudaMemcpyDeviceToHost, stream_));
  }
  return Sync();
}

Status CudaBackendImpl::ReadSummaries(std::span<const PageId> pages, float* dst) {
  QKV_RETURN_IF_ERROR(FlushUpdates());
  const std::size_t elems = g_.summary_elems();
  std::vector<char> raw(pages.size() * summary_bytes());
  for (std::size_t i = 0; i < pages.size(); ++i)
    QKV_CUDA(cudaMemcpyAsync(raw.data() + i * summary_bytes(), summaries_.as<char>() + std::size_t(pages[i]) * summary_bytes(),
                             summary_bytes(), cudaMemcpyDeviceToHost, stream_));
  QKV_RETURN_IF_ERROR(Sync());
  if (e4m3())
    kernels::DecodeSummaryE4m3Cpu(reinterpret_cast<const uint8_t*>(raw.data()), pages.size() * elems, dst);
  else
    ToFloats(raw.data(), g_.dtype, pages.size() * elems, dst);
  return Status::Ok();
}

// ---- the decode step ---------------------------------------------------------------

Status CudaBackendImpl::DecodeStep(const Step& st) {
  for (std::size_t i = 0; i < st.partitions.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (st.partitions[i] == st.partitions[j])
        return Status::InvalidArgument("the CUDA backend needs distinct sequences in a batch");
  if (st.dense && c_.cold_miss != ColdMissPolicy::kStrict && mover_->has_disk())
    return Status::FailedPrecondition("dense attention on the CUDA backend needs the strict cold-miss policy");
  StepArgs a{st.partitions, st.lists, st.layer, st.dense, st.q, st.out, st.host_f32, st.step, st.selections};
  AttendStats* stats = st.stats;
  int64_t selected = 0;
  if (stats && stats->time_phases) {
    a.select_us = &stats->select_us;
    a.resolve_us = &stats->resolve_us;
    a.attend_us = &stats->attend_us;
  }
  a.selected = &selected;
  if (stats) a.graphs_captured = &stats->graphs_captured;
  QKV_RETURN_IF_ERROR(RunStep(a));
  if (!stats) return Status::Ok();
  const int64_t pages_budget = c_.policy.page_budget(st.layer, g_.page_size);
  stats->head_pages_selected += selected;
  for (const PageList* l : st.lists) {
    const int64_t pages = int64_t(l->pages.size());
    stats->head_pages_total += pages * g_.kv_heads;
    if (!st.dense && !c_.policy.is_dense(st.layer) && pages_budget < pages)
      stats->summary_bytes_read += pages * int64_t(summary_bytes());
  }
  // Whole head-pages (a tail is counted whole): what the kernel reads.
  stats->kv_bytes_read += selected * int64_t(2 * piece());
  return Status::Ok();
}

Status CudaBackendImpl::RunStep(const StepArgs& s) {
  if (!async_error_.ok()) return std::exchange(async_error_, Status::Ok());
  HostClock clock(prof_);
  const int B = int(s.lists.size()), H = g_.kv_heads, G = g_.group(), D = g_.head_dim, S = g_.page_size;
  const int rows = B * H;
  const std::size_t qelems = std::size_t(B) * g_.q_heads * D;
  const kc::DType dt = kc::DType(g_.dtype);

  // Plans (host only).
  std::vector<int32_t> counts(B), last_len(B), page_indptr(B + 1, 0);
  for (int b = 0; b < B; ++b) {
    counts[b] = int32_t(s.lists[b]->pages.size());
    last_len[b] = s.lists[b]->last_page_len(S);
    page_indptr[b + 1] = page_indptr[b] + counts[b];
  }
  kc::SelectShape shape;
  shape.batch = B;
  shape.kv_heads = H;
  shape.group = G;
  shape.head_dim = D;
  shape.page_size = S;
  shape.page_budget = c_.policy.page_budget(s.layer, S);
  shape.sink_pages = c_.policy.sink_pages;
  shape.local_pages = c_.policy.local_pages;
  shape.gqa = kc::GqaAgg(c_.policy.gqa);
  shape.dense = s.dense || c_.policy.is_dense(s.layer);
  kc::SelectPlan splan;
  std::string err;
  if (!kc::PlanSelect(shape, counts.data(), sms_, &splan, &err)) return Status::InvalidArgument(err);
  const std::vector<int32_t>& sel_indptr = splan.out_indptr;
  const int64_t entries = sel_indptr[rows];
  int max_row = 0;
  for (int r = 0; r < rows; ++r) max_row = std::max(max_row, sel_indptr[r + 1] - sel_indptr[r]);

  // Each partition's list holds at least what its sequence may select.
  // (Needs first: a list grown here may lend only beyond its own need.)
  std::vector<int64_t> prev_need(B);
  for (int b = 0; b < B; ++b) {
    prev_need[b] = parts_[s.partitions[b]].last_need;
    parts_[s.partitions[b]].last_need = sel_indptr[(b + 1) * H] - sel_indptr[b * H];
  }
  clock.Mark(kPlan);
  for (int b = 0; b < B; ++b) {
    if (Status st = GrowList(s.partitions[b]); !st.ok()) {
      for (int i = 0; i < B; ++i) parts_[s.partitions[i]].last_need = prev_need[i];  // as before the call
      return st;
    }
  }
  clock.Mark(kGrow);
  std::vector<int32_t> part_indptr(B + 1, 0);
  for (int b = 0; b < B; ++b) part_indptr[b + 1] = part_indptr[b] + int32_t(parts_[s.partitions[b]].owned.size());
  kc::ResolvePlan rplan;
  const bool strict = c_.cold_miss == ColdMissPolicy::kStrict;
  const bool cold_waits = strict && mover_->has_disk();
  // The attention fetches the misses itself (their PCIe round trips overlap
  // its reads of the hits), unless a strict step resolves twice: its first
  // resolve's fills must land before the second classifies them as hits.
  const bool fill_in_attention = !cold_waits && FillInAttention();
  // The first misses of a call (up to kStageBytes of head-pages; a recent
  // query's ~55 a layer, a topic query's ~850) are fetched while the victims
  // are chosen; the attention reads any beyond from their homes.
  const int stage_pages = StageMisses() ? int(kStageBytes / (2 * piece())) : 0;
  const kc::ResolveShape rshape{B, H, S, D, dt, strict ? kc::ColdPolicy::kStrict : kc::ColdPolicy::kDeadline,
                                fill_in_attention, stage_pages};
  // The gather on every SM: within a step nothing runs beside it (the
  // attention waits for it), so the half-grid default, which leaves SMs to
  // work on other streams, would only slow it.
  if (!kc::PlanResolve(rshape, entries, part_indptr[B], sms_, sms_, &rplan, &err)) return Status::InvalidArgument(err);
  kc::AttendPlan aplan;
  if (!kc::PlanAttend(kc::AttendShape{rows, H, G, D, S, dt}, std::max(max_row, 1), sms_, &aplan, &err))
    return Status::InvalidArgument(err);

  // Device buffers for this shape.
  const std::size_t qbytes = qelems * DTypeBytes(g_.dtype);
  QKV_RETURN_IF_ERROR(q_.Reserve(qbytes));
  QKV_RETURN_IF_ERROR(o_.Reserve(qbytes));
  QKV_RETURN_IF_ERROR(sel_pages_.Reserve(std::max<int64_t>(entries, 1) * 4));
  QKV_RETURN_IF_ERROR(res_slots_.Reserve(std::max<int64_t>(entries, 1) * 4));
  QKV_RETURN_IF_ERROR(sel_count_.Reserve(rows * 4));
  QKV_RETURN_IF_ERROR(res_count_.Reserve(rows * 4));
  const int qcap = int(std::max<int64_t>(entries, 1));
  const std::size_t qbytes_req = Align256(std::size_t(qcap) * sizeof(kc::ResolveRequest));
  QKV_RETURN_IF_ERROR(queues_.Reserve(2 * qbytes_req + 256));
  QKV_RETURN_IF_ERROR(sel_ws_.Reserve(std::max<std::size_t>(splan.workspace_bytes, 1)));
  QKV_RETURN_IF_ERROR(res_ws_.Reserve(std::max<std::size_t>(rplan.workspace_bytes, 1)));
  if (att_ws_.bytes() < aplan.workspace_bytes) {
    QKV_RETURN_IF_ERROR(Sync());
    QKV_RETURN_IF_ERROR(att_ws_.Reserve(aplan.workspace_bytes));
    att_ws_zeroed_ = 0;
  }
  if (att_ws_zeroed_ < att_ws_.bytes()) {
    QKV_CUDA(cudaMemsetAsync(att_ws_.as(), 0, att_ws_.bytes(), stream_));
    att_ws_zeroed_ = att_ws_.bytes();
  }

  // Header: page_indptr [B+1] | sel_indptr [rows+1] | part_indptr [B+1] |
  // last_len [B] | part_lists [B] (pointers) | step (int64).
  std::vector<int32_t> hdr;
  hdr.insert(hdr.end(), page_indptr.begin(), page_indptr.end());
  const std::size_t o_sel = hdr.size();
  hdr.insert(hdr.end(), sel_indptr.begin(), sel_indptr.end());
  const std::size_t o_part = hdr.size();
  hdr.insert(hdr.end(), part_indptr.begin(), part_indptr.end());
  const std::size_t o_last = hdr.size();
  hdr.insert(hdr.end(), last_len.begin(), last_len.end());
  if (hdr.size() % 2) hdr.push_back(0);
  const std::size_t o_lists = hdr.size();
  hdr.resize(hdr.size() + 2 * B + 2);
  for (int b = 0; b < B; ++b) {
    int32_t* list = parts_[s.partitions[b]].list.as<int32_t>();
    std::memcpy(hdr.data() + o_lists + 2 * b, &list, sizeof(list));
  }
  const std::size_t o_step = o_lists + 2 * B;
  std::memcpy(hdr.data() + o_step, &s.step, sizeof(int64_t));
  QKV_RETURN_IF_ERROR(header_.Reserve(hdr.size() * 4));
  const int32_t* d_hdr = header_.as<int32_t>();

  // The mover counts selections for its demotion order; a dense layer's are
  // every page, known here without reading 4 bytes per head-page back.
  const bool want_sel = s.selections || (mover_->has_disk() && !shape.dense);
  // A step whose phases are to be timed is launched directly (see enqueue).
  const bool timed = s.select_us || s.resolve_us || s.attend_us;
  // Nothing on the host waits for this step: it returns once enqueued (see
  // the header: without a disk tier no host home moves under it).
  const bool async = !s.host_f32 && !want_sel && !timed && !mover_->has_disk();
  // What a synchronous step reads back, pinned: f32 out, the cold-miss
  // count, the cumulative counters and the selection.
  IoLayout io;
  io.out = 0;
  io.counts = io.out + Align256(s.host_f32 ? qelems * 4 : 0);
  io.totals = io.counts + 256;
  io.sel_pages = io.totals + Align256(sizeof(kc::ResolveCounters));
  io.sel_count = io.sel_pages + Align256(want_sel ? entries * 4 : 0);
  io.bytes = io.sel_count + Align256(want_sel ? rows * 4 : 0);
  if (!async) QKV_RETURN_IF_ERROR(ReserveIo(io.bytes));

  // Page ids: one sequence reads its mirror in place; a batch is copied together.
  const uint32_t* page_ids = parts_[s.partitions[0]].pages.as<uint32_t>();
  if (B > 1) {
    QKV_RETURN_IF_ERROR(batch_pages_.Reserve(std::size_t(page_indptr[B]) * 4));
    page_ids = batch_pages_.as<uint32_t>();
  }
  if (s.host_f32) {
    QKV_RETURN_IF_ERROR(q_f32_.Reserve(qelems * 4));
    if (g_.dtype != DType::kF32) QKV_RETURN_IF_ERROR(o_f32_.Reserve(qelems * 4));
  }
  clock.Mark(kBuffers);  // and the resolve/attend plans, the header, pinned io
  QKV_RETURN_IF_ERROR(FlushUpdates());
  clock.Mark(kFlush);

  const void* q = s.host_f32 ? (g_.dtype == DType::kF32 ? q_f32_.as() : q_.as()) : s.q;
  char* qb = queues_.as<char>();
  kc::ResolveParams rp;
  rp.step = s.step;
  rp.step_ptr = reinterpret_cast<const int64_t*>(d_hdr + o_step);
  rp.page_indptr = d_hdr;
  rp.page_ids = page_ids;
  rp.sel_indptr = d_hdr + o_sel;
  rp.sel_count = sel_count_.as<int32_t>();
  rp.sel_pages = sel_pages_.as<int32_t>();
  rp.host_addr = host_addr_.as<const void* const>();
  rp.hbm_slot = hbm_slot_.as<int32_t>();
  rp.slot_page = slot_page_.as<uint32_t>();
  rp.slot_head = slot_head_.as<int32_t>();
  rp.slot_last_use = slot_last_use_.as<int64_t>();
  rp.slot_pinned = slot_pinned_.as<uint8_t>();
  rp.part_indptr = d_hdr + o_part;
  rp.part_lists = reinterpret_cast<int32_t* const*>(d_hdr + o_lists);
  rp.slots = pool_.as();
  rp.out_slots = res_slots_.as<int32_t>();
  rp.out_count = res_count_.as<int32_t>();
  rp.cold = reinterpret_cast<kc::ResolveRequest*>(qb);
  rp.bypass = reinterpret_cast<kc::ResolveRequest*>(qb + qbytes_req);
  rp.cold_count = reinterpret_cast<int32_t*>(qb + 2 * qbytes_req);
  rp.bypass_count = rp.cold_count + 1;
  rp.queue_capacity = qcap;
  rp.counters = counters_.as<kc::ResolveCounters>();
  rp.workspace = res_ws_.as();

  std::vector<kc::ResolveRequest> cold;
  auto read_cold_count = [&]() -> Result<int32_t> {
    int32_t n = 0;
    QKV_CUDA(cudaMemcpyAsync(&n, rp.cold_count, 4, cudaMemcpyDeviceToHost, stream_));
    QKV_RETURN_IF_ERROR(Sync());
    return n;
  };
  // The first n cold-miss requests (n: the device's count, read back).
  auto read_cold = [&](int32_t n) -> Status {
    cold.resize(std::clamp(n, 0, qcap));
    if (!cold.empty()) {
      QKV_CUDA(cudaMemcpyAsync(cold.data(), rp.cold, cold.size() * sizeof(kc::ResolveRequest), cudaMemcpyDeviceToHost,
                               stream_));
      QKV_RETURN_IF_ERROR(Sync());
    }
    return Status::Ok();
  };
  // Cold misses under strict: promote, publish, resolve again (hits stay
  // hits). The re-runs count on scratch counters; only their traffic is kept.
  auto settle_cold = [&]() -> Status {
    for (int round = 0;; ++round) {
      QKV_ASSIGN_OR_RETURN(const int32_t n, read_cold_count());
      QKV_RETURN_IF_ERROR(read_cold(n));
      if (cold.empty()) return Status::Ok();
      if (round > 64) return Status::Internal("cold misses do not settle");
      // Every read in flight before waiting for any.
      for (const kc::ResolveRequest& r : cold) QKV_RETURN_IF_ERROR(mover_->Prefetch(r.page, /*ahead=*/false));
      for (const kc::ResolveRequest& r : cold)
        QKV_RETURN_IF_ERROR(mover_->EnsureHost(r.page, ids_->generation(r.page), s.step));
      QKV_RETURN_IF_ERROR(FlushUpdates());
      QKV_CUDA(cudaMemsetAsync(scratch_counters_.as(), 0, scratch_counters_.bytes(), stream_));
      kc::ResolveParams again = rp;
      again.counters = scratch_counters_.as<kc::ResolveCounters>();
      QKV_CUDA(kc::LaunchResolve(rplan, again, stream_));
      kc::ResolveCounters sc;
      QKV_CUDA(cudaMemcpyAsync(&sc, scratch_counters_.as(), sizeof(sc), cudaMemcpyDeviceToHost, stream_));
      QKV_RETURN_IF_ERROR(Sync());
      extra_bytes_ += int64_t(sc.bytes_host_to_hbm);
      extra_evictions_ += int64_t(sc.evictions);
    }
  };
  // The step's device work: select -> resolve -> attend, with the batch's
  // page ids gathered and q and out converted. Captured once per shape and
  // replayed when graphs are on and nothing in it waits for the host. Inputs
  // (header, host q) go up before it from the staging, readbacks are
  // enqueued after it: a graph holds no per-call host address.
  auto enqueue = [&](bool capturing) -> Status {
    if (B > 1)
      for (int b = 0; b < B; ++b)
        QKV_CUDA(cudaMemcpyAsync(batch_pages_.as<uint32_t>() + page_indptr[b], parts_[s.partitions[b]].pages.as(),
                                 std::size_t(counts[b]) * 4, cudaMemcpyDeviceToDevice, stream_));
    if (s.host_f32 && g_.dtype != DType::kF32)
      QKV_CUDA(kc::LaunchConvert(q_f32_.as(), kc::DType::kF32, q_.as(), dt, qelems, stream_));
    // Phase timing only when launched directly: cudaEventElapsedTime refuses
    // events recorded by a graph's nodes (cudaErrorInvalidValue).
    if (timed) QKV_CUDA(cudaEventRecord(ev_[0], stream_));
    kc::SelectParams sp;
    sp.shape = shape;
    sp.q_dtype = dt;
    sp.summary_dtype = sum_dtype();
    sp.q = q;
    sp.summaries = summaries_.as();
    sp.page_indptr = d_hdr;
    sp.page_ids = page_ids;
    sp.out_indptr = d_hdr + o_sel;
    sp.out_pages = sel_pages_.as<int32_t>();
    sp.out_count = sel_count_.as<int32_t>();
    sp.workspace = sel_ws_.as();
    QKV_CUDA(kc::LaunchSelect(splan, sp, stream_));
    if (timed) QKV_CUDA(cudaEventRecord(ev_[1], stream_));
    QKV_CUDA(kc::LaunchResolve(rplan, rp, stream_));
    if (!capturing && cold_waits) QKV_RETURN_IF_ERROR(settle_cold());
    if (timed) QKV_CUDA(cudaEventRecord(ev_[2], stream_));
    kc::AttendParams ap;
    ap.scale = 1.f / std::sqrt(float(D));
    ap.q = q;
    ap.slots = pool_.as();
    ap.indptr = d_hdr + o_sel;
    ap.count = res_count_.as<int32_t>();
    ap.slot_ids = res_slots_.as<int32_t>();
    ap.last_len = d_hdr + o_last;
    ap.o = s.host_f32 ? o_.as() : s.out;
    ap.workspace = att_ws_.as();
    const kc::ResolveFillList fills = kc::ResolveFills(rplan, res_ws_.as());
    if (fill_in_attention) ap.fills = fills.jobs;
    if (const cudaError_t e = kc::RunAttend(aplan, ap, stream_); e != cudaSuccess) {
      // The resolve named slots for the misses: they get their bytes anyway.
      if (fill_in_attention) kc::LaunchGather(fills.jobs, fills.count, piece(), sms_, stream_);
      return CudaStatus("RunAttend", e);
    }
    if (timed) QKV_CUDA(cudaEventRecord(ev_[3], stream_));
    if (s.host_f32 && g_.dtype != DType::kF32)
      QKV_CUDA(kc::LaunchConvert(o_.as(), dt, o_f32_.as(), kc::DType::kF32, qelems, stream_));
    return Status::Ok();
  };
  QKV_RETURN_IF_ERROR(Upload(header_.as(), hdr.data(), hdr.size() * 4));
  if (s.host_f32) QKV_RETURN_IF_ERROR(Upload(q_f32_.as(), s.q, qelems * 4));
  if (c_.cuda_graphs && !cold_waits && !timed) {
    // Everything a captured step bakes in: shapes, buffers, pointers.
    std::vector<int64_t> key = {B, shape.dense, shape.page_budget, s.host_f32,
                                int64_t(reinterpret_cast<uintptr_t>(s.host_f32 ? nullptr : s.q)),
                                int64_t(reinterpret_cast<uintptr_t>(s.host_f32 ? nullptr : s.out))};
    for (int b = 0; b < B; ++b) {
      key.push_back(s.partitions[b]);
      key.push_back(counts[b]);
      key.push_back(int64_t(reinterpret_cast<uintptr_t>(parts_[s.partitions[b]].pages.as())));
      key.push_back(part_indptr[b + 1] - part_indptr[b]);
    }
    const int64_t captured = graphs_captured_;
    QKV_ASSIGN_OR_RETURN(cudaGraphExec_t exec, GraphFor(key, [&] { return enqueue(true); }));
    if (s.graphs_captured) *s.graphs_captured += graphs_captured_ - captured;
    QKV_CUDA(cudaGraphLaunch(exec, stream_));
  } else {
    QKV_RETURN_IF_ERROR(enqueue(false));
  }
  if (async) {
    unchecked_async_ = true;  // its bypasses are checked at the next wait (Sync)
    if (s.selected) *s.selected += entries;  // exact for max/mean and dense; union rows may use less
    clock.Mark(kLaunch);
    return Status::Ok();
  }
  if (s.host_f32)
    QKV_CUDA(cudaMemcpyAsync(io_ + io.out, g_.dtype != DType::kF32 ? o_f32_.as() : o_.as(), qelems * 4,
                             cudaMemcpyDeviceToHost, stream_));
  QKV_CUDA(cudaMemcpyAsync(io_ + io.counts, rp.cold_count, 4, cudaMemcpyDeviceToHost, stream_));
  QKV_CUDA(cudaMemcpyAsync(io_ + io.totals, counters_.as(), sizeof(kc::ResolveCounters), cudaMemcpyDeviceToHost,
                           stream_));
  if (want_sel) {
    QKV_CUDA(cudaMemcpyAsync(io_ + io.sel_pages, sel_pages_.as(), entries * 4, cudaMemcpyDeviceToHost, stream_));
    QKV_CUDA(cudaMemcpyAsync(io_ + io.sel_count, sel_count_.as(), rows * 4, cudaMemcpyDeviceToHost, stream_));
  }
  clock.Mark(kLaunch);
  unchecked_async_ = false;  // checked below, from the counters read back with the outputs
  QKV_RETURN_IF_ERROR(Sync());
  clock.Mark(kDeviceWait);
  if (s.host_f32) std::memcpy(s.out, io_ + io.out, qelems * 4);
  int32_t cold_count = 0;
  std::memcpy(&cold_count, io_ + io.counts, sizeof(cold_count));
  // Read in place: io_ stays put until the next step.
  const int32_t* sel_pages = reinterpret_cast<const int32_t*>(io_ + io.sel_pages);
  const int32_t* sel_count = reinterpret_cast<const int32_t*>(io_ + io.sel_count);
  // Bypasses since the last check: this step's and any earlier asynchronous
  // step's, reported now.
  kc::ResolveCounters totals;
  std::memcpy(&totals, io_ + io.totals, sizeof(totals));
  const uint64_t bypassed = totals.bypasses - bypasses_seen_;
  bypasses_seen_ = totals.bypasses;
  if (bypassed > 0) return NoSlotFault(bypassed);

  if (timed) {
    float a = 0, b = 0, c = 0;
    QKV_CUDA(cudaEventElapsedTime(&a, ev_[0], ev_[1]));
    QKV_CUDA(cudaEventElapsedTime(&b, ev_[1], ev_[2]));
    QKV_CUDA(cudaEventElapsedTime(&c, ev_[2], ev_[3]));
    if (s.select_us) *s.select_us += 1e3 * a;
    if (s.resolve_us) *s.resolve_us += 1e3 * b;
    if (s.attend_us) *s.attend_us += 1e3 * c;
  }
  // A page is noted once per call: a row selecting every page notes them all,
  // so the other rows of its sequence need not (NoteSelected is idempotent
  // within a step, but at 1M tokens a dense layer's 8 rows were 524K scattered
  // writes a call).
  const bool note = mover_->has_disk();
  if (want_sel) {
    if (s.selections) s.selections->resize(B);
    for (int b = 0; b < B; ++b) {
      const PageList& list = *s.lists[b];
      PageSelection* out = s.selections ? &(*s.selections)[b] : nullptr;
      if (out) {
        out->indptr.assign(1, 0);
        out->pages.clear();
      }
      bool noted_all = false;
      for (int h = 0; h < H; ++h) {
        const int r = b * H + h;
        const int n = std::min(sel_count[r], sel_indptr[r + 1] - sel_indptr[r]);
        const int32_t* row = sel_pages + sel_indptr[r];
        if (out) out->pages.insert(out->pages.end(), row, row + n);
        if (note && !noted_all) {
          for (int i = 0; i < n; ++i) mover_->NoteSelected(list.pages[row[i]], s.step);
          noted_all = n == counts[b];
        }
        if (s.selected) *s.selected += n;
        if (out) out->indptr.push_back(int32_t(out->pages.size()));
      }
    }
  } else {
    if (s.selected) *s.selected += entries;  // exact for max/mean and dense; union rows may use less
    if (note)  // a dense layer (see want_sel): every page of every sequence
      for (int b = 0; b < B; ++b)
        for (PageId page : s.lists[b]->pages) mover_->NoteSelected(page, s.step);
  }
  // Deadline: the pages attended without start their promotion now (their
  // count came back with the step's outputs).
  if (!strict && mover_->has_disk() && cold_count > 0) {
    QKV_RETURN_IF_ERROR(read_cold(cold_count));
    for (const kc::ResolveRequest& r : cold) QKV_RETURN_IF_ERROR(mover_->Prefetch(r.page, /*ahead=*/false));
  }
  clock.Mark(kReadback);  // selections, timings, host queues
  return Status::Ok();
}

Result<double> CudaBackendImpl::TimeDenseOffload(std::span<const PageList* const> lists, std::size_t max_bytes,
                                                 int reps, int64_t* bytes) {
  const int H = g_.kv_heads;
  const std::size_t head_page = 2 * piece();
  std::vector<kc::GatherJob> jobs;
  int64_t total = 0;
  for (const PageList* l : lists)
    for (PageId page : l->pages) {
      total += int64_t(H) * int64_t(head_page);
      const void* home = mover_->HostHome(page);
      if (!home || (jobs.size() + H) * head_page > max_bytes) continue;
      const char* d = static_cast<const char*>(home_dev(home));
      for (int h = 0; h < H; ++h)
        jobs.push_back({d + std::size_t(h) * piece(), d + std::size_t(H + h) * piece(),
                        reinterpret_cast<void*>(jobs.size() * head_page)});  // offset, rebased below
    }
  if (jobs.empty()) return Status::FailedPrecondition("no page has a host home to stream from");
  DevBuf dst, meta;
  QKV_RETURN_IF_ERROR(dst.Reserve(jobs.size() * head_page));
  for (kc::GatherJob& j : jobs) j.dst = dst.as<char>() + reinterpret_cast<uintptr_t>(j.dst);
  QKV_RETURN_IF_ERROR(meta.Reserve(jobs.size() * sizeof(kc::GatherJob) + 16));
  const int32_t n = int32_t(jobs.size());
  QKV_CUDA(cudaMemcpyAsync(meta.as(), jobs.data(), jobs.size() * sizeof(kc::GatherJob), cudaMemcpyHostToDevice, stream_));
  auto* count = reinterpret_cast<int32_t*>(meta.as<char>() + jobs.size() * sizeof(kc::GatherJob));
  QKV_CUDA(cudaMemcpyAsync(count, &n, 4, cudaMemcpyHostToDevice, stream_));
  std::vector<float> ms;
  for (int r = 0; r <= reps; ++r) {  // the first is a warm-up
    QKV_CUDA(cudaEventRecord(ev_[0], stream_));
    QKV_CUDA(kc::LaunchGather(meta.as<kc::GatherJob>(), count, piece(), sms_, stream_));
    QKV_CUDA(cudaEventRecord(ev_[1], stream_));
    QKV_RETURN_IF_ERROR(Sync());
    float t = 0;
    QKV_CUDA(cudaEventElapsedTime(&t, ev_[0], ev_[1]));
    if (r > 0) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double measured = double(jobs.size() * head_page);
  *bytes = total;
  return 1e3 * double(ms[ms.size() / 2]) * double(total) / measured;
}

BackendCounters CudaBackendImpl::counters() {
  const CudaCounters d = device_counters();
  BackendCounters c;
  c.selected = d.selected, c.hits = d.hits, c.misses = d.misses_host + d.misses_disk, c.evictions = d.evictions;
  c.bytes_h2d = d.bytes_host_to_hbm;
  c.cold_misses = d.misses_disk, c.cold_stalls = d.cold_stalls, c.pages_skipped = d.pages_skipped;
  c.slots_capacity = d.slots_capacity, c.slots_used = d.slots_used, c.slots_peak = d.slots_peak;
  c.slot_bytes = d.slot_bytes;
  return c;
}

CudaCounters CudaBackendImpl::device_counters() {
  kc::ResolveCounters c{};
  cudaMemcpyAsync(&c, counters_.as(), sizeof(c), cudaMemcpyDeviceToHost, stream_);
  cudaStreamSynchronize(stream_);
  CudaCounters out;
  out.selected = int64_t(c.selected);
  out.hits = int64_t(c.hits);
  out.misses_host = int64_t(c.misses_host);
  out.misses_disk = int64_t(c.misses_disk);
  out.evictions = int64_t(c.evictions) + extra_evictions_;
  out.bytes_host_to_hbm = int64_t(c.bytes_host_to_hbm) + extra_bytes_;
  out.cold_stalls = int64_t(c.cold_stalls);
  out.pages_skipped = int64_t(c.pages_skipped);
  out.slots_capacity = uint64_t(slots_);
  out.slots_used = uint64_t(slots_ - int64_t(free_.size()));
  out.slots_peak = slots_peak_;
  out.slot_bytes = 2 * piece();
  return out;
}

}  // namespace

Result<std::unique_ptr<DataPlane>> MakeCudaBackend(const Config& config, PageAllocator* ids, TierMover* mover,
                                                   SlotArena* host) {
  auto impl = std::make_unique<CudaBackendImpl>(config, ids, mover, host);
  QKV_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<DataPlane>(std::move(impl));
}

}  // namespace questkv
