#include "selector/select.h"

#include "core/constants.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <utility>

#include "kernels/cpu/kernels_cpu.h"

namespace questkv {

Selector::Selector(const Geometry& g, const SelectionPolicy& p) : g_(g), p_(p) {}

namespace {

Status ValidateInput(const SelectInput& in, const Geometry& g, const PageSelection* out) {
  if (in.q == nullptr) return Status::InvalidArgument("Select: q is null");
  if (in.summary_slab == nullptr) return Status::InvalidArgument("Select: summary_slab is null");
  if (in.page_ids == nullptr) return Status::InvalidArgument("Select: page_ids is null");
  if (out == nullptr) return Status::InvalidArgument("Select: out is null");
  if (in.num_pages < 1)
    return Status::InvalidArgument("Select: num_pages = " + std::to_string(in.num_pages) +
                                   ", must be >= 1");
  if (in.layer < 0 || in.layer >= g.layers)
    return Status::InvalidArgument("Select: layer = " + std::to_string(in.layer) +
                                   " is not a layer of " + g.ToString());
  return Status::Ok();
}

// Appends the indices i with flags[i] != 0, ascending, as the next CSR row.
void EmitRow(const std::vector<uint8_t>& flags, int n, PageSelection* out) {
  for (int i = 0; i < n; ++i)
    if (flags[i]) out->pages.push_back(i);
  out->indptr.push_back(int32_t(out->pages.size()));
}

}  // namespace

Status Selector::Select(const SelectInput& in, PageSelection* out) { return Select(in, out, nullptr, 0); }

Status Selector::Select(const SelectInput& in, PageSelection* out, PageSelection* next, int next_pages) {
  QKV_RETURN_IF_ERROR(ValidateInput(in, g_, out));
  if (next) next->indptr.assign(1, 0), next->pages.clear();
  const int n = in.num_pages;
  out->indptr.assign(1, 0);
  out->pages.clear();
  scores_.clear();
  reranked_ = 0;
  boxes_read_ = 0;
  adaptive_pages_.clear();
  adaptive_capped_.clear();
  const int64_t page_budget = p_.page_budget(in.layer, g_.page_size);
  if (p_.is_dense(in.layer) || page_budget >= n) {
    // Every page is attended, so ranking would change nothing: skip scoring.
    mark_.assign(n, 1);
    for (int h = 0; h < g_.kv_heads; ++h) EmitRow(mark_, n, out);
    if (next)
      for (int h = 0; h < g_.kv_heads; ++h) next->indptr.push_back(0);
    return Status::Ok();
  }
  const int fixed = MarkSinkAndLocal(n);
  const int k = int(std::max<int64_t>(0, page_budget - fixed));
  const bool grouped = p_.group_pages > 0 && in.group_slab != nullptr;
  const bool rerank = p_.rerank > 0 && in.exact_scores;
  if (grouped) {
    scores_.assign(std::size_t(g_.q_heads) * n, -std::numeric_limits<float>::infinity());
  } else {
    ScoreAll(in);
    boxes_read_ = int64_t(n) * g_.kv_heads;
  }
  const int G = g_.group();
  const bool adaptive = p_.unread_bound_mass > 0;
  const int floor_k = int(std::clamp<int64_t>(p_.adaptive_floor / g_.page_size - fixed, 0, k));
  for (int h = 0; h < g_.kv_heads; ++h) {
    mark_.assign(skip_.begin(), skip_.end());
    if (p_.gqa == GqaMode::kUnion) {
      for (int gi = 0; gi < G; ++gi) {
        if (grouped) ScoreGrouped(in, h, gi, 1, GqaMode::kMax, n, k);
        const float* s = HeadScores(h * G + gi);
        MarkTopK(s, n, adaptive ? AdaptiveK(s, n, floor_k, k) : k);
      }
    } else {
      // The re-rank's candidates are the top ceil(rerank * k) by the bound.
      if (grouped) ScoreGrouped(in, h, 0, G, p_.gqa, n, rerank ? int(RerankCandidates(p_.rerank, k, n)) : k);
      Aggregate(h, n, p_.gqa);
      const int kh = adaptive ? AdaptiveK(agg_.data(), n, floor_k, k) : k;
      if (rerank) {
        QKV_RETURN_IF_ERROR(Rerank(in, h, n, kh));
      } else {
        MarkTopK(agg_.data(), n, kh);
      }
    }
    EmitRow(mark_, n, out);
    if (next) EmitRunnersUp(h, n, next_pages, next);
  }
  return Status::Ok();
}

// skip_ := sink ∪ local (these are taken regardless of score, so top-K skips
// them). The local window keeps at least the tail page even if a policy that
// bypassed validation says 0. Returns |sink ∪ local|.
int Selector::MarkSinkAndLocal(int n) {
  skip_.assign(n, 0);
  const int sink = std::min(p_.sink_pages, n);
  const int local = std::min(std::max(p_.local_pages, 1), n);
  for (int i = 0; i < sink; ++i) skip_[i] = 1;
  for (int i = n - local; i < n; ++i) skip_[i] = 1;
  int fixed = 0;
  for (int i = 0; i < n; ++i) fixed += skip_[i];
  return fixed;
}

void Selector::ScoreAll(const SelectInput& in) {
  const int n = in.num_pages;
  const int group = g_.group();
  scores_.resize(std::size_t(g_.q_heads) * n);
  for (int h = 0; h < g_.kv_heads; ++h)
    kernels::ScorePagesCpu(in.q + std::size_t(h) * group * g_.head_dim, group, g_.head_dim,
                           in.summary_slab, g_.kv_heads, h, in.page_ids, n,
                           scores_.data() + std::size_t(h) * group * n, g_.e4m3_summaries());
}

// Scores of query heads [first, first + heads) of KV head h's group, as
// ScoreAll writes them, for the pages of every group whose bound can reach the
// k-th best score (aggregated by `mode`) among the other groups' pages read
// before it; best bound first. A group's bound is the same ScorePagesCpu over
// its box, and both the bound and the aggregation are monotone in the box,
// rounding included: a page of a group whose bound is below the k-th score
// scores below it too, so the top k (ties toward the lower page) are those of
// the flat scan. The other pages keep -inf.
void Selector::ScoreGrouped(const SelectInput& in, int h, int first, int heads, GqaMode mode, int n, int k) {
  if (k <= 0) return;  // nothing to rank: no page is read
  const int B = p_.group_pages, D = g_.head_dim, groups = (n + B - 1) / B;
  const float* q = in.q + (std::size_t(h) * g_.group() + first) * D;
  const bool e4m3 = g_.e4m3_summaries();
  while (int(iota_.size()) < groups) iota_.push_back(uint32_t(iota_.size()));
  group_bound_.resize(std::size_t(heads) * groups);
  group_agg_.resize(groups);
  kernels::ScorePagesCpu(q, heads, D, in.group_slab, g_.kv_heads, h, iota_.data(), groups, group_bound_.data(), e4m3);
  AggregateGroupScores(group_bound_.data(), heads, groups, mode, group_agg_.data());
  // Boxes read once per KV head: kUnion's heads scan in turn, each reading
  // what it needs of the same boxes.
  if (first == 0) {
    boxes_read_ += groups;
    read_.assign(n, 0);
  }
  // NaN (unknown) bounds first: such a group is always read.
  auto key = [](float x) { return std::isnan(x) ? std::numeric_limits<float>::infinity() : x; };
  order_.resize(groups);
  for (int i = 0; i < groups; ++i) order_[i] = i;
  std::sort(order_.begin(), order_.end(), [&](int a, int b) {
    const float x = key(group_agg_[a]), y = key(group_agg_[b]);
    return x != y ? x > y : a < b;
  });
  best_.clear();
  const auto worse = std::greater<float>();  // min-heap: best_.front() is the k-th best
  for (int g : order_) {
    if (int(best_.size()) == k && key(group_agg_[g]) < best_.front()) break;  // so are the groups after it
    const int p0 = g * B, count = std::min(B, n - p0);
    page_scores_.resize(std::size_t(heads) * count);
    page_agg_.resize(count);
    kernels::ScorePagesCpu(q, heads, D, in.summary_slab, g_.kv_heads, h, in.page_ids + p0, count, page_scores_.data(),
                           e4m3);
    for (int j = 0; j < count; ++j) boxes_read_ += !std::exchange(read_[p0 + j], uint8_t(1));
    AggregateGroupScores(page_scores_.data(), heads, count, mode, page_agg_.data());
    for (int r = 0; r < heads; ++r)
      std::copy_n(page_scores_.data() + std::size_t(r) * count, count,
                  scores_.data() + (std::size_t(h) * g_.group() + first + r) * n + p0);
    for (int j = 0; j < count; ++j) {
      if (skip_[p0 + j]) continue;
      // NaN ranks below every number: as -inf it can only make the scan read more.
      const float x = std::isnan(page_agg_[j]) ? -std::numeric_limits<float>::infinity() : page_agg_[j];
      if (int(best_.size()) < k) {
        best_.push_back(x);
        std::push_heap(best_.begin(), best_.end(), worse);
      } else if (x > best_.front()) {
        std::pop_heap(best_.begin(), best_.end(), worse);
        best_.back() = x;
        std::push_heap(best_.begin(), best_.end(), worse);
      }
    }
  }
}

const float* Selector::HeadScores(int q_head) const {
  const std::size_t n = scores_.size() / g_.q_heads;
  return scores_.data() + q_head * n;
}

void AggregateGroupScores(const float* scores, int group, int n, GqaMode mode, float* out) {
  for (int i = 0; i < n; ++i) out[i] = scores[i];
  for (int gi = 1; gi < group; ++gi) {
    const float* s = scores + std::size_t(gi) * n;
    if (mode == GqaMode::kMax)
      for (int i = 0; i < n; ++i) out[i] = std::max(out[i], s[i]);
    else
      for (int i = 0; i < n; ++i) out[i] += s[i];
  }
  if (mode == GqaMode::kMean)
    for (int i = 0; i < n; ++i) out[i] /= float(group);
}

// agg_[i] := max or mean over the group's query heads of U_i.
void Selector::Aggregate(int kv_head, int n, GqaMode mode) {
  agg_.resize(n);
  AggregateGroupScores(HeadScores(kv_head * g_.group()), g_.group(), n, mode, agg_.data());
}

// The best `count` pages of KV head h by group-max score outside mark_.
void Selector::EmitRunnersUp(int h, int n, int count, PageSelection* next) {
  if (p_.gqa != GqaMode::kMax) Aggregate(h, n, GqaMode::kMax);
  chosen_.resize(n);
  scratch_.resize(n);
  const int got = kernels::TopKCpu(agg_.data(), n, mark_.data(), count, chosen_.data(), scratch_.data());
  next->pages.insert(next->pages.end(), chosen_.begin(), chosen_.begin() + got);
  next->indptr.push_back(int32_t(next->pages.size()));
}

// Candidates: the top ceil(rerank * k) by the bound (agg_); kept: the best k
// of them by exact score (a candidate without one keeps its bound), ties
// toward the lower page.
Status Selector::Rerank(const SelectInput& in, int kv_head, int n, int k) {
  const int c = int(RerankCandidates(p_.rerank, k, n));
  chosen_.resize(n);
  scratch_.resize(n);
  const int got = kernels::TopKCpu(agg_.data(), n, skip_.data(), c, chosen_.data(), scratch_.data());
  cand_.assign(chosen_.begin(), chosen_.begin() + got);
  exact_.assign(std::size_t(got), 0.f);
  QKV_RETURN_IF_ERROR(in.exact_scores(kv_head, cand_, exact_.data()));
  reranked_ += got;
  for (int i = 0; i < got; ++i)
    if (std::isnan(exact_[i])) exact_[i] = agg_[cand_[i]];
  // Best k among the candidates: TopKCpu over their exact scores.
  chosen_.resize(std::max(got, 1));
  scratch_.resize(std::max(got, 1));
  const int kept = kernels::TopKCpu(exact_.data(), got, nullptr, k, chosen_.data(), scratch_.data());
  for (int i = 0; i < kept; ++i) mark_[cand_[chosen_[i]]] = 1;
  return Status::Ok();
}

// The fewest of the top cap_k pages (outside skip_), at least floor_k, whose
// bound mass exp(U/sqrt(D)) leaves at most unread_bound_mass of all the
// ranked pages' bound mass unread. Masses are taken relative to the largest
// bound; an infinite or NaN largest bound (nothing to compare) takes the cap.
int Selector::AdaptiveK(const float* scores, int n, int floor_k, int cap_k) {
  const float scale = 1.f / std::sqrt(float(g_.head_dim));
  float top = -std::numeric_limits<float>::infinity();
  int ranked = 0;
  for (int i = 0; i < n; ++i)
    if (!skip_[i]) top = std::max(top, scores[i]), ++ranked;  // std::max keeps top over a NaN score
  int k = std::min(cap_k, ranked);
  if (std::isfinite(top)) {
    double total = 0;
    for (int i = 0; i < n; ++i)
      if (!skip_[i] && !std::isnan(scores[i])) total += std::exp(double(scores[i] - top) * scale);
    chosen_.resize(n);
    scratch_.resize(n);
    const int got = kernels::TopKCpu(scores, n, skip_.data(), k, chosen_.data(), scratch_.data());
    ranked_.assign(chosen_.begin(), chosen_.begin() + got);
    std::sort(ranked_.begin(), ranked_.end(), [&](int a, int b) {
      const bool na = std::isnan(scores[a]), nb = std::isnan(scores[b]);
      if (na != nb) return nb;
      return !na && scores[a] != scores[b] ? scores[a] > scores[b] : a < b;
    });
    const double unread_limit = p_.unread_bound_mass * total;
    double unread = total;
    for (k = 0; k < got && (k < floor_k || unread > unread_limit); ++k)
      if (!std::isnan(scores[ranked_[k]])) unread -= std::exp(double(scores[ranked_[k]] - top) * scale);
  }
  adaptive_pages_.push_back(k);
  adaptive_capped_.push_back(k == cap_k);
  return k;
}

void Selector::MarkTopK(const float* scores, int n, int k) {
  chosen_.resize(n);
  scratch_.resize(n);
  const int got = kernels::TopKCpu(scores, n, skip_.data(), k, chosen_.data(), scratch_.data());
  for (int i = 0; i < got; ++i) mark_[chosen_[i]] = 1;
}

}  // namespace questkv
