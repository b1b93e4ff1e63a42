#include "parallel/context_parallel.h"

#include <algorithm>
#include <string>

#include "kernels/attention_state.h"

namespace questkv {

namespace {

constexpr int32_t kTagCandidates = 1;
constexpr int32_t kTagStates = 2;

}  // namespace

ContextParallel::ContextParallel(const Geometry& g, const SelectionPolicy& p, ShardLayout layout)
    : g_(g), p_(p), layout_(layout) {}

Status ContextParallel::Decode(Communicator& comm, const ContextShard& in, ParallelDecodeOutput* out) {
  QKV_RETURN_IF_ERROR(AbortIfError(comm, Validate(comm, in, out)));
  return DecodeValid(comm, in, out);
}

// Fills owned_ with this rank's share.
Status ContextParallel::Validate(const Communicator& comm, const ContextShard& in, const ParallelDecodeOutput* out) {
  QKV_RETURN_IF_ERROR(ValidateStep(g_, in.q, in.scale, in.num_pages, in.tail_len, in.layer));
  if (out == nullptr) return Status::InvalidArgument("context parallel: out is null");
  QKV_ASSIGN_OR_RETURN(owned_, ShardPages(layout_, in.num_pages, comm.size(), comm.rank()));
  if (in.num_local != int(owned_.size()))
    return Status::InvalidArgument("context parallel: rank " + std::to_string(comm.rank()) + " holds " +
                                   std::to_string(in.num_local) + " pages; the " +
                                   std::string(ShardLayoutName(layout_)) + " layout of " +
                                   std::to_string(in.num_pages) + " pages over " + std::to_string(comm.size()) +
                                   " ranks gives it " + std::to_string(owned_.size()));
  if (in.num_local > 0 && (in.summary_slab == nullptr || in.page_ids == nullptr || in.pages == nullptr))
    return Status::InvalidArgument("context parallel: rank " + std::to_string(comm.rank()) + " holds " +
                                   std::to_string(in.num_local) + " pages but summary_slab, page_ids or pages is null");
  return Status::Ok();
}

Status ContextParallel::DecodeValid(Communicator& comm, const ContextShard& in, ParallelDecodeOutput* out) {
  const int n = in.num_pages;
  const int64_t budget = p_.page_budget(in.layer, g_.page_size);
  const bool dense = p_.is_dense(in.layer) || budget >= n;
  // Sink and local window as Selector::MarkSinkAndLocal takes them (the
  // window keeps at least the tail); a dense step is a window of every page.
  const int sink = dense ? 0 : std::min(p_.sink_pages, n);
  const int local = dense ? n : std::min(std::max(p_.local_pages, 1), n);
  const int k = dense ? 0 : int(std::max<int64_t>(0, budget - std::min(n, sink + local)));
  const int rows = p_.gqa == GqaMode::kUnion ? g_.q_heads : g_.kv_heads;
  std::vector<std::vector<int32_t>> winners(rows);
  if (k > 0) {
    skip_.resize(owned_.size());
    for (std::size_t i = 0; i < owned_.size(); ++i) skip_[i] = owned_[i] < sink || owned_[i] >= n - local;
    ScoreOwned(in);
    OwnCandidates(k);
    QKV_RETURN_IF_ERROR(exchange_.Gather(comm, Header(in, kTagCandidates, k), sent_.data(),
                                         sent_.size() * sizeof(Candidate)));
    gathered_.resize(sent_.size() * comm.size());
    for (int r = 0; r < comm.size(); ++r) exchange_.CopyPayload(r, gathered_.data() + r * sent_.size());
    GlobalTopK(comm.size(), k, &winners);
  }
  out->first_kv_head = 0;
  EmitSelection(n, sink, local, winners, &out->selection);
  AttendOwned(in, comm.rank(), comm.size(), out->selection);
  const std::size_t state_floats = std::size_t(g_.q_heads) * (g_.head_dim + 2);
  QKV_RETURN_IF_ERROR(exchange_.Gather(comm, Header(in, kTagStates, dense ? -1 : k), mine_.data(),
                                       state_floats * sizeof(float)));
  states_.resize(state_floats * comm.size());
  for (int r = 0; r < comm.size(); ++r) exchange_.CopyPayload(r, states_.data() + r * state_floats);
  MergeStates(comm.size(), out);
  return Status::Ok();
}

StepHeader ContextParallel::Header(const ContextShard& in, int tag, int top_k) const {
  return {tag,       in.num_pages, in.layer,   in.tail_len, g_.q_heads,
          g_.kv_heads, g_.head_dim,  g_.page_size, top_k,     int32_t(p_.gqa)};
}

// scores_ [Hq][num_local] := U_p(q) of the owned pages.
void ContextParallel::ScoreOwned(const ContextShard& in) {
  const int n = int(owned_.size());
  const int group = g_.group();
  scores_.resize(std::size_t(g_.q_heads) * n);
  if (n == 0) return;
  for (int h = 0; h < g_.kv_heads; ++h)
    kernels::ScorePagesCpu(in.q + std::size_t(h) * group * g_.head_dim, group, g_.head_dim, in.summary_slab,
                           g_.kv_heads, h, in.page_ids, n, scores_.data() + std::size_t(h) * group * n);
}

// The ranking of one candidate row over the owned pages: a query head's
// scores (union), or the KV head's group aggregated as the Selector does it.
const float* ContextParallel::RowScores(int row) {
  const std::size_t n = owned_.size();
  if (p_.gqa == GqaMode::kUnion) return scores_.data() + row * n;
  agg_.resize(n);
  AggregateGroupScores(scores_.data() + row * g_.group() * n, g_.group(), int(n), p_.gqa, agg_.data());
  return agg_.data();
}

// sent_ [rows][k] := each row's k best owned pages outside sink and local
// window, padded with page -1. The owned pages are in ascending global
// order, so TopKCpu's ties toward the lower index are ties toward the lower
// global page: the global top-k is always among the ranks' candidates.
void ContextParallel::OwnCandidates(int k) {
  const int n = int(owned_.size());
  const int rows = p_.gqa == GqaMode::kUnion ? g_.q_heads : g_.kv_heads;
  sent_.assign(std::size_t(rows) * k, Candidate{kernels::kNegInf, -1});
  chosen_.resize(n);
  scratch_.resize(n);
  for (int row = 0; row < rows; ++row) {
    const float* s = RowScores(row);
    const int got = kernels::TopKCpu(s, n, skip_.data(), k, chosen_.data(), scratch_.data());
    for (int i = 0; i < got; ++i) sent_[std::size_t(row) * k + i] = {s[chosen_[i]], owned_[chosen_[i]]};
  }
}

// winners[row] := the k best of every rank's candidates for the row, by the
// TopKCpu order over the candidates sorted by global page. Every rank runs
// this on the same gathered bytes, so every rank gets the same winners.
void ContextParallel::GlobalTopK(int ranks, int k, std::vector<std::vector<int32_t>>* winners) {
  const std::size_t rows = winners->size();
  for (std::size_t row = 0; row < rows; ++row) {
    pool_.clear();
    for (int r = 0; r < ranks; ++r)
      for (int j = 0; j < k; ++j) {
        const Candidate& c = gathered_[(r * rows + row) * k + j];
        if (c.page >= 0) pool_.push_back(c);
      }
    std::sort(pool_.begin(), pool_.end(), [](const Candidate& a, const Candidate& b) { return a.page < b.page; });
    const int m = int(pool_.size());
    pool_scores_.resize(m);
    for (int i = 0; i < m; ++i) pool_scores_[i] = pool_[i].score;
    chosen_.resize(m);
    scratch_.resize(m);
    const int got = kernels::TopKCpu(pool_scores_.data(), m, nullptr, k, chosen_.data(), scratch_.data());
    (*winners)[row].clear();
    for (int i = 0; i < got; ++i) (*winners)[row].push_back(pool_[chosen_[i]].page);
  }
}

// Per KV head, ascending: sink pages ∪ local window ∪ the winners of its rows.
void ContextParallel::EmitSelection(int n, int sink, int local, const std::vector<std::vector<int32_t>>& winners,
                                    PageSelection* out) const {
  const int rows_per_head = p_.gqa == GqaMode::kUnion ? g_.group() : 1;
  out->indptr.assign(1, 0);
  out->pages.clear();
  std::vector<int32_t> row;
  for (int h = 0; h < g_.kv_heads; ++h) {
    row.clear();
    for (int i = 0; i < sink; ++i) row.push_back(i);
    for (int i = n - local; i < n; ++i) row.push_back(i);
    for (int r = h * rows_per_head; r < (h + 1) * rows_per_head; ++r)
      row.insert(row.end(), winners[r].begin(), winners[r].end());
    std::sort(row.begin(), row.end());
    row.erase(std::unique(row.begin(), row.end()), row.end());
    out->pages.insert(out->pages.end(), row.begin(), row.end());
    out->indptr.push_back(int32_t(out->pages.size()));
  }
}

// mine_ ([o: Hq][D] [m: Hq] [d: Hq]) := the partial state
// of every query head over the selected pages this rank owns.
void ContextParallel::AttendOwned(const ContextShard& in, int rank, int ranks, const PageSelection& sel) {
  const int n = in.num_pages, group = g_.group(), hq = g_.q_heads, dim = g_.head_dim;
  const HeldPages held{in.pages,   g_.kv_heads, g_.page_size, dim, LocalPageIndex(layout_, n, ranks, rank, n - 1),
                       in.tail_len};
  mine_.resize(std::size_t(hq) * (dim + 2));
  float* o = mine_.data();
  float* m = o + std::size_t(hq) * dim;
  float* d = m + hq;
  for (int h = 0; h < g_.kv_heads; ++h) {
    own_idx_.clear();
    for (int i = 0; i < sel.count(h); ++i) {
      const int li = LocalPageIndex(layout_, n, ranks, rank, sel.row(h)[i]);
      if (li >= 0) own_idx_.push_back(li);
    }
    const std::size_t q0 = std::size_t(h) * group;
    AttendHeldPages(held, h, own_idx_, in.q + q0 * dim, group, in.scale, &refs_, o + q0 * dim, m + q0, d + q0);
  }
}

// out->o, out->lse := the ranks' partial states merged in rank order.
void ContextParallel::MergeStates(int ranks, ParallelDecodeOutput* out) const {
  const int hq = g_.q_heads, dim = g_.head_dim;
  const std::size_t stride = std::size_t(hq) * (dim + 2);
  out->o.assign(std::size_t(hq) * dim, 0.f);
  out->lse.resize(hq);
  for (int h = 0; h < hq; ++h) {
    float m = kernels::kNegInf, d = 0.f;
    for (int r = 0; r < ranks; ++r) {
      const float* base = states_.data() + r * stride;
      const float* rm = base + std::size_t(hq) * dim;
      kernels::MergeState(out->o.data() + std::size_t(h) * dim, m, d, base + std::size_t(h) * dim, rm[h], rm[hq + h],
                          dim);
    }
    out->lse[h] = kernels::StateLse(m, d);
  }
}

}  // namespace questkv
