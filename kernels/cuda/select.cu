// Select on the device (this file: PlanSelect and LaunchSelect, which picks
// the kernels; select_score.cu, select_topk.cu and select_fused.cu hold them,
// select_common.cuh what they share):
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
//  head-pages in all, all rows' clusters in one wave; summaries in the
//  query's dtype or E4M3): 1 and 3 in one launch, a cluster of 8 blocks per
//  row scoring into the first block's shared key cache, which then selects
//  and emits.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/cuda/kernels_cuda.h"
#include "kernels/cuda/select_common.cuh"

namespace questkv::kernels::cuda {
namespace {

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
  if (s.positions < 1) return fail("positions = " + std::to_string(s.positions) + ", must be >= 1");
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
      const long long winners = (long long)ScoredHeads(s) * r.k;
      cap = int(std::min<long long>(n, r.fixed + winners));
    }
    for (int h = 0; h < s.kv_heads; ++h) {
      if ((long long)plan->out_indptr.back() + cap > (1LL << 31) - 1) return fail("selection CSR over 2^31 entries");
      plan->out_indptr.push_back(plan->out_indptr.back() + cap);
    }
    plan->total_pages += n;
    plan->max_pages = std::max(plan->max_pages, n);
  }
  const int A = ScoredHeads(s);
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
  plan->split_long_rows = s.split_long_rows;
  return true;
}

bool SelectIsFused(const SelectPlan& plan, const SelectParams& p) {
  const SelectShape& s = p.shape;
  const int rows = s.batch * s.kv_heads;
  return !s.dense && s.gqa != GqaMode::kUnion && s.group <= 4 && !p.q_rows && !s.mma_scores && !s.keep_scores &&
         (p.q_dtype == p.summary_dtype || p.summary_dtype == DType::kE4M3) &&
         plan.max_pages <= plan.key_cache && plan.max_pages <= kFuseMaxPages &&
         (long long)rows * plan.max_pages <= kFuseMaxHeadPages &&
         rows * kFuseBlocks <= std::max(1, plan.score_blocks / kScoreBlocksPerSm);  // one wave: a cluster block per SM
}

cudaError_t LaunchSelect(const SelectPlan& plan, const SelectParams& p, cudaStream_t stream) {
  const SelectShape& s = p.shape;
  const int rows = s.batch * s.kv_heads;
  if (SelectIsFused(plan, p)) return LaunchFusedSelect(plan, p, stream);
  float* scores = static_cast<float*>(p.workspace);
  uint8_t* marks = nullptr;
  const std::size_t head_pages = std::size_t(plan.total_pages) * s.kv_heads;
  if (s.positions > 1 && !p.q_rows) return cudaErrorInvalidValue;
  const int A = ScoredHeads(s);
  if (A > 1) marks = static_cast<uint8_t*>(p.workspace) + AlignUp(head_pages * A * sizeof(float));
  // kMax/kMean with long rows: row states, histograms, picks, k-th keys,
  // chunk counts and candidates after the scores.
  LongRows lr{};
  const int chunks = (plan.max_pages + kEmitChunk - 1) / kEmitChunk;
  // The chunked phases cost a memset and one to three launches; they pay off
  // for rows of more than kLongRowMin keys (H200: the one-block select over
  // 32K cached keys took ~50 us, 64K binned ~65).
  if (!s.dense && s.gqa != GqaMode::kUnion && plan.max_pages > kLongRowMin) {
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
    const cudaError_t e = p.q_rows ? LaunchScoreBlocks(plan, p, scores, st, stream) : LaunchScore(plan, p, scores, st, stream);
    if (e != cudaSuccess) return e;
    if (marks) {
      if (const cudaError_t e = LaunchClearMarks(plan, p, marks, stream); e != cudaSuccess) return e;
    }
  }
  // Long rows: the chunked phases, many blocks a row.
  if (st) return LaunchLongRows(plan, p, scores, lr, stream);
  return LaunchTopK(plan, p, scores, marks, stream);
}

}  // namespace questkv::kernels::cuda
