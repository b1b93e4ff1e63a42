// Select's top-K kernels (select.cu describes the pipeline): TopKKernel, one
// block a row; LongRowPhases, many blocks a row for rows of more than
// kLongRowMin keys (LongRowKernel in one launch, or HistKernel,
// BinSelectKernel and EmitKernel); ClearMarks for kUnion's marks.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <mutex>

#include "kernels/cuda/select_common.cuh"

namespace questkv::kernels::cuda {
namespace {

// Keys in [kmin, kmin + span] fall in bins of 2^shift keys from kmin, at most
// kBins of them: bin = (key - kmin) >> shift, monotone in the key. (A shift,
// not a 64-bit division: that cost ~40 us per 64K keys in one block.)
__device__ __forceinline__ int RangeShift(uint32_t span) { return max(0, 32 - __clz(int(span)) - 11); }

constexpr int kShortRowMin = 1024;  // keys; longer rows find their k-th key through a range histogram
constexpr int kCandCap = 2048;      // keys of the k-th key's bin that RangeKth gathers

// With a range histogram of a row's scored keys in sh.bins: the bin holding
// the k-th largest key (sh.pick_bucket), the rank of that key within the bin
// (sh.pick_rank) and the bin's count (sh.pick_count). Read after a barrier.
__device__ void PickRangeBin(TopKShared& sh, int k) {
  // Thread t owns kPer bins from the top (thread 0: the highest).
  constexpr int kPer = kBins / kTopKThreads;
  const int top = kBins - 1 - int(threadIdx.x) * kPer;
  int c[kPer], sum = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) sum += c[j] = int(sh.bins[top - j]);
  int incl;
  BlockScan(sh.scan).InclusiveSum(sum, incl);
  const int before = incl - sum;
  if (before < k && k <= incl) {
    int rr = k - before, j = 0;
    while (j < kPer - 1 && c[j] < rr) rr -= c[j++];
    sh.pick_bucket = top - j;
    sh.pick_rank = rr;
    sh.pick_count = c[j];
  }
}

// The k-th largest scored key of a row held in `cache` (CacheSlot order),
// whose scored keys lie in [kmin, kmin + span], and its ties as RadixKth
// gives them: a kBins-bin histogram over the range, the bin holding the
// k-th key, that bin's keys gathered into `cand` and radix-selected there
// (every key equal to the k-th is in its bin). Two plain passes over the row
// instead of RadixKth's four digit levels, which cost ~100 us a block at 32K
// keys (scores share their top digits, so the levels' warp-aggregated
// atomics serialise). False, with nothing decided, when the bin holds more
// than kCandCap keys. Block-uniform; r.k >= 1.
__device__ bool RangeKth(const uint32_t* cache, const RowPolicy& r, uint32_t kmin, uint32_t span, TopKShared& sh,
                         uint32_t* cand, uint32_t* kth, int* ties, int* equal) {
  const int shift = RangeShift(span);
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) sh.bins[b] = 0;
  if (threadIdx.x == 0) sh.n_cand = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < r.n; i += blockDim.x)
    if (!Skipped(r, i)) atomicAdd(&sh.bins[(cache[CacheSlot(i)] - kmin) >> shift], 1u);
  __syncthreads();
  PickRangeBin(sh, r.k);
  __syncthreads();
  const int pick = sh.pick_bucket;
  RowPolicy cr{};
  cr.k = sh.pick_rank;
  if (sh.pick_count > kCandCap) return false;
  for (int i = threadIdx.x; i < r.n; i += blockDim.x) {
    const uint32_t key = cache[CacheSlot(i)];
    if (!Skipped(r, i) && int((key - kmin) >> shift) == pick) cand[CacheSlot(atomicAdd(&sh.n_cand, 1))] = key;
  }
  __syncthreads();
  cr.n = sh.n_cand;
  RadixKth(Keys{nullptr, cand}, cr, sh, kth, ties, equal);
  return true;
}

// A row of at most kTopKThreads * kItems keys (load(i): key of scored page
// i) held in registers, kItems consecutive ones per thread (kMax/kMean): the row's key range, a
// kBins-bin histogram over it, the bin holding the k-th largest key,
// its keys gathered into `cand` (shared, CacheSlot order; may be where load
// reads: every key is in registers first) and radix-selected,
// then one ordered emit. Every pass after the load reads registers; keys
// spread over the range, so the histogram's atomics rarely collide. Returns
// the count emitted (block-uniform).
template <typename Load, typename Emit>
__device__ int SelectShortRow(Load load, const RowPolicy& r, uint32_t* cand, TopKShared& sh, Emit emit) {
  const int i0 = int(threadIdx.x) * kItems;
  uint32_t key[kItems];
  uint32_t valid = 0, fixed = 0;  // bit t: a scored key / a sink or local page
#pragma unroll
  for (int t = 0; t < kItems; ++t) {
    const int i = i0 + t;
    key[t] = 0;
    if (i < r.n) {
      if (Skipped(r, i)) fixed |= 1u << t;
      else key[t] = load(i), valid |= 1u << t;
    }
  }
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) sh.bins[b] = 0;
  if (threadIdx.x == 0) sh.kmax = 0, sh.kmin_inv = 0, sh.n_cand = 0;
  uint32_t kx = 0, kn = 0;
#pragma unroll
  for (int t = 0; t < kItems; ++t)
    if (valid >> t & 1u) kx = max(kx, key[t]), kn = max(kn, ~key[t]);
  kx = __reduce_max_sync(0xFFFFFFFFu, kx);
  kn = __reduce_max_sync(0xFFFFFFFFu, kn);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) atomicMax(&sh.kmax, kx), atomicMax(&sh.kmin_inv, kn);
  __syncthreads();
  const uint32_t kmin = ~sh.kmin_inv;
  const int shift = RangeShift(sh.kmax - kmin);
#pragma unroll
  for (int t = 0; t < kItems; ++t)
    if (valid >> t & 1u) atomicAdd(&sh.bins[(key[t] - kmin) >> shift], 1u);
  __syncthreads();
  PickRangeBin(sh, r.k);
  __syncthreads();
  const int pick = sh.pick_bucket;
#pragma unroll
  for (int t = 0; t < kItems; ++t)
    if ((valid >> t & 1u) && int((key[t] - kmin) >> shift) == pick) cand[CacheSlot(atomicAdd(&sh.n_cand, 1))] = key[t];
  __syncthreads();
  RowPolicy cr{};
  cr.n = sh.n_cand;
  cr.k = sh.pick_rank;
  uint32_t kth = 0;
  int ties = 0, equal = 0;
  RadixKth(Keys{nullptr, cand}, cr, sh, &kth, &ties, &equal);
  // Emit: fixed pages and keys above the k-th; keys equal to it while their
  // rank among equals (index order) is below `ties`.
  uint32_t taken = fixed, eqm = 0;
#pragma unroll
  for (int t = 0; t < kItems; ++t)
    if (valid >> t & 1u) {
      if (key[t] > kth) taken |= 1u << t;
      else if (key[t] == kth) eqm |= 1u << t;
    }
  if (ties == equal) {
    taken |= eqm;
  } else {
    int e_rank;
    BlockScan(sh.scan).ExclusiveSum(__popc(eqm), e_rank);
    __syncthreads();
#pragma unroll
    for (int t = 0; t < kItems; ++t)
      if (eqm >> t & 1u) {
        if (e_rank < ties) taken |= 1u << t;
        ++e_rank;
      }
  }
  int pos, total;
  BlockScan(sh.scan).ExclusiveSum(__popc(taken), pos, total);
#pragma unroll
  for (int t = 0; t < kItems; ++t)
    if (taken >> t & 1u) emit(i0 + t, pos++);
  return total;
}

// kCachedMaxMean: only rows whose keys fit the shared cache, kMax/kMean
// (the common short-row case, compiled alone: a smaller kernel misses the
// instruction cache less).
template <bool kCachedMaxMean>
__global__ void __launch_bounds__(kTopKThreads, 1) TopKKernel(SelectParams p, int key_cache, float* scores,
                                                            uint8_t* marks) {
  ChainWait();
  ChainRelease();
  extern __shared__ uint32_t cache[];
  __shared__ TopKShared sh;
  __shared__ uint32_t cand[kCandCap + kCandCap / 32 + 1];  // RangeKth's
  const SelectShape& s = p.shape;
  const int row = blockIdx.x;
  const int b = row / s.kv_heads;
  const int h = row % s.kv_heads;
  const int first = p.page_indptr[b];
  const RowPolicy r = PolicyFor(s, p.page_indptr[b + 1] - first);
  const int out0 = p.out_indptr[row];
  const uint32_t* ids = p.page_ids + first;
  auto emit = [&](int i, int pos) { p.out_pages[out0 + pos] = i; };
  int count;
  if (r.all) {
    for (int i = threadIdx.x; i < r.n; i += blockDim.x) emit(i, i);
    count = r.n;
  } else if (r.k == 0) {
    count = OrderedPassAll(r.n, sh, [&](int i) { return Skipped(r, i); }, emit);
  } else {
    const int A = kCachedMaxMean ? 1 : ScoredHeads(s);
    const bool cached = kCachedMaxMean || r.n <= key_cache;
    uint8_t* mark = marks ? marks + (std::size_t)first * s.kv_heads + (std::size_t)h * r.n : nullptr;
    uint32_t kth = 0;
    int ties = 0, equal = 0;
    // SelectShortRow past kShortRowMin keys; shorter rows are faster through
    // RadixKth alone (H200, select, same binary: with the threshold at 512,
    // Llama-2-7B at 768 keys a row b1 20.7 -> 22.0 us, b16 108 -> 112; at
    // 1024, against 2048, 2048 keys a row Llama-3-8B b1 23.2 -> 21.1 us and
    // Llama-2-7B b16 212 -> 205.6, RadixKth's four levels alone having taken
    // 5.7 us there; bench/results/2026-12-03-gpu-batch1-select-ablation.md).
    const bool short_row = kCachedMaxMean && r.n > kShortRowMin && r.n <= kTopKThreads * kItems;
    for (int a = 0; a < (short_row ? 0 : A); ++a) {
      const float* row_scores = scores + (std::size_t)first * s.kv_heads * A + ((std::size_t)h * A + a) * r.n;
      bool decided = false;
      if (cached) {
        // Long rows: their key range too, for RangeKth.
        const bool ranged = r.n > kShortRowMin;
        if (threadIdx.x == 0) sh.kmax = 0, sh.kmin_inv = 0;
        __syncthreads();
        uint32_t kx = 0, kn = 0;
        for (int i = threadIdx.x; i < r.n; i += blockDim.x) {
          const uint32_t key = Key(row_scores[i]);
          cache[CacheSlot(i)] = key;
          if (!Skipped(r, i)) kx = max(kx, key), kn = max(kn, ~key);
        }
        if (ranged) {
          kx = __reduce_max_sync(0xFFFFFFFFu, kx);
          kn = __reduce_max_sync(0xFFFFFFFFu, kn);
          if ((threadIdx.x & 31) == 0) atomicMax(&sh.kmax, kx), atomicMax(&sh.kmin_inv, kn);
        }
        __syncthreads();
        if (ranged)
          decided = RangeKth(cache, r, ~sh.kmin_inv, sh.kmax - ~sh.kmin_inv, sh, cand, &kth, &ties, &equal);
      }
      const Keys keys{row_scores, cached ? cache : nullptr};
      if (!decided) RadixKth(keys, r, sh, &kth, &ties, &equal);
      if (A > 1) {
        // kUnion: mark this query head's winners, then emit the union below.
        auto eq = [&](int i) { return !Skipped(r, i) && keys(i) == kth; };
        auto wins = [&](int i, int eq_rank) {
          if (Skipped(r, i)) return a == 0;  // sink/local marked once
          const uint32_t key = keys(i);
          return key > kth || (key == kth && eq_rank < ties);
        };
        auto set = [&](int i, int) { mark[i] = 1; };
        if (ties == equal) OrderedPassAll(r.n, sh, [&](int i) { return wins(i, 0); }, set);
        else OrderedPass(r.n, sh, eq, wins, set);
        // (mark is only ever set, never cleared, within this row.)
      }
      __syncthreads();
    }
    if (short_row) {
      const float* row_scores = scores + (std::size_t)first * s.kv_heads + (std::size_t)h * r.n;
      count = SelectShortRow([&](int i) { return Key(__ldg(row_scores + i)); }, r, cache, sh, emit);
    } else if (A == 1) {
      const float* row_scores = scores + (std::size_t)first * s.kv_heads + (std::size_t)h * r.n;
      const Keys keys{row_scores, cached ? cache : nullptr};
      auto eq = [&](int i) { return !Skipped(r, i) && keys(i) == kth; };
      auto take = [&](int i, int eq_rank) {
        if (Skipped(r, i)) return true;
        const uint32_t key = keys(i);
        return key > kth || (key == kth && eq_rank < ties);
      };
      count = ties == equal ? OrderedPassAll(r.n, sh, [&](int i) { return take(i, 0); }, emit)
                            : OrderedPass(r.n, sh, eq, take, emit);
    } else {
      __syncthreads();
      count = OrderedPassAll(r.n, sh, [&](int i) { return mark[i] != 0; }, emit);
    }
  }
  __syncthreads();  // out_pages written
  EmitSlots(p, ids, h, out0, count);
  if (threadIdx.x == 0) p.out_count[row] = count;
}

// Long rows (kMax/kMean, rows of more than kLongRowMin keys in the batch):
// many blocks a row throughout, never one block over a whole row (H200,
// Llama-3-8B b1 1M: one block a row gathering its bin's keys took 27 us of
// the select, under ncu's clocks; the ordered emit in one block a row took
// ~50-65 us on rows of 32K-64K keys). Grid (chunks of kEmitChunk keys,
// rows); a block holds its chunk's keys in registers, kEmitItems consecutive
// ones a thread, through three phases, each ending in a row-wide step taken
// by the row's last block to finish the phase:
//  1. HistChunk: the chunk's scored keys into the row's kBins-bin histogram
//     over the score kernel's key range [kmin, kmax]; the last block finds
//     the bin holding the k-th largest key and the key's rank in it (PickBin).
//  2. BinChunk: the chunk's winners other than the keys in that bin (sink
//     and local pages, keys in higher bins) counted, the bin's keys appended
//     to the row's candidates; the last block radix-selects the k-th key
//     among them and adds each candidate to its chunk's count of keys above
//     or equal to the k-th (BinFinish).
//  3. EmitChunk: the chunks before this one added up (equal keys win in
//     index order while their rank is below `ties`), the chunk emitted in
//     order.
// When the whole grid is resident at once, LongRowKernel runs the three in
// one launch, a row's blocks waiting at each row-wide step for the flag its
// last block sets; otherwise HistKernel, BinSelectKernel and EmitKernel run
// them one launch each. One launch against three, same binary (H200, select,
// bench/results/2026-12-03-gpu-long-row-topk-one-launch.md): Llama-3-8B b1 512K 83.8 ->
// 77.6 us, b1 1M 125.9 -> 118.8; Llama-2-7B b1 512K 200.1 -> 190.4 (Llama-2-7B
// b1 1M, 512 blocks, and batch 16 do not fit one wave: the same path both
// ways). Against the three earlier kernels (a histogram pass, then the bin
// select's and the emit's, each loading the row's scores again), both
// changes: Llama-3-8B b1 512K 83.7 -> 76.3, 1M 124.2 -> 117.5; Llama-2-7B b1
// 512K 202.9 -> 193.9, 1M 368.9 -> 360.7.
// Rows of 4K-16K keys stay with the one-block top-K, faster there (b1 128K
// 32.3 against 45.9 us through these phases).
using EmitScan = cub::BlockScan<int, kEmitThreads>;
using EmitReduce = cub::BlockReduce<int, kEmitThreads>;

struct EmitRow {
  RowPolicy r;
  const float* scores;  // the row's
  int out0;
};
__device__ __forceinline__ EmitRow EmitRowOf(const SelectParams& p, const float* scores, int row) {
  const SelectShape& s = p.shape;
  const int b = row / s.kv_heads, h = row % s.kv_heads;
  const int first = p.page_indptr[b];
  EmitRow e;
  e.r = PolicyFor(s, p.page_indptr[b + 1] - first);
  e.scores = scores + (std::size_t)first * s.kv_heads + (std::size_t)h * e.r.n;
  e.out0 = p.out_indptr[row];
  return e;
}

struct LongShared {
  TopKShared sh;  // sh.bins: the chunk's histogram, then RadixKth's
  uint32_t keys[kBinCap + kBinCap / 32 + 1];  // the row's candidates (its last block)
  union {
    typename EmitScan::TempStorage scan;
    typename EmitReduce::TempStorage red;
  };
  int2 pick;
  int base_out, base_eq, total_out;
  bool last;
};

// A block's chunk: thread t's kEmitItems consecutive keys from c0 + t *
// kEmitItems, with bit masks of the scored ones and of the sink and local
// pages (a row choosing every page has no scores: what is read there is
// never used). 16-byte loads when the row's scores are aligned for them
// (H200, select, same call: Llama-2-7B b1 1M 370.6 -> 360.7 us, Llama-3-8B
// b1 512K 78.8 -> 76.3; bench/results/2026-12-03-gpu-long-row-topk-one-launch.md).
struct ChunkKeys {
  uint32_t key[kEmitItems];
  uint32_t valid, fixed;
};
__device__ __forceinline__ ChunkKeys LoadChunk(const EmitRow& e, int c0) {
  const int i0 = c0 + int(threadIdx.x) * kEmitItems;
  const float* src = e.scores + i0;
  float x[kEmitItems];
  if (i0 + kEmitItems <= e.r.n && (reinterpret_cast<std::uintptr_t>(src) & 15) == 0) {
#pragma unroll
    for (int v = 0; v < kEmitItems / 4; ++v) {
      const float4 f = __ldg(reinterpret_cast<const float4*>(src) + v);
      x[4 * v] = f.x, x[4 * v + 1] = f.y, x[4 * v + 2] = f.z, x[4 * v + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int t = 0; t < kEmitItems; ++t) x[t] = i0 + t < e.r.n ? __ldg(src + t) : 0.f;
  }
  ChunkKeys ck;
  ck.valid = ck.fixed = 0;
#pragma unroll
  for (int t = 0; t < kEmitItems; ++t) {
    const int i = i0 + t;
    ck.key[t] = 0;
    if (i >= e.r.n) continue;
    if (e.r.all || Skipped(e.r, i)) ck.fixed |= 1u << t;
    else ck.key[t] = Key(x[t]), ck.valid |= 1u << t;
  }
  return ck;
}

__device__ __forceinline__ int ChunksOf(int n) { return (n + kEmitChunk - 1) / kEmitChunk; }

// Every thread's writes fenced, then one ticket on `counter`: true in the
// row's last block to arrive (block-uniform).
__device__ bool LastOfRow(uint32_t* counter, int n, LongShared& ls) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) ls.last = atomicAdd(counter, 1u) == unsigned(ChunksOf(n)) - 1;
  __syncthreads();
  if (!ls.last) return false;
  __threadfence();
  return true;
}

// LongRowKernel's row-wide steps: the last block sets the flag once its
// results are written (Publish, one thread); the others wait for it.
__device__ __forceinline__ void Publish(uint32_t* flag) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flag), "r"(1u) : "memory");
}
__device__ void AwaitFlag(const uint32_t* flag) {
  if (threadIdx.x == 0) {
    uint32_t v = 0;
    for (;;) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
      if (v) break;
      __nanosleep(32);
    }
  }
  __syncthreads();
}

// Phase 1 (rows with a k-th key to find): true in the row's last block.
__device__ bool HistChunk(const ChunkKeys& ck, const RowPolicy& r, uint32_t kmin, int shift, uint32_t* gh,
                          RowState& rs, LongShared& ls) {
  for (int i = threadIdx.x; i < kBins; i += kEmitThreads) ls.sh.bins[i] = 0;
  __syncthreads();
#pragma unroll
  for (int t = 0; t < kEmitItems; ++t)
    if (ck.valid >> t & 1u) atomicAdd(&ls.sh.bins[(ck.key[t] - kmin) >> shift], 1u);
  __syncthreads();
  for (int i = threadIdx.x; i < kBins; i += kEmitThreads)
    if (ls.sh.bins[i]) atomicAdd(gh + i, ls.sh.bins[i]);
  return LastOfRow(&rs.done, r.n, ls);
}

// The row's last block after phase 1: (bin of the k-th largest key, the
// key's rank in it), from the row's histogram.
__device__ int2 PickBin(const uint32_t* gh, int k, LongShared& ls) {
  constexpr int kPer = kBins / kEmitThreads;  // thread t: bins top, top-1, .., from the highest
  const int top = kBins - 1 - int(threadIdx.x) * kPer;
  int cnt[kPer], sum = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) sum += cnt[j] = int(__ldcg(gh + top - j));
  int incl;
  EmitScan(ls.scan).InclusiveSum(sum, incl);
  const int before = incl - sum;
  if (before < k && k <= incl) {
    int rr = k - before, j = 0;
    while (cnt[j] < rr) rr -= cnt[j++];
    ls.pick = make_int2(top - j, rr);
  }
  __syncthreads();
  return ls.pick;
}

// The bin-select inputs of a row: its key range's shift and whether the
// k-th key's bin fits the candidate list.
struct BinOf {
  int2 pick;  // (bin, rank in it)
  uint32_t kmin;
  int shift;
  bool gather;
};

// Phase 2: counts[c] = (winners other than the bin's keys, 0), the bin's keys
// appended to the row's candidates `rc`; true in the row's last block.
__device__ bool BinChunk(const ChunkKeys& ck, const RowPolicy& r, const BinOf& bo, int c0, int2* rc,
                         int2* chunk_counts, RowState& rs, LongShared& ls) {
  int above = __popc(ck.fixed);
  if (!r.all && r.k > 0) {
    const int i0 = c0 + int(threadIdx.x) * kEmitItems;
#pragma unroll
    for (int t = 0; t < kEmitItems; ++t) {
      if (!(ck.valid >> t & 1u)) continue;
      const int bin = int((ck.key[t] - bo.kmin) >> bo.shift);
      if (bin > bo.pick.x) ++above;
      else if (bin == bo.pick.x && bo.gather) rc[atomicAdd(&rs.n_cand, 1u)] = make_int2(int(ck.key[t]), i0 + t);
    }
  }
  const int a = EmitReduce(ls.red).Sum(above);
  if (threadIdx.x == 0) chunk_counts[blockIdx.x] = make_int2(a, 0);
  return LastOfRow(&rs.bin_done, r.n, ls);
}

// The row's last block after phase 2: (k-th key, ties that win, keys equal,
// 1), each candidate added to its chunk's count of keys above (x) or equal
// to (y) the k-th. Rows choosing every page, or only sink and local pages,
// need no k-th key: every key is above 0 or equal to it and all equal ones
// win; none is above or equal to 2^32 - 1 (Key never gives it).
__device__ int4 BinFinish(const EmitRow& e, const BinOf& bo, const int2* rc, RowState& rs, int2* chunk_counts,
                          LongShared& ls) {
  const RowPolicy& r = e.r;
  if (r.all) return make_int4(0, INT_MAX, 0, 1);
  if (r.k == 0) return make_int4(-1, 0, 0, 1);
  uint32_t kth = 0;
  int ties = 0, equal = 0;
  if (bo.gather) {
    const int c = int(__ldcg(&rs.n_cand));
    for (int j = threadIdx.x; j < c; j += kEmitThreads) ls.keys[CacheSlot(j)] = uint32_t(__ldcg(&rc[j].x));
    __syncthreads();
    RowPolicy cr{};
    cr.n = c;
    cr.k = bo.pick.y;
    RadixKth(Keys{nullptr, ls.keys}, cr, ls.sh, &kth, &ties, &equal);
    for (int j = threadIdx.x; j < c; j += kEmitThreads) {
      const uint32_t key = ls.keys[CacheSlot(j)];
      int* at = &chunk_counts[__ldcg(&rc[j].y) / kEmitChunk].x;
      if (key > kth) atomicAdd(at, 1);
      else if (key == kth) atomicAdd(at + 1, 1);
    }
  } else {  // many equal scores: the whole row's keys, from the scores
    RadixKth(Keys{e.scores, nullptr}, r, ls.sh, &kth, &ties, &equal);
    for (int i = threadIdx.x; i < r.n; i += kEmitThreads) {
      if (Skipped(r, i)) continue;
      const uint32_t key = Key(__ldcg(e.scores + i));
      if (int((key - bo.kmin) >> bo.shift) != bo.pick.x) continue;
      int* at = &chunk_counts[i / kEmitChunk].x;
      if (key > kth) atomicAdd(at, 1);
      else if (key == kth) atomicAdd(at + 1, 1);
    }
  }
  __threadfence();  // the counts, before the row's flag (LongRowKernel)
  return make_int4(int(kth), ties, equal, 1);
}

// Phase 3: the chunk's winners in order at their places in the row's output.
__device__ void EmitChunk(const SelectParams& p, const EmitRow& e, int row, const ChunkKeys& ck, int4 rk,
                          const int2* chunk_counts, int c0, LongShared& ls) {
  const int last_chunk = ChunksOf(e.r.n) - 1;
  const uint32_t kth = uint32_t(rk.x);
  const int ties = rk.y;
  if (threadIdx.x == 0) {
    int out = 0, eq = 0, eq_run = 0, all = 0;
    for (int c = 0; c <= last_chunk; ++c) {
      const int2 v = __ldcg(chunk_counts + c);
      const int won = v.x + min(max(ties - eq_run, 0), v.y);
      if (c < int(blockIdx.x)) out += won, eq += v.y;
      eq_run += v.y;
      all += won;
    }
    ls.base_out = out;
    ls.base_eq = eq;
    ls.total_out = all;
  }
  __syncthreads();
  uint32_t above = 0, eqm = 0;
#pragma unroll
  for (int t = 0; t < kEmitItems; ++t)
    if (ck.valid >> t & 1u) {
      if (ck.key[t] > kth) above |= 1u << t;
      else if (ck.key[t] == kth) eqm |= 1u << t;
    }
  uint32_t taken = ck.fixed | above;
  if (ties >= rk.z) {
    taken |= eqm;
  } else {
    int e_rank;
    EmitScan(ls.scan).ExclusiveSum(__popc(eqm), e_rank);
    __syncthreads();
    e_rank += ls.base_eq;
#pragma unroll
    for (int t = 0; t < kEmitItems; ++t)
      if (eqm >> t & 1u) {
        if (e_rank < ties) taken |= 1u << t;
        ++e_rank;
      }
  }
  int pos;
  EmitScan(ls.scan).ExclusiveSum(__popc(taken), pos);
  pos += ls.base_out;
  const SelectShape& s = p.shape;
  const int b = row / s.kv_heads, h = row % s.kv_heads;
  const uint32_t* ids = p.page_ids + p.page_indptr[b];
  const int i0 = c0 + int(threadIdx.x) * kEmitItems;
#pragma unroll
  for (int t = 0; t < kEmitItems; ++t)
    if (taken >> t & 1u) {
      const int i = i0 + t;
      p.out_pages[e.out0 + pos] = i;
      if (p.out_slots) p.out_slots[e.out0 + pos] = p.hbm_slot[(std::size_t)ids[i] * s.kv_heads + h];
      ++pos;
    }
  if (int(blockIdx.x) == last_chunk && threadIdx.x == 0) p.out_count[row] = ls.total_out;
}

__device__ __forceinline__ BinOf BinOfRow(const RowState& rs, int2 pick, const uint32_t* gh, int cand_cap) {
  BinOf bo;
  bo.pick = pick;
  bo.kmin = ~rs.kmin_inv;
  bo.shift = RangeShift(rs.kmax - bo.kmin);
  bo.gather = int(__ldcg(gh + pick.x)) <= cand_cap;
  return bo;
}

// Phases kFrom..kTo of the long rows' top-K in one launch: all three
// (LongRowKernel, the whole grid resident: LaunchSelect checks), a row's
// blocks waiting at each row-wide step for its flag; or one (HistKernel,
// BinSelectKernel, EmitKernel), the launch before having finished the step.
template <int kFrom, int kTo>
__global__ void __launch_bounds__(kEmitThreads) LongRowPhases(SelectParams p, const float* scores, LongRows lr) {
  ChainWait();
  ChainRelease();
  __shared__ LongShared ls;
  const int row = blockIdx.y;
  const EmitRow e = EmitRowOf(p, scores, row);
  const int c0 = blockIdx.x * kEmitChunk;
  const bool select = !e.r.all && e.r.k > 0;  // a k-th key to find
  if (c0 >= e.r.n || (kTo == 1 && !select)) return;
  int4 rk{};
  if constexpr (kFrom == 3) {
    rk = __ldcg(lr.row_kth + row);
    if (rk.w != 1) return;
  }
  const ChunkKeys ck = LoadChunk(e, c0);
  int2* chunk_counts = lr.counts + (std::size_t)row * gridDim.x;
  if constexpr (kFrom <= 2) {
    RowState& rs = lr.st[row];
    uint32_t* gh = lr.ghist + (std::size_t)row * kBins;
    BinOf bo{};
    if (select) {
      int2 pk;
      if constexpr (kFrom == 1) {
        const uint32_t kmin = ~rs.kmin_inv;
        const bool last = HistChunk(ck, e.r, kmin, RangeShift(rs.kmax - kmin), gh, rs, ls);
        if (last) {
          pk = PickBin(gh, e.r.k, ls);
          if (threadIdx.x == 0) {
            lr.pick[row] = pk;
            if (kTo > 1) Publish(&rs.hist_ready);
          }
        }
        if constexpr (kTo == 1) return;
        if (!last) {
          AwaitFlag(&rs.hist_ready);
          pk = __ldcg(lr.pick + row);
        }
      } else {
        pk = __ldcg(lr.pick + row);
      }
      bo = BinOfRow(rs, pk, gh, lr.cand_cap);
    }
    int2* rc = lr.cand + (std::size_t)row * lr.cand_cap;
    const bool last = BinChunk(ck, e.r, bo, c0, rc, chunk_counts, rs, ls);
    if (last) {
      rk = BinFinish(e, bo, rc, rs, chunk_counts, ls);
      __syncthreads();  // every count added
      if (threadIdx.x == 0) {
        lr.row_kth[row] = rk;
        if (kTo > 2) Publish(&rs.kth_ready);
      }
    }
    if constexpr (kTo == 2) return;
    if (!last) {
      AwaitFlag(&rs.kth_ready);
      rk = __ldcg(lr.row_kth + row);
    }
  }
  EmitChunk(p, e, row, ck, rk, chunk_counts, c0, ls);
}
constexpr auto LongRowKernel = LongRowPhases<1, 3>;
constexpr auto HistKernel = LongRowPhases<1, 1>;
constexpr auto BinSelectKernel = LongRowPhases<2, 2>;
constexpr auto EmitKernel = LongRowPhases<3, 3>;

// kUnion's marks start cleared; one byte per (page, KV head).
__global__ void ClearMarks(uint8_t* marks, const int32_t* page_indptr, int batch, int kv_heads) {
  const long long n = (long long)page_indptr[batch] * kv_heads;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    marks[i] = 0;
}

// Blocks of kKernel (kThreads threads, static shared memory only) that the
// current device holds at once: its occupancy a multiprocessor times the
// device's own multiprocessor count (not the caller's num_sms: a grid sized
// by a wrong count must not be taken for resident). Once per device; 0 when
// a query fails.
template <auto kKernel, int kThreads>
long long ResidentBlocks() {
  constexpr int kMaxDevices = 64;
  static std::once_flag once[kMaxDevices];
  static long long blocks[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev >= kMaxDevices) {
    (void)cudaGetLastError();
    return 0;
  }
  std::call_once(once[dev], [dev] {
    int per_sm = 0, sms = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kThreads, 0) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      per_sm = sms = 0;
    }
    blocks[dev] = (long long)per_sm * sms;
  });
  return blocks[dev];
}

// The top-K kernels' largest key cache (beside their ~19 KiB of static shared memory).
template <auto kKernel>
cudaError_t AllowKeyCache() {
  return AllowDynamicSmem<kKernel, int((kMaxKeyCache + kMaxKeyCache / 32 + 1) * sizeof(uint32_t))>();
}

}  // namespace

cudaError_t LaunchClearMarks(const SelectPlan& plan, const SelectParams& p, uint8_t* marks, cudaStream_t stream) {
  const SelectShape& s = p.shape;
  ClearMarks<<<plan.score_blocks, 256, 0, stream>>>(marks, p.page_indptr, s.batch, s.kv_heads);
  return cudaGetLastError();
}

cudaError_t LaunchLongRows(const SelectPlan& plan, const SelectParams& p, const float* scores, const LongRows& lr,
                           cudaStream_t stream) {
  const SelectShape& s = p.shape;
  const int rows = s.batch * s.kv_heads;
  const int chunks = (plan.max_pages + kEmitChunk - 1) / kEmitChunk;
  const dim3 grid(chunks, rows);
  // One launch when every block of the grid is resident at once: a row's
  // blocks wait for each other at its row-wide steps, so none may wait for
  // a block that cannot start.
  if (!plan.split_long_rows && (long long)chunks * rows <= ResidentBlocks<LongRowKernel, kEmitThreads>()) {
    if (const cudaError_t e =
            LaunchChained(LongRowKernel, grid, dim3(kEmitThreads), 0, stream, s.chain, p, scores, lr);
        e != cudaSuccess)
      return e;
    return cudaGetLastError();
  }
  for (auto kernel : {HistKernel, BinSelectKernel, EmitKernel})
    if (const cudaError_t e = LaunchChained(kernel, grid, dim3(kEmitThreads), 0, stream, s.chain, p, scores, lr);
        e != cudaSuccess)
      return e;
  return cudaGetLastError();
}

cudaError_t LaunchTopK(const SelectPlan& plan, const SelectParams& p, float* scores, uint8_t* marks,
                       cudaStream_t stream) {
  const SelectShape& s = p.shape;
  const int rows = s.batch * s.kv_heads;
  const bool unioned = ScoredHeads(s) > 1;
  const std::size_t smem = std::size_t(s.dense ? 0 : plan.key_cache + plan.key_cache / 32 + 1) * sizeof(uint32_t);
  const bool common = !s.dense && !unioned && plan.max_pages <= plan.key_cache;
  auto kernel = common ? TopKKernel<true> : TopKKernel<false>;
  for (const cudaError_t e : {AllowKeyCache<TopKKernel<true>>(), AllowKeyCache<TopKKernel<false>>()})
    if (e != cudaSuccess) return e;
  if (const cudaError_t e = LaunchChained(kernel, dim3(rows), dim3(kTopKThreads), smem, stream, s.chain, p,
                                          s.dense ? 0 : plan.key_cache, scores, marks);
      e != cudaSuccess)
    return e;
  return cudaGetLastError();
}

}  // namespace questkv::kernels::cuda
