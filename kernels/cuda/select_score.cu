// Select's score kernels (select.cu describes the pipeline): ScoreKernel
// (staged through per-warp cp.async tiles), ScoreKernelDirect (a thread per
// head-page, direct loads) and ScoreKernelLanes (eight lanes per head-page,
// G = 4, D = 128), and LaunchScore, which picks one.
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/select_common.cuh"

namespace questkv::kernels::cuda {
namespace {

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

// Writes a head-page's scores (kUnion: per query head; else aggregated) and
// returns the aggregate.
template <int G>
__device__ __forceinline__ float StoreScores(const SelectShape& s, float* scores, long long item, int first, int n,
                                             int h, int i, const float* score) {
  if (s.gqa == GqaMode::kUnion) {
    float* out = scores + (std::size_t)first * s.kv_heads * G + (std::size_t)h * G * n;
#pragma unroll
    for (int g = 0; g < G; ++g) out[(std::size_t)g * n + i] = score[g];
    return score[0];
  }
  const float agg = Aggregate<G>(s.gqa, score);
  scores[item] = agg;
  return agg;
}

// Padding after each head-page row that a score kernel stages in shared
// memory. A multiple of 32 bytes: a cp.async whose shared destination is not
// on the 32-byte alignment of its global source reads that sector twice
// through the L2. With 16 bytes every other row was off: measured on an H100
// (bench/results/2026-12-06-gpu-h100-score-cp-async-alignment.md), 32 bytes
// took the L2 read sectors from 101.1 to 67.5 M (staged kernel, Llama-2-7B,
// batch 16, 128K; DRAM's 67.2 M) and from 25.3 to 16.9 M (lanes kernel,
// Llama-3-8B), the select 1-4% faster, though the staged kernel's 16-byte
// reads of rows 18 pieces apart now meet 2-way bank conflicts.
constexpr int kSmemRowPad = 32;

// The score kernel's warp-private tiles: per phase, 8 pieces of 16 bytes of
// a head-page's min and the same 8 of its max (kPhaseDims dimensions), for
// the warp's 32 head-pages; rows padded by 32 bytes (kSmemRowPad).
template <typename SumT>
struct Tile {
  static constexpr int kEP = 16 / sizeof(SumT);  // elements per piece
  static constexpr int kPhaseDims = 8 * kEP;
  static constexpr int kStride = 16 * 16 + kSmemRowPad;  // bytes per head-page row
  static constexpr int kBytes = 32 * kStride;            // one buffer of one warp
};
constexpr int kScoreWarps = 2;        // per block: 2 x 2 buffers x 9 KiB, static shared memory
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
// 2026-11-29-gpu-llama2-128k-host-cost.md): 5% faster for Llama-2-7B (G = 1) at batch 1
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
        // even), each read once.
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
// four head-pages, coalesced 16-byte cp.async pieces, rows padded by
// kSmemRowPad: conflict-free 2-byte reads), so a warp's next copies are in flight
// while it scores. Measured on the H200 against the direct and staged
// kernels, same scores bit for bit (bench/results/2026-12-02-gpu-llama3-select-attention-splits.md):
// Llama-3-8B b16 128K 241 -> 201 us, b16 1M 1830 -> 1494 us, b1 1M 137 -> 104 us.
constexpr int kLaneStages = 2;  // 3 and 4 stages measured no faster
constexpr int kLaneWarps = 8;
template <typename SumT, int D>
constexpr int kLaneRow = 2 * D * int(sizeof(SumT)) + kSmemRowPad;  // bytes of a head-page's row in a stage
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

// Unit k's row (sequence b, its first page and page count n, KV head h)
// and its first page i_begin in the row (warp-uniform).
struct LaneUnitAt {
  int b, first, n, h, i_begin;
};
__device__ inline LaneUnitAt FindLaneUnit(const SelectParams& p, long long k, int unit) {
  const int H = p.shape.kv_heads;
  int b = 0, hi_b = p.shape.batch;
  while (hi_b - b > 1) {
    const int mid = (b + hi_b) / 2;
    if ((long long)H * LaneUnitsBefore(p.page_indptr[mid], mid, unit) <= k) b = mid; else hi_b = mid;
  }
  const int first = p.page_indptr[b], n = p.page_indptr[b + 1] - first;
  const long long u0 = LaneUnitsBefore(first, b, unit);
  const int per_head = int(LaneUnitsBefore(p.page_indptr[b + 1], b + 1, unit) - u0);
  const int local = int(k - (long long)H * u0);
  return {b, first, n, local / per_head, (local % per_head) * unit};
}
// Units of the whole batch.
__device__ inline long long LaneUnitCount(const SelectParams& p, int unit) {
  return (long long)p.shape.kv_heads * LaneUnitsBefore(p.page_indptr[p.shape.batch], p.shape.batch, unit);
}
// A unit's key range (every lane's keys) into its row's state: one atomic
// pair a unit (per step, as FoldKeyRange does, the same-address atomics cost
// ~2x the scan at 1M on the H200).
__device__ inline void FoldUnitKeyRange(RowState* row, uint32_t kmax, uint32_t kmin_inv) {
  kmax = __reduce_max_sync(0xFFFFFFFFu, kmax);
  kmin_inv = __reduce_max_sync(0xFFFFFFFFu, kmin_inv);
  if ((threadIdx.x & 31) == 0 && (kmax | kmin_inv)) {
    atomicMax(&row->kmax, kmax);
    atomicMax(&row->kmin_inv, kmin_inv);
  }
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
  const long long units = LaneUnitCount(p, unit);
  const QT* q_all = static_cast<const QT*>(p.q);
  const unsigned char* slab = static_cast<const unsigned char*>(p.summaries);
  for (long long k = (long long)blockIdx.x * kLaneWarps + warp; k < units; k += (long long)gridDim.x * kLaneWarps) {
    const LaneUnitAt u = FindLaneUnit(p, k, unit);  // not a structured binding: the lambdas capture these
    const int b = u.b, first = u.first, n = u.n, h = u.h, i_begin = u.i_begin;
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
    if (st) FoldUnitKeyRange(st + b * H + h, kmax, kmin_inv);
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
// The unit and grid of a lanes (or mma) score kernel: at most two blocks an SM.
struct LaneGrid {
  int unit, blocks;
};
inline LaneGrid LaneGridFor(const SelectPlan& plan, const SelectShape& s) {
  const int sms = std::max(1, plan.score_blocks / kScoreBlocksPerSm);
  const int unit = LaneUnit((long long)plan.total_pages * s.kv_heads, sms);
  const long long units = (long long)s.kv_heads * LaneUnitsBefore(plan.total_pages, s.batch, unit);
  return {unit, int(std::clamp<long long>((units + kLaneWarps - 1) / kLaneWarps, 1, 2LL * sms))};
}

// ScoreKernelMma (SelectShape::mma_scores): the bound as a product on the
// tensor cores. U_p(q) = sum_j max(q_j min_j, q_j max_j) = sum_j (min(q_j, 0)
// min_j + max(q_j, 0) max_j), so a head-page's score is the dot product of
// its summary row [min | max] (2D elements, as stored) with [q- | q+], and
// 16 head-pages against a group's G <= 8 query heads are one m16n8k16 mma
// per 16 of those 2D elements (A: the pages, row-major; B: the heads,
// zero past G). Each lane loads the 16 bytes of 8 consecutive elements of
// its two pages (g and g + 8) straight from memory, and its query pieces in
// the same order: a dot product may sum its dimensions in any order, so the
// k-th row of A and B need only name the same element. The products are
// exact (16-bit operands); the tensor cores' sums are not the CPU twin's
// order, so scores differ from it in their last bits and a selection can
// differ where two scores do (the twin's tests allow exactly that). An E4M3
// summary (f16 queries) converts to f16 exactly, its ±inf codes to NaN. The
// product then has NaN where the twin, which multiplies only the chosen
// bound, may not (the other half's zero query times NaN): a tile with a NaN
// score (rare: a key past ±448, or an empty box) scores its pages again on
// the CUDA cores (ScoreHeadPageCold). kMax / kMean then aggregate each
// page's G scores in the CPU's order (StoreScores).
template <typename QT, typename SumT>
constexpr bool kMmaScores =
    (std::is_same_v<QT, __half> && (std::is_same_v<SumT, __half> || kIsE4m3<SumT>)) ||
    (std::is_same_v<QT, __nv_bfloat16> && std::is_same_v<SumT, __nv_bfloat16>);

template <typename QT>
__device__ __forceinline__ void MmaScore16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<QT, __half>)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif defined(__CUDA_ARCH__)
  __trap();  // no mma below sm_80: never a silent wrong answer
#endif
}

// Elements 8t..8t+7 of 32-element piece c of a head-page's summary row at
// `row`, as four words of QT pairs (zero when `ok` is false).
template <typename QT, typename SumT>
__device__ __forceinline__ uint4 SummaryPiece(const unsigned char* row, int c, int t, bool ok) {
  if (!ok) return make_uint4(0, 0, 0, 0);
  if constexpr (kIsE4m3<SumT>) {
    const uint2 raw = __ldg(reinterpret_cast<const uint2*>(row + c * 32 + t * 8));
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t((i < 2 ? raw.x : raw.y) >> (16 * (i & 1))),
                                                       __NV_E4M3);
      w[i] = uint32_t(h.x) | uint32_t(h.y) << 16;
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  } else {
    return Load16(row + (c * 32 + t * 8) * 2);
  }
}

// A head-page's G scores as the CUDA-core kernels have them (ScoreHeadPage:
// the CPU twin's terms and order; a chosen ±inf code makes a score +inf),
// out of line: the rare tile with a NaN score pays for its registers.
template <typename QT, typename SumT, int D, int G>
__device__ __noinline__ void ScoreHeadPageCold(const unsigned char* row, const QT* q, float* score) {
  ScoreHeadPage<QT, SumT, D, G>(reinterpret_cast<const SumT*>(row), q, score);
}

template <typename QT, typename SumT, int D, int G>
__global__ void __launch_bounds__(kLaneWarps * 32) ScoreKernelMma(SelectParams p, float* scores, RowState* st, int unit) {
  ChainWait();
  ChainRelease();
  static_assert(G <= 8 && D % 32 == 0, "a group fits the mma's 8 columns");
  constexpr int kPieces = 2 * D / 32;  // 32-element pieces of a summary row
  constexpr int kBatch = kPieces < 8 ? kPieces : 8;  // pieces loaded before their mma
  constexpr int kRowBytes = 2 * D * int(sizeof(SumT));
  const SelectShape& s = p.shape;
  const int H = s.kv_heads;
  const int lane = int(threadIdx.x & 31), g = lane >> 2, t = lane & 3, warp = int(threadIdx.x >> 5);
  const long long units = LaneUnitCount(p, unit);
  const QT* q_all = static_cast<const QT*>(p.q);
  const unsigned char* slab = static_cast<const unsigned char*>(p.summaries);
  for (long long k = (long long)blockIdx.x * kLaneWarps + warp; k < units; k += (long long)gridDim.x * kLaneWarps) {
    const LaneUnitAt u = FindLaneUnit(p, k, unit);  // not a structured binding: the lambdas capture these
    const int b = u.b, first = u.first, n = u.n, h = u.h, i_begin = u.i_begin;
    const RowPolicy pol = PolicyFor(s, n);
    if (i_begin >= n || pol.all) continue;  // idle unit, or a row choosing every page
    const int i_end = min(n, i_begin + unit);
    // B: column g is query head g (zero past G); lane (g, t) holds its
    // elements 8t..8t+7 of each piece: min(q, 0) against the min half, max(q, 0)
    // against the max half.
    uint32_t qb[kPieces][4];
    const QT* q_group = q_all + ((std::size_t)b * H * G + (std::size_t)h * G) * D;
    {
      const QT* q = q_group + (std::size_t)(g < G ? g : 0) * D;
#pragma unroll
      for (int c = 0; c < kPieces; ++c) {
        const int e0 = c * 32 + t * 8;  // in [min | max]
        const bool upper = e0 >= D;
        const uint4 raw = g < G ? Load16(q + (upper ? e0 - D : e0)) : make_uint4(0, 0, 0, 0);
        const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          QT two[2];
          memcpy(two, &w[i], 4);
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float f = ToFloat<QT>(two[j]);
            two[j] = FromFloat<QT>(upper ? fmaxf(f, 0.f) : fminf(f, 0.f));  // exact: a 16-bit value or zero
          }
          memcpy(&qb[c][i], two, 4);
        }
      }
    }
    uint32_t kmax = 0, kmin_inv = 0;  // the unit's key range (st): one atomic pair per unit
#pragma unroll 1
    for (int i0 = i_begin; i0 < i_end; i0 += 16) {
      const int ia = i0 + g, ib = i0 + g + 8;  // this lane's pages: rows g and g + 8 of A
      const bool oka = ia < i_end, okb = ib < i_end;
      const unsigned char* ra = slab + (oka ? ((long long)p.page_ids[first + ia] * H + h) * kRowBytes : 0);
      const unsigned char* rb = slab + (okb ? ((long long)p.page_ids[first + ib] * H + h) * kRowBytes : 0);
      float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int c0 = 0; c0 < kPieces; c0 += kBatch) {
        uint4 pa[kBatch], pb[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          pa[j] = SummaryPiece<QT, SumT>(ra, c0 + j, t, oka);
          pb[j] = SummaryPiece<QT, SumT>(rb, c0 + j, t, okb);
        }
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const uint32_t* q = qb[c0 + j];
          MmaScore16<QT>(c, {pa[j].x, pb[j].x, pa[j].y, pb[j].y}, q[0], q[1]);
          MmaScore16<QT>(c, {pa[j].z, pb[j].z, pa[j].w, pb[j].w}, q[2], q[3]);
        }
      }
      // Lane (g, t): page ia's scores of heads 2t, 2t + 1 in c[0], c[1]; page
      // ib's in c[2], c[3]. Each page's G scores to the lanes t = 0 (ia) and
      // t = 1 (ib) of its quad.
      float sa[G], sb[G];
#pragma unroll
      for (int x = 0; x < G; ++x) {
        const int src = (lane & ~3) + x / 2;
        sa[x] = FinishScore<SumT>(__shfl_sync(0xFFFFFFFFu, x % 2 ? c[1] : c[0], src));
        sb[x] = FinishScore<SumT>(__shfl_sync(0xFFFFFFFFu, x % 2 ? c[3] : c[2], src));
      }
      const int i = t == 0 ? ia : ib;
      if constexpr (kIsE4m3<SumT>) {
        const bool nan = isnan(c[0]) || isnan(c[1]) || isnan(c[2]) || isnan(c[3]);
        if (__any_sync(0xFFFFFFFFu, nan) && t < 2 && i < i_end)
          ScoreHeadPageCold<QT, SumT, D, G>(t == 0 ? ra : rb, q_group, t == 0 ? sa : sb);
      }
      if (t < 2 && i < i_end) {
        const float agg = StoreScores<G>(s, scores, (long long)first * H + (long long)h * n + i, first, n, h, i,
                                         t == 0 ? sa : sb);
        if (!Skipped(pol, i)) kmax = max(kmax, Key(agg)), kmin_inv = max(kmin_inv, ~Key(agg));
      }
    }
    if (st) FoldUnitKeyRange(st + b * H + h, kmax, kmin_inv);
  }
}

// The score kernel for one (q dtype, summary dtype, D, G), and its grid.
template <typename QT, typename SumT, int D, int G>
cudaError_t LaunchScoreTyped(const SelectPlan& plan, const SelectParams& p, float* scores, RowState* st,
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
  if constexpr (kMmaScores<QT, SumT>) {
    if (s.mma_scores) {
      const LaneGrid grid = LaneGridFor(plan, s);
      return LaunchChained(ScoreKernelMma<QT, SumT, D, G>, dim3(grid.blocks), dim3(kLaneWarps * 32), 0, stream, s.chain,
                           p, scores, st, grid.unit);
    }
  }
  if constexpr (G == 4 && D == 128) {
    constexpr auto kernel = ScoreKernelLanes<QT, SumT, D, G>;
    constexpr int smem = kLaneSmem<SumT, D>;
    if (const cudaError_t e = AllowDynamicSmem<kernel, smem>(); e != cudaSuccess) return e;
    const LaneGrid grid = LaneGridFor(plan, s);
    if (const cudaError_t e = LaunchChained(kernel, dim3(grid.blocks), dim3(kLaneWarps * 32), smem, stream, s.chain, p,
                                            scores, st, grid.unit);
        e != cudaSuccess)
      return e;
  } else if (kStaged && (G <= 2 || head_pages >= kStagedMinHeadPages)) {
    if constexpr (kStaged) {
      const long long slots = ScoreSlots<(G <= 2)>(plan.total_pages, s.batch, s.kv_heads);
      const long long groups = (std::max(slots, 1LL) + 31) / 32;
      const int blocks = int(std::min<long long>(plan.score_blocks, (groups + kScoreWarps - 1) / kScoreWarps));
      if (const cudaError_t e = LaunchChained(ScoreKernel<QT, SumT, D, G>, dim3(blocks), dim3(kScoreWarps * 32), 0,
                                              stream, s.chain, p, scores, st);
          e != cudaSuccess)
        return e;
    }
  } else {
    const long long need = (std::max<long long>(head_pages, 1) + 255) / 256;
    const int blocks = int(std::min<long long>(std::max(1, plan.score_blocks / kScoreBlocksPerSm) * 8, need));
    if (const cudaError_t e = LaunchChained(ScoreKernelDirect<QT, SumT, D, G>, dim3(blocks), dim3(256), 0, stream,
                                            s.chain, p, scores, st);
        e != cudaSuccess)
      return e;
  }
  return cudaSuccess;
}

// Shared block selection (p.q_rows): a thread per head-page, as
// ScoreKernelDirect, scoring it for each position of its block in turn (the
// summary read once from memory, then from L1). kMax/kMean fold each score
// into the aggregate in (position, query head) order: std::max, or a
// sequential sum divided by n * G, as select.cc does over a group of n * G
// heads. kUnion keeps each (position, head)'s score apart, a block of fewer
// than shape.positions positions repeating its last (a union of repeats is
// the union).
template <typename QT, typename SumT, int D, int G>
__global__ void __launch_bounds__(256) ScoreBlockKernel(SelectParams p, float* scores, RowState* st) {
  ChainWait();
  ChainRelease();
  const SelectShape& s = p.shape;
  const int H = s.kv_heads;
  const long long slots = ScoreSlots<false>(p.page_indptr[s.batch], s.batch, H);
  const QT* q_all = static_cast<const QT*>(p.q);
  const SumT* slab = static_cast<const SumT*>(p.summaries);
  const bool unioned = s.gqa == GqaMode::kUnion;
  const int A = ScoredHeads(s);
  for (long long base = blockIdx.x * (long long)blockDim.x + (threadIdx.x & ~31); base < slots;
       base += (long long)gridDim.x * blockDim.x) {
    const ItemRef it = Locate<false>(p, base + (threadIdx.x & 31), slots, D);
    float agg = 0.f;
    if (it.valid) {
      const int row0 = p.q_rows[it.b], n = p.q_rows[it.b + 1] - row0;
      const int positions = unioned ? s.positions : n;
      float* out = scores + (std::size_t)it.first * H * A + (std::size_t)it.h * A * it.n + it.i;
      for (int pos = 0; pos < positions; ++pos) {
        const int row = row0 + min(pos, n - 1);
        float score[G];
        ScoreHeadPage<QT, SumT, D, G>(slab + it.off, q_all + ((std::size_t)row * H * G + (std::size_t)it.h * G) * D,
                                      score);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          if (unioned) {
            out[(std::size_t)(pos * G + g) * it.n] = score[g];
          } else if (pos == 0 && g == 0) {
            agg = score[0];
          } else if (s.gqa == GqaMode::kMax) {
            agg = agg < score[g] ? score[g] : agg;
          } else {
            agg = __fadd_rn(agg, score[g]);
          }
        }
      }
      if (!unioned) {
        if (s.gqa == GqaMode::kMean) agg = __fdiv_rn(agg, float(n * G));
        scores[it.item] = agg;
      }
    }
    if (st) FoldKeyRange(st, it.valid && !Skipped(PolicyFor(s, it.n), it.i), it.b * H + it.h, Key(agg));
  }
}

}  // namespace

cudaError_t LaunchScoreBlocks(const SelectPlan& plan, const SelectParams& p, float* scores, RowState* st,
                              cudaStream_t stream) {
  const SelectShape& s = p.shape;
  const std::size_t head_pages = std::size_t(plan.total_pages) * s.kv_heads;
  const long long need = (std::max<long long>(head_pages, 1) + 255) / 256;
  const int blocks = int(std::min<long long>(std::max(1, plan.score_blocks / kScoreBlocksPerSm) * 8, need));
  QKV_DISPATCH_DTYPE(p.q_dtype, QT, {
    QKV_DISPATCH_SUMMARY_DTYPE(p.summary_dtype, SumT, {
      QKV_DISPATCH_HEAD_DIM(s.head_dim, D, {
        QKV_DISPATCH_GROUP(s.group, G, {
          if (const cudaError_t e = LaunchChained(ScoreBlockKernel<QT, SumT, D, G>, dim3(blocks), dim3(256), 0, stream,
                                                  s.chain, p, scores, st);
              e != cudaSuccess)
            return e;
        })
      })
    })
  })
  return cudaSuccess;
}

cudaError_t LaunchScore(const SelectPlan& plan, const SelectParams& p, float* scores, RowState* st,
                        cudaStream_t stream) {
  const SelectShape& s = p.shape;
  QKV_DISPATCH_DTYPE(p.q_dtype, QT, {
    QKV_DISPATCH_SUMMARY_DTYPE(p.summary_dtype, SumT, {
      QKV_DISPATCH_HEAD_DIM(s.head_dim, D, {
        QKV_DISPATCH_GROUP(s.group, G, {
          if (const cudaError_t e = LaunchScoreTyped<QT, SumT, D, G>(plan, p, scores, st, stream); e != cudaSuccess)
            return e;
        })
      })
    })
  })
  return cudaSuccess;
}

}  // namespace questkv::kernels::cuda
