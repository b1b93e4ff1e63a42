#include "parallel/global_topk.h"

#include <algorithm>

#include "kernels/attention_state.h"
#include "kernels/cpu/kernels_cpu.h"

namespace questkv {

ContextStepPlan PlanContextStep(const Geometry& g, const SelectionPolicy& p, int layer, int num_pages) {
  const int n = num_pages;
  const int64_t budget = p.page_budget(layer, g.page_size);
  ContextStepPlan plan;
  plan.dense = p.is_dense(layer) || budget >= n;
  plan.sink = plan.dense ? 0 : std::min(p.sink_pages, n);
  plan.local = plan.dense ? n : std::min(std::max(p.local_pages, 1), n);
  plan.k = plan.dense ? 0 : int(std::max<int64_t>(0, budget - std::min(n, plan.sink + plan.local)));
  plan.rows = p.gqa == GqaMode::kUnion ? g.q_heads : g.kv_heads;
  return plan;
}

void TopKMerge::OwnCandidates(const float* scores, int n, const uint8_t* skip, const int32_t* pages, int k,
                              PageCandidate* out) {
  std::fill(out, out + k, PageCandidate{kernels::kNegInf, -1});
  chosen_.resize(n);
  scratch_.resize(n);
  const int got = kernels::TopKCpu(scores, n, skip, k, chosen_.data(), scratch_.data());
  for (int i = 0; i < got; ++i) out[i] = {scores[chosen_[i]], pages[chosen_[i]]};
}

void TopKMerge::GlobalRow(const PageCandidate* first, std::size_t rank_stride, int ranks, int k,
                          std::vector<int32_t>* winners) {
  pool_.clear();
  for (int r = 0; r < ranks; ++r)
    for (int j = 0; j < k; ++j) {
      const PageCandidate& c = first[r * rank_stride + j];
      if (c.page >= 0) pool_.push_back(c);
    }
  std::sort(pool_.begin(), pool_.end(),
            [](const PageCandidate& a, const PageCandidate& b) { return a.page < b.page; });
  const int m = int(pool_.size());
  pool_scores_.resize(m);
  for (int i = 0; i < m; ++i) pool_scores_[i] = pool_[i].score;
  chosen_.resize(m);
  scratch_.resize(m);
  const int got = kernels::TopKCpu(pool_scores_.data(), m, nullptr, k, chosen_.data(), scratch_.data());
  winners->clear();
  for (int i = 0; i < got; ++i) winners->push_back(pool_[chosen_[i]].page);
}

void EmitContextSelection(const Geometry& g, const ContextStepPlan& plan, int num_pages,
                          const std::vector<std::vector<int32_t>>& winners, PageSelection* out) {
  const int rows_per_head = plan.rows / g.kv_heads;
  out->indptr.assign(1, 0);
  out->pages.clear();
  std::vector<int32_t> row;
  for (int h = 0; h < g.kv_heads; ++h) {
    row.clear();
    for (int i = 0; i < plan.sink; ++i) row.push_back(i);
    for (int i = num_pages - plan.local; i < num_pages; ++i) row.push_back(i);
    if (!winners.empty())
      for (int r = h * rows_per_head; r < (h + 1) * rows_per_head; ++r)
        row.insert(row.end(), winners[r].begin(), winners[r].end());
    std::sort(row.begin(), row.end());
    row.erase(std::unique(row.begin(), row.end()), row.end());
    out->pages.insert(out->pages.end(), row.begin(), row.end());
    out->indptr.push_back(int32_t(out->pages.size()));
  }
}

void MergeRankStates(const float* states, std::size_t stride, int ranks, int hq, int dim, float* o, float* lse) {
  std::fill(o, o + std::size_t(hq) * dim, 0.f);
  for (int h = 0; h < hq; ++h) {
    float m = kernels::kNegInf, d = 0.f;
    for (int r = 0; r < ranks; ++r) {
      const float* base = states + r * stride;
      const float* rm = base + std::size_t(hq) * dim;
      kernels::MergeState(o + std::size_t(h) * dim, m, d, base + std::size_t(h) * dim, rm[h], rm[hq + h], dim);
    }
    lse[h] = kernels::StateLse(m, d);
  }
}

}  // namespace questkv
