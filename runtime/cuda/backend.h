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
// decode step on device pointers returns as soon as it is enqueued unless
// the host must wait for it: selections asked for, phase timing, or cold
// misses under `strict` with a disk tier. What the host learns of a step —
// the pages it selected (the mover's demotion order) and its cold misses
// (promoted for the next steps under `deadline`) — a small kernel writes into
// mapped pinned memory (a Report), read a few calls later, when a later call
// is enqueued, or at Synchronize(). Host homes stay put under queued kernels:
// every such call takes a ticket and the mover keeps a home that stops being
// readable out of use until the calls queued by then are done
// (TierMover::SetDeviceReads). The device's cumulative count of selected
// head-pages that found no slot is checked at the next wait, and such a
// fault comes back from the next call or from Synchronize(). Within a step
// nothing waits on the host except cold misses under `strict`. An append
// that fills pages does not wait for their seal copies either: an event
// follows the copies, and the mover ends each seal (checksum, readable,
// demotable) once that event has passed, seen at a later call.
//
// Thread-compatible; one CUDA stream.
//
// Plain C++ against the CUDA runtime API; every kernel comes from kernels/cuda.
//
// This header is the backend's own (runtime/cuda/*.cc): its helpers and the
// class that implements DataPlane. Files by responsibility: backend.cc
// (device buffers, staging, table edits, counters), partitions.cc (slot
// lists), append.cc (append, tails, reads), step_plan.cc (planning a decode
// step), step_run.cc (enqueue, graphs, cold misses, read-back).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kernels/cuda/kernels_cuda.h"
#include "prefetch/tier_mover.h"
#include "runtime/backend.h"
#include "tiers/arena.h"
#include "tiers/page_allocator.h"

namespace questkv::cuda_backend {

namespace kc = kernels::cuda;

constexpr int kStagingPages = 64;  // pages a prefill chunk passes through at once

inline Status CudaStatus(const char* what, cudaError_t e) {
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

// Misses staged while the resolve chooses victims (kc::ResolveShape::
// stage_pages; Config::cuda_stage_misses): at most this many bytes a call.
constexpr std::size_t kStageBytes = std::size_t(16) << 20;

// Bumped by the device and pinned allocations of this backend that a captured
// step graph may bake in: a new one retires the graphs.
inline uint64_t g_alloc_epoch = 0;

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
  // `in_graphs`: captured step graphs may bake the block's address in, so a
  // new block drops them (g_alloc_epoch). A partition's list and page mirror
  // pass false: the steps read the lists through their header and key their
  // graphs by the page mirror's address; so do the append's staging buffers,
  // which no step reads.
  Status Reserve(std::size_t bytes, bool in_graphs = true) {
    if (bytes <= n_) return Status::Ok();
    if (p_) QKV_CUDA(cudaDeviceSynchronize());  // queued work may still read the old block
    cudaFree(p_);
    p_ = nullptr;
    n_ = 0;
    QKV_CUDA(cudaMalloc(&p_, bytes));
    n_ = bytes;
    if (in_graphs) ++g_alloc_epoch;
    return Status::Ok();
  }
  // A step buffer whose size follows page counts and list lengths: rounded
  // up to a power of two, so a growing sequence retires the step graphs a
  // logarithmic number of times rather than at every new page.
  Status Grow(std::size_t bytes) {
    return bytes <= n_ ? Status::Ok() : Reserve(std::bit_ceil(std::max<std::size_t>(bytes, 256)));
  }
  template <typename T = void>
  T* as() const { return static_cast<T*>(p_); }
  std::size_t bytes() const { return n_; }

 private:
  void* p_ = nullptr;
  std::size_t n_ = 0;
};

inline std::size_t Align256(std::size_t x) { return (x + 255) & ~std::size_t(255); }

// Selected head-pages that found no slot: the partition lists always hold a
// step's selection, so this is a fault, never a policy outcome.
inline Status NoSlotFault(uint64_t n) {
  return Status::Internal(std::to_string(n) + " selected head-pages found no slot (partition lists too short)");
}

// Host-side time of DecodeStep's and Append's phases, summed; printed to
// stderr when the backend goes when Config::cuda_profile_host is set (to see
// what the host adds to a step). A decode call's first phase is the mover's
// pump, between BeginStep and the step; an enqueued call's "report wait" is
// its wait for an older call's report, which paces the host to the device.
enum HostPhase {
  kPump, kPlan, kGrow, kBuffers, kFlush, kLaunch, kDeviceWait, kReportWait, kReadback, kHostPhases
};
constexpr const char* kHostPhaseNames[kHostPhases] = {"pump",   "plan",        "grow lists",  "buffers", "table flush",
                                                      "launch", "device wait", "report wait", "readback"};
// Append: ids, homes and draft room; the page mirror; the old tail; fresh
// pages; the list, the seals' wait and SealEnd.
enum AppendPhase { kAppendReserve, kAppendMirror, kAppendTail, kAppendFresh, kAppendFinish, kAppendPhases };
constexpr const char* kAppendPhaseNames[kAppendPhases] = {"reserve", "page mirror", "old tail", "fresh pages",
                                                          "list and seals"};
struct HostProfile {
  static constexpr int kMaxPhases = 10;
  HostProfile(const char* const* names, int phases) : names(names), phases(phases) {}
  const char* const* names;
  int phases;
  double us[kMaxPhases] = {};
  int64_t calls = 0;
  // Calls whose phase took over 100 us, and those calls' time in it: a
  // few one-off costs (first growth, graph capture) or a steady one.
  int64_t slow_calls[kMaxPhases] = {};
  double slow_us[kMaxPhases] = {};
  // "name mean (n over 100 us: total us), ...", means per call.
  std::string Line() const {
    std::string line;
    for (int i = 0; i < phases; ++i) {
      char part[96];
      std::snprintf(part, sizeof(part), "%s%s %.1f (%lld over 100 us: %.0f us)", i ? ", " : "", names[i],
                    us[i] / std::max<int64_t>(calls, 1), (long long)slow_calls[i], slow_us[i]);
      line += part;
    }
    return line;
  }
};
// The stream's time between marks (events recorded between calls' work,
// never inside a graph): where a decode step's device time goes besides its
// kernels, the device's waits for the host's next submission included. A
// span is named by the marks that bound it; spans between other pairs (a
// prefill's appends back to back) are not counted. Settled at each Sync; no
// span crosses one. An append of fewer tokens than a page (decode, drafts)
// and one of a page or more (prefill chunks) start with different marks, so
// a decode step's appends are not pooled with the prefill's.
enum StreamMark {
  kMarkAppend, kMarkAfterAppend, kMarkTables, kMarkGraph, kMarkDirect, kMarkReport, kMarkAfterCall, kMarkFill
};
enum StreamSpan { kSpanAppend, kSpanToDecode, kSpanTables, kSpanGraph, kSpanDirect, kSpanReport, kSpanToAppend,
                  kSpanFill, kStreamSpans };
constexpr const char* kStreamSpanNames[kStreamSpans] = {
    "append", "until decode", "tables and inputs up", "step graph", "step launched directly", "report",
    "until next append", "prefill append"};
struct StreamProfile {
  std::vector<std::pair<int, cudaEvent_t>> marks;  // since the last Sync, in stream order
  std::vector<cudaEvent_t> spare;
  std::vector<float> us[kStreamSpans];
  // The span from mark `from` to mark `to`; -1 where the pair is not one.
  static int SpanOf(int from, int to) {
    if (from == kMarkAppend && to == kMarkAfterAppend) return kSpanAppend;
    if (from == kMarkFill && to == kMarkAfterAppend) return kSpanFill;
    if ((from == kMarkAfterAppend || from == kMarkAfterCall) && to == kMarkTables) return kSpanToDecode;
    if (from == kMarkTables && (to == kMarkGraph || to == kMarkDirect)) return kSpanTables;
    if ((from == kMarkGraph || from == kMarkDirect) && to == kMarkReport)
      return from == kMarkGraph ? kSpanGraph : kSpanDirect;
    if (from == kMarkReport && to == kMarkAfterCall) return kSpanReport;
    if (from == kMarkAfterCall && to == kMarkAppend) return kSpanToAppend;
    return -1;
  }
  // "name p50 / mean (spans), ..." in us.
  std::string Line() {
    std::string line;
    for (int i = 0; i < kStreamSpans; ++i) {
      std::vector<float>& v = us[i];
      if (v.empty()) continue;
      double sum = 0;
      for (float x : v) sum += x;
      std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
      char part[128];
      std::snprintf(part, sizeof(part), "%s%s %.1f / %.1f (%zu)", line.empty() ? "" : ", ", kStreamSpanNames[i],
                    double(v[v.size() / 2]), sum / double(v.size()), v.size());
      line += part;
    }
    return line;
  }
};

class HostClock {
 public:
  using Time = std::chrono::steady_clock::time_point;
  explicit HostClock(HostProfile& p, Time since = std::chrono::steady_clock::now()) : p_(p), last_(since) {
    ++p_.calls;
  }
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


class CudaBackendImpl final : public DataPlane {
 public:
  CudaBackendImpl(const Config& c, PageAllocator* ids, TierMover* mover, SlotArena* host)
      : c_(c), g_(c.geometry), ids_(ids), mover_(mover), host_(host) {}
  ~CudaBackendImpl() override {
    mover_->SetDeviceReads({});  // the mover may outlive the backend; the device is idle below
    if (c_.cuda_profile_host && prof_.calls) {
      std::fprintf(stderr,
                   "questkv cuda decode host profile (%lld calls, us/call): %s; %lld step graphs captured, "
                   "%lld updated in place (updates refused: %s), %lld retired by new buffers\n",
                   (long long)prof_.calls, prof_.Line().c_str(), (long long)graphs_captured_, (long long)graphs_updated_,
                   RefusalLine().c_str(), (long long)graphs_retired_);
    }
    if (c_.cuda_profile_host && append_prof_.calls)
      std::fprintf(stderr, "questkv cuda append host profile, calls of fewer than %d tokens (%lld calls, us/call): %s\n",
                   g_.page_size, (long long)append_prof_.calls, append_prof_.Line().c_str());
    if (c_.cuda_profile_host && fill_prof_.calls)
      std::fprintf(stderr, "questkv cuda append host profile, calls of %d tokens or more (%lld calls, us/call): %s\n",
                   g_.page_size, (long long)fill_prof_.calls, fill_prof_.Line().c_str());
    if (stream_) cudaStreamSynchronize(stream_);
    for (const SealBatch& b : seal_batches_) {  // landed: the stream is idle
      for (PageId page : b.pages) mover_->SealEnd(page);
      cudaEventDestroy(b.done);
    }
    if (c_.cuda_profile_host) {
      SettleStreamMarks();
      if (!stream_prof_.us[kSpanGraph].empty() || !stream_prof_.us[kSpanDirect].empty())
        std::fprintf(stderr, "questkv cuda stream profile (us a span, p50 / mean (spans)): %s\n",
                     stream_prof_.Line().c_str());
      for (cudaEvent_t e : stream_prof_.spare) cudaEventDestroy(e);
    }
    for (cudaEvent_t e : ev_)
      if (e) cudaEventDestroy(e);
    for (Report& r : reports_) {
      if (r.done) cudaEventDestroy(r.done);
      if (r.host) cudaFreeHost(r.host);
    }
    for (auto& [ticket, e] : ticket_events_) cudaEventDestroy(e);
    for (cudaEvent_t e : spare_events_) cudaEventDestroy(e);
    if (stage_) cudaFreeHost(stage_);
    ClearGraphs();
    if (io_) cudaFreeHost(io_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  Status Init();

  Result<uint32_t> AddPartition() override;
  void RemovePartition(uint32_t part) override;
  void PageDied(PageId page) override {
    // Its seal copy lands first: the mover frees the home after this.
    if (Status s = EndSealOf(page); !s.ok() && async_error_.ok()) async_error_ = s;
    clears_.push_back({nullptr, int64_t(page), kc::TableOp::kDropPage, 0});
    if (auto it = tail_owner_.find(page); it != tail_owner_.end()) {
      parts_[it->second].tail_page = kNoPage;  // the id may come back as anyone's page
      tail_owner_.erase(it);
    }
    if (auto it = held_.find(page); it != held_.end()) {  // a rolled-back draft page: its slots go free
      ReleaseSlots(it->second.slots);
      held_.erase(it);
    }
  }
  void SetHome(PageId page, const void* home) override {
    const void* dev = home ? host_dev_ + (static_cast<const char*>(home) - host_base_) : nullptr;
    Set(host_addr_.as<const void*>() + page, int64_t(reinterpret_cast<uintptr_t>(dev)), kc::TableOp::kSet64);
  }
  Status SetPages(uint32_t part, std::span<const PageId> pages) override;
  Status Append(uint32_t part, PageList& list, const void* k, const void* v, int64_t n, bool host_f32,
                int64_t step, bool hold) override;
  void BeginStep(int64_t step) override {
    step_ = step;
    step_begun_ = std::chrono::steady_clock::now();
  }
  Status SealHeld(PageId page) override;
  Status CopyTail(uint32_t src_part, PageId src, uint32_t dst_part, PageId dst, int len, int64_t) override;
  Status TailFromHost(uint32_t part, PageId dst, const void* page, int len, int64_t) override;
  Status TruncateTail(uint32_t part, PageId tail, int len) override;
  Status ReadPage(uint32_t part, PageId page, void* dst, int64_t step) override {
    if (!mover_->sealed(page)) return ReadUnsealed(part, page, dst);
    QKV_RETURN_IF_ERROR(EndSealOf(page));
    return mover_->ReadPage(page, ids_->generation(page), dst, step);
  }
  Status ReadSummaries(std::span<const PageId> pages, float* dst) override;
  std::size_t summary_elem_bytes() const override { return g_.summary_elem_bytes(); }
  Status DecodeStep(const Step& s) override;
  Status DecodeRows(const Step& st, const std::vector<int>& rows);
  bool on_device() const override { return true; }
  Status Synchronize() override {
    QKV_RETURN_IF_ERROR(Sync());
    QKV_RETURN_IF_ERROR(TakeReports(/*keep=*/0));
    QKV_RETURN_IF_ERROR(EndSeals(/*wait=*/false));  // all landed: Sync waited for them
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
    bool shared = false;  // shared block selection (Step::shared_blocks)
    double* select_us = nullptr;
    double* resolve_us = nullptr;
    double* attend_us = nullptr;
    int64_t* selected = nullptr;
    int64_t* graphs_captured = nullptr;
    AttendStats* adaptive = nullptr;  // the adaptive rows' counts since the last call that waited
  };
  // What one step's functions share: its shapes, plans, header and buffers.
  struct IoLayout {  // offsets in io_ of what a synchronous step reads back
    std::size_t out = 0, totals = 0, adaptive = 0, sel_pages = 0, sel_count = 0, bytes = 0;
  };
  struct StepPlan {
    StepPlan(HostProfile& prof, HostClock::Time since) : clock(prof, since) {}
    HostClock clock;
    int B = 0, rows = 0, max_row = 0;
    std::size_t qelems = 0;
    bool padded = false;  // q and out through qpad_ and opad_ (kgroup())
    DType dt = DType::kF16;
    std::vector<int32_t> counts, last_len, page_indptr;  // [B], [B], [B+1]
    // The resolve's sequences: the distinct lists (partitions) of the rows.
    // Rows sharing one (a block's positions: causal views of one list, so
    // their logical page indices agree) make a block step: the resolve runs
    // once per list over the union of their selections (kc::BlockUnion) and
    // each row attends the slots its own entries got (kc::BlockSlots).
    bool block = false;
    int L = 0;
    std::vector<uint32_t> lists;                   // [L] partitions, in order of first row
    std::vector<int32_t> members_indptr, members;  // [L+1], [B]: rows of each list, in row order
    std::vector<int32_t> list_of;                  // [B] each row's list
    std::vector<int32_t> list_start, list_pages;   // [L+1] page table starts (the longest row's), [L]
    std::vector<int32_t> part_indptr;              // [L+1] list slots
    std::vector<int32_t> usel_indptr;              // [L*Hkv+1] union rows' capacities (block)
    int64_t uentries = 0;                          // usel_indptr's last (block); else entries
    kc::SelectShape shape;
    kc::SelectPlan splan;
    // Shared block selection (BlockSelection::kShared) in a block step: the
    // select runs over the lists, each list's pages scored with all its
    // rows' queries (lshape, lplan: into shared_pages_), then each row takes
    // its share of its list's pages (kc::BlockShare) into the rows' CSR,
    // whose capacities splan.out_indptr then holds.
    bool shared = false;
    kc::SelectShape lshape;
    kc::SelectPlan lplan;
    std::vector<int32_t> lpage_indptr;  // [L+1]
    const uint32_t* list_ids = nullptr;                  // the lists' page tables side by side
    // Re-rank (SelectionPolicy::rerank): a widened select's rows are the
    // candidates LaunchRerank narrows to splan's.
    bool rerank = false;
    kc::SelectShape wshape;
    kc::SelectPlan wplan;
    int max_listed = 0;
    kc::ResolvePlan rplan;
    kc::AttendPlan aplan;
    int64_t entries = 0;  // selection bound of the whole batch
    bool strict = false, cold_waits = false, fill_in_attention = false;
    // deadline with a skip limit below 1: the call waits for the host, which
    // decides list by list whether its cold misses are skipped or waited for
    bool skip_limit = false;
    bool want_sel = false, note = false, timed = false, async = false;
    int qcap = 0;
    std::size_t qbytes_req = 0;
    IoLayout io;
    std::vector<int32_t> hdr;
    std::size_t o_sel = 0, o_cand = 0, o_part = 0, o_last = 0, o_lists = 0, o_step = 0;
    std::size_t o_lstart = 0, o_usel = 0, o_members = 0;  // block steps
    std::size_t o_srcs = 0;                               // B > 1
    std::size_t o_lsel = 0, o_lpages = 0, o_listof = 0, o_lsrcs = 0;  // shared
    int64_t use_mark = 0;  // this launch's (PackHeader)
    const int32_t* d_hdr = nullptr;
    const uint32_t* page_ids = nullptr;
    const void* q = nullptr;
    kc::ResolveParams rp;
    std::vector<kc::ResolveRequest> cold;
    std::vector<int32_t> skipped;  // entries a skip-limited call attends without (sorted)
  };
  Status RunStep(const StepArgs& s);
  Status PlanStep(const StepArgs& s, StepPlan& p);
  void PlanLists(const StepArgs& s, StepPlan& p);
  Status PlanShared(StepPlan& p);
  void PlanUnion(StepPlan& p);
  Status GrowLists(const StepArgs& s, StepPlan& p);
  int64_t PinnedSelected(const StepArgs& s, const StepPlan& p, int l) const;
  Status PlanResolveAndAttend(const StepArgs& s, StepPlan& p);
  Status ReserveStepBuffers(const StepArgs& s, StepPlan& p);
  void PackHeader(const StepArgs& s, StepPlan& p);
  kc::ResolveParams ResolveParamsFor(const StepArgs& s, const StepPlan& p);
  Status ReadCold(StepPlan& p, int32_t n);
  Status SettleCold(const StepArgs& s, StepPlan& p);
  // Under a skip limit: which of the first resolve's cold misses (p.cold)
  // the call skips (into p.skipped; the rest stay in p.cold to wait for).
  void ChooseSkips(StepPlan& p, const std::vector<int32_t>& used);
  Status Enqueue(const StepArgs& s, StepPlan& p, bool capturing);
  // A padded step's q into qpad_, and its kernels' outputs from opad_ into `out`.
  Status PadQ(const StepPlan& p);
  Status UnpadOut(const StepPlan& p, void* out);
  Status Launch(const StepArgs& s, StepPlan& p);
  Status ReadBack(const StepArgs& s, StepPlan& p);
  Status ReturnSelections(const StepArgs& s, StepPlan& p);
  // What the host learns of a step, written by kc::LaunchStepReport into
  // mapped pinned memory and read once `done` has passed.
  struct Report {
    char* host = nullptr;
    char* dev = nullptr;
    std::size_t cap = 0;
    cudaEvent_t done = nullptr;
    bool pending = false;
    uint64_t seq = 0;  // order of queuing
    int64_t step = 0;
    bool strict = false, first_head_only = false;
    bool note = true;  // its pages were read back, for the mover to note
    int rows = 0, kv_heads = 0;
    std::vector<int32_t> sel_indptr, page_counts;  // [rows + 1], [batch]
    std::size_t o_counts = 0, o_cold_count = 0, o_cold = 0;  // pages at 0
    int cold_cap = 0;
  };
  Status QueueReport(const StepArgs& s, const StepPlan& p);
  // Applies pending reports, oldest first, waiting for each, until the
  // newest `keep` are left. *selected: the head-pages the newest selected.
  Status TakeReports(int keep, int64_t* selected = nullptr, HostClock* clock = nullptr);
  Status ApplyReport(Report& r, int64_t* selected);
  // Tickets of the calls that may still read host homes (see the top).
  uint64_t ReadsQueued() const { return reads_done_ < reads_queued_ ? reads_queued_ : 0; }
  Result<uint64_t> ReadsDone(bool wait);
  Status TicketCall();
  // A spare event (or a new one, without timing) recorded on the stream.
  Status RecordEvent(cudaEvent_t* e);
  // A page with no home yet (the tail, or a held draft page) from its slots.
  Status ReadUnsealed(uint32_t part, PageId page, void* dst);
  struct Partition {
    bool live = false;
    std::vector<int32_t> tail;       // [Hkv] pinned slots of the page being filled
    PageId tail_page = kNoPage;      // the page whose head-pages the tail slots hold
    std::vector<int32_t> owned;      // the list's slots, as a set (order lives on the device)
    DevBuf list;                     // [owned.size()] LRU first, reordered by the resolve
    DevBuf pages;                    // device mirror of the page list
    int64_t pages_len = 0;
    int64_t last_need = 0;           // slots its last step could select: what it keeps
    bool stepping = false;           // its step is growing lists: its need is not lent
  };

  std::size_t piece() const { return g_.head_page_elems() * DTypeBytes(g_.dtype); }
  // Summaries are kept in the model dtype: the min and max of keys stored in
  // that dtype are values of it, so nothing is rounded and scores (computed
  // in f32) are the same bits as from f32 summaries — at half the bytes the
  // select reads, for f16/bf16. Or as E4M3 codes rounded outward, half again.
  bool e4m3() const { return g_.e4m3_summaries(); }
  DType sum_dtype() const { return e4m3() ? DType::kE4M3 : g_.dtype; }
  std::size_t summary_bytes() const { return g_.summary_elems() * g_.summary_elem_bytes(); }
  // The kernels' GQA group: the model's, or for 3, 5, 6 and 7 the next power
  // of two. A padded step runs its kernels on q copied into [rows][kgroup][D]
  // (PadQ): the heads past the model's repeat the group's first head, so
  // kMax and kUnion select exactly as over the model's heads, or for kMean
  // are zero, which scales a row's every mean by G / kgroup and keeps its
  // ranking (but for means one rounding apart); their outputs are dropped
  // (UnpadOut). kUnion rows' capacities count the padded heads.
  int kgroup() const { return std::bit_ceil(unsigned(g_.group())); }
  bool padded() const { return kgroup() != g_.group(); }
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
  // other than `except`; `below_need`: then, from lists outside the step
  // being planned, below their needs, down to nothing if need be.
  Status Reclaim(int64_t must, int64_t want, uint32_t except, bool below_need = false);
  // An equal share of the pool's slots among live lists, and the slots a
  // list aims to hold with it (see GrowList).
  int64_t Share() const;
  static int64_t Target(const Partition& P, int64_t share) {
    return std::max(P.last_need, std::min(4 * P.last_need, share));
  }
  Status ExtendList(uint32_t part, const std::vector<int32_t>& slots);
  // Slots of no page and no list: released on the device, free again.
  void ReleaseSlots(const std::vector<int32_t>& slots) {
    for (int32_t s : slots) clears_.push_back({nullptr, s, kc::TableOp::kReleaseSlot, 0});
    free_.insert(free_.end(), slots.begin(), slots.end());
  }
  // Hkv free slots, pinned, for `page` (nullptr: no page yet).
  std::vector<int32_t> TakePinnedSlots(const PageId* page);
  Status AssignTail(uint32_t part, PageId page);
  Status RebuildSummary(const void* k_heads_host, PageId page, int len);
  Status LaunchAppendOne(const int32_t* hdr, int32_t start, const uint32_t* page_ids, int n, const void* k,
                         const void* v);
  Status LaunchAppendRange(Partition& P, int64_t t0, int64_t t1, const void* k, const void* v);
  Status ConvertIn(const void* host_f32, std::size_t elems, DevBuf& f32, DevBuf& out, const void** dev);
  // What one append's functions share.
  struct AppendPlan {
    struct Sealing {
      PageId page;
      int64_t logical;
      void* home;
    };
    const void* k = nullptr;
    const void* v = nullptr;
    bool host_f32 = true;
    bool hold = false;                // draft tokens: filled pages stay in hbm, unsealed (held_)
    int64_t old_tokens = 0, end = 0, old_pages = 0, total_pages = 0;
    int64_t t = 0;                    // next token to write
    std::vector<PageId> fresh;        // ids of the pages this call adds
    std::vector<Sealing> sealing;     // pages this call fills, with their homes
    std::size_t next_seal = 0;
    std::unordered_map<PageId, std::size_t> resident_at;  // page -> its Hkv slots in `resident`
    std::vector<int32_t> resident;
  };
  Status ReserveAppend(const PageList& list, int64_t step, AppendPlan& a);
  Status SealThrough(const Partition& P, AppendPlan& a, int64_t last_logical, int64_t first_staged);
  // Copies head-pages from their slots to their homes, on the stream.
  Status LaunchSeals(const std::vector<kc::SealJob>& jobs);
  // Seals without a wait for their copies. BeginSeal: the page's home
  // (SealBegin, tried again once the copies in flight have landed when the
  // host has no room: their homes cannot be demoted until then).
  // EndSealsLater, once the copies are enqueued: the homes go into the
  // device's host_addr at once (the stream orders the copy before any later
  // read) and the mover's SealEnd (checksum, host-readable, demotable) waits
  // for an event after the copies. EndSeals: those whose event has passed,
  // or all after a wait; EndSealOf: the page's, before the host reads or
  // frees it.
  Result<void*> BeginSeal(PageId page, int64_t step);
  Status EndSealsLater(std::span<const AppendPlan::Sealing> seals);
  Status EndSeals(bool wait);
  Status EndSealOf(PageId page) { return sealing_.count(page) ? EndSeals(/*wait=*/true) : Status::Ok(); }
  Status AppendRows(const AppendPlan& a, int64_t t0, int64_t t1, const void** kd, const void** vd);
  Status AppendToOldTail(uint32_t part, AppendPlan& a);
  Status AppendFreshPages(uint32_t part, AppendPlan& a);

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
  DevBuf adaptive_counters_;  // kc::AdaptiveCounters since the last call that waited read them
  int64_t slots_ = 0;
  std::vector<int32_t> free_;     // free slots (not staging, not in any partition)
  std::vector<int32_t> staging_;  // [kStagingPages][Hkv]
  uint64_t slots_peak_ = 0;
  std::vector<Partition> parts_;
  std::vector<uint32_t> free_parts_;
  int64_t extra_bytes_ = 0, extra_evictions_ = 0;  // moved by strict re-resolves
  // Cold misses the device counted as skipped that a skip-limited call
  // waited for instead, and the calls (lists at a layer) that waited.
  int64_t skips_waited_ = 0, deadline_waits_ = 0;
  HostProfile prof_{kHostPhaseNames, kHostPhases};
  HostProfile append_prof_{kAppendPhaseNames, kAppendPhases};  // calls of fewer than S tokens (decode)
  HostProfile fill_prof_{kAppendPhaseNames, kAppendPhases};    // of S or more (prefill)
  StreamProfile stream_prof_;
  // With Config::cuda_profile_host: a mark on the stream (outside graph
  // captures); the spans between marks are summed at the next Sync.
  void MarkStream(int mark);
  void SettleStreamMarks();

  // Per-call buffers.
  DevBuf summary_f32_, header_, batch_pages_, q_f32_, q_, o_, o_f32_, kv_f32_, kv_in_, v_in_, sel_pages_, sel_count_, res_slots_,
      res_count_, queues_, sel_ws_, res_ws_, att_ws_, cand_pages_, cand_count_, rerank_ws_, usel_pages_, usel_count_,
      shared_pages_, shared_count_, list_pages_, qpad_, opad_;
  std::size_t att_ws_zeroed_ = 0;  // bytes at the start of att_ws_ known zero (the attention's counters)
  // What header_ holds once the stream's queued writes land (empty: unknown).
  std::vector<int32_t> header_held_;

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
  // A call that returns at once waits for the report of the call
  // kReportsInFlight - 1 before it: the device has that many calls queued
  // while the host applies a report. A dense layer's report notes every page
  // (~0.6 ms at 512K on the host, ~1.1 ms at 1M), the time of several sparse
  // calls on the device: with fewer in flight the device idled while the
  // host noted them.
  static constexpr int kReportsInFlight = 8;
  Report reports_[kReportsInFlight];
  // A dense layer's pages are the hottest there are: reading all of them back
  // and noting them at every step told the mover nothing new and cost the
  // host ~0.5 ms a call at 512K. Its reports carry them once every
  // kDenseNoteModelSteps model steps (runtime step of the last such report,
  // per layer), far more recently than the coldest pages a demotion takes.
  static constexpr int64_t kDenseNoteModelSteps = 8;
  std::vector<int64_t> dense_noted_step_;
  // Whether the report of a step of `layer` at runtime step `step` carries its pages.
  bool ReportNotes(int layer, int64_t step);
  uint64_t report_seq_ = 0;
  uint64_t reads_queued_ = 0, reads_done_ = 0;
  std::deque<std::pair<uint64_t, cudaEvent_t>> ticket_events_;  // oldest first
  std::vector<cudaEvent_t> spare_events_;
  // Seal copies enqueued, not yet ended: each call's pages and the event
  // after their copies, oldest first; an append waits for them past
  // kMaxSealsInFlight pages. (Not tickets: a seal writes only its own
  // homes, so it keeps no freed home out of use.)
  struct SealBatch {
    cudaEvent_t done = nullptr;
    std::vector<PageId> pages;
  };
  static constexpr std::size_t kMaxSealsInFlight = 4096;
  std::deque<SealBatch> seal_batches_;
  std::unordered_set<PageId> sealing_;

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
  // The instantiated graph of a step shape, captured by `enqueue` on first
  // use. `sizes` (page counts, list lengths) change as sequences grow: the
  // shape's graph is then captured again and its executable updated in
  // place (cudaGraphExecUpdate: kernel parameters and grids), a fraction of
  // a new instantiation's cost; a new one only when the kernels differ.
  Result<cudaGraphExec_t> GraphFor(const std::vector<int64_t>& shape, const std::vector<int64_t>& sizes,
                                   const std::function<Status()>& enqueue) {
    if (graphs_epoch_ != g_alloc_epoch || graphs_.size() > 512) {
      graphs_retired_ += int64_t(graphs_.size());
      ClearGraphs();
      graphs_epoch_ = g_alloc_epoch;
    }
    const auto it = graphs_.find(shape);
    if (it != graphs_.end() && it->second.sizes == sizes) return it->second.exec;
    cudaGraph_t graph = nullptr;
    QKV_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
    const Status st = enqueue();
    const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
    QKV_RETURN_IF_ERROR(st);
    QKV_CUDA(end);
    if (it != graphs_.end()) {
      cudaGraphExecUpdateResultInfo info{};
      if (cudaGraphExecUpdate(it->second.exec, graph, &info) == cudaSuccess) {
        cudaGraphDestroy(graph);
        it->second.sizes = sizes;
        ++graphs_updated_;
        return it->second.exec;
      }
      (void)cudaGetLastError();  // refused (graph_update_refusals_ says why): a new instantiation below
      ++graph_update_refusals_[std::clamp(int(info.result), 0, kRefusalKinds - 1)];
      cudaGraphExecDestroy(it->second.exec);  // (launches already queued still run)
      graphs_.erase(it);
    }
    cudaGraphExec_t exec = nullptr;
    const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    QKV_CUDA(inst);
    ++graphs_captured_;
    graphs_[shape] = {exec, sizes};
    return exec;
  }
  void ClearGraphs() {
    for (auto& [shape, g] : graphs_) cudaGraphExecDestroy(g.exec);
    graphs_.clear();
  }

  char* io_ = nullptr;       // pinned
  std::size_t io_cap_ = 0;
  struct StepGraph {
    cudaGraphExec_t exec = nullptr;
    std::vector<int64_t> sizes;  // what it was last captured with
  };
  std::map<std::vector<int64_t>, StepGraph> graphs_;
  uint64_t graphs_epoch_ = 0;
  int64_t graphs_captured_ = 0;  // instantiations
  int64_t graphs_updated_ = 0;   // executables updated in place
  int64_t graphs_retired_ = 0;   // dropped for a new buffer (or a full cache)
  // Updates refused, by cudaGraphExecUpdateResult (profile line).
  static constexpr int kRefusalKinds = 9;
  int64_t graph_update_refusals_[kRefusalKinds] = {};
  std::string RefusalLine() const {
    static constexpr const char* kNames[kRefusalKinds] = {"none",           "error",    "topology",
                                                          "node type",      "function", "parameters",
                                                          "not supported",  "function change", "attributes"};
    std::string line;
    for (int i = 0; i < kRefusalKinds; ++i)
      if (graph_update_refusals_[i])
        line += (line.empty() ? "" : ", ") + std::string(kNames[i]) + " " + std::to_string(graph_update_refusals_[i]);
    return line.empty() ? "none" : line;
  }
  std::unordered_map<PageId, uint32_t> tail_owner_;  // page in some partition's tail slots -> partition
  // Full pages of draft tokens (Append with hold), until SealHeld or their
  // death: pinned slots in no list, no home.
  struct Held {
    uint32_t part;
    std::vector<int32_t> slots;  // [Hkv]
  };
  std::unordered_map<PageId, Held> held_;
  int64_t step_ = 0;  // the current decode call's (BeginStep)
  HostClock::Time step_begun_{};  // and when it began (the pump's start)
  int64_t use_marks_ = 0;  // the resolve's use marks handed out (PackHeader)
  std::vector<kc::TableUpdate> clears_, sets_;
  std::unordered_map<const void*, std::size_t> set_index_;
};

}  // namespace questkv::cuda_backend
