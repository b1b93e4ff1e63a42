// Internal to select (select.cu and its kernel families select_score.cu,
// select_topk.cu, select_fused.cu): the device helpers and sizes more than
// one family uses, the workspace structs select.cu carves, and each family's
// launcher. Not part of the library's interface (kernels_cuda.h).
#pragma once

#include <cub/block/block_scan.cuh>

#include <cstddef>
#include <cstdint>
#include <mutex>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels_cuda.h"

namespace questkv::kernels::cuda {

// The top-K and fused select blocks. A row's top-K is one block whose warps
// each run a chain of dependent phases, ~1500 instructions at ~17 cycles
// apiece (ncu, 512 threads x 16 keys); 1024 threads x 8 keys halve each
// warp's unrolled key loops (H200, select + attend, same call: Llama-3-8B
// b1 128K 50.7 -> 45.9 us, b1 256K 68.7 -> 63.6, b16 128K 222.9 -> 218.3;
// Llama-2-7B b1 128K 85.6 -> 80.3; b1 8K, fused, 26.1 -> 26.7;
// bench/results/2026-12-02-gpu-topk-1024-threads.md). Cutting barriers and
// dependent loads instead gained nothing.
constexpr int kTopKThreads = 1024;
constexpr int kMaxKeyCache = 47616;  // 192 KiB of keys (with padding) in shared memory

// Per-sequence policy numbers, as select.cc computes them.
struct RowPolicy {
  int n, sink, local, fixed, k;
  bool all;  // every page chosen (dense, budget >= n, or k >= candidates)
};

__host__ __device__ inline RowPolicy PolicyFor(const SelectShape& s, int n) {
  RowPolicy r{};
  r.n = n;
  r.sink = s.sink_pages < n ? s.sink_pages : n;
  const int local = s.local_pages > 1 ? s.local_pages : 1;
  r.local = local < n ? local : n;
  r.fixed = r.sink + r.local < n ? r.sink + r.local : n;
  const long long k = s.page_budget - r.fixed;
  r.k = k > 0 ? int(k < n ? k : n) : 0;
  r.all = s.dense || s.page_budget >= n || r.k >= n - r.fixed;
  return r;
}

// Query heads whose scores a kUnion row keeps apart (every position's G
// under shared block selection), else 1: one aggregate score a head-page.
__host__ __device__ inline int ScoredHeads(const SelectShape& s) {
  return s.gqa == GqaMode::kUnion ? s.group * s.positions : 1;
}

__device__ inline bool Skipped(const RowPolicy& r, int i) { return i < r.sink || i >= r.n - r.local; }

// topk_cpu.cc's Key: larger score -> larger key, -0 == +0, NaN lowest.
__device__ inline uint32_t Key(float x) {
  uint32_t bits = __float_as_uint(x);
  bits = bits == 0x80000000u ? 0u : bits;
  const uint32_t key = bits ^ (uint32_t(int32_t(bits) >> 31) | 0x80000000u);
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? 0u : key;
}

// Per-row state of the multi-block top-K (kMax/kMean), zeroed by LaunchSelect:
// the largest key and the complement of the smallest among the row's scored
// (non-sink, non-local) pages, the histogram phase's and the bin select's
// finish counters, how many candidates the bin select has gathered, and the
// flags LongRowKernel's row-wide steps set.
struct RowState {
  uint32_t kmax, kmin_inv, done, bin_done, n_cand, hist_ready, kth_ready, pad;
};
constexpr int kBins = 2048;  // histogram bins over [kmin, kmax]

// Chunk c of 8 elements of a row of T, as floats (one or two 16-byte loads;
// e4m3: one 8-byte load).
template <typename T>
__device__ __forceinline__ void Load8(const T* row, int c, float* out) {
  if constexpr (kIsE4m3<T>) {
    UnpackE4m3x8(__ldg(reinterpret_cast<const uint2*>(row + c * 8)), out);
  } else {
#pragma unroll
    for (int v = 0; v < 8 / kVec16<T>; ++v) Unpack16<T>(Load16(row + c * 8 + v * kVec16<T>), out + v * kVec16<T>);
  }
}

// ScoreTerm's fma form is exact when q and the summaries are 16-bit, or q
// 16-bit and the summaries E4M3 (at most 15 significant bits).
template <typename QT, typename SumT>
constexpr bool kExactProducts = sizeof(QT) == 2 && sizeof(SumT) <= 2;

// A query head's score as summed. E4M3: a term on a ±inf code decoded to NaN
// and made the sum NaN; the score is then +inf (always chosen), before any
// aggregation, as in ScorePagesCpu.
template <typename SumT>
__device__ __forceinline__ float FinishScore(float sum) {
  if constexpr (kIsE4m3<SumT>) return isnan(sum) ? INFINITY : sum;
  else return sum;
}

// One chunk of 8 dimensions for one query head: ScorePagesCpu's 8 partial sums.
template <bool kExact>
__device__ __forceinline__ void FoldChunk8(float* acc, const float* qv, const float* mn, const float* mx) {
#pragma unroll
  for (int l = 0; l < 8; ++l) acc[l] = ScoreTerm<kExact>(acc[l], qv[l], mn[l], mx[l]);
}

// The 8 partial sums added in ScorePagesCpu's order (pairwise).
__device__ __forceinline__ float SumLanes8(const float* acc) {
  return __fadd_rn(__fadd_rn(__fadd_rn(acc[0], acc[1]), __fadd_rn(acc[2], acc[3])),
                   __fadd_rn(__fadd_rn(acc[4], acc[5]), __fadd_rn(acc[6], acc[7])));
}

// kMax / kMean over a group's G scores, as select.cc aggregates them
// (std::max in order; a sequential sum, then a division).
template <int G>
__device__ __forceinline__ float Aggregate(GqaMode gqa, const float* score) {
  float agg = score[0];
  if (gqa == GqaMode::kMax) {
#pragma unroll
    for (int g = 1; g < G; ++g) agg = agg < score[g] ? score[g] : agg;
  } else {
#pragma unroll
    for (int g = 1; g < G; ++g) agg = __fadd_rn(agg, score[g]);
    agg = __fdiv_rn(agg, float(G));
  }
  return agg;
}

// U_p(q) of one head-page for the G query heads of its group (q: G rows of
// D), read straight from its summary (lo = min, then max) with 16-byte
// loads: ScorePagesCpu's arithmetic and order.
template <typename QT, typename SumT, int D, int G>
__device__ __forceinline__ void ScoreHeadPage(const SumT* lo, const QT* q, float* score) {
  const SumT* hi = lo + D;
  float acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int l = 0; l < 8; ++l) acc[g][l] = 0.f;
#pragma unroll 4
  for (int c = 0; c < D / 8; ++c) {
    float mn[8], mx[8];
    Load8(lo, c, mn);
    Load8(hi, c, mx);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float qv[8];
      Load8(q + g * D, c, qv);
      FoldChunk8<kExactProducts<QT, SumT>>(acc[g], qv, mn, mx);
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) score[g] = FinishScore<SumT>(SumLanes8(acc[g]));
}

// Blocks of the staged score kernel (select_score.cu) a multiprocessor; the
// plan's score_blocks.
constexpr int kScoreBlocksPerSm = 6;  // as many as an SM's shared memory holds

using BlockScan = cub::BlockScan<int, kTopKThreads>;

struct TopKShared {
  // RadixKth's two digit histograms (bins[0, 256) and bins[256, 512), one
  // filled while the other is cleared); the range histogram of
  // SelectShortRow and RangeKth.
  uint32_t bins[kBins];
  uint32_t kmax, kmin_inv;
  int pick_bucket;
  int pick_rank;
  int pick_count;
  int n_cand;
  typename BlockScan::TempStorage scan;
};

// One padding word per 32 keys: OrderedPass's threads read kItems
// consecutive keys each, which would otherwise hit one bank kItems (8) ways.
__device__ __forceinline__ int CacheSlot(int i) { return i + (i >> 5); }

// Key of candidate i (cache in shared memory when the row fits).
struct Keys {
  const float* scores;
  const uint32_t* cache;  // null: recompute from scores
  __device__ uint32_t operator()(int i) const { return cache ? cache[CacheSlot(i)] : Key(scores[i]); }
};

// The k-th largest key among non-skipped candidates (*kth), how many keys
// equal to it win (*ties) and how many there are (*equal). Four 8-bit digit
// levels, two barriers each: the block bins the keys that match the prefix
// so far; warp 0 finds the bucket holding the rank-th largest (8 bins a
// lane, one warp scan) while the other warps clear the next level's
// histogram. (topk_cpu.cc uses 11/11/10-bit digits; the k-th key and its
// tie count do not depend on the split. The former 3-level version with a
// 2048-bin block scan per level cost ~28 us per block on the H200.)
__device__ inline void RadixKth(const Keys& keys, const RowPolicy& r, TopKShared& sh,
                                uint32_t* kth, int* ties, int* equal) {
  uint32_t prefix = 0;
  int rank = r.k;
  int count = 0;
  for (int b = threadIdx.x; b < 256; b += blockDim.x) sh.bins[b] = 0;
  __syncthreads();
#pragma unroll 1
  for (int level = 0; level < 4; ++level) {
    const int shift = 24 - 8 * level;
    const uint32_t high_mask = level == 0 ? 0u : ~0u << (shift + 8);
    uint32_t* hist = sh.bins + (level & 1) * 256;
    // Scores cluster in few top-digit buckets: aggregate a warp's equal
    // buckets into one atomic instead of up to 32 serialised ones.
    for (int base = 0; base < r.n; base += blockDim.x) {
      const int i = base + threadIdx.x;
      uint32_t bin = 0xFFFFFFFFu;
      if (i < r.n && !Skipped(r, i)) {
        const uint32_t key = keys(i);
        if ((key & high_mask) == prefix) bin = (key >> shift) & 0xFFu;
      }
      const unsigned same = __match_any_sync(0xFFFFFFFFu, bin);
      if (bin != 0xFFFFFFFFu && (threadIdx.x & 31) == __ffs(same) - 1) atomicAdd(&hist[bin], __popc(same));
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      // Lane l owns bins 255 - 8l down to 248 - 8l (lane 0: the highest).
      const int lane = int(threadIdx.x);
      const int top = 255 - 8 * lane;
      int c[8], sum = 0;
#pragma unroll
      for (int t = 0; t < 8; ++t) sum += c[t] = int(hist[top - t]);
      int incl = sum;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int v = __shfl_up_sync(0xFFFFFFFFu, incl, off);
        if (lane >= off) incl += v;
      }
      const int before = incl - sum;
      if (before < rank && rank <= incl) {
        int rr = rank - before, t = 0;
#pragma unroll
        for (int u = 0; u < 7; ++u)
          if (t == u && c[u] < rr) rr -= c[u], t = u + 1;
        int ct = c[0];
#pragma unroll
        for (int u = 1; u < 8; ++u) ct = t == u ? c[u] : ct;
        sh.pick_bucket = top - t;
        sh.pick_rank = rr;
        sh.pick_count = ct;
      }
    } else {
      uint32_t* next = sh.bins + ((level + 1) & 1) * 256;
      for (int b = int(threadIdx.x) - 32; b < 256; b += int(blockDim.x) - 32) next[b] = 0;
    }
    __syncthreads();
    prefix |= uint32_t(sh.pick_bucket) << shift;
    rank = sh.pick_rank;
    count = sh.pick_count;
  }
  // Every thread has read pick_* before anyone can write them again (the
  // next writer passes a barrier first).
  *kth = prefix;
  *ties = rank;
  *equal = count;
}

// Visits i in [0, n) in index order, kItems consecutive indices per thread
// (two block scans per kItems * blockDim indices); emit(i, pos) for each i
// with take(i, eq_rank) true, pos counting the taken ones. eq(i) marks the
// keys equal to the k-th, eq_rank counts them before i.
constexpr int kItems = 8;
template <typename Take, typename Eq, typename Emit>
__device__ int OrderedPass(int n, TopKShared& sh, Eq eq, Take take, Emit emit) {
  int eq_base = 0, out_base = 0;
  for (int c = 0; c < n; c += blockDim.x * kItems) {
    const int i0 = c + threadIdx.x * kItems;
    int e_local = 0;
#pragma unroll
    for (int t = 0; t < kItems; ++t) e_local += i0 + t < n && eq(i0 + t) ? 1 : 0;
    int e_rank, e_total;
    BlockScan(sh.scan).ExclusiveSum(e_local, e_rank, e_total);
    __syncthreads();
    uint32_t taken = 0;
    int t_local = 0, e_seen = eq_base + e_rank;
#pragma unroll
    for (int t = 0; t < kItems; ++t) {
      const int i = i0 + t;
      if (i >= n) break;
      if (take(i, e_seen)) taken |= 1u << t, ++t_local;
      e_seen += eq(i) ? 1 : 0;
    }
    int pos, t_total;
    BlockScan(sh.scan).ExclusiveSum(t_local, pos, t_total);
    __syncthreads();
#pragma unroll
    for (int t = 0; t < kItems; ++t)
      if (taken >> t & 1u) emit(i0 + t, out_base + pos++);
    eq_base += e_total;
    out_base += t_total;
  }
  return out_base;
}

// OrderedPass when no tie needs its rank (every key equal to the k-th wins,
// or none is compared): one block scan per kItems * blockDim indices.
template <typename Take, typename Emit>
__device__ int OrderedPassAll(int n, TopKShared& sh, Take take, Emit emit) {
  int out_base = 0;
  for (int c = 0; c < n; c += blockDim.x * kItems) {
    const int i0 = c + threadIdx.x * kItems;
    uint32_t taken = 0;
#pragma unroll
    for (int t = 0; t < kItems; ++t)
      if (i0 + t < n && take(i0 + t)) taken |= 1u << t;
    int pos, t_total;
    BlockScan(sh.scan).ExclusiveSum(__popc(taken), pos, t_total);
    __syncthreads();
#pragma unroll
    for (int t = 0; t < kItems; ++t)
      if (taken >> t & 1u) emit(i0 + t, out_base + pos++);
    out_base += t_total;
  }
  return out_base;
}

// After a row's pages are emitted (and a barrier): the HBM slot of each
// chosen head-page when asked for, one coalesced pass. (Looking the slot up
// inside the ordered emit serialised two dependent global loads per page
// and thread: most of a short row's select time on the H200.)
__device__ __forceinline__ void EmitSlots(const SelectParams& p, const uint32_t* ids, int h, int out0, int count) {
  if (!p.out_slots) return;
  for (int j = threadIdx.x; j < count; j += blockDim.x)
    p.out_slots[out0 + j] = p.hbm_slot[(std::size_t)ids[p.out_pages[out0 + j]] * p.shape.kv_heads + h];
}

// The long rows' chunked top-K (select_topk.cu says why and how): blocks of
// kEmitThreads threads, kEmitItems keys a thread.
constexpr int kEmitThreads = 256;
constexpr int kEmitItems = 16;
constexpr int kEmitChunk = kEmitThreads * kEmitItems;
constexpr int kLongRowMin = 16384;  // keys; longer rows take the chunked phases
constexpr int kBinCap = 4096;       // candidates a row's bin select holds; a fuller bin takes the row's keys

// The long-row buffers of LaunchSelect's workspace: per row its state and
// histogram (zeroed before the score kernel), (bin, rank) pick, k-th key,
// counts per chunk ([row][chunk], the grid's width) and cand_cap candidates.
struct LongRows {
  RowState* st;
  uint32_t* ghist;
  int2* pick;
  int4* row_kth;
  int2* counts;
  int2* cand;
  int cand_cap;
};

// The fused select's limits (select_fused.cu says why).
constexpr int kFuseBlocks = 8;
constexpr int kFuseMaxPages = 2048;
constexpr long long kFuseMaxHeadPages = 8192;

// Once per device and kernel: allows kBytes of dynamic shared memory (the
// default limit, 48 KiB, counts the kernel's static shared memory too).
template <auto kKernel, int kBytes>
cudaError_t AllowDynamicSmem() {
  constexpr int kMaxDevices = 64;
  static std::once_flag once[kMaxDevices];
  static cudaError_t error[kMaxDevices] = {};
  int dev = 0;
  if (const cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  if (dev >= kMaxDevices) return cudaErrorInvalidDevice;
  std::call_once(once[dev], [dev] {
    error[dev] = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  });
  return error[dev];
}

// ---- each family's launcher --------------------------------------------------

// The score kernel for p's q dtype, summary dtype, D and G, and its grid
// (select_score.cu). With st, each scored key is also folded into its row's
// key range.
cudaError_t LaunchScore(const SelectPlan& plan, const SelectParams& p, float* scores, RowState* st,
                        cudaStream_t stream);

// The score kernel of shared block selection (p.q_rows; select_score.cu):
// a thread per head-page scoring it for every position of its block.
cudaError_t LaunchScoreBlocks(const SelectPlan& plan, const SelectParams& p, float* scores, RowState* st,
                              cudaStream_t stream);

// Clears kUnion's marks (select_topk.cu).
cudaError_t LaunchClearMarks(const SelectPlan& plan, const SelectParams& p, uint8_t* marks, cudaStream_t stream);

// The long rows' top-K phases, many blocks a row: one launch when the whole
// grid is resident and plan.split_long_rows is false, else three
// (select_topk.cu).
cudaError_t LaunchLongRows(const SelectPlan& plan, const SelectParams& p, const float* scores, const LongRows& lr,
                           cudaStream_t stream);

// The one-block-a-row top-K (select_topk.cu): dense rows, kUnion rows (with
// their marks), and kMax/kMean batches without long rows.
cudaError_t LaunchTopK(const SelectPlan& plan, const SelectParams& p, float* scores, uint8_t* marks,
                       cudaStream_t stream);

// Score, top-K and emit in one launch, a cluster a row (select_fused.cu);
// LaunchSelect decides when it fits.
cudaError_t LaunchFusedSelect(const SelectPlan& plan, const SelectParams& p, cudaStream_t stream);

}  // namespace questkv::kernels::cuda
