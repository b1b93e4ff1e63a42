// CUDA kernels of the decode step (DESIGN.md §4): append + summary, select
// (score + GQA aggregation + top-K + sink/local/tail), and sparse paged decode
// attention. Each has a CPU twin in kernels/cpu/kernels_cpu.h and a test
// comparing the two (tests/kernels_cuda).
//
// Like kernels/cpu, these take plain device pointers, CSR index arrays and
// sizes, and know nothing of sequences or tiers. Two levels of errors:
//   * Plan* functions validate shapes on the host and return false with a
//     message; they allocate nothing on the device.
//   * Launch*/Run* functions only launch (no host synchronisation, no
//     allocation), so they can be captured in a CUDA graph. They return
//     cudaError_t; a size the dispatch does not cover returns
//     cudaErrorInvalidValue and LastErrorMessage() names it.
//
// Chaining: on sm_90 the launches of the decode step use programmatic
// dependent launch, so a kernel may be scheduled while the kernel before it
// in the stream drains; it waits for that kernel to complete before it
// reads anything, so the outputs are the same either way. Each launcher
// takes a `chain` flag (AppendParams, SelectShape, ResolveShape and
// AttendShape::chain, LaunchGather's argument), true by default; false
// launches plainly, to measure the difference with the same binary.
//
// Layouts (DESIGN.md §3), all row-major:
//   slot pool   [slot][2 (K,V)][S][D]   one head-page per slot
//   summaries   [PageId][Hkv][2 (min,max)][D]
//   hbm_slot    [PageId][Hkv]           slot of each head-page (-1: not cached)
//   queries     [batch][Hq][D], Hq = Hkv * G; row r = b * Hkv + h owns query
//               heads h*G .. h*G+G-1, i.e. q + r * G * D
// Thread-safety: stateless functions; LastErrorMessage() is per thread.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/constants.h"
#include "questkv/config.h"

namespace questkv::kernels::cuda {

// kE4M3: 8-bit summaries only (AppendParams::summary_dtype,
// SelectParams::summary_dtype, LaunchResetSummaries), codes of core/e4m3.h
// (min rounded down, max up; 0x7F = +inf, 0xFF = -inf; the empty box is min
// 0x7F, max 0xFF). Selects score them as ScorePagesCpu(..., e4m3 = true):
// a term on an infinite bound makes the score +inf, so the head-page is
// chosen. Every other dtype argument rejects it.
using ::questkv::DType;
using ::questkv::DTypeBytes;
using ::questkv::DTypeName;

// One head-page to fetch: its K piece and its V piece (S * D elements each,
// in its pinned host home or in a resolve's HBM staging) and the slot [K][V]
// they go to (null: read only).
struct GatherJob {
  const void* k;
  const void* v;
  void* dst;
};

// Message of the last launch on this thread that returned cudaErrorInvalidValue
// for an unsupported size or dtype ("" if none).
const std::string& LastErrorMessage();

// ---- append + summary ----------------------------------------------------------

// Writes the new tokens of a ragged batch into their head-page slots and folds
// their keys into the summaries of the touched head-pages (eq. 8), exactly as
// AppendTokensHeadsCpu does, token by token in order. Prefill chunks and single
// decode tokens alike. The pages must already exist in the page table and have
// slots; a page's summary must hold the empty box before its first token.
// E4M3 summaries: each touched summary is decoded, folded, and rounded
// outward once a call, as AppendTokensHeadsCpu then SnapSummaryE4m3Cpu.
struct AppendParams {
  DType kv_dtype = DType::kF16;       // k, v, slot pool
  DType summary_dtype = DType::kF32;  // summaries: f32, f16, bf16 or e4m3
  bool chain = true;                  // chained to the kernel before it (see the top)
  int batch = 0;
  int kv_heads = 0;
  int page_size = 0;  // S
  int head_dim = 0;   // D
  // Bound on new tokens of any one sequence in this call (sizes the grid).
  int max_new_tokens = 0;
  const int32_t* append_indptr = nullptr;  // [batch + 1] rows of k/v per sequence, first 0
  const int32_t* start_pos = nullptr;      // [batch] token position of the first new token
  const int32_t* page_indptr = nullptr;    // [batch + 1] page table CSR, first 0
  // One sequence whose header rides in the launch (append_indptr null, batch
  // 1): max_new_tokens rows from token position `start`, its pages page_ids[0..].
  // The kernel then reads no header from memory: a staged one sits in host
  // memory, and its reads cross PCIe before any K/V moves.
  int32_t start = 0;
  const uint32_t* page_ids = nullptr;      // [page_indptr[batch]] PageIds in logical order
  const int32_t* hbm_slot = nullptr;       // [PageId][Hkv]
  const void* k = nullptr;                 // [append_indptr[batch]][Hkv][D]
  const void* v = nullptr;                 // [append_indptr[batch]][Hkv][D]
  void* slots = nullptr;                   // slot pool
  void* summaries = nullptr;               // summary slab
};
cudaError_t LaunchAppend(const AppendParams& p, cudaStream_t stream);

// Sets the summaries of `n` PageIds to the empty box (min=+inf, max=-inf;
// e4m3: codes 0x7F, 0xFF).
cudaError_t LaunchResetSummaries(void* summaries, DType summary_dtype, const uint32_t* page_ids, int n,
                                 int kv_heads, int head_dim, cudaStream_t stream);

// ---- select ---------------------------------------------------------------------

using ::questkv::GqaMode;

// The policy of selector/select.cc for one layer: budget in pages
// (floor(token_budget / S)), sink and local pages, GQA mode, dense flag.
struct SelectShape {
  int batch = 0;
  int kv_heads = 0;
  int group = 1;  // G
  int head_dim = 0;
  int page_size = 0;
  int64_t page_budget = 0;
  int sink_pages = 1;
  int local_pages = 8;
  GqaMode gqa = GqaMode::kMax;
  bool dense = false;
  // Rows of more than 16K pages: their top-K in three launches even when the
  // one-launch kernel's grid would be resident at once. That kernel's blocks
  // wait for each other, so it assumes they all become resident; a kernel of
  // another stream that held SMs while it waited for this stream's later
  // work would stall it. PlanSelect copies it into SelectPlan.
  bool split_long_rows = false;
  bool chain = true;  // LaunchSelect's kernels chained (see the top)
  // Shared block selection (BlockSelection::kShared, SelectParams::q_rows):
  // the most query rows a batch row's block has. 1 otherwise.
  int positions = 1;
  // Scores on the tensor cores (ScoreKernelMma) where q is f16 with f16 or
  // E4M3 summaries, or bf16 with bf16 ones, and a row is one position: the
  // same bound, summed in another order, so scores differ from the CPU
  // twin's in their last bits. Off: the CUDA-core kernels, bit for bit.
  bool mma_scores = false;
  // Leave every ranked row's scores in the workspace (never the fused path,
  // which scores in shared memory): LaunchAdaptive reads them.
  bool keep_scores = false;
};

// Host-side plan: the output CSR's row capacities (exact counts for kMax/kMean
// and dense layers; an upper bound for kUnion) and the workspace size.
struct SelectPlan {
  std::vector<int32_t> out_indptr;  // [batch * Hkv + 1], copy to the device as SelectParams::out_indptr
  std::size_t workspace_bytes = 0;
  int64_t total_pages = 0;
  int max_pages = 0;      // longest sequence, in pages
  int score_blocks = 0;   // grid of the score kernel
  int key_cache = 0;      // keys the top-K block keeps in shared memory
  // SelectShape::split_long_rows, as planned; tests and the bench set it
  // here to run both ways on one plan.
  bool split_long_rows = false;
};
// page_counts: host copy of each sequence's number of pages (>= 1).
bool PlanSelect(const SelectShape& s, const int32_t* page_counts, int num_sms, SelectPlan* plan,
                std::string* error);

struct SelectParams {
  SelectShape shape;
  DType q_dtype = DType::kF16;
  DType summary_dtype = DType::kF32;       // f32, f16, bf16 or e4m3
  const void* q = nullptr;                 // [batch][Hq][D] (q_rows: [q_rows[batch]][Hq][D])
  const void* summaries = nullptr;         // [PageId][Hkv][2][D]
  const int32_t* page_indptr = nullptr;    // [batch + 1]
  const uint32_t* page_ids = nullptr;      // [page_indptr[batch]]
  const int32_t* hbm_slot = nullptr;       // optional [PageId][Hkv]: also write out_slots
  const int32_t* out_indptr = nullptr;     // [rows + 1] from PlanSelect
  int32_t* out_pages = nullptr;            // [out_indptr[rows]] logical page indices, ascending
  int32_t* out_slots = nullptr;            // optional, same shape: hbm_slot of each chosen page
  int32_t* out_count = nullptr;            // [rows] pages chosen per row
  void* workspace = nullptr;               // PlanSelect's workspace_bytes
  // Shared block selection: batch row b is a block of positions of one
  // sequence, q's rows q_rows[b] .. q_rows[b + 1] - 1 (at most
  // shape.positions, at least one), each scoring all of b's pages. A page's
  // kMax/kMean score aggregates over every position's G query heads,
  // position by position (the CPU selector's over a group of n * G heads);
  // kUnion unites each (position, query head)'s top-K. Null: row b's query
  // is q's row b.
  const int32_t* q_rows = nullptr;         // [batch + 1] on the device
};
// Score (U_p = Σ_j max(q_j·min_j, q_j·max_j), with the CPU twin's float
// arithmetic and summation order), aggregate, top-K with ties toward the
// lower page index, plus sink and local pages; rows ascending.
cudaError_t LaunchSelect(const SelectPlan& plan, const SelectParams& p, cudaStream_t stream);
// Whether LaunchSelect takes the one-launch fused path (few short kMax/kMean
// rows, G <= 4): it scores in shared memory and leaves no scores in the
// workspace.
bool SelectIsFused(const SelectPlan& plan, const SelectParams& p);

// ---- adaptive budgets (SelectionPolicy::unread_bound_mass) ---------------------------

// What the adaptive rows chose, summed on the device over calls: rankings,
// pages beside sink and local (in all, the largest), how many stopped at the
// budget, and how many chose p pages (hist[min(p, kAdaptiveHistPages)]).
constexpr int kAdaptiveHistPages = 256;
struct AdaptiveCounters {
  unsigned long long rankings, pages, pages_max, cap_hits;
  unsigned long long hist[kAdaptiveHistPages + 1];
};
// The largest page budget of an adaptive select (its winners are sorted in
// one block).
constexpr int kAdaptiveMaxPages = 2048;

struct AdaptiveParams {
  SelectShape shape;                     // the select's (kMax/kMean, one position, keep_scores)
  double unread_bound_mass = 0;          // e in (0, 1)
  int64_t floor_tokens = 0;              // SelectionPolicy::adaptive_floor
  const float* scores = nullptr;         // the select's workspace: row (b, h) at page_indptr[b] * Hkv + h * n
  const int32_t* page_indptr = nullptr;  // [batch + 1]
  const int32_t* out_indptr = nullptr;   // the select's output CSR, narrowed in place
  int32_t* out_pages = nullptr;
  int32_t* out_count = nullptr;
  AdaptiveCounters* counters = nullptr;  // accumulated
  // kMean over a group padded with zero query heads (a model group of
  // mean_heads < shape.group, q padded to the power of two the kernels take):
  // the kept scores are sums over mean_heads heads divided by shape.group, so
  // each is scaled back to the model's mean, fl(x * group / mean_heads), as
  // select.cc computes it, before its bound mass is weighed. 0: not padded.
  int mean_heads = 0;
};
// selector/select.cc's AdaptiveK on each row the select ranked: of its top-k
// pages by the bound, best first, the fewest (at least the floor's) whose
// bound masses exp(U_p / sqrt(D)) leave at most e of all ranked pages' mass
// unread; the row keeps those beside its sink and local pages, ascending.
// A row whose best score is not finite keeps all k. The total is summed in
// double in another order than the CPU's, so a row whose unread mass lies
// within rounding of the limit may stop one page apart.
cudaError_t LaunchAdaptive(const AdaptiveParams& p, cudaStream_t stream);

// ---- two-stage re-rank (SelectionPolicy::rerank) ------------------------------------

// The shape of the select whose rows are a re-rank's candidates: the budget
// widened to the sink and local pages plus ceil(rerank * k) others, k the
// shape's budget less its sink and local pages (rerank >= 1; kMax or kMean,
// sparse layers).
SelectShape RerankShape(const SelectShape& s, double rerank);

struct RerankParams {
  SelectShape shape;                    // the layer's (not widened)
  DType kv_dtype = DType::kF16;         // of q and of the keys
  DType summary_dtype = DType::kF16;    // the model dtype or e4m3
  const void* q = nullptr;              // [batch][Hq][D]
  const void* summaries = nullptr;      // [PageId][Hkv][2][D]
  const int32_t* page_indptr = nullptr; // [batch + 1]
  const uint32_t* page_ids = nullptr;   // [page_indptr[batch]]
  const int32_t* last_len = nullptr;    // [batch] valid tokens of each sequence's last page
  const int32_t* hbm_slot = nullptr;    // [PageId][Hkv] slot or -1
  const void* slots = nullptr;          // slot s's K at slots + s * 2 * S * D * sizeof(dtype)
  const void* const* host_addr = nullptr;  // [PageId] device address of its host home, or null
  const int32_t* cand_indptr = nullptr;    // the widened select's output CSR
  const int32_t* cand_pages = nullptr;
  const int32_t* cand_count = nullptr;
  int max_listed = 0;                      // longest row of cand_indptr (<= 16384)
  float* workspace = nullptr;              // [cand_indptr[rows]] exact scores
  const int32_t* out_indptr = nullptr;     // PlanSelect's for `shape`
  int32_t* out_pages = nullptr;            // ascending, as LaunchSelect writes them
  int32_t* out_count = nullptr;
};
// Each row: its sink and local pages and the best k of its candidates by
// exact score (the CPU backend's: group max or mean of each page's largest
// logit, keys from HBM or the host home; a page on disk keeps its bound).
cudaError_t LaunchRerank(const RerankParams& p, cudaStream_t stream);

// ---- sparse paged decode attention ---------------------------------------------

struct AttendShape {
  int rows = 0;  // batch * Hkv
  int kv_heads = 0;
  int group = 1;      // G: 1, 2, 4, 8
  int head_dim = 0;   // 64, 128, 256
  int page_size = 0;  // 8, 16, 32, 64
  DType dtype = DType::kF16;  // q, K/V and o; accumulation is fp32
  bool chain = true;          // chained to the kernel before it (see the top)
};

// Split-K over pages: each row's pages are cut into `splits` chunks of
// `pages_per_split`; partial (o, m, d) states merge associatively, in the
// last block of each row to finish (one launch).
struct AttendPlan {
  AttendShape shape;
  int splits = 1;
  int pages_per_split = 0;
  int max_pages = 0;
  std::size_t workspace_bytes = 0;
  // The workspace's first counter_bytes hold per-row counters, the rest the
  // splits' partials (0: one split, no workspace used). The counters must be
  // zero at launch (RunAttend leaves them so): a launch of more rows than
  // the one before finds its extra counters where that one's partials were.
  std::size_t counter_bytes = 0;
};
// max_pages: bound on the entries of any row (the grid is sized for it, so the
// run step can be captured once and replayed with other selections).
// The plan fills one wave: rows x splits blocks of at most
// AttendBlocksPerSm(s) a multiprocessor.
bool PlanAttend(const AttendShape& s, int max_pages, int num_sms, AttendPlan* plan, std::string* error);
// Blocks of the attention kernel for a valid shape s that one multiprocessor
// of the current device holds at once, at most 4; 4 when the runtime cannot
// tell (no device). Cached per device and kernel.
int AttendBlocksPerSm(const AttendShape& s);

struct AttendParams {
  float scale = 0.f;                  // multiplies q·k (1/sqrt(D) for models)
  const void* q = nullptr;            // [rows][G][D]
  const void* slots = nullptr;        // slot pool [slot][2][S][D]
  const int32_t* indptr = nullptr;    // [rows + 1] entries of each row, first 0
  const int32_t* count = nullptr;     // optional [rows]: entries used (<= capacity); null: all
  const int32_t* slot_ids = nullptr;  // [indptr[rows]] slot of each entry, any order
  const int32_t* last_len = nullptr;  // optional [rows / Hkv]: valid tokens (1..S) of each row's
                                      // last used entry; null: every entry is full
  // Optional: the misses a resolve left to the attention (ResolveShape::fill_in_attention).
  // An entry whose slot id is negative is fills[~id]: its K and V are read from
  // the job's source (its pinned host home: 16-byte loads over PCIe, beside the
  // other entries' reads from HBM; or the resolve's staging) and, when the job
  // names a slot (dst), stored there too. Never a row's last entry (the tail
  // is always in HBM).
  const GatherJob* fills = nullptr;
  void* o = nullptr;                  // [rows][G][D]; zeros for an empty row
  float* lse = nullptr;               // optional [rows][G]: m + log d (-inf for an empty row)
  void* workspace = nullptr;          // PlanAttend's workspace_bytes, its first counter_bytes zero
                                      // (per-row counters that RunAttend leaves at zero)
};
cudaError_t RunAttend(const AttendPlan& plan, const AttendParams& p, cudaStream_t stream);


// ==== resolve: hit/miss, victims, gather of misses (kernels/cuda/resolve.cu) =====
//
// For every selected head-page: hit against hbm_slot, or a victim slot of its
// sequence's partition and a zero-copy gather of K and V from the pinned host
// home (16-byte loads over PCIe), or a host request (cold miss: home on disk;
// bypass: no slot could be taken). The rule is ResolveCpu's
// (kernels/cpu/resolve_cpu.cc), reproduced exactly. Partitions are explicit
// slot lists per sequence, least recently used first, reordered by each call;
// the host moves slots between lists between steps (a partition never takes a
// slot from another during a step, unlike the CPU backend's HbmCache).
//
// Cold misses under `strict`: the host waits for the promotions, publishes
// host_addr and calls again with the same step (hits stay hits, the promoted
// pages become host misses). Under `deadline` attention runs without them.
// Either way out_slots/out_count hold what attention can read now, in place.

using ::questkv::ColdMissPolicy;

// Same layout as kernels::resolve::Request.
struct ResolveRequest {
  uint32_t page;
  int32_t head;
  int32_t row;
  int32_t entry;
};

// Same layout as kernels::resolve::Counters; accumulated on the device over
// calls, read back with CopyResolveCountersAsync (never on the critical path).
struct ResolveCounters {
  unsigned long long selected, hits, misses_host, misses_disk, bypasses, evictions, bytes_host_to_hbm,
      cold_stalls, pages_skipped, queue_overflows;
};

struct ResolveShape {
  int batch = 0;
  int kv_heads = 0;
  int page_size = 0;  // S
  int head_dim = 0;   // D
  DType dtype = DType::kF16;
  ColdMissPolicy policy = ColdMissPolicy::kDeadline;
  // Leave the misses to the attention instead of gathering them: out_slots
  // names each head-page to fetch as ~job (a negative id) into
  // ResolveFills(), and RunAttend with AttendParams::fills reads it from its
  // home while it attends the hits and stores it into its slot. The gather's
  // PCIe round trips then overlap the attention instead of preceding it.
  // The slots are valid only once that attention has run: the caller must
  // run it before anything else reads them (a second resolve of the same
  // step, as strict's cold-miss retry does, must not follow a fused one).
  bool fill_in_attention = false;
  // With fill_in_attention: up to this many misses a call are fetched into
  // HBM staging (2 * piece_bytes each, in the workspace) by extra blocks of
  // the assign while it chooses victims, and the attention reads them from
  // there; later misses it reads from their homes. 0: none staged.
  int stage_pages = 0;
  bool chain = true;  // LaunchResolve's kernels chained (see the top)
};

struct ResolvePlan {
  ResolveShape shape;
  int64_t entries = 0;     // bound on sel_indptr[rows]
  int64_t list_slots = 0;  // bound on part_indptr[batch]
  std::size_t piece_bytes = 0;  // one head-page's K (= its V)
  int gather_blocks = 0;
  int stage_cap = 0;     // misses staged a call (ResolveShape::stage_pages, at most entries)
  int stage_blocks = 0;  // the assign's staging blocks
  std::size_t workspace_bytes = 0;
};
// piece_bytes must be a multiple of 16. gather_blocks <= 0 picks the default,
// half the SMs: >= 90% of the pinned copy limit alone on the H200 while
// leaving SMs to attention on another stream (fewer blocks: less bandwidth,
// less interference; bench/gpu/gather_bench's overlap rows).
bool PlanResolve(const ResolveShape& s, int64_t entries, int64_t list_slots, int num_sms, int gather_blocks,
                 ResolvePlan* plan, std::string* error);

struct ResolveParams {
  // The launch's use mark: the slots it uses get it in slot_last_use, and a
  // list slot already holding it is no victim. It must differ from every
  // earlier launch's that touched the same lists (the CUDA backend numbers
  // its launches: a caller may decode one list several times a step).
  int64_t step = 0;
  const int64_t* step_ptr = nullptr;      // optional: the mark read from device memory instead (graphs)
  const int32_t* page_indptr = nullptr;   // [batch + 1] page table CSR
  const uint32_t* page_ids = nullptr;     // [page_indptr[batch]]
  const int32_t* sel_indptr = nullptr;    // [rows + 1] selection rows (capacities), first 0
  const int32_t* sel_count = nullptr;     // optional [rows]: entries used
  const int32_t* sel_pages = nullptr;     // [sel_indptr[rows]] logical page indices (select's out_pages)
  const void* const* host_addr = nullptr; // [PageId] device pointer to the home page [2][Hkv][S][D] in
                                          // mapped pinned memory; null: home on disk
  int32_t* hbm_slot = nullptr;            // [PageId][Hkv]
  uint32_t* slot_page = nullptr;          // [slots] 0xFFFFFFFF when free
  int32_t* slot_head = nullptr;           // [slots]
  int64_t* slot_last_use = nullptr;       // [slots]
  const uint8_t* slot_pinned = nullptr;   // [slots] tails: never victims
  const int32_t* part_indptr = nullptr;   // [batch + 1]
  int32_t* part_slots = nullptr;          // [part_indptr[batch]] LRU first; each slot in at most one list
  int32_t* const* part_lists = nullptr;   // optional [batch]: sequence b's list lives at part_lists[b]
                                          // (length from part_indptr) instead of in part_slots
  void* slots = nullptr;                  // slot pool [slot][2][S][D]
  int32_t* out_slots = nullptr;           // [sel_indptr[rows]] attention's slot_ids (same indptr)
  int32_t* out_count = nullptr;           // [rows] attention's count
  ResolveRequest* cold = nullptr;         // [queue_capacity], any order
  int32_t* cold_count = nullptr;          // set by the call; > capacity: requests were dropped
  ResolveRequest* bypass = nullptr;       // [queue_capacity], any order
  int32_t* bypass_count = nullptr;
  int queue_capacity = 0;
  ResolveCounters* counters = nullptr;
  void* workspace = nullptr;              // PlanResolve's workspace_bytes
};
// Five launches (reset, classify, assign, finalize, gather; no gather with
// fill_in_attention); no host synchronisation.
cudaError_t LaunchResolve(const ResolvePlan& plan, const ResolveParams& p, cudaStream_t stream);

// The gather alone: jobs[0 .. *job_count) copy piece_bytes from k and from v
// into dst and dst + piece_bytes, with 16-byte loads spread over every block.
// chain: chained to the kernel before it (see the top).
cudaError_t LaunchGather(const GatherJob* jobs, const int32_t* job_count, std::size_t piece_bytes, int blocks,
                         cudaStream_t stream, bool chain = true);

// The resolve's fetch list in its workspace: [*count] jobs, the first ones the
// misses filled into victim slots (the gather's jobs), then, with
// fill_in_attention, one read-only job (dst null) for each entry whose
// head-page another entry of the step is filling (a page shared by two
// sequences of the batch). For AttendParams::fills, or LaunchGather.
struct ResolveFillList {
  const GatherJob* jobs;
  const int32_t* count;  // device
};
ResolveFillList ResolveFills(const ResolvePlan& plan, void* workspace);

cudaError_t CopyResolveCountersAsync(const ResolveCounters* device, ResolveCounters* pinned_host,
                                     cudaStream_t stream);

// ==== around the step: table edits, seal copies, step reports, conversion (kernels/cuda/tables.cu) ====

// The residency and slot tables of the resolve (same meaning as ResolveParams).
struct DeviceTables {
  int32_t* hbm_slot = nullptr;       // [PageId][Hkv]
  uint32_t* slot_page = nullptr;     // [slots]
  int32_t* slot_head = nullptr;      // [slots]
  int64_t* slot_last_use = nullptr;  // [slots]
  uint8_t* slot_pinned = nullptr;    // [slots]
  int kv_heads = 0;
};

enum class TableOp : int32_t {
  kSet8,        // *(uint8_t*)addr = value
  kSet32,       // *(int32_t*)addr = value
  kSet64,       // *(int64_t*)addr = value
  kDropPage,    // page `value` died: its cached slots become empty, residency cleared
  kReleaseSlot, // slot `value` leaves its page (residency cleared) and becomes free, unpinned
};
struct TableUpdate {
  void* addr;  // kSet*: a device address
  int64_t value;
  TableOp op;
  int32_t pad;
};
// Applies updates[0 .. n) in parallel: no two may touch the same cell.
cudaError_t LaunchTableUpdates(const TableUpdate* updates, int n, const DeviceTables& tables,
                               cudaStream_t stream);

// One head-page leaving a slot ([K piece][V piece]) for its host home.
struct SealJob {
  const void* slot;
  void* k_dst;
  void* v_dst;
};
cudaError_t LaunchSealCopy(const SealJob* jobs, int n, std::size_t piece_bytes, cudaStream_t stream);

// The first `len` rows of a page's K and V pieces, read from its slots
// (slots + hbm_slot[page * kv_heads + h] * 2 * piece_bytes; each piece
// [page_size][row_bytes]), into the append kernel's rows: k_out and v_out
// [len][kv_heads][row_bytes]. One kernel for every head: a rollback's kept
// tokens, appended anew. row_bytes a multiple of 16.
struct PageRowsParams {
  const void* slots = nullptr;
  const int32_t* hbm_slot = nullptr;
  uint32_t page = 0;
  int kv_heads = 0;
  int len = 0;
  std::size_t row_bytes = 0;
  std::size_t piece_bytes = 0;
  void* k_out = nullptr;
  void* v_out = nullptr;
};
cudaError_t LaunchPageRows(const PageRowsParams& p, cudaStream_t stream);

// What the host learns of a decode step, written straight into mapped
// pinned memory (no copy on the stream): each row's selected pages as page
// ids, the rows' counts, and the resolve's cold-miss requests.
struct StepReportParams {
  // The step's selection (select's outputs) and page table.
  const int32_t* sel_indptr = nullptr;   // [rows + 1]
  const int32_t* sel_count = nullptr;    // [rows]
  const int32_t* sel_pages = nullptr;    // logical page indices
  const int32_t* page_indptr = nullptr;  // [batch + 1]
  const uint32_t* page_ids = nullptr;
  int rows = 0, kv_heads = 0;            // row r is sequence r / kv_heads
  bool first_head_only = false;          // pages of each sequence's first row only (a dense
                                         // layer: every row selects every page)
  const ResolveRequest* cold = nullptr;  // the resolve's queue
  const int32_t* cold_count = nullptr;
  // Outputs (device pointers of mapped host memory).
  uint32_t* pages = nullptr;             // [sel_indptr[rows]]: ids of row r's first counts[r]
                                         // entries; null: not written
  int32_t* counts = nullptr;             // [rows] entries used (min of sel_count and the row's capacity)
  int32_t* cold_out_count = nullptr;     // *cold_count as the resolve left it (may exceed cold_cap)
  ResolveRequest* cold_out = nullptr;    // [cold_cap] the first requests
  int cold_cap = 0;
};
cudaError_t LaunchStepReport(const StepReportParams& p, cudaStream_t stream);

// ==== a block of positions in one step (kernels/cuda/block.cu) ====
// Rows of several positions of one sequence (causal views of one list, so
// their logical page indices agree) select on their own; the resolve then
// runs once per list over the union of their selections, and each row
// attends the slots its own entries resolved to.

// Union row (list u, head h) = the entries of rows members[i] * kv_heads + h,
// i in [members_indptr[u], members_indptr[u + 1]), in that order, each
// logical page at its first appearance. out_indptr holds each union row's
// capacity (the members' capacities summed is always enough).
struct BlockUnionParams {
  int lists = 0, kv_heads = 0;
  int max_pages = 0;                        // logical pages of the longest list (a bitmap of them)
  const int32_t* members_indptr = nullptr;  // [lists + 1]
  const int32_t* members = nullptr;         // select rows' sequences
  const int32_t* sel_indptr = nullptr;      // [rows + 1] the select's rows
  const int32_t* sel_count = nullptr;       // optional [rows]
  const int32_t* sel_pages = nullptr;
  const int32_t* out_indptr = nullptr;      // [lists * kv_heads + 1]
  int32_t* out_pages = nullptr;
  int32_t* out_count = nullptr;             // [lists * kv_heads]
};
cudaError_t LaunchBlockUnion(const BlockUnionParams& p, cudaStream_t stream);

// Shared block selection: row r (position r / kv_heads, head h) takes its
// list's shared pages below its own local window, then that window
// [n - min(max(local_pages, 1), n), n), n its own page count; ascending
// when the shared pages are. The shared pages hold the list's longest
// row's local window, so a row's pages are all in its causal view.
struct BlockShareParams {
  int rows = 0, kv_heads = 0, local_pages = 1;
  const int32_t* page_indptr = nullptr;    // [rows / kv_heads + 1] each position's pages
  const int32_t* list_of = nullptr;        // [rows / kv_heads] each position's list
  const int32_t* shared_indptr = nullptr;  // [lists * kv_heads + 1]
  const int32_t* shared_count = nullptr;   // optional [lists * kv_heads]
  const int32_t* shared_pages = nullptr;
  const int32_t* out_indptr = nullptr;     // [rows + 1]
  int32_t* out_pages = nullptr;
  int32_t* out_count = nullptr;            // [rows]
};
cudaError_t LaunchBlockShare(const BlockShareParams& p, cudaStream_t stream);

// After the union's resolve (its gather done): each row's slots for the
// attention, hbm_slot of its entries' head-pages in entry order, entries
// without a slot (cold under deadline, bypassed) left out.
struct BlockSlotsParams {
  int rows = 0, kv_heads = 0;              // row r: sequence r / kv_heads, head r % kv_heads
  const int32_t* sel_indptr = nullptr;     // [rows + 1]
  const int32_t* sel_count = nullptr;      // optional [rows]
  const int32_t* sel_pages = nullptr;      // logical page indices
  const int32_t* page_indptr = nullptr;    // [sequences + 1]
  const uint32_t* page_ids = nullptr;
  const int32_t* hbm_slot = nullptr;       // [PageId][Hkv]
  int32_t* out_slots = nullptr;            // [sel_indptr[rows]] (same indptr)
  int32_t* out_count = nullptr;            // [rows]
};
cudaError_t LaunchBlockSlots(const BlockSlotsParams& p, cudaStream_t stream);

// dst[0, n) = src[0, n) (host memory), the values carried in the launch's
// parameters (n <= kLaunchInts): a step's header up without a copy-engine
// transfer, whose engine switches cost a step more than its bytes do.
constexpr int kLaunchInts = 1000;  // 4 KB of kernel parameters, less dst and n
cudaError_t LaunchWriteInts(int32_t* dst, const int32_t* src, int n, cudaStream_t stream);

// A batch's page tables side by side: dst[indptr[b] + i] = src[b][i] for i
// below indptr[b + 1] - indptr[b]. One kernel, not a copy (a graph node) per
// sequence: a verified block has a row per position.
cudaError_t LaunchGatherPageIds(const uint32_t* const* src, const int32_t* indptr, int batch, uint32_t* dst,
                                cudaStream_t stream);

// dst[i] = (To) src[i] for n elements.
cudaError_t LaunchConvert(const void* src, DType from, void* dst, DType to, std::size_t n, cudaStream_t stream);

// ==== an engine's own paged KV (kernels/cuda/engine.cu) ====
// Summaries [P][Hkv][2][D] (min, max) of pages[i] rebuilt from its first
// lens[i] keys of k_cache: [P][S][Hkv][D] when nhd, else [P][Hkv][S][D]; the
// same dtype (f32, f16, bf16) for both. Arguments are checked by the caller.
struct SummariesFromCacheParams {
  DType dtype = DType::kF16;
  const void* k_cache = nullptr;
  void* summaries = nullptr;
  const int32_t* pages = nullptr;  // [n]
  const int32_t* lens = nullptr;   // [n], 1..S
  int n = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int page_size = 0;
  bool nhd = true;
};
cudaError_t LaunchSummariesFromCache(const SummariesFromCacheParams& p, cudaStream_t stream);

// out[r][j] (r = b * Hkv + h, j < width) = indices[indptr[b] + sel_pages[
// sel_indptr[r] + j]] for j < sel_count[r], else -1: a select's rows of
// logical page indices as the engine's page ids.
struct PaddedPageIdsParams {
  const int32_t* sel_indptr = nullptr;
  const int32_t* sel_pages = nullptr;
  const int32_t* sel_count = nullptr;
  const int32_t* indptr = nullptr;
  const int32_t* indices = nullptr;
  int rows = 0;
  int kv_heads = 0;
  int width = 0;
  int32_t* out = nullptr;
};
cudaError_t LaunchPaddedPageIds(const PaddedPageIdsParams& p, cudaStream_t stream);

}  // namespace questkv::kernels::cuda
