#include "parallel/context_parallel.h"

#include <string>

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
  const ContextStepPlan plan = PlanContextStep(g_, p_, in.layer, n);
  std::vector<std::vector<int32_t>> winners(plan.rows);
  if (plan.k > 0) {
    skip_.resize(owned_.size());
    for (std::size_t i = 0; i < owned_.size(); ++i) skip_[i] = plan.fixed(owned_[i], n);
    ScoreOwned(in);
    OwnCandidates(plan);
    QKV_RETURN_IF_ERROR(exchange_.Gather(comm, Header(in, kTagCandidates, plan.k), sent_.data(),
                                         sent_.size() * sizeof(PageCandidate)));
    gathered_.resize(sent_.size() * comm.size());
    for (int r = 0; r < comm.size(); ++r) exchange_.CopyPayload(r, gathered_.data() + r * sent_.size());
    for (int row = 0; row < plan.rows; ++row)
      merge_.GlobalRow(gathered_.data() + std::size_t(row) * plan.k, sent_.size(), comm.size(), plan.k,
                       &winners[row]);
  }
  out->first_kv_head = 0;
  EmitContextSelection(g_, plan, n, winners, &out->selection);
  AttendOwned(in, comm.rank(), comm.size(), out->selection);
  const std::size_t state_floats = std::size_t(g_.q_heads) * (g_.head_dim + 2);
  QKV_RETURN_IF_ERROR(exchange_.Gather(comm, Header(in, kTagStates, plan.dense ? -1 : plan.k), mine_.data(),
                                       state_floats * sizeof(float)));
  states_.resize(state_floats * comm.size());
  for (int r = 0; r < comm.size(); ++r) exchange_.CopyPayload(r, states_.data() + r * state_floats);
  out->o.resize(std::size_t(g_.q_heads) * g_.head_dim);
  out->lse.resize(g_.q_heads);
  MergeRankStates(states_.data(), state_floats, comm.size(), g_.q_heads, g_.head_dim, out->o.data(), out->lse.data());
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
                           g_.kv_heads, h, in.page_ids, n, scores_.data() + std::size_t(h) * group * n,
                           g_.e4m3_summaries());
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
// window, padded with page -1. The owned pages ascend in global order, so
// the global top-k is always among the ranks' candidates.
void ContextParallel::OwnCandidates(const ContextStepPlan& plan) {
  sent_.resize(std::size_t(plan.rows) * plan.k);
  for (int row = 0; row < plan.rows; ++row)
    merge_.OwnCandidates(RowScores(row), int(owned_.size()), skip_.data(), owned_.data(), plan.k,
                         sent_.data() + std::size_t(row) * plan.k);
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

}  // namespace questkv
