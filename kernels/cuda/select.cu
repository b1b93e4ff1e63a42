// Select on the device, in two launches:
//  1. ScoreKernel: U_p(q) for every (page, KV head) of every scored sequence,
//     one thread per head-page keeping 8 partial sums (dimensions j ≡ l mod 8)
//     added in order at the end: the CPU twin's (score_cpu.cc) float
//     arithmetic and summation order, so scores match it bit for bit. The G
//     query heads of a group share each summary read; kMax/kMean aggregate
//     in place (std::max / sequential sum then divide, as select.cc does).
//  2. TopKKernel: one block per (sequence, KV head): a radix select over
//     order-preserving keys (11 + 11 + 10 bits, topk_cpu.cc's digits), then
//     one ordered pass that emits sink ∪ local ∪ winners ascending; keys equal
//     to the k-th win in index order. kUnion runs the select per query head
//     and ORs the winners into a byte mask first.
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/kernels_cuda.h"

namespace questkv::kernels::cuda {
namespace {

constexpr int kTopKThreads = 1024;
constexpr int kScoreThreads = 256;
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

__device__ inline int SeqOf(const int32_t* indptr, int batch, long long p) {
  int lo = 0, hi = batch;  // indptr[lo] <= p < indptr[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (indptr[mid] <= p) lo = mid; else hi = mid;
  }
  return lo;
}

// Narrow groups (G <= 2): 8 lanes per head-page, lane l summing dimensions
// j ≡ l (mod 8), lanes then added in order; consecutive lanes read
// consecutive elements, which measured faster than a thread per page when
// there is little arithmetic per byte.
template <typename QT, typename SumT, int D, int G>
__global__ void __launch_bounds__(kScoreThreads) ScoreKernelLanes(SelectParams p, float* scores) {
  const SelectShape& s = p.shape;
  const int Hkv = s.kv_heads;
  const long long items = (long long)p.page_indptr[s.batch] * Hkv;
  const int lane = threadIdx.x & 31;
  const int l = lane & 7;
  const long long warp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  const long long warps = (gridDim.x * (long long)blockDim.x) >> 5;
  const QT* q_all = static_cast<const QT*>(p.q);
  const SumT* slab = static_cast<const SumT*>(p.summaries);
  for (long long base = warp * 4; base < items; base += warps * 4) {
    const long long item = base + (lane >> 3);
    bool valid = item < items;
    const long long gp = valid ? item / Hkv : 0;
    const int h = valid ? int(item % Hkv) : 0;
    const int b = SeqOf(p.page_indptr, s.batch, gp);
    const int first = p.page_indptr[b];
    const int n = p.page_indptr[b + 1] - first;
    valid = valid && !PolicyFor(s, n).all;
    float acc[G];
#pragma unroll
    for (int g = 0; g < G; ++g) acc[g] = 0.f;
    if (valid) {
      const SumT* lo = slab + ((std::size_t)p.page_ids[gp] * Hkv + h) * 2 * D;
      const SumT* hi = lo + D;
      const QT* q = q_all + ((std::size_t)b * Hkv * G + (std::size_t)h * G) * D;
#pragma unroll 4
      for (int j = l; j < D; j += 8) {
        const float mn = ToFloat(lo[j]);
        const float mx = ToFloat(hi[j]);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float qj = ToFloat(q[g * D + j]);
          const float a = __fmul_rn(qj, mn);
          const float c = __fmul_rn(qj, mx);
          acc[g] = __fadd_rn(acc[g], a > c ? a : c);
        }
      }
    }
    // Lanes in order, as the CPU adds its 8 partial sums.
    float score[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float sum = 0.f;
#pragma unroll
      for (int m = 0; m < 8; ++m) sum = __fadd_rn(sum, __shfl_sync(0xFFFFFFFFu, acc[g], (lane & ~7) + m));
      score[g] = sum;
    }
    if (!valid || l != 0) continue;
    const int i = int(gp - first);
    if (s.gqa == GqaAgg::kUnion) {
      float* row = scores + (std::size_t)first * Hkv * G + (std::size_t)h * G * n;
#pragma unroll
      for (int g = 0; g < G; ++g) row[(std::size_t)g * n + i] = score[g];
    } else {
      float agg = score[0];
      if (s.gqa == GqaAgg::kMax) {
#pragma unroll
        for (int g = 1; g < G; ++g) agg = agg < score[g] ? score[g] : agg;
      } else {
#pragma unroll
        for (int g = 1; g < G; ++g) agg = __fadd_rn(agg, score[g]);
        agg = __fdiv_rn(agg, float(G));
      }
      scores[(std::size_t)first * Hkv + (std::size_t)h * n + i] = agg;
    }
  }
}

// Chunk c of 8 elements of a row of T, as floats (one or two 16-byte loads).
template <typename T>
__device__ __forceinline__ void Load8(const T* row, int c, float* out) {
#pragma unroll
  for (int v = 0; v < 8 / kVec16<T>; ++v) Unpack16<T>(Load16(row + c * 8 + v * kVec16<T>), out + v * kVec16<T>);
}

// One thread per (sequence, KV head, page), pages fastest so a warp shares
// its queries; the thread walks the summary in 16-byte chunks of 8
// dimensions, which are exactly one element of each of the CPU's 8 partial
// sums, so acc[g][l] sees the CPU's sequence of additions.
template <typename QT, typename SumT, int D, int G>
__global__ void __launch_bounds__(kScoreThreads) ScoreKernel(SelectParams p, float* scores) {
  const SelectShape& s = p.shape;
  const int Hkv = s.kv_heads;
  const long long items = (long long)p.page_indptr[s.batch] * Hkv;
  const QT* q_all = static_cast<const QT*>(p.q);
  const SumT* slab = static_cast<const SumT*>(p.summaries);
  for (long long item = blockIdx.x * (long long)blockDim.x + threadIdx.x; item < items;
       item += (long long)gridDim.x * blockDim.x) {
    // item = page_indptr[b] * Hkv + h * n + i: also the kMax/kMean output offset.
    int lo_b = 0, hi_b = s.batch;
    while (hi_b - lo_b > 1) {
      const int mid = (lo_b + hi_b) / 2;
      if ((long long)p.page_indptr[mid] * Hkv <= item) lo_b = mid; else hi_b = mid;
    }
    const int b = lo_b;
    const int first = p.page_indptr[b];
    const int n = p.page_indptr[b + 1] - first;
    if (PolicyFor(s, n).all) continue;
    const long long rem = item - (long long)first * Hkv;
    const int h = int(rem / n);
    const int i = int(rem % n);
    const SumT* lo = slab + ((std::size_t)p.page_ids[first + i] * Hkv + h) * 2 * D;
    const SumT* hi = lo + D;
    const QT* q = q_all + ((std::size_t)b * Hkv * G + (std::size_t)h * G) * D;
    float acc[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int l = 0; l < 8; ++l) acc[g][l] = 0.f;
#pragma unroll 2
    for (int c = 0; c < D / 8; ++c) {
      float mn[8], mx[8];
      Load8(lo, c, mn);
      Load8(hi, c, mx);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float qv[8];
        Load8(q + g * D, c, qv);
#pragma unroll
        for (int l = 0; l < 8; ++l) {
          const float a = __fmul_rn(qv[l], mn[l]);
          const float e = __fmul_rn(qv[l], mx[l]);
          acc[g][l] = __fadd_rn(acc[g][l], a > e ? a : e);
        }
      }
    }
    float score[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float sum = 0.f;
#pragma unroll
      for (int l = 0; l < 8; ++l) sum = __fadd_rn(sum, acc[g][l]);
      score[g] = sum;
    }
    if (s.gqa == GqaAgg::kUnion) {
      float* row = scores + (std::size_t)first * Hkv * G + (std::size_t)h * G * n;
#pragma unroll
      for (int g = 0; g < G; ++g) row[(std::size_t)g * n + i] = score[g];
    } else {
      float agg = score[0];
      if (s.gqa == GqaAgg::kMax) {
#pragma unroll
        for (int g = 1; g < G; ++g) agg = agg < score[g] ? score[g] : agg;
      } else {
#pragma unroll
        for (int g = 1; g < G; ++g) agg = __fadd_rn(agg, score[g]);
        agg = __fdiv_rn(agg, float(G));
      }
      scores[item] = agg;
    }
  }
}

using BlockScan = cub::BlockScan<int, kTopKThreads>;

struct TopKShared {
  uint32_t hist[2048];
  int pick_bucket;
  int pick_rank;
  typename BlockScan::TempStorage scan;
};

// One padding word per 32 keys: OrderedPass's threads read kItems
// consecutive keys each, which would otherwise hit one bank 16 ways.
__device__ __forceinline__ int CacheSlot(int i) { return i + (i >> 5); }

// Key of candidate i (cache in shared memory when the row fits).
struct Keys {
  const float* scores;
  const uint32_t* cache;  // null: recompute from scores
  __device__ uint32_t operator()(int i) const { return cache ? cache[CacheSlot(i)] : Key(scores[i]); }
};

// The k-th largest key among non-skipped candidates (*kth) and how many keys
// equal to it win (*ties): topk_cpu.cc's three digit levels.
__device__ void RadixKth(const Keys& keys, const RowPolicy& r, TopKShared& sh, uint32_t* kth, int* ties) {
  const int shifts[3] = {21, 10, 0};
  const uint32_t masks[3] = {0x7FFu, 0x7FFu, 0x3FFu};
  uint32_t prefix = 0, high_mask = 0;
  int rank = r.k;
  for (int level = 0; level < 3; ++level) {
    const int shift = shifts[level];
    const uint32_t mask = masks[level];
    for (int b = threadIdx.x; b < 2048; b += blockDim.x) sh.hist[b] = 0;
    __syncthreads();
    // Scores cluster in few top-digit buckets: aggregate a warp's equal
    // buckets into one atomic instead of up to 32 serialised ones.
    for (int base = 0; base < r.n; base += blockDim.x) {
      const int i = base + threadIdx.x;
      uint32_t bin = 0xFFFFFFFFu;
      if (i < r.n && !Skipped(r, i)) {
        const uint32_t key = keys(i);
        if ((key & high_mask) == prefix) bin = (key >> shift) & mask;
      }
      const unsigned same = __match_any_sync(0xFFFFFFFFu, bin);
      if (bin != 0xFFFFFFFFu && (threadIdx.x & 31) == __ffs(same) - 1) atomicAdd(&sh.hist[bin], __popc(same));
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      const int bins = int(mask) + 1;
      const int per = bins / 32;
      const int top = bins - 1 - lane * per;  // lane 0 owns the highest bins
      int sum = 0;
      for (int t = 0; t < per; ++t) sum += int(sh.hist[top - t]);
      int incl = sum;
      for (int off = 1; off < 32; off <<= 1) {
        const int v = __shfl_up_sync(0xFFFFFFFFu, incl, off);
        if (lane >= off) incl += v;
      }
      const int before = incl - sum;
      if (before < rank && rank <= incl) {
        int rr = rank - before;
        int b = top;
        while (int(sh.hist[b]) < rr) rr -= int(sh.hist[b--]);
        sh.pick_bucket = b;
        sh.pick_rank = rr;
      }
    }
    __syncthreads();
    prefix |= uint32_t(sh.pick_bucket) << shift;
    high_mask |= mask << shift;
    rank = sh.pick_rank;
    __syncthreads();
  }
  *kth = prefix;
  *ties = rank;
}

// Visits i in [0, n) in index order, kItems consecutive indices per thread
// (two block scans per kItems * blockDim indices); emit(i, pos) for each i
// with take(i, eq_rank) true, pos counting the taken ones. eq(i) marks the
// keys equal to the k-th, eq_rank counts them before i.
constexpr int kItems = 16;
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

__global__ void __launch_bounds__(kTopKThreads) TopKKernel(SelectParams p, int key_cache, float* scores,
                                                            uint8_t* marks) {
  extern __shared__ uint32_t cache[];
  __shared__ TopKShared sh;
  const SelectShape& s = p.shape;
  const int row = blockIdx.x;
  const int b = row / s.kv_heads;
  const int h = row % s.kv_heads;
  const int first = p.page_indptr[b];
  const RowPolicy r = PolicyFor(s, p.page_indptr[b + 1] - first);
  const int out0 = p.out_indptr[row];
  const uint32_t* ids = p.page_ids + first;
  auto emit = [&](int i, int pos) {
    p.out_pages[out0 + pos] = i;
    if (p.out_slots) p.out_slots[out0 + pos] = p.hbm_slot[(std::size_t)ids[i] * s.kv_heads + h];
  };
  int count;
  if (r.all) {
    for (int i = threadIdx.x; i < r.n; i += blockDim.x) emit(i, i);
    count = r.n;
  } else if (r.k == 0) {
    count = OrderedPass(r.n, sh, [](int) { return false; }, [&](int i, int) { return Skipped(r, i); }, emit);
  } else {
    const int A = s.gqa == GqaAgg::kUnion ? s.group : 1;
    const bool cached = r.n <= key_cache;
    uint8_t* mark = marks ? marks + (std::size_t)first * s.kv_heads + (std::size_t)h * r.n : nullptr;
    uint32_t kth = 0;
    int ties = 0;
    for (int a = 0; a < A; ++a) {
      const float* row_scores = scores + (std::size_t)first * s.kv_heads * A + ((std::size_t)h * A + a) * r.n;
      if (cached) {
        for (int i = threadIdx.x; i < r.n; i += blockDim.x) cache[CacheSlot(i)] = Key(row_scores[i]);
        __syncthreads();
      }
      const Keys keys{row_scores, cached ? cache : nullptr};
      RadixKth(keys, r, sh, &kth, &ties);
      if (A > 1) {
        // kUnion: mark this query head's winners, then emit the union below.
        auto eq = [&](int i) { return !Skipped(r, i) && keys(i) == kth; };
        auto wins = [&](int i, int eq_rank) {
          if (Skipped(r, i)) return a == 0;  // sink/local marked once
          const uint32_t key = keys(i);
          return key > kth || (key == kth && eq_rank < ties);
        };
        OrderedPass(r.n, sh, eq, wins, [&](int i, int) { mark[i] = 1; });
        // (mark is only ever set, never cleared, within this row.)
      }
      __syncthreads();
    }
    if (A == 1) {
      const float* row_scores = scores + (std::size_t)first * s.kv_heads + (std::size_t)h * r.n;
      const Keys keys{row_scores, cached ? cache : nullptr};
      auto eq = [&](int i) { return !Skipped(r, i) && keys(i) == kth; };
      auto take = [&](int i, int eq_rank) {
        if (Skipped(r, i)) return true;
        const uint32_t key = keys(i);
        return key > kth || (key == kth && eq_rank < ties);
      };
      count = OrderedPass(r.n, sh, eq, take, emit);
    } else {
      __syncthreads();
      count = OrderedPass(r.n, sh, [](int) { return false; }, [&](int i, int) { return mark[i] != 0; }, emit);
    }
  }
  if (threadIdx.x == 0) p.out_count[row] = count;
}

// kUnion's marks start cleared; one byte per (page, KV head).
__global__ void ClearMarks(uint8_t* marks, const int32_t* page_indptr, int batch, int kv_heads) {
  const long long n = (long long)page_indptr[batch] * kv_heads;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    marks[i] = 0;
}

std::size_t AlignUp(std::size_t x) { return (x + 255) & ~std::size_t(255); }

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
  plan->workspace_bytes = AlignUp(head_pages * A * sizeof(float)) + (A > 1 ? AlignUp(head_pages) : 0);
  plan->score_blocks = std::max(1, num_sms) * 8;
  plan->key_cache = std::min(plan->max_pages, kMaxKeyCache);
  return true;
}

cudaError_t LaunchSelect(const SelectPlan& plan, const SelectParams& p, cudaStream_t stream) {
  const SelectShape& s = p.shape;
  const int rows = s.batch * s.kv_heads;
  float* scores = static_cast<float*>(p.workspace);
  uint8_t* marks = nullptr;
  const std::size_t head_pages = std::size_t(plan.total_pages) * s.kv_heads;
  if (s.gqa == GqaAgg::kUnion && s.group > 1)
    marks = static_cast<uint8_t*>(p.workspace) + AlignUp(head_pages * s.group * sizeof(float));
  if (!s.dense) {
    QKV_DISPATCH_DTYPE(p.q_dtype, QT, {
      QKV_DISPATCH_DTYPE(p.summary_dtype, SumT, {
        QKV_DISPATCH_HEAD_DIM(s.head_dim, D, {
          QKV_DISPATCH_GROUP(s.group, G, {
            if constexpr (G <= 2)
              ScoreKernelLanes<QT, SumT, D, G><<<plan.score_blocks, kScoreThreads, 0, stream>>>(p, scores);
            else
              ScoreKernel<QT, SumT, D, G><<<plan.score_blocks, kScoreThreads, 0, stream>>>(p, scores);
          })
        })
      })
    })
    if (marks) ClearMarks<<<plan.score_blocks, 256, 0, stream>>>(marks, p.page_indptr, s.batch, s.kv_heads);
  }
  const std::size_t smem = std::size_t(s.dense ? 0 : plan.key_cache + plan.key_cache / 32 + 1) * sizeof(uint32_t);
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(TopKKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return e;
  }
  TopKKernel<<<rows, kTopKThreads, smem, stream>>>(p, s.dense ? 0 : plan.key_cache, scores, marks);
  return cudaGetLastError();
}

}  // namespace questkv::kernels::cuda
