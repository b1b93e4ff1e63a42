// Quest page selection for one (sequence, layer): which logical pages each KV
// head attends this step.
//
// Policy (SelectionPolicy in questkv/config.h): page budget P_b =
// floor(token_budget / S); if P_b >= num_pages or the layer is dense, every
// page. Otherwise the sink pages (first sink_pages) and the local window (last
// local_pages, always including the tail) are taken, and the remaining
// P_b − |sink ∪ local| slots go to the top scores U_p(q) among the other pages,
// ties toward the lower page index. GQA: kMax / kMean aggregate the G query
// heads' scores per page into one ranking per KV head; kUnion takes top-K per
// query head and merges the sets per KV head (so a KV head may read up to G×
// the top-K share).
//
// Thread-compatible: a Selector holds scratch buffers, one per thread.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "questkv/config.h"
#include "questkv/selection.h"
#include "questkv/status.h"

namespace questkv {

// One sequence's pages at one layer, as the selector sees them.
struct SelectInput {
  const float* q = nullptr;              // [Hq][D] this step's queries
  const float* summary_slab = nullptr;   // [PageId][Hkv][2][D]
  const uint32_t* page_ids = nullptr;    // [num_pages] logical order
  int num_pages = 0;                     // >= 1
  int layer = 0;
  // Re-rank (SelectionPolicy::rerank): writes, for KV head `kv_head`, each
  // candidate page's exact score — its maximum logit q·k over its keys,
  // aggregated over the group's query heads as the GQA mode says — or NaN
  // where the keys cannot be had now (the page is then ranked by its bound).
  // Null: no re-rank.
  std::function<Status(int kv_head, std::span<const int32_t> pages, float* exact)> exact_scores = nullptr;
  // Exact hierarchical scan (SelectionPolicy::group_pages = B): box g, laid
  // out like the summary slab ([group][Hkv][2][D]), holds every page box of
  // page_ids[g*B, (g+1)*B) — a larger box bounds a larger score, so group g's
  // score bounds each of its pages'. Null: the flat scan.
  const float* group_slab = nullptr;
};

// out[i] := the max or mean over the G rows of scores ([G][n], rows of n) of
// U_i: one KV head's ranking under GqaMode kMax / kMean. The one definition,
// so that the context-parallel selection (parallel/) ranks with the same bits.
void AggregateGroupScores(const float* scores, int group, int n, GqaMode mode, float* out);

class Selector {
 public:
  // Geometry and policy must already be validated.
  Selector(const Geometry& g, const SelectionPolicy& p);

  // Fills out. InvalidArgument for num_pages < 1, null pointers, or a layer
  // outside the geometry.
  Status Select(const SelectInput& in, PageSelection* out);
  // The same, plus in *next the `next_pages` best-ranked pages per KV head
  // that were not selected (by the group's max score in every GQA mode):
  // the pages most likely to be selected soon, which the tiers may promote
  // ahead of need. Empty rows when nothing was scored.
  Status Select(const SelectInput& in, PageSelection* out, PageSelection* next, int next_pages);

  // Pages whose keys the last Select's re-rank read (all KV heads).
  int64_t reranked() const { return reranked_; }
  // Boxes (one KV head's min/max pair, of a page or a group) the last Select
  // scored: every page's for each KV head in the flat scan, 0 when it did not
  // score.
  int64_t boxes_read() const { return boxes_read_; }
  // Adaptive budgets: the page counts beyond sink and local the last Select
  // chose, one per ranking; empty when the rule is off or nothing was ranked.
  const std::vector<int>& adaptive_pages() const { return adaptive_pages_; }
  // Whether each of those stopped at the cap.
  const std::vector<uint8_t>& adaptive_capped() const { return adaptive_capped_; }
  // Scores U_p(q) of the last Select, [Hq][num_pages] (row = query head), or
  // empty if the last Select did not score: a dense layer or a budget that
  // covers every page selects all pages without ranking them. The
  // hierarchical scan leaves -inf for the pages of groups it did not read.
  const std::vector<float>& scores() const { return scores_; }

 private:
  int MarkSinkAndLocal(int n);
  void ScoreAll(const SelectInput& in);
  void ScoreGrouped(const SelectInput& in, int kv_head, int first, int heads, GqaMode mode, int n, int k);
  const float* HeadScores(int q_head) const;
  void Aggregate(int kv_head, int n, GqaMode mode);
  void MarkTopK(const float* scores, int n, int k);
  int AdaptiveK(const float* scores, int n, int floor_k, int cap_k);
  Status Rerank(const SelectInput& in, int kv_head, int n, int k);
  void EmitRunnersUp(int h, int n, int count, PageSelection* next);

  Geometry g_;
  SelectionPolicy p_;
  std::vector<float> scores_;     // [Hq][num_pages]
  std::vector<float> agg_;        // [num_pages]
  std::vector<uint8_t> skip_;     // [num_pages] sink ∪ local
  std::vector<int> chosen_;       // [num_pages]
  std::vector<int> scratch_;      // [num_pages]
  std::vector<uint8_t> mark_;     // [num_pages] the KV head's row being built
  std::vector<float> exact_;      // re-rank: candidates' exact scores, then their ranking keys
  std::vector<int32_t> cand_;     // re-rank candidates
  int64_t reranked_ = 0;
  int64_t boxes_read_ = 0;
  // Hierarchical scan scratch.
  std::vector<uint32_t> iota_;    // group ids 0..
  std::vector<float> group_bound_, group_agg_, page_scores_, page_agg_;
  std::vector<int> order_;        // groups, best bound first
  std::vector<float> best_;       // min-heap of the k best scores read
  std::vector<uint8_t> read_;     // [num_pages] boxes read for this KV head
  std::vector<int> adaptive_pages_;
  std::vector<uint8_t> adaptive_capped_;
  std::vector<int> ranked_;       // adaptive: candidates, best first
};

}  // namespace questkv
