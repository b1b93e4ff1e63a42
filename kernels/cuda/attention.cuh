// Sparse paged decode attention kernel (DESIGN.md §4 step 4), included by one
// .cu per K/V dtype so the instantiations compile in parallel.
//
// Grid (rows, splits): a block attends entries [split * pps, +pps) of one
// (sequence, KV head) row for all G query heads of its group, reading each
// head-page in place from its slot. Lanes own slices of D (16-byte loads);
// TY row groups per warp, R rows per lane per step with every K and V load of
// the step issued before any arithmetic. Each warp keeps an online-softmax
// state (base-2 logits, unnormalised o) for its rows; warps merge through
// shared memory, and the block writes either the final output (one split) or
// a normalised partial (o, m, d); with splits, the last block of a row to
// finish (a counter per row in the workspace) merges the row's partials, so
// the whole attention is one launch. An entry the resolve left to fetch
// (AttendParams::fills) is read from its host home by the same loads and
// stored into its slot by the warp that read it: its PCIe round trips
// overlap the other warps' reads from HBM. 16-bit K/V with G = 8 and
// D <= 128 take the tensor-core path (AttendWarpMma: the same loads, issued
// an item ahead; the dot products and the weighted sum by mma); the rest
// take the CUDA cores.
#pragma once

#include <cfloat>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/kernels_cuda.h"

namespace questkv::kernels::cuda {

inline constexpr int kAttendWarps = 4;
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

template <typename T, int D, int S, int G>
struct AttendTraits {
  static constexpr int kVec = kVec16<T>;                               // elements per 16-byte load
  static constexpr int kTx = D / kVec < 32 ? D / kVec : 32;            // lanes per row
  static constexpr int kNv = D / (kVec * kTx);                         // loads per lane per row
  static constexpr int kE = kNv * kVec;                                // elements per lane per row
  static constexpr int kTy = 32 / kTx;                                 // rows per warp per load
  static constexpr int kRmax = G >= 8 ? 2 : 4;
  static constexpr int kR = S / kTy < kRmax ? S / kTy : kRmax;         // rows per lane per step
  static constexpr int kRows = kTy * kR;                               // rows per warp per step
  static constexpr int kBlocksPerPage = S / kRows;
  static_assert(kR >= 1 && S % kRows == 0, "page size too small for this head dim");
};

// Workspace: the per-row finish counters [rows] (zero between launches: the
// merging block resets its row's), then the split partials: o
// [rows][splits][G][D], m and d [rows][splits][G].
struct PartialView {
  float* o;
  float* m;
  float* d;
  int* done;
};
inline std::size_t CounterBytes(int rows) { return (std::size_t(rows) * sizeof(int) + 255) & ~std::size_t(255); }
inline PartialView Partials(void* ws, int rows, int splits, int group, int head_dim) {
  int* done = static_cast<int*>(ws);
  float* o = reinterpret_cast<float*>(static_cast<char*>(ws) + CounterBytes(rows));
  float* m = o + std::size_t(rows) * splits * group * head_dim;
  return {o, m, m + std::size_t(rows) * splits * group, done};
}

// The last block of a row merges its splits' partials (the arithmetic of
// kernels/attention_state.h MergeState), with as few dependent L2 round trips
// as it can: each split's m and d are read once into shared memory `w`
// (2 * G * splits floats); one warp per query head finds the max and the
// split weights d_s * exp(m_s - M) and their sum (each lane a strided share
// of the splits, then a butterfly: a fixed order); then the partial o's are
// summed by P threads per 4 columns (P = the block's threads over the row's
// G * D / 4 column groups, at least 1), 8 loads in flight each (16 took the
// G = 1 kernel past 64 registers: a second wave at batch 16), and the P sums
// added in order. __ldcg reads the other blocks' partials from L2. (A
// few threads walking the splits in turn, and d read twice, cost ~1 us of a
// 15 us batch-1 attention on the H200.)
template <typename T, int D, int G>
__device__ void MergeRow(const PartialView& part, int row, int splits, float* w, T* out, float* lse) {
  constexpr int kThreads = kAttendWarps * 32;
  constexpr int kCols = G * D / 4;
  constexpr int kParts = kThreads / kCols >= 1 ? kThreads / kCols : 1;
  __shared__ float sh_inv[G];
  __shared__ float4 sh_part[kParts > 1 ? kThreads : 1];
  const std::size_t at0 = std::size_t(row) * splits * G;  // [splits][G] of this row
  float* wm = w;                   // [G][splits]: m (-inf: empty), then the weights
  float* wd = w + G * splits;      // [G][splits]: d
  for (int i = threadIdx.x; i < G * splits; i += kThreads) {
    const int s = i / G, g = i % G;
    const float d = __ldcg(part.d + at0 + i);
    const float m = __ldcg(part.m + at0 + i);
    wm[g * splits + s] = d == 0.f ? -INFINITY : m;
    wd[g * splits + s] = d;
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int g = warp; g < G; g += kAttendWarps) {
    float mm = -INFINITY;
    for (int s = lane; s < splits; s += 32) mm = fmaxf(mm, wm[g * splits + s]);
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) mm = fmaxf(mm, __shfl_xor_sync(0xFFFFFFFFu, mm, off));
    float sum = 0.f;
    for (int s = lane; s < splits; s += 32) {
      const float d = wd[g * splits + s];
      const float ws = d == 0.f ? 0.f : d * __expf(wm[g * splits + s] - mm);
      wm[g * splits + s] = ws;
      sum += ws;
    }
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, off);
    if (lane == 0) {
      sh_inv[g] = sum == 0.f ? 0.f : 1.f / sum;
      if (lse) lse[row * G + g] = sum == 0.f ? -INFINITY : mm + logf(sum);
    }
  }
  __syncthreads();
  auto store = [&](int c4, const float4& o) {
    const int g = c4 / (D / 4), c = (c4 % (D / 4)) * 4;
    const float inv = sh_inv[g];
    T* dst = out + std::size_t(row) * G * D + g * D + c;
    dst[0] = FromFloat<T>(o.x * inv), dst[1] = FromFloat<T>(o.y * inv);
    dst[2] = FromFloat<T>(o.z * inv), dst[3] = FromFloat<T>(o.w * inv);
  };
  for (int idx = threadIdx.x; idx < kCols * kParts; idx += kThreads) {
    const int c4 = idx % kCols, q = idx / kCols;
    const int g = c4 / (D / 4), c = (c4 % (D / 4)) * 4;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int s = q; s < splits; s += kParts) {
      const float ws = wm[g * splits + s];
      const float4 v = __ldcg(reinterpret_cast<const float4*>(part.o + (at0 + std::size_t(s) * G + g) * D + c));
      o.x += ws * v.x, o.y += ws * v.y, o.z += ws * v.z, o.w += ws * v.w;
    }
    if constexpr (kParts > 1) sh_part[idx] = o;
    else store(c4, o);
  }
  if constexpr (kParts > 1) {
    __syncthreads();
    for (int c4 = threadIdx.x; c4 < kCols; c4 += kThreads) {
      float4 o = sh_part[c4];
#pragma unroll
      for (int q = 1; q < kParts; ++q) {
        const float4 v = sh_part[q * kCols + c4];
        o.x += v.x, o.y += v.y, o.z += v.z, o.w += v.w;
      }
      store(c4, o);
    }
  }
}

// Where entry `id` of a row is read from: its slot in the pool ([K][V], S x D
// each), or (~id, a head-page the resolve left to fetch) its host home, with
// the slot it is stored to (null: read only).
template <typename T>
struct EntryBytes {
  const T* k;
  const T* v;
  T* fill;
};
template <typename T, int D, int S>
__device__ __forceinline__ EntryBytes<T> EntryOf(const AttendParams& p, int32_t id) {
  if (id >= 0) {
    const T* k = static_cast<const T*>(p.slots) + std::size_t(id) * 2 * S * D;
    return {k, k + S * D, nullptr};
  }
  const GatherJob job = p.fills[~id];
  return {static_cast<const T*>(job.k), static_cast<const T*>(job.v), static_cast<T*>(job.dst)};
}

// ---- the tensor-core path: 16-bit K/V, groups of 8, D <= 128 -------------
// A warp takes 8 tokens of a head-page at a time. Lane (g, t) = (lane / 4,
// lane % 4) loads row g's 16-byte pieces i at element i * 32 + t * 8, of K
// and of V, as the CUDA-core path loads its pieces (fills and tails alike).
// S = Q Kᵀ by m16n8k16 mma (A: the G queries in rows 0..G-1, zero below;
// B: those K pieces as they are, since a dot product may sum its dimensions
// in any order and Q is loaded in the same order); its C fragment leaves
// lane (g, t) query g's logits of tokens 2t and 2t + 1. O^T += V^T P^T by
// m16n8k8 mma: P^T's B fragment is those two weights, rounded to T; V^T's A
// fragments are V's pieces transposed 8 x 8 by movmatrix, which puts
// dimension d(i, j, g) = i * 32 + (g / 2) * 8 + 2j + g % 2 in row g of the
// transpose of register j of piece i. O^T's C fragments leave lane (g, t)
// the o of queries 2t, 2t + 1 at two of those dimensions per 16-row tile.
template <typename T>
__device__ __forceinline__ void MmaS(float (&c)[4], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t z = 0;
  if constexpr (std::is_same_v<T, __half>)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(z), "r"(a2), "r"(z), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(z), "r"(a2), "r"(z), "r"(b0), "r"(b1));
#elif defined(__CUDA_ARCH__)
  __trap();  // no mma below sm_80: never a silent wrong answer
#endif
}
template <typename T>
__device__ __forceinline__ void MmaO(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __half>)
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(b0));
  else
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(b0));
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}
__device__ __forceinline__ uint32_t Transpose8x8(uint32_t x) {
  uint32_t y = x;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
  return y;
}
template <typename T>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi) {
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}
__device__ __forceinline__ uint32_t Word(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// On for groups of 8 only. H200, batch 16, budgets 512-4096, against the
// CUDA cores in the same call: Llama-3-70B's 8 x 8 heads 41.5 / 64.4 / 107.5
// / 182.0 -> 24.9 / 35.9 / 53.4 / 84.0 us (pipelined). Llama-3-8B's groups
// of 4 on this path ran 23.3 / 32.7 / 51.6 / 82.5 us against 22.0 / 32.0 /
// 50.7 / 83.4 on the CUDA cores: no gain, and slower at batch 1
// (bench/results/2026-12-03-gpu-tensor-core-pipelining.md).
template <typename T, int D, int S, int G>
struct AttendMma {
  static constexpr bool kOn = sizeof(T) == 2 && G == 8 && D <= 128;
};

// One warp's share of a block's entries by the tensor-core path, into its
// row of sh_o, sh_m and sh_d (base-2 m).
template <typename T, int D, int S, int G>
__device__ __forceinline__ void AttendWarpMma(const AttendParams& p, int row, int base, int count, int e0, int e1,
                                              int last_len, int warp, float (*sh_o)[G][D], float (*sh_m)[G],
                                              float (*sh_d)[G]) {
  constexpr int kI = D / 32;          // 16-byte pieces of a row a lane holds
  constexpr int kTiles = D / 16;      // O^T's 16-row tiles
  constexpr int kPerPage = S / 8;     // 8-token items a page
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  // Q's A fragments: query g's pieces (zero past G).
  uint4 qa[kI];
  const T* q_row = static_cast<const T*>(p.q) + (std::size_t(row) * G + g) * D + t * 8;
#pragma unroll
  for (int i = 0; i < kI; ++i) qa[i] = g < G ? Load16(q_row + i * 32) : make_uint4(0, 0, 0, 0);
  const float qs = p.scale * kLog2e;
  float mg = -INFINITY, dg = 0.f;  // query g's state; dg over this lane's tokens
  float o[kTiles][4];
#pragma unroll
  for (int x = 0; x < kTiles; ++x) o[x][0] = o[x][1] = o[x][2] = o[x][3] = 0.f;
  // Software-pipelined by one item: a warp issues item it + kAttendWarps's
  // loads before its arithmetic on item it, whose loads the previous pass
  // issued; slot ids come one item further ahead. Without it ptxas spread
  // an item's 8 loads among the dependent mma chain, and each item waited
  // out 3 DRAM round trips in turn (ncu, H200: 17 cycles a warp
  // instruction, two thirds of them on the loads). The second set of K/V
  // registers takes the kernel from 114 to 162 registers, 3 blocks a
  // multiprocessor instead of 4, which PlanAttend's one wave accounts for.
  const int items = e1 > e0 ? (e1 - e0) * kPerPage : 0;
  struct Item {
    EntryBytes<T> bytes;
    int r0, len;  // rows [r0, r0 + 8) of a page of len valid rows; len 0: no item
  };
  auto id_of = [&](int it) { return it < items ? p.slot_ids[base + e0 + it / kPerPage] : 0; };
  auto locate = [&](int it, int32_t id) {
    Item m{{nullptr, nullptr, nullptr}, 0, 0};
    if (it < items) {
      const int e = e0 + it / kPerPage;
      m.r0 = (it % kPerPage) * 8;
      m.len = e == count - 1 ? last_len : S;
      if (m.r0 < m.len) m.bytes = EntryOf<T, D, S>(p, id);  // else a short tail page: nothing in these 8 rows
    }
    return m;
  };
  const int lane_row = g * D + t * 8;
  auto load = [&](const Item& m, uint4 (&kr)[kI], uint4 (&vr)[kI]) {
    const bool in = m.r0 + g < m.len;
    const int at = m.r0 * D + lane_row;
#pragma unroll
    for (int i = 0; i < kI; ++i) {
      kr[i] = in ? Load16(m.bytes.k + at + i * 32) : make_uint4(0, 0, 0, 0);
      vr[i] = in ? Load16(m.bytes.v + at + i * 32) : make_uint4(0, 0, 0, 0);
    }
  };
  uint4 kr[kI], vr[kI];
  Item cur = locate(warp, id_of(warp));
  int32_t id_next = id_of(warp + kAttendWarps);
  load(cur, kr, vr);
  for (int it = warp; it < items; it += kAttendWarps) {
    const Item nxt = locate(it + kAttendWarps, id_next);
    id_next = id_of(it + 2 * kAttendWarps);
    uint4 nk[kI], nv[kI];
    load(nxt, nk, nv);
    const int r0 = cur.r0, len = cur.len;
    if (T* fill = cur.bytes.fill)  // a sealed page: every row was read
#pragma unroll
      for (int i = 0; i < kI; ++i) {
        const int at = r0 * D + lane_row + i * 32;
        *reinterpret_cast<uint4*>(fill + at) = kr[i];
        *reinterpret_cast<uint4*>(fill + S * D + at) = vr[i];
      }
    if (r0 < len) {
      float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int i = 0; i < kI; ++i) {
        MmaS<T>(c, qa[i].x, qa[i].y, kr[i].x, kr[i].y);
        MmaS<T>(c, qa[i].z, qa[i].w, kr[i].z, kr[i].w);
      }
      // Query g, tokens r0 + 2t and r0 + 2t + 1.
      const float s0 = r0 + 2 * t < len ? c[0] * qs : -INFINITY;
      const float s1 = r0 + 2 * t + 1 < len ? c[1] * qs : -INFINITY;
      float mx = fmaxf(s0, s1);
      mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 2));
      const float m_new = fmaxf(mg, mx);  // finite: row r0 < len
      const bool moved = m_new != mg;
      const float alpha = moved ? exp2f(mg - m_new) : 1.f;
      mg = m_new;
      const float p0 = exp2f(s0 - m_new), p1 = exp2f(s1 - m_new);
      dg = dg * alpha + p0 + p1;
      if (__any_sync(0xFFFFFFFFu, moved)) {
        // O^T's columns are queries 2t and 2t + 1: their alphas from lanes 8t and 8t + 4.
        const float a_lo = __shfl_sync(0xFFFFFFFFu, alpha, 8 * t);
        const float a_hi = __shfl_sync(0xFFFFFFFFu, alpha, 8 * t + 4);
#pragma unroll
        for (int x = 0; x < kTiles; ++x) o[x][0] *= a_lo, o[x][1] *= a_hi, o[x][2] *= a_lo, o[x][3] *= a_hi;
      }
      const uint32_t pb = PackPair<T>(p0, p1);
#pragma unroll
      for (int i = 0; i < kI; ++i)
#pragma unroll
        for (int jp = 0; jp < 2; ++jp)
          MmaO<T>(o[i * 2 + jp], Transpose8x8(Word(vr[i], 2 * jp)), Transpose8x8(Word(vr[i], 2 * jp + 1)), pb);
    }
    cur = nxt;
#pragma unroll
    for (int i = 0; i < kI; ++i) kr[i] = nk[i], vr[i] = nv[i];
  }
  // dg over the row's 8 tokens: add the 4 lanes of query g.
  dg += __shfl_xor_sync(0xFFFFFFFFu, dg, 1);
  dg += __shfl_xor_sync(0xFFFFFFFFu, dg, 2);
  if (t == 0 && g < G) sh_m[warp][g] = mg, sh_d[warp][g] = dg;
  // o[i * 2 + jp]: rows d(i, 2jp, g) (0, 1) and d(i, 2jp + 1, g) (2, 3); columns 2t, 2t + 1.
  if (2 * t < G)
#pragma unroll
    for (int i = 0; i < kI; ++i)
#pragma unroll
      for (int jp = 0; jp < 2; ++jp) {
        const int d_lo = i * 32 + (g >> 1) * 8 + 4 * jp + (g & 1), d_hi = d_lo + 2;
        const float* c = o[i * 2 + jp];
        sh_o[warp][2 * t][d_lo] = c[0], sh_o[warp][2 * t + 1][d_lo] = c[1];
        sh_o[warp][2 * t][d_hi] = c[2], sh_o[warp][2 * t + 1][d_hi] = c[3];
      }
}

// Most splits a plan may have: the merge's m, d and weights reuse sh_o
// (kAttendWarps * G * D floats; 2 * G * splits needed, D >= 64).
inline constexpr int kMaxSplits = kAttendWarps * 32;

template <typename T, int D, int S, int G>
__global__ void __launch_bounds__(kAttendWarps * 32)
    AttendKernel(AttendParams p, int kv_heads, int pps, int splits, PartialView part) {
  ChainWait();
  ChainRelease();
  using Tr = AttendTraits<T, D, S, G>;
  constexpr int kTx = Tr::kTx, kTy = Tr::kTy, kR = Tr::kR, kNv = Tr::kNv, kE = Tr::kE, kVec = Tr::kVec;
  __shared__ float sh_o[kAttendWarps][G][D];
  __shared__ float sh_m[kAttendWarps][G];
  __shared__ float sh_d[kAttendWarps][G];

  const int row = blockIdx.x;
  const int split = blockIdx.y;
  const int warp = threadIdx.x >> 5;

  const int base = p.indptr[row];
  const int count = p.count ? p.count[row] : p.indptr[row + 1] - base;
  const int e0 = split * pps;
  const int e1 = min(count, e0 + pps);
  const int last_len = p.last_len ? p.last_len[row / kv_heads] : S;

  if constexpr (AttendMma<T, D, S, G>::kOn) {
    AttendWarpMma<T, D, S, G>(p, row, base, count, e0, e1, last_len, warp, sh_o, sh_m, sh_d);
  } else {
    const int lane = threadIdx.x & 31;
    const int tx = lane % kTx;
    const int ty = lane / kTx;
    // Queries, pre-scaled so logits come out in base 2.
    float q[G][kE];
    const T* q_row = static_cast<const T*>(p.q) + std::size_t(row) * G * D;
    const float qs = p.scale * kLog2e;
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int v = 0; v < kNv; ++v) {
        float f[kVec];
        Unpack16<T>(Load16(q_row + g * D + (v * kTx + tx) * kVec), f);
#pragma unroll
        for (int e = 0; e < kVec; ++e) q[g][v * kVec + e] = f[e] * qs;
      }

    // The lane's o for all G heads; its softmax state (m, d) for one head, gw:
    // the G dot products of a row are reduced across its kTx lanes by halving
    // exchanges (each lane sends half its partial sums to its partner and keeps
    // the other half), so after log2 G of them each lane holds one head's sum,
    // then by butterflies over the kTx / G lanes sharing that head. Against a
    // butterfly per head (G log2 kTx shuffles a row, and every lane's max and
    // exp2 for all G heads), G = 4, kTx = 16: 5 shuffles a row, not 16, and a
    // quarter of the exp2s; the probabilities and rescales every lane's o needs
    // come back from the head's lanes by G (kR + 1) shuffles an item.
    static_assert(G <= kTx, "a row's lanes hold at least one head each");
    constexpr int kSpan = kTx / G;  // lanes of a row holding one head's sum: head gw = tx / kSpan
    const int row_lane0 = lane & ~(kTx - 1);  // the first lane of this lane's row group
    float mw = -INFINITY, dw = 0.f, o[G][kE];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int e = 0; e < kE; ++e) o[g][e] = 0.f;
    // Head g's value v from its lanes in this row group.
    auto from_head = [&](float v, int g) { return G == 1 ? v : __shfl_sync(0xFFFFFFFFu, v, row_lane0 + g * kSpan); };

    const int items = e1 > e0 ? (e1 - e0) * Tr::kBlocksPerPage : 0;
    for (int it = warp; it < items; it += kAttendWarps) {
      const int e = e0 + it / Tr::kBlocksPerPage;
      const int r0 = (it % Tr::kBlocksPerPage) * Tr::kRows;
      const int len = e == count - 1 ? last_len : S;
      if (r0 >= len) continue;  // a short tail page: nothing in this row block
      const auto [k_base, v_base, fill] = EntryOf<T, D, S>(p, p.slot_ids[base + e]);
      // This lane's load j, v: row r0 + j * kTy + ty, columns from (v * kTx + tx) * kVec.
      auto row_of = [&](int j) { return r0 + j * kTy + ty; };
      auto at = [&](int j, int v) { return row_of(j) * D + (v * kTx + tx) * kVec; };
      uint4 kr[kR][kNv], vr[kR][kNv];
#pragma unroll
      for (int j = 0; j < kR; ++j)
#pragma unroll
        for (int v = 0; v < kNv; ++v) {
          const bool in = row_of(j) < len;
          kr[j][v] = in ? Load16(k_base + at(j, v)) : make_uint4(0, 0, 0, 0);
          vr[j][v] = in ? Load16(v_base + at(j, v)) : make_uint4(0, 0, 0, 0);
        }
      if (fill)  // a sealed page: len == S, every row of the block was read; stored after all loads are issued
#pragma unroll
        for (int j = 0; j < kR; ++j)
#pragma unroll
          for (int v = 0; v < kNv; ++v) {
            *reinterpret_cast<uint4*>(fill + at(j, v)) = kr[j][v];
            *reinterpret_cast<uint4*>(fill + S * D + at(j, v)) = vr[j][v];
          }
      float sw[kR];  // head gw's base-2 logits of this lane's rows (-inf past len), then their weights
#pragma unroll
      for (int j = 0; j < kR; ++j) {
        float kf[kE];
#pragma unroll
        for (int v = 0; v < kNv; ++v) Unpack16<T>(kr[j][v], kf + v * kVec);
        float acc[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
          acc[g] = 0.f;
#pragma unroll
          for (int x = 0; x < kE; ++x) acc[g] = fmaf(q[g][x], kf[x], acc[g]);
        }
        // Halving exchanges: the upper lane of each pair keeps the upper half of the heads.
#pragma unroll
        for (int level = 0; (G >> level) > 1; ++level) {
          const int off = kTx >> (level + 1), half = G >> (level + 1);
          const bool upper = (lane & off) != 0;
#pragma unroll
          for (int i = 0; i < half; ++i) {
            const float send = upper ? acc[i] : acc[i + half];
            const float keep = upper ? acc[i + half] : acc[i];
            acc[i] = keep + __shfl_xor_sync(0xFFFFFFFFu, send, off);
          }
        }
#pragma unroll
        for (int off = kSpan / 2; off >= 1; off >>= 1) acc[0] += __shfl_xor_sync(0xFFFFFFFFu, acc[0], off);
        sw[j] = row_of(j) < len ? acc[0] : -INFINITY;
      }
      float mx = sw[0];
#pragma unroll
      for (int j = 1; j < kR; ++j) mx = fmaxf(mx, sw[j]);
#pragma unroll
      for (int off = kTx; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, off));
      const float m_new = fmaxf(mw, mx);  // finite: row r0 < len always
      const bool moved = m_new != mw;
      const float alpha = moved ? exp2f(mw - m_new) : 1.f;
      mw = m_new;
      dw *= alpha;
#pragma unroll
      for (int j = 0; j < kR; ++j) {
        sw[j] = exp2f(sw[j] - m_new);
        dw += sw[j];
      }
      // o rescaled only when some head's max moved (alpha is 1 otherwise): past
      // a row's first items, most items leave every max where it was.
      if (__any_sync(0xFFFFFFFFu, moved))
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float a = from_head(alpha, g);
#pragma unroll
          for (int x = 0; x < kE; ++x) o[g][x] *= a;
        }
#pragma unroll
      for (int j = 0; j < kR; ++j) {
        float vf[kE];
#pragma unroll
        for (int v = 0; v < kNv; ++v) Unpack16<T>(vr[j][v], vf + v * kVec);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float pj = from_head(sw[j], g);
#pragma unroll
          for (int x = 0; x < kE; ++x) o[g][x] = fmaf(pj, vf[x], o[g][x]);
        }
      }
    }

    // Every head's (m, d) to every lane: m is the warp's, d this row group's.
    float m[G], d[G];
#pragma unroll
    for (int g = 0; g < G; ++g) m[g] = from_head(mw, g), d[g] = from_head(dw, g);
    // Row groups of the warp share m; add their d and o.
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int off = kTx; off < 32; off <<= 1) {
        d[g] += __shfl_xor_sync(0xFFFFFFFFu, d[g], off);
#pragma unroll
        for (int x = 0; x < kE; ++x) o[g][x] += __shfl_xor_sync(0xFFFFFFFFu, o[g][x], off);
      }
    }
    if (ty == 0) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int v = 0; v < kNv; ++v)
#pragma unroll
          for (int e = 0; e < kVec; ++e) sh_o[warp][g][(v * kTx + tx) * kVec + e] = o[g][v * kVec + e];
        if (tx == 0) {
          sh_m[warp][g] = m[g];
          sh_d[warp][g] = d[g];
        }
      }
    }
  }  // the CUDA-core path
  __syncthreads();

  // Merge the warps: one thread per (g, column).
  T* out = static_cast<T*>(p.o) + std::size_t(row) * G * D;
  for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
    const int g = i / D, c = i % D;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < kAttendWarps; ++w) mm = fmaxf(mm, sh_m[w][g]);
    float dd = 0.f, oo = 0.f;
    if (mm != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kAttendWarps; ++w) {
        const float a = sh_d[w][g] == 0.f ? 0.f : exp2f(sh_m[w][g] - mm);
        dd += sh_d[w][g] * a;
        oo += sh_o[w][g][c] * a;
      }
    }
    const float on = dd == 0.f ? 0.f : oo / dd;
    if (splits == 1) {
      out[i] = FromFloat<T>(on);
      if (p.lse && c == 0) p.lse[row * G + g] = dd == 0.f ? -INFINITY : mm * kLn2 + logf(dd);
    } else {
      const std::size_t at = (std::size_t(row) * splits + split) * G + g;
      part.o[at * D + c] = on;
      if (c == 0) {
        part.m[at] = dd == 0.f ? -INFINITY : mm * kLn2;
        part.d[at] = dd;
      }
    }
  }
  if (splits == 1) return;
  // Publish this block's partial; the row's last block merges.
  __shared__ int is_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    is_last = atomicAdd(part.done + row, 1) == splits - 1;
    if (is_last) part.done[row] = 0;  // every block of the row has counted
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  MergeRow<T, D, G>(part, row, splits, &sh_o[0][0][0], static_cast<T*>(p.o), p.lse);
}

// The launch for one K/V dtype: sizes become template constants. Each dtype
// is instantiated in its own translation unit (attention_{f32,f16,bf16}.cu)
// so the three compile in parallel; `extern template` below keeps other
// includers from instantiating them again.
template <typename T>
cudaError_t LaunchAttendTyped(const AttendPlan& plan, const AttendParams& p, cudaStream_t stream) {
  const AttendShape& s = plan.shape;
  const dim3 grid(s.rows, plan.splits);
  const PartialView part = Partials(p.workspace, s.rows, plan.splits, s.group, s.head_dim);
  QKV_DISPATCH_HEAD_DIM(s.head_dim, D, {
    QKV_DISPATCH_PAGE_SIZE(s.page_size, S, {
      QKV_DISPATCH_GROUP(s.group, G, {
        if (const cudaError_t e = LaunchChained(AttendKernel<T, D, S, G>, grid, dim3(kAttendWarps * 32), 0, stream,
                                                s.chain, p, s.kv_heads, plan.pages_per_split, plan.splits, part);
            e != cudaSuccess)
          return e;
      })
    })
  })
  return cudaGetLastError();
}

// Blocks of the kernel for shape s that fit on one multiprocessor of the
// current device, into *blocks.
template <typename T>
cudaError_t AttendBlocksPerSmTyped(const AttendShape& s, int* blocks) {
  QKV_DISPATCH_HEAD_DIM(s.head_dim, D, {
    QKV_DISPATCH_PAGE_SIZE(s.page_size, S, {
      QKV_DISPATCH_GROUP(s.group, G, {
        return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, AttendKernel<T, D, S, G>, kAttendWarps * 32, 0);
      })
    })
  })
  return cudaSuccess;
}

#define QKV_ATTEND_INSTANCE(T)                                                                       \
  template cudaError_t LaunchAttendTyped<T>(const AttendPlan&, const AttendParams&, cudaStream_t); \
  template cudaError_t AttendBlocksPerSmTyped<T>(const AttendShape&, int*)
extern template cudaError_t LaunchAttendTyped<float>(const AttendPlan&, const AttendParams&, cudaStream_t);
extern template cudaError_t LaunchAttendTyped<__half>(const AttendPlan&, const AttendParams&, cudaStream_t);
extern template cudaError_t LaunchAttendTyped<__nv_bfloat16>(const AttendPlan&, const AttendParams&, cudaStream_t);
extern template cudaError_t AttendBlocksPerSmTyped<float>(const AttendShape&, int*);
extern template cudaError_t AttendBlocksPerSmTyped<__half>(const AttendShape&, int*);
extern template cudaError_t AttendBlocksPerSmTyped<__nv_bfloat16>(const AttendShape&, int*);

}  // namespace questkv::kernels::cuda
