// Context-parallel Quest decode of one layer for one sequence (seed
// §2.1): the sequence's pages, with their summaries and K/V, are spread
// over the R ranks of a group (ShardLayout), and the ranks together select and
// attend exactly what one Selector and one attention over all pages would.
//
// Per step, on every rank:
//   1. score the owned pages for the G query heads of each KV head and
//      aggregate them per the GQA mode (max, mean; union ranks each query
//      head on its own);
//   2. take the K best owned candidates (score, global page) per row, where K
//      is the global budget's top-K share, floor(token_budget / S) minus the
//      sink and local-window pages: never K per rank, which would let the
//      budget grow with R;
//   3. all-gather the candidates; every rank computes the same global top-K
//      (ties toward the lower page, as TopKCpu) and adds the sink pages, the
//      local window and the tail: the Selector's selection, bit for bit;
//   4. attend its own selected pages, giving a partial (o, m, d) per query
//      head, all-gather those and merge them in rank order.
// A dense layer, or a budget covering every page, skips 1-3. The outputs
// equal the single-rank ones up to float rounding of the merge order.
//
// Thread-compatible: a decoder holds scratch, one per rank's thread.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/cpu/kernels_cpu.h"
#include "parallel/communicator.h"
#include "parallel/decode_common.h"
#include "parallel/global_topk.h"
#include "parallel/shard.h"
#include "questkv/config.h"
#include "questkv/status.h"

namespace questkv {

// One rank's share of one sequence at one layer.
struct ContextShard {
  const float* q = nullptr;             // [Hq][D] this step's queries, the same on every rank
  const float* summary_slab = nullptr;  // this rank's slab, [PageId][Hkv][2][D]
  const uint32_t* page_ids = nullptr;   // [num_local] PageIds of the owned pages, ShardPages order
  const float* const* pages = nullptr;  // [num_local] the owned pages' K/V, [2][Hkv][S][D] each
  int num_local = 0;                    // ShardPages(layout, num_pages, R, rank).size()
  int num_pages = 0;                    // the sequence's pages on all ranks, >= 1; the same on every rank
  int tail_len = 0;                     // valid tokens of logical page num_pages - 1, 1..S
  int layer = 0;
  float scale = 0.f;                    // multiplies q·k; 1/sqrt(D) for the model
};

class ContextParallel {
 public:
  // Geometry and policy must already be validated (the same on every rank).
  ContextParallel(const Geometry& g, const SelectionPolicy& p, ShardLayout layout);

  // Runs the step above with the other ranks of comm. On success out holds
  // the selection of every KV head and the merged output of every query
  // head, identical on every rank. InvalidArgument for bad input on this rank
  // (null pointers, num_local that is not this rank's share, sizes out of
  // range) or a rank that disagrees on the step; errors of the collectives
  // as Communicator's. Any error aborts the group.
  Status Decode(Communicator& comm, const ContextShard& in, ParallelDecodeOutput* out);

 private:
  Status Validate(const Communicator& comm, const ContextShard& in, const ParallelDecodeOutput* out);
  Status DecodeValid(Communicator& comm, const ContextShard& in, ParallelDecodeOutput* out);
  StepHeader Header(const ContextShard& in, int tag, int top_k) const;
  void ScoreOwned(const ContextShard& in);
  const float* RowScores(int row);
  void OwnCandidates(const ContextStepPlan& plan);
  void AttendOwned(const ContextShard& in, int rank, int ranks, const PageSelection& sel);

  Geometry g_;
  SelectionPolicy p_;
  ShardLayout layout_;
  StepExchange exchange_;
  std::vector<int32_t> owned_;          // [num_local] global page of each owned page
  std::vector<uint8_t> skip_;           // [num_local] sink or local window
  std::vector<float> scores_;           // [Hq][num_local]
  std::vector<float> agg_;              // [num_local]
  TopKMerge merge_;
  std::vector<PageCandidate> sent_;      // [rows][K]
  std::vector<PageCandidate> gathered_;  // [R][rows][K]
  std::vector<int32_t> own_idx_;
  std::vector<kernels::HeadPageRef> refs_;
  std::vector<float> mine_;             // [o: Hq][D] [m: Hq] [d: Hq] this rank's partial states
  std::vector<float> states_;           // [R][Hq * (D + 2)] every rank's, as mine_
};

}  // namespace questkv
