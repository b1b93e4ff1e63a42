// Select on the device:
//  1. ScoreKernel: U_p(q) for every (page, KV head) of every scored sequence,
//     one thread per head-page keeping 8 partial sums (dimensions j ≡ l mod 8)
//     added pairwise at the end: the CPU twin's (score_cpu.cc) float
//     arithmetic and summation order, so scores match it bit for bit. G <= 2,
//     or 256K+ head-pages: each warp copies its 32 head-pages' summaries into its own
//     double-buffered shared tile with cp.async (coalesced 16-byte pieces);
//     smaller selects with G >= 4 (ScoreKernelDirect): each thread reads its
//     own summary, the arithmetic per byte hiding the scattered loads.
//     ScoreKernelLanes replaces both for G = 4, D = 128 (Llama-3-8B): eight
//     lanes per head-page, one partial sum each, the query in registers, fed
//     from a per-warp cp.async ring.
//     The G query heads of a group share each summary read; kMax/kMean
//     aggregate in place (std::max / sequential sum then divide, as select.cc
//     does) and fold each row's key range (min, max) with atomics.
//     E4M3 summaries (all three kernels; D = 64 reads directly, its summary
//     being shorter than the staged tile's 128-dimension phase) decode with
//     the hardware conversion, NaN for the ±inf codes, and a query head's NaN
//     score becomes +inf before anything else sees it: ScorePagesCpu's e4m3
//     rule.
//  2. Batches with a row of more than kLongRowMin keys (kMax/kMean), many
//     blocks per (sequence, KV head) row throughout, in three phases: a
//     histogram of each row's keys over [min, max] in global memory, the
//     row's last block finding the bin that holds the k-th largest key; each
//     chunk's winners above that bin counted and the bin's keys gathered, the
//     row's last block radix-selecting the k-th key among them (four 8-bit
//     digits) and how many keys equal to it win; then sink ∪ local ∪ winners
//     emitted ascending, chunk by chunk, keys equal to the k-th winning in
//     index order. LongRowKernel runs the phases in one launch when its grid
//     is resident at once, HistKernel, BinSelectKernel and EmitKernel
//     otherwise.
//  3. Other batches, TopKKernel: one block per row finds the k-th key the
//     same way over the row's keys held in its shared key cache (a range
//     histogram, then the bin's keys) or by the radix select alone when
//     short, and emits the row in one ordered pass. kUnion selects per query
//     head over the whole row and ORs the winners into a byte mask first.
//  FusedSelectKernel (kMax/kMean, G <= 4, rows of <= 2048 pages, <= 8192
//  head-pages in all, all rows' clusters in one wave): 1 and 3 in one
//  launch, a cluster of 8 blocks per row scoring into the first block's
//  shared key cache, which then selects and emits.
#include <cooperative_groups.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/kernels_cuda.h"

namespace questkv::kernels::cuda {
namespace {

// The top-K and fused select blocks. A row's top-K is one block whose warps
// each run a chain of dependent phases, ~1500 instructions at ~17 cycles
// apiece (ncu, 512 threads x 16 keys); 1024 threads x 8 keys halve each
// warp's unrolled key loops (H200, select + attend, same call: Llama-3-8B
// b1 128K 50.7 -> 45.9 us, b1 256K 68.7 -> 63.6, b16 128K 222.9 -> 218.3;
// Llama-2-7B b1 128K 85.6 -> 80.3; b1 8K, fused, 26.1 -> 26.7;
// bench/results/2026-12-02-gpu-session-16.md). Cutting barriers and
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

// Keys in [kmin, kmin + span] fall in bins of 2^shift keys from kmin, at most
// kBins of them: bin = (key - kmin) >> shift, monotone in the key. (A shift,
// not a 64-bit division: that cost ~40 us per 64K keys in one block.)
__device__ __forceinline__ int RangeShift(uint32_t span) { return max(0, 32 - __clz(int(span)) - 11); }

template <typename T>
__device__ __forceinline__ void Smem8(const unsigned char* row, int first_piece, float* out) {
#pragma unroll
  for (int v = 0; v < 8 / kVec16<T>; ++v)
    Unpack16<T>(*reinterpret_cast<const uint4*>(row + (first_piece + v) * 16), out + v * kVec16<T>);
}

// The first (upper false) or second 8 bytes of a 16-byte piece.
__device__ __forceinline__ uint2 HalfPiece(const uint4& piece, bool upper) {
  return upper ? make_uint2(piece.z, piece.w) : make_uint2(piece.x, piece.y);
}

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

// Folds each lane's scored key into its row's key range: per distinct row of
// the warp, a warp max of key and of ~key, then one atomic each. The whole
// warp must call it.
__device__ __forceinline__ void FoldKeyRange(RowState* st, bool todo, int row, uint32_t key) {
  const int lane = threadIdx.x & 31;
  unsigned pending = __ballot_sync(0xFFFFFFFFu, todo);
  while (pending) {
    const int leader = __ffs(pending) - 1;
    const int lr = __shfl_sync(0xFFFFFFFFu, row, leader);
    const bool mine = todo && row == lr;
    const uint32_t kx = __reduce_max_sync(0xFFFFFFFFu, mine ? key : 0u);
    const uint32_t kn = __reduce_max_sync(0xFFFFFFFFu, mine ? ~key : 0u);
    if (lane == leader) {
      atomicMax(&st[lr].kmax, kx);
      atomicMax(&st[lr].kmin_inv, kn);
    }
    todo = todo && !mine;
    pending = __ballot_sync(0xFFFFFFFFu, todo);
  }
}

// kMax / kMean over a group's G scores, as select.cc aggregates them
// (std::max in order; a sequential sum, then a division).
template <int G>
__device__ __forceinline__ float Aggregate(GqaAgg gqa, const float* score) {
  float agg = score[0];
  if (gqa == GqaAgg::kMax) {
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

// Writes a head-page's scores (kUnion: per query head; else aggregated) and
// returns the aggregate.
template <int G>
__device__ __forceinline__ float StoreScores(const SelectShape& s, float* scores, long long item, int first, int n,
                                             int h, int i, const float* score) {
  if (s.gqa == GqaAgg::kUnion) {
    float* out = scores + (std::size_t)first * s.kv_heads * G + (std::size_t)h * G * n;
#pragma unroll
    for (int g = 0; g < G; ++g) out[(std::size_t)g * n + i] = score[g];
    return score[0];
  }
  const float agg = Aggregate<G>(s.gqa, score);
  scores[item] = agg;
  return agg;
}

// The score kernel's warp-private tiles: per phase, 8 pieces of 16 bytes of
// a head-page's min and the same 8 of its max (kPhaseDims dimensions), for
// the warp's 32 head-pages; rows padded by 16 bytes (an odd number of pieces
// apart: no bank conflicts when each lane reads its own row).
template <typename SumT>
struct Tile {
  static constexpr int kEP = 16 / sizeof(SumT);  // elements per piece
  static constexpr int kPhaseDims = 8 * kEP;
  static constexpr int kStride = 16 * 16 + 16;   // bytes per head-page row
  static constexpr int kBytes = 32 * kStride;    // one buffer of one warp
};
constexpr int kScoreWarps = 2;        // per block: 2 x 2 buffers x 8.5 KiB, static shared memory
constexpr int kScoreBlocksPerSm = 6;  // as many as an SM's shared memory holds
constexpr std::size_t kStagedMinHeadPages = std::size_t(1) << 18;  // G >= 4: below, ScoreKernelDirect

// The score kernels walk slots. Without kChunked a slot is an item (item =
// page_indptr[b] * Hkv + h * n + i, the kMax/kMean score's offset). With it,
// sequence b owns Hkv * (n + 31) slots from Hkv * (page_indptr[b] + 31 * b);
// inside, its pages go in chunks of 32, and each chunk's Hkv heads one after
// the other, 32 slots (a warp) per (chunk, head): a warp scores 32
// consecutive pages of one KV head (one query, broadcast) and the warps beside
// it the other heads of the same pages, so that together they read whole
// [Hkv][2][D] summaries instead of pieces Hkv * 2 * D elements apart. Slots
// past a row's last chunk are idle. Measured on the H200 (bench/results/
// 2026-11-29-gpu-session-5.md): 5% faster for Llama-2-7B (G = 1) at batch 1
// and 512K-1M tokens, 5-8% slower for Llama-3-8B (G = 4) at batch 16; the
// staged kernel chunks for G <= 2 only.
template <bool kChunked>
__host__ __device__ inline long long ScoreSlots(long long pages_before, int b, int kv_heads) {
  return (long long)kv_heads * (pages_before + (kChunked ? 31LL * b : 0LL));
}

// What slot `slot` scores: off = its summary's first element, -1 when there
// is nothing to score (an idle slot, or a row choosing every page).
struct ItemRef {
  long long off = -1, item = -1;
  int b = 0, first = 0, n = 1, h = 0, i = 0;
  bool valid = false;
};
template <bool kChunked>
__device__ __forceinline__ ItemRef Locate(const SelectParams& p, long long slot, long long slots, int D) {
  const SelectShape& s = p.shape;
  const int H = s.kv_heads;
  ItemRef r;
  if (slot >= slots) return r;
  int hi_b = s.batch;
  while (hi_b - r.b > 1) {
    const int mid = (r.b + hi_b) / 2;
    if (ScoreSlots<kChunked>(p.page_indptr[mid], mid, H) <= slot) r.b = mid; else hi_b = mid;
  }
  r.first = p.page_indptr[r.b];
  r.n = p.page_indptr[r.b + 1] - r.first;
  const long long local = slot - ScoreSlots<kChunked>(r.first, r.b, H);
  if constexpr (kChunked) {
    const long long chunk = local / (32LL * H);
    const int in_chunk = int(local - chunk * 32 * H);
    r.h = in_chunk >> 5;
    r.i = int(chunk * 32) + (in_chunk & 31);
    if (r.i >= r.n) {  // idle
      r.i = 0;
      return r;
    }
  } else {
    r.h = int(local / r.n);
    r.i = int(local % r.n);
  }
  r.valid = !PolicyFor(s, r.n).all;
  r.item = (long long)r.first * H + (long long)r.h * r.n + r.i;
  if (r.valid) r.off = ((long long)p.page_ids[r.first + r.i] * H + r.h) * 2 * D;
  return r;
}

// ScoreKernel (G <= 2, or many head-pages): U_p(q) of every head-page, one lane per head-page, each warp
// taking 32 slots (ScoreSlots) at a time. The summaries come through the
// warp's own double-buffered tile: cp.async copies of the next phase (this
// group's, or the next group's first) are in flight while the lanes score
// the current one, and each copy instruction reads two head-pages' 256
// contiguous bytes (one thread per head-page reading its own 16 bytes at a
// time touched 32 lines per load: 40% of DRAM bandwidth on the H200). The
// lane walks its summary in chunks of 8 dimensions, exactly one element of
// each of the CPU's 8 partial sums, so acc[g][l] sees ScorePagesCpu's
// additions in its order; the G query heads of a group share each read.
// With `st`, each scored key is also folded into its row's key range. No
// block barrier: a warp's loop is its own.
template <typename QT, typename SumT, int D, int G>
__global__ void __launch_bounds__(kScoreWarps * 32) ScoreKernel(SelectParams p, float* scores, RowState* st) {
  ChainWait();
  ChainRelease();
  using T = Tile<SumT>;
  constexpr int kPhases = D / T::kPhaseDims;
  static_assert(kPhases >= 1 && D % T::kPhaseDims == 0, "whole phases only");
  __shared__ __align__(16) unsigned char tiles[kScoreWarps][2][T::kBytes];
  const int lane = int(threadIdx.x & 31), warp = int(threadIdx.x >> 5);
  const SelectShape& s = p.shape;
  constexpr bool kChunked = G <= 2;
  const long long slots = ScoreSlots<kChunked>(p.page_indptr[s.batch], s.batch, s.kv_heads);
  const long long step = (long long)gridDim.x * kScoreWarps * 32;
  long long base = ((long long)blockIdx.x * kScoreWarps + warp) * 32;
  if (base >= slots) return;  // warp-uniform
  const QT* q_all = static_cast<const QT*>(p.q);
  const SumT* slab = static_cast<const SumT*>(p.summaries);
  // Copies phase ph of the 32 head-pages whose lanes hold `it` into `dst`:
  // lanes 0-15 one head-page's 16 pieces (8 of min, 8 of max), 16-31 the next's.
  auto issue = [&](const ItemRef& it, int ph, unsigned char* dst) {
    const int piece = lane & 15;
    const long long elem = (piece >> 3) * D + ph * T::kPhaseDims + (piece & 7) * T::kEP;
#pragma unroll
    for (int m = 0; m < 16; ++m) {
      const int j = 2 * m + (lane >> 4);
      const long long off = __shfl_sync(0xFFFFFFFFu, it.off, j);
      CopyAsync16(dst + j * T::kStride + piece * 16, slab + (off < 0 ? 0 : off + elem), off >= 0);
    }
    CommitCopies();
  };
  ItemRef cur = Locate<kChunked>(p, base + lane, slots, D), next;
  int nb = 0;  // the buffer being scored
  issue(cur, 0, tiles[warp][0]);
  for (;;) {
    const bool more = base + step < slots;  // warp-uniform
    if (more) next = Locate<kChunked>(p, base + step + lane, slots, D);
    const QT* q = q_all + ((std::size_t)cur.b * s.kv_heads * G + (std::size_t)cur.h * G) * D;
    float acc[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int l = 0; l < 8; ++l) acc[g][l] = 0.f;
#pragma unroll
    for (int ph = 0; ph < kPhases; ++ph) {
      if (ph + 1 < kPhases) issue(cur, ph + 1, tiles[warp][nb ^ 1]);
      else if (more) issue(next, 0, tiles[warp][nb ^ 1]);
      if (ph + 1 < kPhases || more) WaitCopies<1>();
      else WaitCopies<0>();
      __syncwarp();
      if (cur.valid) {
        const unsigned char* row = tiles[warp][nb] + lane * T::kStride;
        // E4M3: the pieces of min and max holding chunks c and c + 1 (c
        // even), each read once: a lane's 16-byte reads of the padded rows
        // are conflict-free, 8-byte ones 2-way.
        [[maybe_unused]] uint4 piece_mn, piece_mx;
#pragma unroll
        for (int c = 0; c < T::kPhaseDims / 8; ++c) {
          float mn[8], mx[8];
          if constexpr (kIsE4m3<SumT>) {
            if (c % 2 == 0) {
              piece_mn = *reinterpret_cast<const uint4*>(row + c * 8);
              piece_mx = *reinterpret_cast<const uint4*>(row + 128 + c * 8);
            }
            UnpackE4m3x8(HalfPiece(piece_mn, c % 2), mn);
            UnpackE4m3x8(HalfPiece(piece_mx, c % 2), mx);
          } else {
            Smem8<SumT>(row, c * (8 / T::kEP), mn);
            Smem8<SumT>(row, 8 + c * (8 / T::kEP), mx);
          }
#pragma unroll
          for (int g = 0; g < G; ++g) {
            float qv[8];
            Load8(q + g * D, ph * (T::kPhaseDims / 8) + c, qv);
            FoldChunk8<kExactProducts<QT, SumT>>(acc[g], qv, mn, mx);
          }
        }
      }
      __syncwarp();  // every lane is done with this buffer before it is refilled
      nb ^= 1;
    }
    float score[G];
#pragma unroll
    for (int g = 0; g < G; ++g) score[g] = FinishScore<SumT>(SumLanes8(acc[g]));
    const float agg = cur.valid ? StoreScores<G>(s, scores, cur.item, cur.first, cur.n, cur.h, cur.i, score) : 0.f;
    if (st) FoldKeyRange(st, cur.valid && !Skipped(PolicyFor(s, cur.n), cur.i), cur.b * s.kv_heads + cur.h, Key(agg));
    if (!more) break;
    base += step;
    cur = next;
  }
}

// Wide groups (G >= 4): one thread per head-page reading its summary
// directly with 16-byte loads (enough arithmetic per byte to hide the
// uncoalesced reads better than the staged kernel, measured).
template <typename QT, typename SumT, int D, int G>
__global__ void __launch_bounds__(256) ScoreKernelDirect(SelectParams p, float* scores, RowState* st) {
  ChainWait();
  ChainRelease();
  const SelectShape& s = p.shape;
  const long long slots = ScoreSlots<false>(p.page_indptr[s.batch], s.batch, s.kv_heads);
  const QT* q_all = static_cast<const QT*>(p.q);
  const SumT* slab = static_cast<const SumT*>(p.summaries);
  for (long long base = blockIdx.x * (long long)blockDim.x + (threadIdx.x & ~31); base < slots;
       base += (long long)gridDim.x * blockDim.x) {
    const ItemRef it = Locate<false>(p, base + (threadIdx.x & 31), slots, D);
    float agg = 0.f;
    if (it.valid) {
      float score[G];
      ScoreHeadPage<QT, SumT, D, G>(slab + it.off, q_all + ((std::size_t)it.b * s.kv_heads * G + (std::size_t)it.h * G) * D,
                                    score);
      agg = StoreScores<G>(s, scores, it.item, it.first, it.n, it.h, it.i, score);
    }
    if (st) FoldKeyRange(st, it.valid && !Skipped(PolicyFor(s, it.n), it.i), it.b * s.kv_heads + it.h, Key(agg));
  }
}

// ScoreKernelLanes (G = 4, D = 128: Llama-3-8B; its D = 64 instances spilled): a
// warp scores `unit` consecutive pages of one (sequence, KV head) row, four
// head-pages at a time, eight lanes each. Lane l of a head-page's eight owns
// ScorePagesCpu's partial sum l (dimensions j ≡ l mod 8, in order), so its
// G * D / 8 query values stay in registers for the whole unit; the eight
// partial sums are then added by three butterfly shuffles (SumGroup8). The summaries come
// through a per-warp ring of kLaneStages shared-memory stages (each the next
// four head-pages, coalesced 16-byte cp.async pieces, rows padded by 16
// bytes: conflict-free 2-byte reads), so a warp's next copies are in flight
// while it scores. Measured on the H200 against the direct and staged
// kernels, same scores bit for bit (bench/results/2026-12-02-gpu-session-11.md):
// Llama-3-8B b16 128K 241 -> 201 us, b16 1M 1830 -> 1494 us, b1 1M 137 -> 104 us.
constexpr int kLaneStages = 2;  // 3 and 4 stages measured no faster
constexpr int kLaneWarps = 8;
template <typename SumT, int D>
constexpr int kLaneRow = 2 * D * int(sizeof(SumT)) + 16;  // bytes of a head-page's row in a stage
constexpr int kLaneUnitMax = 128;  // pages; LaneUnit's largest
// The rings, then each warp's table of its unit's summary offsets.
template <typename SumT, int D>
constexpr int kLaneSmem = kLaneWarps * (kLaneStages * 4 * kLaneRow<SumT, D> + kLaneUnitMax * 8);

// Units of `unit` pages: sequence b owns Hkv * (f(b + 1) - f(b)) of them from
// Hkv * f(b), f(b) = floor((page_indptr[b] + b * (unit - 1)) / unit): at
// least ceil(n_b / unit) per KV head (f(b + 1) - f(b) >= floor((n_b + unit -
// 1) / unit)), found from page_indptr alone; a unit past its row's end idles.
__host__ __device__ inline long long LaneUnitsBefore(long long pages_before, int b, int unit) {
  return (pages_before + (long long)b * (unit - 1)) / unit;
}

template <typename QT, typename SumT, int D, int G>
__global__ void __launch_bounds__(kLaneWarps * 32) ScoreKernelLanes(SelectParams p, float* scores, RowState* st,
                                                                    int unit) {
  ChainWait();
  ChainRelease();
  static_assert(G * D / 8 <= 64, "query values per lane must fit in registers");
  constexpr int kRow = kLaneRow<SumT, D>;
  constexpr int kStage = 4 * kRow;
  constexpr int kPieces = 2 * D * int(sizeof(SumT)) / 16;  // 16-byte pieces of one head-page's summary
  static_assert(4 * kPieces % 32 == 0, "a stage's pieces spread evenly over the lanes");
  extern __shared__ __align__(16) unsigned char lane_ring[];
  const SelectShape& s = p.shape;
  const int H = s.kv_heads;
  const int lane = int(threadIdx.x & 31), grp = lane >> 3, l = lane & 7, warp = int(threadIdx.x >> 5);
  unsigned char* ring = lane_ring + warp * kLaneStages * kStage;
  long long* offs = reinterpret_cast<long long*>(lane_ring + kLaneWarps * kLaneStages * kStage) + warp * kLaneUnitMax;
  const long long units = (long long)H * LaneUnitsBefore(p.page_indptr[s.batch], s.batch, unit);
  const QT* q_all = static_cast<const QT*>(p.q);
  const unsigned char* slab = static_cast<const unsigned char*>(p.summaries);
  for (long long k = (long long)blockIdx.x * kLaneWarps + warp; k < units; k += (long long)gridDim.x * kLaneWarps) {
    int b = 0, hi_b = s.batch;  // the sequence owning unit k (warp-uniform)
    while (hi_b - b > 1) {
      const int mid = (b + hi_b) / 2;
      if ((long long)H * LaneUnitsBefore(p.page_indptr[mid], mid, unit) <= k) b = mid; else hi_b = mid;
    }
    const int first = p.page_indptr[b], n = p.page_indptr[b + 1] - first;
    const long long u0 = LaneUnitsBefore(first, b, unit);
    const int per_head = int(LaneUnitsBefore(p.page_indptr[b + 1], b + 1, unit) - u0);
    const int local = int(k - (long long)H * u0);
    const int h = local / per_head;
    const int i_begin = (local % per_head) * unit;
    const RowPolicy pol = PolicyFor(s, n);
    if (i_begin >= n || pol.all) continue;  // idle unit, or a row choosing every page
    const int i_end = min(n, i_begin + unit);
    const int steps = (i_end - i_begin + 3) / 4;
    // The unit's summary offsets, once (per step, the page-id loads and
    // 64-bit offset arithmetic were ~60 of the loop's ~550 instructions).
    // The previous unit's reads are done: its loop ended in a warp barrier.
    for (int j = lane; j < i_end - i_begin; j += 32)
      offs[j] = ((long long)p.page_ids[first + i_begin + j] * H + h) * (2 * D * (long long)sizeof(SumT));
    __syncwarp();
    // Step t's copies into its stage: 4 head-pages x kPieces pieces over the
    // warp (zero-filled past the unit's end). One commit group per step.
    auto issue = [&](int t) {
      unsigned char* dst = ring + (t % kLaneStages) * kStage;
#pragma unroll
      for (int m = 0; m < 4 * kPieces / 32; ++m) {
        const int piece = m * 32 + lane, j = piece / kPieces, c = piece % kPieces;
        const int at = t * 4 + j;
        const bool ok = t < steps && i_begin + at < i_end;
        CopyAsync16(dst + j * kRow + c * 16, slab + (ok ? offs[at] : 0) + c * 16, ok);
      }
      CommitCopies();
    };
#pragma unroll
    for (int t = 0; t < kLaneStages - 1; ++t) issue(t);
    uint32_t kmax = 0, kmin_inv = 0;  // the unit's key range (st): one atomic pair per unit
    float qr[G][D / 8];
    const QT* q = q_all + ((std::size_t)b * H * G + (std::size_t)h * G) * D;
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int c = 0; c < D / 8; ++c) qr[g][c] = ToFloat<QT>(q[g * D + c * 8 + l]);
#pragma unroll 1
    for (int t = 0; t < steps; ++t) {
      issue(t + kLaneStages - 1);
      WaitCopies<kLaneStages - 1>();
      __syncwarp();
      const SumT* lo = reinterpret_cast<const SumT*>(ring + (t % kLaneStages) * kStage + grp * kRow);
      float acc[G];
#pragma unroll
      for (int g = 0; g < G; ++g) acc[g] = 0.f;
#pragma unroll
      for (int c = 0; c < D / 8; ++c) {
        float mn, mx;
        if constexpr (kIsE4m3<SumT>) {  // one conversion for the pair
          const float2 f = DecodeE4m3x2(uint16_t(lo[c * 8 + l].bits | lo[D + c * 8 + l].bits << 8));
          mn = f.x, mx = f.y;
        } else {
          mn = ToFloat<SumT>(lo[c * 8 + l]), mx = ToFloat<SumT>(lo[D + c * 8 + l]);
        }
#pragma unroll
        for (int g = 0; g < G; ++g) acc[g] = ScoreTerm<kExactProducts<QT, SumT>>(acc[g], qr[g][c], mn, mx);
      }
      __syncwarp();  // the stage is read before a later issue refills it
      float score[G];
#pragma unroll
      for (int g = 0; g < G; ++g) score[g] = FinishScore<SumT>(SumGroup8(acc[g]));  // the group's eight partial sums
      const int i = i_begin + t * 4 + grp;
      const bool mine = l == 0 && i < i_end;
      if (mine) {
        const float agg = StoreScores<G>(s, scores, (long long)first * H + (long long)h * n + i, first, n, h, i, score);
        if (!Skipped(pol, i)) kmax = max(kmax, Key(agg)), kmin_inv = max(kmin_inv, ~Key(agg));
      }
    }
    WaitCopies<0>();  // the empty tail groups too, before the next unit reuses the ring
    __syncwarp();
    if (st) {  // per step (FoldKeyRange) the same-address atomics cost ~2x the scan at 1M (H200)
      kmax = __reduce_max_sync(0xFFFFFFFFu, kmax);
      kmin_inv = __reduce_max_sync(0xFFFFFFFFu, kmin_inv);
      if (lane == 0 && (kmax | kmin_inv)) {
        atomicMax(&st[b * H + h].kmax, kmax);
        atomicMax(&st[b * H + h].kmin_inv, kmin_inv);
      }
    }
  }
}

// The unit for ScoreKernelLanes: the largest of 128/64/32/16 pages that still
// gives every SM 8 warps' worth of units (H200, Llama-3-8B: 128 at b16 128K
// and b1 1M; 32 at b1 128K, 20.3 us against 33.8 with 128).
inline int LaneUnit(long long head_pages, int sms) {
  int unit = kLaneUnitMax;
  while (unit > 16 && head_pages / unit < 8LL * sms) unit /= 2;
  return unit;
}

using BlockScan = cub::BlockScan<int, kTopKThreads>;
constexpr int kShortRowMin = 1024;  // keys; longer rows find their k-th key through a range histogram
constexpr int kCandCap = 2048;      // keys of the k-th key's bin that RangeKth gathers

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
__device__ void RadixKth(const Keys& keys, const RowPolicy& r, TopKShared& sh, uint32_t* kth, int* ties, int* equal) {
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

// After a row's pages are emitted (and a barrier): the HBM slot of each
// chosen head-page when asked for, one coalesced pass. (Looking the slot up
// inside the ordered emit serialised two dependent global loads per page
// and thread: most of a short row's select time on the H200.)
__device__ __forceinline__ void EmitSlots(const SelectParams& p, const uint32_t* ids, int h, int out0, int count) {
  if (!p.out_slots) return;
  for (int j = threadIdx.x; j < count; j += blockDim.x)
    p.out_slots[out0 + j] = p.hbm_slot[(std::size_t)ids[p.out_pages[out0 + j]] * p.shape.kv_heads + h];
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
    const int A = !kCachedMaxMean && s.gqa == GqaAgg::kUnion ? s.group : 1;
    const bool cached = kCachedMaxMean || r.n <= key_cache;
    uint8_t* mark = marks ? marks + (std::size_t)first * s.kv_heads + (std::size_t)h * r.n : nullptr;
    uint32_t kth = 0;
    int ties = 0, equal = 0;
    // SelectShortRow past kShortRowMin keys; shorter rows are faster through
    // RadixKth alone (H200, select, same binary: with the threshold at 512,
    // Llama-2-7B at 768 keys a row b1 20.7 -> 22.0 us, b16 108 -> 112; at
    // 1024, against 2048, 2048 keys a row Llama-3-8B b1 23.2 -> 21.1 us and
    // Llama-2-7B b16 212 -> 205.6, RadixKth's four levels alone having taken
    // 5.7 us there; bench/results/2026-12-03-gpu-session-20.md).
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
// bench/results/2026-12-03-gpu-session-21.md): Llama-3-8B b1 512K 83.8 ->
// 77.6 us, b1 1M 125.9 -> 118.8; Llama-2-7B b1 512K 200.1 -> 190.4 (Llama-2-7B
// b1 1M, 512 blocks, and batch 16 do not fit one wave: the same path both
// ways). Against the three earlier kernels (a histogram pass, then the bin
// select's and the emit's, each loading the row's scores again), both
// changes: Llama-3-8B b1 512K 83.7 -> 76.3, 1M 124.2 -> 117.5; Llama-2-7B b1
// 512K 202.9 -> 193.9, 1M 368.9 -> 360.7.
// Rows of 4K-16K keys stay with the one-block top-K, faster there (b1 128K
// 32.3 against 45.9 us through these phases).
constexpr int kEmitThreads = 256;
constexpr int kEmitItems = 16;
constexpr int kEmitChunk = kEmitThreads * kEmitItems;
constexpr int kLongRowMin = 16384;  // keys; longer rows take the chunked phases
constexpr int kBinCap = 4096;       // candidates a row's bin select holds; a fuller bin takes the row's keys
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
// b1 512K 78.8 -> 76.3; bench/results/2026-12-03-gpu-session-21.md).
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

// Few short rows (kMax/kMean, G <= 4, <= kFuseMaxPages pages, one cluster per
// row fitting in one wave): one launch. A cluster of kFuseBlocks blocks per
// row scores the row's pages (G threads per page, one query head each, with
// ScoreKernel's arithmetic) and writes each key straight into
// the shared key cache of the cluster's first block (distributed shared
// memory); after one cluster barrier that block radix-selects over the cached
// keys and emits the row, as TopKKernel does. No score workspace, no memset.
// (Up to 8192 pages, with a thread per page and SelectShortRow in the first
// block, it was slower than score + top-K at 128K on the H200: 46 vs 38 us
// a layer, bench/results/2026-11-29-gpu-session-7.md.) Past kFuseMaxHeadPages
// head-pages in all, the lanes score kernel on every SM then the top-K is
// faster (H200, Llama-3-8B select: b1 32K 24.7 -> 22.6 us, b2 16K 24.6 ->
// 20.4, b2 32K 36.8 -> 26.6; b1 16K stays fused, 17.7 against 18.9;
// bench/results/2026-12-02-gpu-session-15.md).
constexpr int kFuseBlocks = 8;
constexpr int kFuseMaxPages = 2048;
constexpr long long kFuseMaxHeadPages = 8192;

template <typename QT, typename SumT, int D, int G>
__global__ void __cluster_dims__(kFuseBlocks, 1, 1) __launch_bounds__(kTopKThreads, 1)
    FusedSelectKernel(SelectParams p) {
  namespace cg = cooperative_groups;
  extern __shared__ uint32_t cache[];
  __shared__ TopKShared sh;
  const SelectShape& s = p.shape;
  const int row = blockIdx.y;
  const int b = row / s.kv_heads;
  const int h = row % s.kv_heads;
  const int first = p.page_indptr[b];
  const RowPolicy r = PolicyFor(s, p.page_indptr[b + 1] - first);
  const int out0 = p.out_indptr[row];
  const uint32_t* ids = p.page_ids + first;
  auto emit = [&](int i, int pos) { p.out_pages[out0 + pos] = i; };
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned rank = cluster.block_rank();
  if (r.all || r.k == 0) {  // same branch for the whole cluster: no barrier needed
    if (rank != 0) return;
    int count;
    if (r.all) {
      for (int i = threadIdx.x; i < r.n; i += blockDim.x) emit(i, i);
      count = r.n;
    } else {
      count = OrderedPassAll(r.n, sh, [&](int i) { return Skipped(r, i); }, emit);
    }
    __syncthreads();
    EmitSlots(p, ids, h, out0, count);
    if (threadIdx.x == 0) p.out_count[row] = count;
    return;
  }
  // Blocks of a cluster may start at different times: none writes into block
  // 0's shared memory before all have started (arrive now, wait before the
  // first remote write).
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  bool waited = false;
  uint32_t* dst = cluster.map_shared_rank(cache, 0);
  const int chunk = (r.n + kFuseBlocks - 1) / kFuseBlocks;
  const int i0 = int(rank) * chunk;
  const int i1 = min(r.n, i0 + chunk);
  const SumT* slab = static_cast<const SumT*>(p.summaries);
  // G threads per page, one query head each (consecutive lanes); the
  // page's first lane aggregates the G scores in order.
  constexpr int kPerPass = kTopKThreads / G;
  const int g = int(threadIdx.x) % G;
  const QT* q = static_cast<const QT*>(p.q) + (((std::size_t)b * s.kv_heads + h) * G + g) * D;
  for (int base = i0; base < i1; base += kPerPass) {  // same trip count in the whole block
    const int i = base + int(threadIdx.x) / G;
    const bool active = i < i1 && !Skipped(r, i);
    float score = 0.f;
    if (active) ScoreHeadPage<QT, SumT, D, 1>(slab + ((std::size_t)ids[i] * s.kv_heads + h) * 2 * D, q, &score);
    float sc[G];
    sc[0] = score;
#pragma unroll
    for (int gg = 1; gg < G; ++gg) sc[gg] = __shfl_down_sync(0xFFFFFFFFu, score, gg);
    if (!waited) {
      asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
      waited = true;
    }
    if (active && g == 0) dst[CacheSlot(i)] = Key(Aggregate<G>(s.gqa, sc));
  }
  if (!waited) asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
  cluster.sync();  // every key is in block 0's cache
  if (rank != 0) return;
  uint32_t kth = 0;
  int ties = 0, equal = 0;
  const Keys keys{nullptr, cache};
  RadixKth(keys, r, sh, &kth, &ties, &equal);
  __syncthreads();
  auto eq = [&](int i) { return !Skipped(r, i) && keys(i) == kth; };
  auto take = [&](int i, int eq_rank) {
    if (Skipped(r, i)) return true;
    const uint32_t key = keys(i);
    return key > kth || (key == kth && eq_rank < ties);
  };
  const int count = ties == equal ? OrderedPassAll(r.n, sh, [&](int i) { return take(i, 0); }, emit)
                                  : OrderedPass(r.n, sh, eq, take, emit);
  __syncthreads();
  EmitSlots(p, ids, h, out0, count);
  if (threadIdx.x == 0) p.out_count[row] = count;
}

// kUnion's marks start cleared; one byte per (page, KV head).
__global__ void ClearMarks(uint8_t* marks, const int32_t* page_indptr, int batch, int kv_heads) {
  const long long n = (long long)page_indptr[batch] * kv_heads;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    marks[i] = 0;
}

std::size_t AlignUp(std::size_t x) { return (x + 255) & ~std::size_t(255); }

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

// QUESTKV_SPLIT_LONG_ROWS=1: PlanSelect's default for SelectPlan::split_long_rows
// (never LongRowKernel). Its blocks wait for each other, so it assumes they can
// all become resident; another stream's kernel that held SMs while waiting for
// this stream's later work would stall it.
bool SplitLongRowsForced() {
  static const bool on = [] {
    const char* v = std::getenv("QUESTKV_SPLIT_LONG_ROWS");
    return v && v[0] == '1';
  }();
  return on;
}

// The top-K kernels' largest key cache (beside their ~19 KiB of static shared memory).
template <auto kKernel>
cudaError_t AllowKeyCache() {
  return AllowDynamicSmem<kKernel, int((kMaxKeyCache + kMaxKeyCache / 32 + 1) * sizeof(uint32_t))>();
}

// The score kernel for one (q dtype, summary dtype, D, G), and its grid.
template <typename QT, typename SumT, int D, int G>
cudaError_t LaunchScore(const SelectPlan& plan, const SelectParams& p, float* scores, RowState* st,
                        cudaStream_t stream) {
  const SelectShape& s = p.shape;
  const std::size_t head_pages = std::size_t(plan.total_pages) * s.kv_heads;
  // G = 4, D = 128: the lanes kernel (other G >= 4 shapes either hold too many
  // query values per lane or spill a few registers; not measured). Otherwise,
  // below kStagedMinHeadPages, the direct kernel (H200, Llama-3-8B before the
  // lanes kernel: 41.5 vs 50.0 us at b1 128K; the staged one 129 vs
  // 140 us at b1 512K, 1987 vs 2358 us at b16 1M).
  // E4M3 phases are 128 dimensions: D = 64 takes the direct kernel.
  constexpr bool kStaged = Tile<SumT>::kPhaseDims <= D;
  if constexpr (G == 4 && D == 128) {
    constexpr auto kernel = ScoreKernelLanes<QT, SumT, D, G>;
    constexpr int smem = kLaneSmem<SumT, D>;
    if (const cudaError_t e = AllowDynamicSmem<kernel, smem>(); e != cudaSuccess) return e;
    const int sms = std::max(1, plan.score_blocks / kScoreBlocksPerSm);
    const int unit = LaneUnit((long long)head_pages, sms);
    const long long units = (long long)s.kv_heads * LaneUnitsBefore(plan.total_pages, s.batch, unit);
    const int blocks = int(std::clamp<long long>((units + kLaneWarps - 1) / kLaneWarps, 1, 2LL * sms));
    if (const cudaError_t e = LaunchChained(kernel, dim3(blocks), dim3(kLaneWarps * 32), smem, stream, p,
                                            scores, st, unit);
        e != cudaSuccess)
      return e;
  } else if (kStaged && (G <= 2 || head_pages >= kStagedMinHeadPages)) {
    if constexpr (kStaged) {
      const long long slots = ScoreSlots<(G <= 2)>(plan.total_pages, s.batch, s.kv_heads);
      const long long groups = (std::max(slots, 1LL) + 31) / 32;
      const int blocks = int(std::min<long long>(plan.score_blocks, (groups + kScoreWarps - 1) / kScoreWarps));
      if (const cudaError_t e = LaunchChained(ScoreKernel<QT, SumT, D, G>, dim3(blocks), dim3(kScoreWarps * 32), 0,
                                              stream, p, scores, st);
          e != cudaSuccess)
        return e;
    }
  } else {
    const long long need = (std::max<long long>(head_pages, 1) + 255) / 256;
    const int blocks = int(std::min<long long>(std::max(1, plan.score_blocks / kScoreBlocksPerSm) * 8, need));
    if (const cudaError_t e =
            LaunchChained(ScoreKernelDirect<QT, SumT, D, G>, dim3(blocks), dim3(256), 0, stream, p, scores, st);
        e != cudaSuccess)
      return e;
  }
  return cudaSuccess;
}

}  // namespace

bool PlanSelect(const SelectShape& s, const int32_t* page_counts, int num_sms, SelectPlan* plan,
                std::string* error) {
  auto fail = [&](std::string m) {
    if (error) *error = "PlanSelect: " + std::move(m);
    return false;
  };
  if (s.batch < 1) return fail("batch = " + std::to_string(s.batch) + ", must be >= 1");
  if (s.kv_heads < 1) return fail("kv_heads = " + std::to_string(s.kv_heads) + ", must be >= 1");
  if (s.group != 1 && s.group != 2 && s.group != 4 && s.group != 8)
    return fail("GQA group = " + std::to_string(s.group) + " (supported: 1, 2, 4, 8)");
  if (s.head_dim != 64 && s.head_dim != 128 && s.head_dim != 256)
    return fail("head_dim = " + std::to_string(s.head_dim) + " (supported: 64, 128, 256)");
  if (s.page_size < 1) return fail("page_size = " + std::to_string(s.page_size));
  if ((long long)s.batch * s.kv_heads > (1LL << 31) - 1) return fail("too many rows");
  plan->out_indptr.assign(1, 0);
  plan->total_pages = 0;
  plan->max_pages = 0;
  for (int b = 0; b < s.batch; ++b) {
    const int n = page_counts[b];
    if (n < 1) return fail("sequence " + std::to_string(b) + " has " + std::to_string(n) + " pages, must be >= 1");
    const RowPolicy r = PolicyFor(s, n);
    int cap = n;
    if (!r.all) {
      const long long winners = s.gqa == GqaAgg::kUnion ? (long long)s.group * r.k : r.k;
      cap = int(std::min<long long>(n, r.fixed + winners));
    }
    for (int h = 0; h < s.kv_heads; ++h) {
      if ((long long)plan->out_indptr.back() + cap > (1LL << 31) - 1) return fail("selection CSR over 2^31 entries");
      plan->out_indptr.push_back(plan->out_indptr.back() + cap);
    }
    plan->total_pages += n;
    plan->max_pages = std::max(plan->max_pages, n);
  }
  const int A = s.gqa == GqaAgg::kUnion ? s.group : 1;
  const std::size_t head_pages = std::size_t(plan->total_pages) * s.kv_heads;
  const std::size_t rows = std::size_t(s.batch) * s.kv_heads;
  // scores, kUnion marks, then (kMax/kMean) row states + histograms, picks,
  // the long rows' k-th keys, chunk counts and bin candidates.
  const std::size_t chunks = std::size_t(plan->max_pages + kEmitChunk - 1) / kEmitChunk;
  plan->workspace_bytes = AlignUp(head_pages * A * sizeof(float)) + (A > 1 ? AlignUp(head_pages) : 0) +
                          (A == 1 ? AlignUp(rows * (sizeof(RowState) + kBins * sizeof(uint32_t))) +
                                        AlignUp(rows * sizeof(int2)) + AlignUp(rows * sizeof(int4)) +
                                        AlignUp(rows * chunks * sizeof(int2)) +
                                        (plan->max_pages > kLongRowMin ? rows * kBinCap * sizeof(int2) : 0)
                                  : 0);
  plan->score_blocks = std::max(1, num_sms) * kScoreBlocksPerSm;
  plan->key_cache = std::min(plan->max_pages, kMaxKeyCache);
  plan->split_long_rows = SplitLongRowsForced();
  return true;
}

cudaError_t LaunchSelect(const SelectPlan& plan, const SelectParams& p, cudaStream_t stream) {
  const SelectShape& s = p.shape;
  const int rows = s.batch * s.kv_heads;
  if (!s.dense && s.gqa != GqaAgg::kUnion && s.group <= 4 && p.q_dtype == p.summary_dtype &&
      plan.max_pages <= plan.key_cache && plan.max_pages <= kFuseMaxPages &&
      (long long)rows * plan.max_pages <= kFuseMaxHeadPages &&
      rows * kFuseBlocks <= std::max(1, plan.score_blocks / kScoreBlocksPerSm)) {  // one wave: a cluster block per SM
    const std::size_t smem = std::size_t(plan.key_cache + plan.key_cache / 32 + 1) * sizeof(uint32_t);
    const dim3 grid(kFuseBlocks, rows);
    QKV_DISPATCH_DTYPE(p.q_dtype, T, {
      QKV_DISPATCH_HEAD_DIM(s.head_dim, D, {
        QKV_DISPATCH_GROUP(s.group, G, {
          // (G > 4 never gets here; naming only G <= 4 keeps nvcc from
          // wanting a G = 8 instantiation's stub.)
          constexpr int kG = G <= 4 ? G : 4;
          if constexpr (G <= 4) FusedSelectKernel<T, T, D, kG><<<grid, kTopKThreads, smem, stream>>>(p);
        })
      })
    })
    return cudaGetLastError();
  }
  float* scores = static_cast<float*>(p.workspace);
  uint8_t* marks = nullptr;
  const std::size_t head_pages = std::size_t(plan.total_pages) * s.kv_heads;
  const bool unioned = s.gqa == GqaAgg::kUnion && s.group > 1;
  if (unioned) marks = static_cast<uint8_t*>(p.workspace) + AlignUp(head_pages * s.group * sizeof(float));
  // kMax/kMean with long rows: row states, histograms, picks, k-th keys,
  // chunk counts and candidates after the scores.
  LongRows lr{};
  const int chunks = (plan.max_pages + kEmitChunk - 1) / kEmitChunk;
  // The chunked phases cost a memset and one to three launches; they pay off
  // for rows of more than kLongRowMin keys (H200: the one-block select over
  // 32K cached keys took ~50 us, 64K binned ~65).
  if (!s.dense && s.gqa != GqaAgg::kUnion && plan.max_pages > kLongRowMin) {
    char* base = static_cast<char*>(p.workspace) + AlignUp(head_pages * sizeof(float));
    lr.st = reinterpret_cast<RowState*>(base);
    lr.ghist = reinterpret_cast<uint32_t*>(base + rows * sizeof(RowState));
    char* after_hist = base + AlignUp(std::size_t(rows) * (sizeof(RowState) + kBins * sizeof(uint32_t)));
    lr.pick = reinterpret_cast<int2*>(after_hist);
    lr.row_kth = reinterpret_cast<int4*>(after_hist + AlignUp(std::size_t(rows) * sizeof(int2)));
    lr.counts = reinterpret_cast<int2*>(after_hist + AlignUp(std::size_t(rows) * sizeof(int2)) +
                                        AlignUp(std::size_t(rows) * sizeof(int4)));
    lr.cand = reinterpret_cast<int2*>(reinterpret_cast<char*>(lr.counts) +
                                      AlignUp(std::size_t(rows) * chunks * sizeof(int2)));
    lr.cand_cap = std::min(kBinCap, plan.key_cache);
    const cudaError_t e =
        cudaMemsetAsync(lr.st, 0, std::size_t(rows) * (sizeof(RowState) + kBins * sizeof(uint32_t)), stream);
    if (e != cudaSuccess) return e;
  }
  RowState* st = lr.st;
  if (!s.dense) {
    QKV_DISPATCH_DTYPE(p.q_dtype, QT, {
      QKV_DISPATCH_SUMMARY_DTYPE(p.summary_dtype, SumT, {
        QKV_DISPATCH_HEAD_DIM(s.head_dim, D, {
          QKV_DISPATCH_GROUP(s.group, G, {
            if (const cudaError_t e = LaunchScore<QT, SumT, D, G>(plan, p, scores, st, stream); e != cudaSuccess) return e;
          })
        })
      })
    })
    if (marks) ClearMarks<<<plan.score_blocks, 256, 0, stream>>>(marks, p.page_indptr, s.batch, s.kv_heads);
  }
  if (st) {  // long rows: the chunked phases, many blocks a row
    const dim3 grid(chunks, rows);
    // One launch when every block of the grid is resident at once: a row's
    // blocks wait for each other at its row-wide steps, so none may wait for
    // a block that cannot start.
    if (!plan.split_long_rows && (long long)chunks * rows <= ResidentBlocks<LongRowKernel, kEmitThreads>()) {
      if (const cudaError_t e = LaunchChained(LongRowKernel, grid, dim3(kEmitThreads), 0, stream, p, scores, lr);
          e != cudaSuccess)
        return e;
      return cudaGetLastError();
    }
    for (auto kernel : {HistKernel, BinSelectKernel, EmitKernel})
      if (const cudaError_t e = LaunchChained(kernel, grid, dim3(kEmitThreads), 0, stream, p, scores, lr);
          e != cudaSuccess)
        return e;
    return cudaGetLastError();
  }
  const std::size_t smem = std::size_t(s.dense ? 0 : plan.key_cache + plan.key_cache / 32 + 1) * sizeof(uint32_t);
  const bool common = !s.dense && !unioned && plan.max_pages <= plan.key_cache;
  auto kernel = common ? TopKKernel<true> : TopKKernel<false>;
  for (const cudaError_t e : {AllowKeyCache<TopKKernel<true>>(), AllowKeyCache<TopKKernel<false>>()})
    if (e != cudaSuccess) return e;
  if (const cudaError_t e = LaunchChained(kernel, dim3(rows), dim3(kTopKThreads), smem, stream, p,
                                          s.dense ? 0 : plan.key_cache, scores, marks);
      e != cudaSuccess)
    return e;
  return cudaGetLastError();
}

}  // namespace questkv::kernels::cuda
