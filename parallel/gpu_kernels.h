// The GPU decoder's own kernels (parallel/gpu_kernels.cu), beside the ones of
// kernels/cuda: filling a rank's slot pool with deterministic random K/V,
// building its summaries, and the scores of the candidates LaunchSelect chose
// (context parallel sends (score, page) pairs, which LaunchSelect does not
// return). Launchers only launch and return cudaError_t.
//
// A rank's slot pool holds its local pages' head-pages for `heads` KV heads,
// global heads first_head .. first_head + heads - 1: head-page (local page p,
// local head h) is slot p * heads + h, [2 (K,V)][S][D] f16.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace questkv::gpu_decode {

struct PoolShape {
  int64_t pages = 0;    // local pages
  int heads = 0;        // KV heads held
  int first_head = 0;   // global index of the first
  int total_heads = 0;  // the model's KV heads
  int page_size = 0;    // S
  int head_dim = 0;     // D
};

// Every element of every slot := an approximately standard normal f16 that
// depends only on (seed, page_keys[p], global head, K or V, token, dimension),
// so that any split of the pages or heads over ranks holds the same values.
cudaError_t LaunchFillRandom(const PoolShape& s, const int64_t* page_keys, uint64_t seed, void* slots,
                             cudaStream_t stream);

// summaries [p][heads][2 (min,max)][D] f16 := min and max of the first
// lens[p] keys of each head-page, compared as FoldKey (kernels/cpu) does;
// exact, as the keys are f16.
cudaError_t LaunchBuildSummaries(const PoolShape& s, const void* slots, const int32_t* lens, void* summaries,
                                 cudaStream_t stream);

// Same layout as PageCandidate (parallel/global_topk.h).
struct DeviceCandidate {
  float score;
  int32_t page;
};

// For every row of a LaunchSelect over candidate lists (each list ends with
// a dummy page in the local window, which is its last chosen entry):
// out[row_offset[row] + j], j < k := (U_p, global page) of the row's j-th
// chosen entry, scores computed as ScorePagesCpu and aggregated as
// AggregateGroupScores (max or mean, bit for bit); (-inf, -1) past the last.
// One warp per candidate; cudaErrorInvalidValue when head_dim % 8 != 0.
struct CandidateParams {
  int rows = 0;  // LaunchSelect's batch * kv_heads
  int kv_heads = 0;
  int group = 1;
  int head_dim = 0;
  int k = 0;
  bool mean = false;                    // kMean, else kMax (group 1 for kUnion)
  const float* q = nullptr;             // [batch][kv_heads * group][D], LaunchSelect's q
  const __half* summaries = nullptr;    // [PageId][kv_heads][2][D]
  const int32_t* page_indptr = nullptr; // [batch + 1] LaunchSelect's
  const uint32_t* page_ids = nullptr;   // LaunchSelect's
  const int32_t* global_page = nullptr; // [page_indptr[batch]] global page of each listed page
  const int32_t* sel_indptr = nullptr;  // [rows + 1] LaunchSelect's out_indptr
  const int32_t* sel_pages = nullptr;   // LaunchSelect's out_pages (indices into a row's list)
  const int32_t* sel_count = nullptr;   // [rows] LaunchSelect's out_count
  const int32_t* row_offset = nullptr;  // [rows] first candidate of each row in out
  DeviceCandidate* out = nullptr;
};
cudaError_t LaunchCandidateScores(const CandidateParams& p, cudaStream_t stream);

}  // namespace questkv::gpu_decode
