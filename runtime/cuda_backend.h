// The CUDA backend's data plane (DESIGN.md §4, §7): what Runtime::Impl hands
// to the GPU when Config::backend is kCuda. Policy stays in the runtime —
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
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "runtime/config.h"
#include "runtime/status.h"
#include "selector/select.h"
#include "tiers/page_table.h"

namespace questkv {

class TierMover;
class SlotArena;

// Device counters, accumulated since creation.
struct CudaCounters {
  int64_t selected = 0, hits = 0, misses_host = 0, misses_disk = 0, evictions = 0, bytes_host_to_hbm = 0;
  int64_t cold_stalls = 0, pages_skipped = 0;
  uint64_t slots_capacity = 0, slots_used = 0, slots_peak = 0, slot_bytes = 0;
};

class CudaBackend {
 public:
  // Unimplemented when built without CUDA; FailedPrecondition without a
  // usable GPU or with a host arena that is not pinned and mapped;
  // InvalidArgument for sizes the kernels do not cover; ResourceExhausted
  // when device memory cannot be had.
  static Result<std::unique_ptr<CudaBackend>> Create(const Config& config, PageAllocator* ids, TierMover* mover,
                                                      SlotArena* host);
  virtual ~CudaBackend() = default;

  // ---- partitions: one per (sequence, layer) ----------------------------------
  // Takes Hkv pinned tail slots from the free pool.
  virtual Result<uint32_t> AddPartition() = 0;
  // Every slot of the partition back to the free pool, its residency cleared.
  virtual void RemovePartition(uint32_t part) = 0;

  // ---- pages ---------------------------------------------------------------------
  // A page died: its cached slots empty, residency cleared (before any later use of the id).
  virtual void PageDied(PageId page) = 0;
  // The page's readable host home (its host address), or null: mirrored into host_addr.
  virtual void SetHome(PageId page, const void* home) = 0;
  // Replaces the device mirror of the partition's page list.
  virtual Status SetPages(uint32_t part, std::span<const PageId> pages) = 0;

  // ---- append ----------------------------------------------------------------------
  // Appends n >= 1 tokens [n][Hkv][D] to the list: host f32 (`host_f32`) or
  // device memory in the model dtype. Allocates the PageIds it needs and the
  // host homes of the pages that fill (sealed through TierMover::SealBegin/
  // SealEnd); on error nothing is appended and nothing leaks.
  virtual Status Append(uint32_t part, PageList& list, const void* k, const void* v, int64_t n, bool host_f32,
                        int64_t step) = 0;
  // Fork: the first `len` tokens of the tail `src` (in src_part's tail slots)
  // become the new page `dst` in dst_part's tail slots.
  virtual Status CopyTail(uint32_t src_part, PageId src, uint32_t dst_part, PageId dst, int len) = 0;
  // Rollback: `dst` becomes part's tail holding the first `len` tokens of a
  // page whose bytes ([2][Hkv][S][D], model dtype) are at host `page`.
  virtual Status TailFromHost(uint32_t part, PageId dst, const void* page, int len) = 0;
  // Rollback in place: the tail keeps its first `len` tokens (summary rebuilt).
  virtual Status TruncateTail(uint32_t part, PageId tail, int len) = 0;
  // Copies the tail page's bytes to host `dst` ([2][Hkv][S][D], model dtype).
  virtual Status ReadTail(uint32_t part, PageId tail, void* dst) = 0;
  // Summaries [n][Hkv][2][D] of the given pages, to host.
  virtual Status ReadSummaries(std::span<const PageId> pages, float* dst) = 0;

  // ---- the decode step ---------------------------------------------------------
  struct Step {
    std::span<const uint32_t> partitions;     // [B], distinct
    std::span<const PageList* const> lists;   // [B], each >= 1 token
    int layer = 0;
    bool dense = false;        // every page (DenseAttention)
    const void* q = nullptr;   // [B][Hq][D]
    void* out = nullptr;       // [B][Hq][D]
    bool host_f32 = true;      // q/out are host f32, else device memory in the model dtype
    int64_t step = 0;
    std::vector<PageSelection>* selections = nullptr;  // optional, resized to B
    // Optional: device time of select, resolve (incl. cold waits), attention,
    // microseconds. A step asked for them is launched directly, not from a graph.
    double* select_us = nullptr;
    double* resolve_us = nullptr;
    double* attend_us = nullptr;
    int64_t* selected = nullptr;  // head-pages selected (added to)
    int64_t* graphs_captured = nullptr;  // optional: step graphs this call captured (added to)
  };
  virtual Status DecodeStep(const Step& s) = 0;

  // Dense offload, measured: streams every sealed page of the lists (all
  // heads, K and V) from its pinned host home into device memory with the
  // zero-copy gather, as a decode step that keeps nothing in HBM must, and
  // returns the median time of `reps` runs in microseconds. At most
  // `max_bytes` are streamed; beyond that the time is scaled by the bytes
  // (the gather runs at a flat rate). *bytes gets the bytes it stands for.
  virtual Result<double> TimeDenseOffload(std::span<const PageList* const> lists, std::size_t max_bytes, int reps,
                                          int64_t* bytes) = 0;

  // Waits for everything enqueued; returns (and clears) the first fault an
  // asynchronous decode step reported.
  virtual Status Synchronize() = 0;
  // The cudaStream_t every call is ordered on.
  virtual void* stream() const = 0;

  virtual CudaCounters counters() = 0;
};

}  // namespace questkv
