// The global top-K of context-parallel selection, shared by the
// CPU decoder (ContextParallel) and the GPU one (GpuDecoder): the step's
// policy numbers, each rank's best K candidates per ranking row, the global
// top-K over every rank's candidates, the selection rows, and the merge of
// the ranks' partial attention states in rank order.
//
// Every rank runs these on the same gathered bytes, so every rank gets the
// same winners, and the winners are what one Selector over all pages picks:
// TopKCpu's order (higher score first, ties toward the lower page) over
// candidates sorted by global page.
//
// Thread-compatible: a TopKMerge holds scratch, one per thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "questkv/config.h"
#include "selector/select.h"

namespace questkv {

// How one step of one sequence selects, as Selector::MarkSinkAndLocal takes
// it (the local window keeps at least the tail page).
struct ContextStepPlan {
  bool dense = false;  // every page: a dense layer or a budget covering them all
  int sink = 0;        // pages [0, sink)
  int local = 0;       // pages [n - local, n); every page when dense
  int k = 0;           // pages ranked by score; 0 when nothing is ranked
  int rows = 0;        // ranking rows: Hq under kUnion, else Hkv
  bool fixed(int page, int num_pages) const { return page < sink || page >= num_pages - local; }
};
ContextStepPlan PlanContextStep(const Geometry& g, const SelectionPolicy& p, int layer, int num_pages);

// One rank's candidate for a ranking row; page -1 pads a row.
struct PageCandidate {
  float score;
  int32_t page;  // global logical page
};

class TopKMerge {
 public:
  // out[0, k) := the k best of scores[0, n) outside skip (may be null), as
  // (score, pages[i]) pairs, padded with (-inf, -1). pages must ascend, so
  // that ties toward the lower index are ties toward the lower global page.
  void OwnCandidates(const float* scores, int n, const uint8_t* skip, const int32_t* pages, int k,
                     PageCandidate* out);

  // *winners := the k best of one row's candidates from every rank: rank r's
  // are first[r * rank_stride + j], j < k (padding ignored).
  void GlobalRow(const PageCandidate* first, std::size_t rank_stride, int ranks, int k,
                 std::vector<int32_t>* winners);

 private:
  std::vector<PageCandidate> pool_;
  std::vector<float> pool_scores_;
  std::vector<int> chosen_, scratch_;
};

// out's rows, one per KV head, ascending: sink ∪ local window ∪ the winners
// of the KV head's ranking rows (winners: plan.rows rows; empty when nothing
// is ranked).
void EmitContextSelection(const Geometry& g, const ContextStepPlan& plan, int num_pages,
                          const std::vector<std::vector<int32_t>>& winners, PageSelection* out);

// o [hq][dim], lse [hq] := the ranks' partial states merged in rank order.
// states: [ranks][stride] floats, each rank's [o: hq][dim] [m: hq] [d: hq].
void MergeRankStates(const float* states, std::size_t stride, int ranks, int hq, int dim, float* o, float* lse);

}  // namespace questkv
