// Resolve on the device: ResolveCpu's rule (kernels/cpu/resolve_cpu.cc) in four
// launches, so that each phase sees the previous one complete:
//  1. ClassifyKernel, a thread per entry: hit (touch the slot), cold, or miss
//     (claim the residency cell with atomicMin: the lowest entry owns it;
//     each sequence counts its misses; with staging, the first misses of
//     the call get a staging index and a job from their home to it).
//  2. AssignKernel, a block per sequence with misses (the others return at
//     once): block scans rank the owned misses, then, in one pass over the
//     partition's list (4096 slots a block scan), the eligible slots and the
//     slots left unused; the k-th miss takes the k-th eligible slot; the rest
//     bypass; each slot goes to its place in the stable reorder of the list
//     (staged in the workspace, copied back at the end).
//     Blocks touch disjoint slots and disjoint residency cells (a claimed cell
//     is never resident, an evicted one was not selected this step).
//     With staging, blocks past the batch fetch the staged misses from their
//     homes meanwhile (the gather's loop), so the PCIe round trips overlap
//     the victim choice instead of following it.
//  3. FinalizeKernel, a block per row: compacts the slots to attend in entry
//     order (block scans), pushes host requests with warp-aggregated atomics,
//     counts. With fill_in_attention a filled entry is attended as ~job (the
//     attention fetches it), and an entry whose head-page another entry
//     fills gets a read-only job of its own (its slot is not filled yet).
// A thread per entry and a block per row, not a warp per row: a dense
// layer's rows hold every page (8K entries at 128K tokens), which a warp
// walked in 256 dependent rounds (~0.5 ms a layer on the H200).
//  4. GatherKernel: every filled slot's K and V from pinned host memory, as
//     one flat range of 16-byte vectors striped over the grid, several loads
//     in flight per thread before any store (PCIe latency is ~1 µs). Not
//     launched with fill_in_attention: the attention reads them.
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <climits>
#include <mutex>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/kernels_cuda.h"

namespace questkv::kernels::cuda {
namespace {

constexpr int kClassifyThreads = 256;
constexpr int kFinalizeThreads = 512;
constexpr int kAssignThreads = 1024;  // one block walks a sequence's list: few rounds
constexpr int kAssignItems = 4;       // list slots a thread holds per round: 4096 a block scan
constexpr int kGatherThreads = 256;
constexpr int kGatherUnroll = 4;
constexpr int32_t kClaimBase = INT32_MIN;
// kFilled: a miss that took a slot (set by the assign; its job in job_of).
enum : int32_t { kIdle = 0, kHit = 1, kCold = 2, kMiss = 3, kFilled = 4 };

struct Workspace {
  uint32_t* page;     // [entries]
  int32_t* head;      // [entries]
  int32_t* state;     // [entries]
  int32_t* owned;     // [entries] owned misses of each sequence, in entry order, from its first entry
  int32_t* unused;    // [list_slots] each list at its offset: its reordered front (slots not used this step)
  int32_t* used;      // [list_slots] likewise its back (slots used this step: hit or filled), list order
  GatherJob* jobs;    // [entries]
  int32_t* job_of;    // [entries] a kFilled entry's job
  int32_t* job_count; // [1]
  int32_t* stage_of;       // [entries] a miss's staging index, -1: read from its home by the attention
  GatherJob* stage_jobs;   // [stage_cap] home -> staging, in index order
  int32_t* stage_count;    // [1] misses numbered (may pass stage_cap)
  char* staging;           // [stage_cap][2][piece_bytes]
  int32_t* misses;    // [batch] entries classified as misses, per sequence
};

std::size_t Align(std::size_t x) { return (x + 255) & ~std::size_t(255); }

Workspace Carve(void* base, int64_t entries, int64_t list_slots, int batch, int64_t stage_cap, std::size_t piece,
                std::size_t* total) {
  auto* p = static_cast<char*>(base);
  std::size_t off = 0;
  auto take = [&](std::size_t bytes) {
    char* at = p ? p + off : nullptr;
    off += Align(bytes);
    return at;
  };
  Workspace w;
  w.page = reinterpret_cast<uint32_t*>(take(entries * 4));
  w.head = reinterpret_cast<int32_t*>(take(entries * 4));
  w.state = reinterpret_cast<int32_t*>(take(entries * 4));
  w.owned = reinterpret_cast<int32_t*>(take(entries * 4));
  w.unused = reinterpret_cast<int32_t*>(take(list_slots * 4));
  w.used = reinterpret_cast<int32_t*>(take(list_slots * 4));
  w.jobs = reinterpret_cast<GatherJob*>(take(entries * sizeof(GatherJob)));
  w.job_of = reinterpret_cast<int32_t*>(take(entries * 4));
  w.job_count = reinterpret_cast<int32_t*>(take(4));
  w.misses = reinterpret_cast<int32_t*>(take(std::size_t(batch) * 4));
  w.stage_of = reinterpret_cast<int32_t*>(take(stage_cap ? entries * 4 : 0));
  w.stage_jobs = reinterpret_cast<GatherJob*>(take(stage_cap * sizeof(GatherJob)));
  w.stage_count = reinterpret_cast<int32_t*>(take(4));
  w.staging = take(stage_cap * 2 * piece);
  if (total) *total = off;
  return w;
}

struct Dims {
  int batch, kv_heads;
  std::size_t piece_bytes;
  bool strict;
  bool fill_in_attention;
  int stage_cap;
};

__device__ inline int UsedEntries(const ResolveParams& p, int row) {
  const int cap = p.sel_indptr[row + 1] - p.sel_indptr[row];
  return p.sel_count ? min(p.sel_count[row], cap) : cap;
}

// The step from device memory when the caller keeps it there (a captured
// graph replayed at later steps), else the value in the parameters.
__device__ inline int64_t StepOf(const ResolveParams& p) { return p.step_ptr ? *p.step_ptr : p.step; }

__global__ void ResetKernel(int32_t* cold_count, int32_t* bypass_count, int32_t* job_count, int32_t* stage_count,
                            int32_t* misses, int batch) {
  ChainWait();
  ChainRelease();
  if (threadIdx.x == 0) {
    *cold_count = 0;
    *bypass_count = 0;
    *job_count = 0;
    *stage_count = 0;
  }
  for (int b = threadIdx.x; b < batch; b += blockDim.x) misses[b] = 0;
}

// The row holding entry e: the last r with sel_indptr[r] <= e (rows are
// few and their bounds stay in cache).
__device__ inline int RowOf(const int32_t* indptr, int rows, int e) {
  int lo = 0, hi = rows - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (indptr[mid] <= e) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

__global__ void __launch_bounds__(kClassifyThreads) ClassifyKernel(ResolveParams p, Workspace w, Dims d,
                                                                   int entries) {
  ChainWait();
  ChainRelease();
  const int e = blockIdx.x * kClassifyThreads + threadIdx.x;
  const int rows = d.batch * d.kv_heads;
  bool miss = false;
  int b = -1, h = 0;
  const char* home = nullptr;
  if (e < entries && e < p.sel_indptr[rows]) {
    const int row = RowOf(p.sel_indptr, rows, e);
    b = row / d.kv_heads;
    h = row % d.kv_heads;
    if (e - p.sel_indptr[row] >= UsedEntries(p, row)) {
      w.state[e] = kIdle;
    } else {
      const uint32_t page = p.page_ids[p.page_indptr[b] + p.sel_pages[e]];
      w.page[e] = page;
      w.head[e] = h;
      int32_t* cell = p.hbm_slot + std::size_t(page) * d.kv_heads + h;
      const int32_t s = *reinterpret_cast<volatile int32_t*>(cell);
      if (s >= 0) {
        w.state[e] = kHit;
        p.slot_last_use[s] = StepOf(p);
      } else if ((home = static_cast<const char*>(p.host_addr[page])) == nullptr) {
        w.state[e] = kCold;
      } else {
        w.state[e] = kMiss;
        atomicMin(cell, kClaimBase + e);
        miss = true;
      }
    }
  }
  const unsigned lanes = __ballot_sync(0xFFFFFFFFu, miss);
  if (!lanes) return;
  const int lane = threadIdx.x & 31;
  if (d.stage_cap > 0) {  // the call's first stage_cap misses, numbered by one atomic a warp
    const int leader = __ffs(lanes) - 1;
    int base = 0;
    if (lane == leader) base = atomicAdd(w.stage_count, __popc(lanes));
    base = __shfl_sync(0xFFFFFFFFu, base, leader);
    if (miss) {
      const int idx = base + __popc(lanes & ((1u << lane) - 1));
      w.stage_of[e] = idx < d.stage_cap ? idx : -1;
      if (idx < d.stage_cap) {
        char* const dst = w.staging + std::size_t(idx) * 2 * d.piece_bytes;
        w.stage_jobs[idx] = GatherJob{home + std::size_t(h) * d.piece_bytes,
                                      home + std::size_t(d.kv_heads + h) * d.piece_bytes, dst};
      }
    }
  }
  // One atomic per sequence present in the warp (a warp spans few rows).
  const unsigned same = __match_any_sync(0xFFFFFFFFu, miss ? b : -1);
  if (miss && (same & lanes & ((1u << lane) - 1)) == 0) atomicAdd(&w.misses[b], __popc(same & lanes));
}

// Where miss entry e's K and V are read from, into dst: its staging copy when
// it has one (fetched by the assign's staging blocks), else its home.
__device__ inline GatherJob SourceOf(const ResolveParams& p, const Workspace& w, const Dims& d, int e, uint32_t page,
                                     int h, void* dst) {
  const int idx = d.stage_cap > 0 ? w.stage_of[e] : -1;
  if (idx >= 0) {
    const char* staged = w.staging + std::size_t(idx) * 2 * d.piece_bytes;
    return GatherJob{staged, staged + d.piece_bytes, dst};
  }
  const char* home = static_cast<const char*>(p.host_addr[page]);
  return GatherJob{home + std::size_t(h) * d.piece_bytes, home + std::size_t(d.kv_heads + h) * d.piece_bytes, dst};
}

// Jobs [0, n): K and V of each, as one flat range of 16-byte vectors striped
// over `workers` threads (this one is `worker`), kGatherUnroll loads in
// flight per thread before any store. Jobs without dst are read-only: skipped.
__device__ void GatherJobs(const GatherJob* __restrict__ jobs, uint32_t n, uint32_t piece_vecs, uint32_t worker,
                           uint32_t workers) {
  const uint32_t job_vecs = 2 * piece_vecs;
  const uint32_t total = n * job_vecs;
  const uint32_t stride = workers;
  for (uint32_t i0 = worker; i0 < total; i0 += stride * kGatherUnroll) {
    uint4 v[kGatherUnroll];
    uint4* dst[kGatherUnroll];
#pragma unroll
    for (int u = 0; u < kGatherUnroll; ++u) {
      const uint32_t i = i0 + u * stride;
      dst[u] = nullptr;
      if (i < total && jobs[i / job_vecs].dst) {  // (read-only jobs: see ResolveFills)
        const GatherJob& j = jobs[i / job_vecs];
        const uint32_t within = i % job_vecs;
        const bool is_v = within >= piece_vecs;
        const uint4* src = static_cast<const uint4*>(is_v ? j.v : j.k) + (within - (is_v ? piece_vecs : 0));
        v[u] = Load16(src);
        dst[u] = static_cast<uint4*>(j.dst) + within;
      }
    }
#pragma unroll
    for (int u = 0; u < kGatherUnroll; ++u)
      if (dst[u]) *dst[u] = v[u];
  }
}

__global__ void __launch_bounds__(kAssignThreads) AssignKernel(ResolveParams p, Workspace w, Dims d) {
  ChainWait();
  ChainRelease();
  if (int(blockIdx.x) >= d.batch) {  // a staging block: fetch the staged misses
    const uint32_t n = uint32_t(min(*w.stage_count, d.stage_cap));
    GatherJobs(w.stage_jobs, n, uint32_t(d.piece_bytes / 16), (blockIdx.x - d.batch) * kAssignThreads + threadIdx.x,
               (gridDim.x - d.batch) * kAssignThreads);
    return;
  }
  const int64_t step = StepOf(p);
  using Scan = cub::BlockScan<int, kAssignThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int job_base;
  __shared__ unsigned long long evictions;
  const int b = blockIdx.x, H = d.kv_heads, tid = threadIdx.x;
  // No miss (every entry hit, or was cold): nothing to place, and the list
  // is left as it is (scanning and reordering a list that holds every page
  // of a long sequence would cost more than the step; the hits' recency is
  // in slot_last_use).
  if (w.misses[b] == 0) return;
  if (tid == 0) evictions = 0;
  const int e_begin = p.sel_indptr[b * H], e_end = p.sel_indptr[(b + 1) * H];

  // Owned misses in entry order (idle entries carry kIdle, so rows' unused
  // tails need no test here).
  int owners = 0;
  for (int base = e_begin; base < e_end; base += kAssignThreads) {
    const int e = base + tid;
    int own = 0;
    if (e < e_end && w.state[e] == kMiss)
      own = p.hbm_slot[std::size_t(w.page[e]) * H + w.head[e]] == kClaimBase + e;
    int rank, total;
    Scan(scan_tmp).ExclusiveSum(own, rank, total);
    if (own) w.owned[e_begin + owners + rank] = e;
    owners += total;
    __syncthreads();
  }
  if (owners == 0) return;  // every miss lost its claim to another sequence's entry

  // One pass over the list, kAssignItems consecutive slots a thread: the
  // eligible slots (neither pinned nor used this step) in list order take
  // the owned misses in order, and each slot is staged at its place in the
  // reordered list — not used this step first, then used (hit, or filled
  // here), each in list order. One block scan a round counts both, packed
  // in 16-bit halves (a round holds at most 4096 slots): before a slot,
  //   eligible = (packed >> 16), not used before the pass = (packed & 0xFFFF),
  // and, the filled slots being the first `owners` eligible ones,
  //   unused after the pass = not used before - min(eligible, owners).
  // A slot's recency changes in this pass only by this block's fills
  // (lists are disjoint).
  constexpr int kRound = kAssignThreads * kAssignItems;
  const int l_begin = p.part_indptr[b], l_end = p.part_indptr[b + 1];
  int32_t* const part = p.part_lists ? p.part_lists[b] - l_begin : p.part_slots;  // indexed by i
  int cands = 0, free_before = 0;  // over the rounds done: eligible slots, slots not used before the pass
  for (int base = l_begin; base < l_end; base += kRound) {
    int32_t s[kAssignItems];
    bool was_used[kAssignItems], elig[kAssignItems];
    int packed = 0;
#pragma unroll
    for (int j = 0; j < kAssignItems; ++j) {
      const int i = base + tid * kAssignItems + j;
      s[j] = i < l_end ? part[i] : -1;
    }
#pragma unroll
    for (int j = 0; j < kAssignItems; ++j) {
      was_used[j] = s[j] >= 0 && p.slot_last_use[s[j]] == step;
      elig[j] = s[j] >= 0 && !was_used[j] && !p.slot_pinned[s[j]];
      packed += (int(elig[j]) << 16) + int(s[j] >= 0 && !was_used[j]);
    }
    int prefix, total;
    Scan(scan_tmp).ExclusiveSum(packed, prefix, total);
    const int round_elig = total >> 16;
    const int take = min(round_elig, max(owners - cands, 0));
    if (take > 0 && tid == 0) job_base = atomicAdd(w.job_count, take);
    __syncthreads();
    int e_rank = cands + (prefix >> 16), f_rank = free_before + (prefix & 0xFFFF);
#pragma unroll
    for (int j = 0; j < kAssignItems; ++j) {
      if (s[j] < 0) break;
      const int i = base + tid * kAssignItems + j;
      const bool taken = elig[j] && e_rank < owners;
      const int unused_rank = f_rank - min(e_rank, owners);
      if (taken) {
        const int e = w.owned[e_begin + e_rank];
        const uint32_t page = w.page[e];
        const int h = w.head[e];
        const uint32_t old = p.slot_page[s[j]];
        if (old != kEmptySlot) {
          p.hbm_slot[std::size_t(old) * H + p.slot_head[s[j]]] = -1;
          atomicAdd(&evictions, 1ull);
        }
        p.slot_page[s[j]] = page;
        p.slot_head[s[j]] = h;
        p.slot_last_use[s[j]] = step;
        p.hbm_slot[std::size_t(page) * H + h] = s[j];
        char* const dst = static_cast<char*>(p.slots) + std::size_t(s[j]) * 2 * d.piece_bytes;
        const int job = job_base + (e_rank - cands);
        w.jobs[job] = SourceOf(p, w, d, e, page, h, dst);
        w.state[e] = kFilled;
        w.job_of[e] = job;
      }
      if (was_used[j] || taken) w.used[i - unused_rank] = s[j];  // (the list's own range of the workspace)
      else w.unused[l_begin + unused_rank] = s[j];
      e_rank += elig[j];
      f_rank += !was_used[j];
    }
    cands += round_elig;
    free_before += total & 0xFFFF;
    __syncthreads();  // scan_tmp and job_base are reused
  }
  // Owners past the eligible slots: bypass, the claim released.
  for (int k = cands + tid; k < owners; k += kAssignThreads) {
    const int e = w.owned[e_begin + k];
    p.hbm_slot[std::size_t(w.page[e]) * H + w.head[e]] = -1;
  }
  const int unused_total = free_before - min(cands, owners);
  for (int k = tid; k < l_end - l_begin; k += kAssignThreads)
    part[l_begin + k] = k < unused_total ? w.unused[l_begin + k] : w.used[l_begin + k - unused_total];
  if (tid == 0) {
    const int filled = min(owners, cands);
    if (evictions) atomicAdd(&p.counters->evictions, evictions);
    if (filled) atomicAdd(&p.counters->bytes_host_to_hbm, 2ull * d.piece_bytes * filled);
  }
}

__device__ inline unsigned WarpCount(bool x) { return __popc(__ballot_sync(0xFFFFFFFFu, x)); }

// Appends the lanes with `push` set; returns how many were dropped (lane 0's
// count is the warp's).
__device__ inline int WarpPush(bool push, const ResolveRequest& r, ResolveRequest* queue, int32_t* count,
                               int capacity) {
  const unsigned mask = __ballot_sync(0xFFFFFFFFu, push);
  if (!mask) return 0;
  const int lane = threadIdx.x & 31;
  int base = 0;
  if (lane == 0) base = atomicAdd(count, __popc(mask));
  base = __shfl_sync(0xFFFFFFFFu, base, 0);
  const int idx = base + __popc(mask & ((1u << lane) - 1));
  const bool drop = push && idx >= capacity;
  if (push && !drop) queue[idx] = r;
  return WarpCount(drop);
}

__global__ void __launch_bounds__(kFinalizeThreads) FinalizeKernel(ResolveParams p, Workspace w, Dims d) {
  ChainWait();
  ChainRelease();
  using Scan = cub::BlockScan<int, kFinalizeThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  const int row = blockIdx.x;
  const int lane = threadIdx.x & 31;
  const int h = row % d.kv_heads;
  const int e0 = p.sel_indptr[row];
  const int n = UsedEntries(p, row);
  unsigned long long selected = 0, hits = 0, misses = 0, cold = 0, bypasses = 0, dropped = 0;
  int out = 0;
  for (int c0 = 0; c0 < n; c0 += kFinalizeThreads) {
    const int i = c0 + int(threadIdx.x);
    const int e = e0 + i;
    const int st = i < n ? w.state[e] : kIdle;
    const uint32_t page = st != kIdle ? w.page[e] : 0;
    int32_t s = -1;
    if (st == kHit || st == kMiss || st == kFilled) s = p.hbm_slot[std::size_t(page) * d.kv_heads + h];
    const ResolveRequest req{page, h, row, e};
    const bool is_cold = st == kCold, is_bypass = st == kMiss && s < 0, keep = s >= 0;
    if (d.fill_in_attention) {
      // Attention fetches what is not in its slot yet: the entry's own fill,
      // or (another entry fills the slot) a read of the home alone.
      if (st == kFilled) s = ~w.job_of[e];
      const bool shared_fill = st == kMiss && s >= 0;
      const unsigned mask = __ballot_sync(0xFFFFFFFFu, shared_fill);
      if (mask) {
        int base = 0;
        if (lane == 0) base = atomicAdd(w.job_count, __popc(mask));
        base = __shfl_sync(0xFFFFFFFFu, base, 0);
        if (shared_fill) {
          const int job = base + __popc(mask & ((1u << lane) - 1));
          w.jobs[job] = SourceOf(p, w, d, e, page, h, nullptr);
          s = ~job;
        }
      }
    }
    selected += WarpCount(st != kIdle);
    hits += WarpCount(st == kHit);
    misses += WarpCount(st == kMiss || st == kFilled);
    cold += WarpCount(is_cold);
    bypasses += WarpCount(is_bypass);
    dropped += WarpPush(is_cold, req, p.cold, p.cold_count, p.queue_capacity);
    dropped += WarpPush(is_bypass, req, p.bypass, p.bypass_count, p.queue_capacity);
    int rank, total;
    Scan(scan_tmp).ExclusiveSum(int(keep), rank, total);
    if (keep) p.out_slots[e0 + out + rank] = s;  // a slot, or ~job (see above)
    out += total;
    __syncthreads();  // scan_tmp is reused
  }
  if (lane != 0) return;
  if (threadIdx.x == 0) p.out_count[row] = out;
  ResolveCounters* c = p.counters;
  if (selected) atomicAdd(&c->selected, selected);
  if (hits) atomicAdd(&c->hits, hits);
  if (misses) atomicAdd(&c->misses_host, misses);
  if (cold) {
    atomicAdd(&c->misses_disk, cold);
    atomicAdd(d.strict ? &c->cold_stalls : &c->pages_skipped, cold);
  }
  if (bypasses) atomicAdd(&c->bypasses, bypasses);
  if (dropped) atomicAdd(&c->queue_overflows, dropped);
}

// kGatherUnroll loads in flight per thread. Deeper (8/16 for small grids) was
// measured and gained nothing (bench/results/2026-11-29-gpu-tuning.md): the
// limit at small grids is per SM, not per thread.
__global__ void __launch_bounds__(kGatherThreads) GatherKernel(const GatherJob* __restrict__ jobs,
                                                               const int32_t* __restrict__ job_count,
                                                               uint32_t piece_vecs) {
  ChainWait();
  ChainRelease();
  GatherJobs(jobs, uint32_t(*job_count), piece_vecs, blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x);
}

}  // namespace

bool PlanResolve(const ResolveShape& s, int64_t entries, int64_t list_slots, int num_sms, int gather_blocks,
                 ResolvePlan* plan, std::string* error) {
  auto fail = [&](const std::string& m) {
    if (error) *error = "PlanResolve: " + m;
    return false;
  };
  if (s.batch <= 0 || s.kv_heads <= 0) return fail("batch and kv_heads must be positive");
  if (s.page_size <= 0 || s.head_dim <= 0) return fail("page_size and head_dim must be positive");
  if (s.dtype != DType::kF32 && s.dtype != DType::kF16 && s.dtype != DType::kBF16)
    return fail(std::string("K/V dtype ") + DTypeName(s.dtype) + " (supported: f32, f16, bf16)");
  if (entries < 0 || list_slots < 0 || entries >= INT32_MAX || list_slots >= INT32_MAX)
    return fail("entries and list_slots must be in [0, 2^31 - 1)");
  const std::size_t piece = std::size_t(s.page_size) * s.head_dim * DTypeBytes(s.dtype);
  if (piece % 16) return fail("a head-page's K (S * D * elem = " + std::to_string(piece) + " B) is not a multiple of 16");
  if (double(entries) * 2 * double(piece / 16) >= double(UINT32_MAX))
    return fail("entries * head-page bytes / 16 must stay under 2^32");
  ResolvePlan out;
  out.shape = s;
  out.entries = entries;
  out.list_slots = list_slots;
  out.piece_bytes = piece;
  // Default: half the SMs. Measured on the H200 (bench/results/2026-11-29-gpu-tuning.md):
  // 66 blocks reach 90% of the pinned copy limit alone, and attention beside
  // the gather runs ~2x slower instead of 4.8x (132 blocks) or 21x (528).
  const int sms = num_sms > 0 ? num_sms : 132;
  out.gather_blocks = gather_blocks > 0 ? gather_blocks : std::max(1, sms / 2);
  // Staging blocks of 1024 threads on a quarter of the SMs: as many loads in
  // flight as the gather's 90%-of-the-link grid.
  out.stage_cap = s.fill_in_attention ? int(std::min<int64_t>(entries, std::max(0, s.stage_pages))) : 0;
  out.stage_blocks = out.stage_cap > 0 ? std::max(1, sms / 4) : 0;
  Carve(nullptr, entries, list_slots, s.batch, out.stage_cap, piece, &out.workspace_bytes);
  *plan = out;
  return true;
}

cudaError_t LaunchGather(const GatherJob* jobs, const int32_t* job_count, std::size_t piece_bytes, int blocks,
                         cudaStream_t stream, bool chain) {
  if (piece_bytes % 16 || blocks <= 0)
    return Unsupported("gather piece_bytes (multiple of 16) or blocks", (long long)piece_bytes, "16 * n");
  // The largest shared-memory carveout lets attention blocks (16+ KiB of
  // shared memory) join SMs running the gather, which needs none: measured,
  // attention beside a gather starts within 0.1-0.5 ms instead of waiting it
  // out. A gather on every SM still slows that attention several times: keep
  // the grid small (PlanResolve's default is half the SMs).
  constexpr int kMaxDevices = 64;
  static std::once_flag carveout[kMaxDevices];
  int dev = 0;
  if (cudaGetDevice(&dev) == cudaSuccess && dev < kMaxDevices)
    std::call_once(carveout[dev], [] {
      cudaFuncSetAttribute(GatherKernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    });
  return LaunchChained(GatherKernel, dim3(blocks), dim3(kGatherThreads), 0, stream, chain, jobs, job_count,
                       uint32_t(piece_bytes / 16));
}

cudaError_t LaunchResolve(const ResolvePlan& plan, const ResolveParams& p, cudaStream_t stream) {
  const ResolveShape& s = plan.shape;
  const Dims d{s.batch, s.kv_heads, plan.piece_bytes, s.policy == ColdMissPolicy::kStrict, s.fill_in_attention,
               plan.stage_cap};
  const Workspace w = Carve(p.workspace, plan.entries, plan.list_slots, s.batch, plan.stage_cap, plan.piece_bytes, nullptr);
  const int rows = s.batch * s.kv_heads;
  const int entries = int(plan.entries);
  const cudaError_t launched[] = {
      LaunchChained(ResetKernel, dim3(1), dim3(256), 0, stream, s.chain, p.cold_count, p.bypass_count, w.job_count,
                    w.stage_count, w.misses, s.batch),
      entries > 0 ? LaunchChained(ClassifyKernel, dim3((entries + kClassifyThreads - 1) / kClassifyThreads),
                                  dim3(kClassifyThreads), 0, stream, s.chain, p, w, d, entries)
                  : cudaSuccess,
      LaunchChained(AssignKernel, dim3(s.batch + plan.stage_blocks), dim3(kAssignThreads), 0, stream, s.chain, p,
                    w, d),
      LaunchChained(FinalizeKernel, dim3(rows), dim3(kFinalizeThreads), 0, stream, s.chain, p, w, d)};
  for (const cudaError_t e : launched)
    if (e != cudaSuccess) return e;
  if (s.fill_in_attention) return cudaSuccess;
  return LaunchGather(w.jobs, w.job_count, plan.piece_bytes, plan.gather_blocks, stream, s.chain);
}

ResolveFillList ResolveFills(const ResolvePlan& plan, void* workspace) {
  const Workspace w =
      Carve(workspace, plan.entries, plan.list_slots, plan.shape.batch, plan.stage_cap, plan.piece_bytes, nullptr);
  return {w.jobs, w.job_count};
}

cudaError_t CopyResolveCountersAsync(const ResolveCounters* device, ResolveCounters* pinned_host,
                                     cudaStream_t stream) {
  return cudaMemcpyAsync(pinned_host, device, sizeof(ResolveCounters), cudaMemcpyDeviceToHost, stream);
}

}  // namespace questkv::kernels::cuda
