// DataPlane: the backend under a Runtime (the one seam between policy and
// data) (DESIGN.md §4, §7). The runtime
// keeps the policy — sequences, PageIds and their refcounts, page lists,
// steps, and the host and disk homes (TierMover) — and a backend keeps the
// hbm tier and what runs over it:
//   * the hbm slots: per (sequence, layer) partition the tail pages' slots
//     (pinned) and a cache of sealed head-pages;
//   * the page summaries (always resident);
//   * append (tokens into tails, summaries folded, full pages sealed into
//     their homes through TierMover::SealBegin/SealEnd), tail copies for
//     fork and rollback, and the decode step: select, resolve (hits, misses
//     fetched from their homes, cold misses through the mover), attend.
// Two implementations: the CPU backend (runtime/cpu_backend.cc; a bounded
// host arena stands in for hbm, kernels/cpu do the work) and the CUDA
// backend (runtime/cuda/: the step on the GPU).
//
// Thread-compatible; a backend is driven by its runtime only.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "questkv/config.h"
#include "questkv/runtime.h"
#include "questkv/status.h"
#include "selector/select.h"
#include "tiers/page_table.h"

namespace questkv {

class PageAllocator;
class SlotArena;
class TierMover;

// The hbm tier's counters, accumulated since creation.
struct BackendCounters {
  int64_t selected = 0, hits = 0, misses = 0, evictions = 0, bypasses = 0, bytes_host_to_hbm = 0;
  int64_t cold_misses = 0, cold_stalls = 0, pages_skipped = 0, deferred_seals = 0, deadline_waits = 0;
  uint64_t slots_capacity = 0, slots_used = 0, slots_peak = 0, slot_bytes = 0;
};

class DataPlane {
 public:
  virtual ~DataPlane() = default;

  // ---- partitions: one per (sequence, layer) ----------------------------------
  virtual Result<uint32_t> AddPartition() = 0;
  // Every slot of the partition freed (pinned slots of pages still shared
  // land where they can still be sealed from).
  virtual void RemovePartition(uint32_t part) = 0;

  // ---- pages ---------------------------------------------------------------------
  // A page died (its id is free again): its slots and anything keyed by it go.
  // Called before the mover drops its homes, so that a backend can wait for
  // its own writes to them.
  virtual void PageDied(PageId page) = 0;
  // Per-page tables hold page ids [0, pages) from now on (PageAllocator's
  // grow hook). Throws std::bad_alloc, changing nothing, when memory is short.
  virtual void GrowPages(uint32_t pages) {}
  // The page's readable host home (its address), or null (TierMover's listener).
  virtual void SetHome(PageId page, const void* home) = 0;
  // The partition's page list changed outside Append (fork, prefix, rollback).
  virtual Status SetPages(uint32_t part, std::span<const PageId> pages) = 0;

  // ---- append ----------------------------------------------------------------------
  // Appends n >= 1 tokens [n][Hkv][D] to the list: host f32 (`host_f32`) or
  // device memory in the model dtype. Allocates the PageIds it needs and
  // seals the pages that fill — unless `hold` (draft tokens): then those
  // pages stay in hbm, unsealed, until SealHeld. On error nothing is appended
  // and nothing leaks.
  virtual Status Append(uint32_t part, PageList& list, const void* k, const void* v, int64_t n, bool host_f32,
                        int64_t step, bool hold) = 0;
  // A full page that an Append held: sealed now (its drafts were accepted).
  // Nothing for a page not held.
  virtual Status SealHeld(PageId page) = 0;
  // Fork: the first `len` tokens of the tail `src` (in src_part) become the
  // new page `dst` in dst_part's tail slots.
  virtual Status CopyTail(uint32_t src_part, PageId src, uint32_t dst_part, PageId dst, int len, int64_t step) = 0;
  // `dst` becomes part's tail holding the first `len` tokens of a page whose
  // bytes ([2][Hkv][S][D], model dtype) are at host `page`.
  virtual Status TailFromHost(uint32_t part, PageId dst, const void* page, int len, int64_t step) = 0;
  // Rollback in place: the tail keeps its first `len` tokens (summary rebuilt).
  virtual Status TruncateTail(uint32_t part, PageId tail, int len) = 0;
  // Copies a page of the partition ([2][Hkv][S][D], model dtype) to host
  // `dst`: a tail from its slots, a sealed page from wherever it is cheapest.
  virtual Status ReadPage(uint32_t part, PageId page, void* dst, int64_t step) = 0;
  // Summaries [n][Hkv][2][D] of the given pages, as f32, to host.
  virtual Status ReadSummaries(std::span<const PageId> pages, float* dst) = 0;
  // Bytes of one stored summary element.
  virtual std::size_t summary_elem_bytes() const = 0;

  // ---- the decode step ---------------------------------------------------------
  // Called once per decode call before its step (work deferred for want of
  // room is retried here).
  virtual void BeginStep(int64_t step) {}
  struct Step {
    std::span<const uint32_t> partitions;     // [B]
    std::span<const PageList* const> lists;   // [B], each >= 1 token
    int layer = 0;
    bool dense = false;        // every page (DenseAttention)
    const void* q = nullptr;   // [B][Hq][D]
    void* out = nullptr;       // [B][Hq][D]
    bool host_f32 = true;      // q/out are host f32, else device memory in the model dtype
    int64_t step = 0;
    std::vector<PageSelection>* selections = nullptr;  // optional, resized to B
    AttendStats* stats = nullptr;                      // optional, added to
    // Optional: the rows come in blocks of these sizes, each the positions of
    // one sequence's block of new tokens (causal views of its list, the last
    // the whole list), and a block selects once for all its rows
    // (BlockSelection::kShared). Empty: every row selects on its own.
    std::span<const int> shared_blocks;
  };
  virtual Status DecodeStep(const Step& s) = 0;

  // Device backends: see Runtime::TimeDenseOffload, Synchronize, cuda_stream.
  virtual bool on_device() const { return false; }
  virtual Result<double> TimeDenseOffload(std::span<const PageList* const> lists, std::size_t max_bytes, int reps,
                                          int64_t* bytes) {
    return Status::FailedPrecondition("TimeDenseOffload needs the CUDA backend");
  }
  virtual Status Synchronize() { return Status::Ok(); }
  virtual void* stream() const { return nullptr; }

  virtual BackendCounters counters() = 0;
};

// The CUDA backend (runtime/cuda/). Unimplemented when built
// without CUDA; FailedPrecondition without a usable GPU or with a host arena
// that is not pinned and mapped; InvalidArgument for sizes the kernels do
// not cover; ResourceExhausted when device memory cannot be had.
Result<std::unique_ptr<DataPlane>> MakeCudaBackend(const Config& config, PageAllocator* ids, TierMover* mover,
                                                 SlotArena* host);
// The CPU backend (runtime/cpu_backend.cc): hbm is a host arena of
// config.hbm_bytes (0: room for every page).
Result<std::unique_ptr<DataPlane>> MakeCpuBackend(const Config& config, PageAllocator* ids, TierMover* mover);

}  // namespace questkv
