// CPU kernels: the CPU backend's compute and the reference twins of the CUDA
// kernels. They take plain pointers and sizes, know nothing of sequences or
// tiers, validate nothing (callers validate), allocate nothing, and are safe to
// call concurrently on disjoint outputs.
//
// Layouts (DESIGN.md §3):
//   page bytes      [2 (K,V)][Hkv][S][D]
//   summary slab    [PageId][Hkv][2 (min,max)][D]
//   queries         [G][D] for the G query heads of one KV head group
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/constants.h"

namespace questkv::kernels {

// ---- append + summary --------------------------------------------------------

// Writes `n` tokens into one page starting at token slot `offset`
// (offset + n <= S) and folds their keys into the page's summary (eq. 8/14).
//   page     [2][Hkv][S][D]
//   summary  [Hkv][2][D]; must hold min=+inf/max=-inf for an empty page
//   k, v     [n][Hkv][D] token-major, as engines produce them
void AppendTokensCpu(float* page, float* summary, int kv_heads, int page_size, int head_dim,
                     int offset, const float* k, const float* v, int n);

// The same for a page whose head-pages are not contiguous (the HBM cache
// holds head-pages in separate slots): k_heads[h], v_heads[h] are head h's
// [S][D] K and V rows.
void AppendTokensHeadsCpu(float* const* k_heads, float* const* v_heads, float* summary, int kv_heads,
                          int head_dim, int offset, const float* k, const float* v, int n);

// Bound of the page-layout wrappers' stack arrays (Geometry::Validate's bound).
inline constexpr int kMaxKvHeads = 1024;

// Re-initialises a summary to the empty box (min=+inf, max=-inf) for every head.
void ResetSummaryCpu(float* summary, int kv_heads, int head_dim);

// Rebuilds a summary from the first `len` valid tokens of a page (rollback
// into a tail, fork). len == 0 gives the empty box.
void RebuildSummaryCpu(const float* page, float* summary, int kv_heads, int page_size,
                       int head_dim, int len);

// Per-head form of RebuildSummaryCpu: k_heads[h] is head h's [S][D] K rows.
void RebuildSummaryHeadsCpu(const float* const* k_heads, float* summary, int kv_heads, int head_dim,
                            int len);

// Summaries on the E4M3 grid (core/e4m3.h): rounds every min of a summary
// [Hkv][2][D] down and every max up, in place. Applied after each fold or
// rebuild it keeps a summary equal to the rounding of its exact box.
void SnapSummaryE4m3Cpu(float* summary, int kv_heads, int head_dim);

// The same summary as codes (a snapped summary encodes exactly), and back.
void EncodeSummaryE4m3Cpu(const float* summary, int kv_heads, int head_dim, uint8_t* codes);
void DecodeSummaryE4m3Cpu(const uint8_t* codes, std::size_t elems, float* out);

// ---- score -------------------------------------------------------------------

// U_p(q) = Σ_j max(q_j·min_j, q_j·max_j) (eq. 2–3), unscaled, for G query heads
// against n head-pages of KV head `kv_head`. Each term is computed as
// q_j·(q_j >= 0 ? max_j : min_j): the same float whenever min_j <= max_j, as
// in every summary of real keys (a slab with min_j > max_j gets that form).
//   q         [G][D]
//   slab      summary slab base, [PageId][Hkv][2][D]
//   page_ids  [n] PageIds in logical order
//   scores    [G][n] out
// e4m3: the slab holds summaries on the E4M3 grid, whose ±inf mark bounds
// beyond its range: a term whose chosen bound is infinite is NaN, as the
// GPU's hardware decode of those codes makes it, and a NaN score is +inf, so
// the head-page is always chosen and the bound still holds.
void ScorePagesCpu(const float* q, int group, int head_dim, const float* slab, int kv_heads,
                   int kv_head, const uint32_t* page_ids, int n, float* scores, bool e4m3 = false);

// ---- top-K -------------------------------------------------------------------

// Selects the k highest scores among indices i in [0, n) with skip[i] == 0
// (skip may be null). Order: higher score first, ties toward the lower index;
// NaN ranks below every number. Writes the chosen indices to out in ascending
// index order and returns how many were chosen (min(k, candidates)).
// out must hold min(k, n) ints, scratch n ints.
int TopKCpu(const float* scores, int n, const uint8_t* skip, int k, int* out, int* scratch);

// ---- attention ---------------------------------------------------------------

// One KV head's view of one page: its K and V rows and the valid length.
struct HeadPageRef {
  const float* k;  // [S][D], first `len` rows valid
  const float* v;  // [S][D]
  int len;         // 1..S
};

// Sparse decode attention of the G query heads of one KV group over n
// head-pages, in any order: each page yields a partial state, merged with
// MergeState (online softmax). Every K/V row is read once for all G heads
// (once per 16 heads for wider groups, a bound that keeps the scratch on the
// stack). Outputs the merged state per query head: o [G][D], m [G], d [G];
// n == 0 gives the empty state. scale multiplies q·k (1/sqrt(D) for the
// model). head_dim <= 512 (asserted).
void AttendPagesCpu(const float* q, int group, int head_dim, const HeadPageRef* pages, int n,
                    float scale, float* o, float* m, float* d);

// Continues the states (o, m, d) over n more pages. Each head merges pages in
// order, so attending pages [0, a) then [a, n) this way gives bit for bit what
// one AttendPagesCpu over [0, n) gives: callers may attend a row in pieces.
void AttendMorePagesCpu(const float* q, int group, int head_dim, const HeadPageRef* pages, int n,
                        float scale, float* o, float* m, float* d);

// ---- reference ---------------------------------------------------------------

// Dense attention of one query over T contiguous tokens, computed in double
// with a two-pass softmax: the independent reference for tests and the
// recall diagnostics.
//   q [D]; k, v [T][D] (row stride `stride` floats); out [D], zeros if T == 0
void DenseAttentionReference(const float* q, const float* k, const float* v, int tokens,
                             int head_dim, std::size_t stride, double scale, float* out);

}  // namespace questkv::kernels

namespace questkv::kernels {

// ---- resolve (CPU twin of kernels/cuda LaunchResolve) -------------------------
// Hit/miss of every selected head-page against the residency tables, victim
// choice per partition, the copy of missed head-pages from their pinned host
// homes, and the host queues (cold misses, bypasses). resolve_cpu.cc states
// the rule; the CUDA kernels follow it exactly, so tests compare tables,
// outputs, queues (as sets: the device fills them in no fixed order),
// counters and the copied bytes.
namespace resolve {

using ::questkv::kEmptySlot;  // slot_page of a free slot

// A selected head-page the host must handle: a cold miss (home on disk) or a
// bypass (no slot of its partition could be taken this step).
struct Request {
  uint32_t page;
  int32_t head;
  int32_t row;    // b * Hkv + h
  int32_t entry;  // index into the selection arrays
};

// Accumulated over calls (never reset by a call).
struct Counters {
  uint64_t selected, hits, misses_host, misses_disk, bypasses, evictions, bytes_host_to_hbm, cold_stalls,
      pages_skipped, queue_overflows;
};

}  // namespace resolve

struct ResolveCpuParams {
  int batch = 0;
  int kv_heads = 0;
  std::size_t piece_bytes = 0;  // bytes of one head-page's K (= of its V): S * D * sizeof(elem)
  int64_t step = 0;
  bool strict = false;  // cold misses: counted as stalls (strict) or skipped pages (deadline)
  const int32_t* page_indptr = nullptr;  // [batch + 1] page table CSR
  const uint32_t* page_ids = nullptr;    // PageIds in logical order
  const int32_t* sel_indptr = nullptr;   // [batch * Hkv + 1] selection rows (capacities)
  const int32_t* sel_count = nullptr;    // optional [rows] entries used
  const int32_t* sel_pages = nullptr;    // logical page indices (select's out_pages)
  const void* const* host_addr = nullptr;  // [PageId] home page [2][Hkv][S][D] in pinned host; null: disk
  int32_t* hbm_slot = nullptr;           // [PageId][Hkv], -1 when not cached
  uint32_t* slot_page = nullptr;         // [slots] kEmptySlot when free
  int32_t* slot_head = nullptr;          // [slots]
  int64_t* slot_last_use = nullptr;      // [slots] last step the slot was selected or filled
  const uint8_t* slot_pinned = nullptr;  // [slots] tail slots: never victims
  const int32_t* part_indptr = nullptr;  // [batch + 1] slot list of each sequence's partition
  int32_t* part_slots = nullptr;         // least recently used first; reordered by the call
  int32_t* const* part_lists = nullptr;  // optional [batch]: list b at part_lists[b] instead of part_slots
  void* slots = nullptr;                 // slot pool [slot][2][piece_bytes]
  int32_t* out_slots = nullptr;          // [sel_indptr[rows]] per row: slots to attend, selection order
  int32_t* out_count = nullptr;          // [rows] entries of out_slots used
  resolve::Request* cold = nullptr;      // [queue_capacity]
  int32_t* cold_count = nullptr;         // set (not added to) by the call; may exceed the capacity
  resolve::Request* bypass = nullptr;    // [queue_capacity]
  int32_t* bypass_count = nullptr;
  int queue_capacity = 0;
  resolve::Counters* counters = nullptr;
};
void ResolveCpu(const ResolveCpuParams& p);

}  // namespace questkv::kernels
