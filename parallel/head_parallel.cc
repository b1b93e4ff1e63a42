#include "parallel/head_parallel.h"

#include <algorithm>
#include <limits>
#include <string>

#include "kernels/attention_state.h"

namespace questkv {

namespace {

constexpr int32_t kTagOutputs = 3;

}  // namespace

HeadParallel::HeadParallel(const Geometry& g, const SelectionPolicy& p, std::vector<int> head_counts)
    : g_(g), p_(p), head_counts_(std::move(head_counts)) {}

Result<HeadRange> HeadParallel::HeadsOf(int ranks, int rank) const {
  QKV_ASSIGN_OR_RETURN(const std::vector<HeadRange> ranges, SplitHeads(g_.kv_heads, ranks, head_counts_));
  if (rank < 0 || rank >= ranks)
    return Status::InvalidArgument("head parallel: rank " + std::to_string(rank) + " is not in [0, " +
                                   std::to_string(ranks) + ")");
  return ranges[rank];
}

Status HeadParallel::Decode(Communicator& comm, const HeadShard& in, ParallelDecodeOutput* out) {
  QKV_RETURN_IF_ERROR(AbortIfError(comm, Validate(comm, in, out)));
  return DecodeValid(comm, in, out);
}

// Fills ranges_ and makes selector_ fit this rank's heads.
Status HeadParallel::Validate(const Communicator& comm, const HeadShard& in, const ParallelDecodeOutput* out) {
  QKV_ASSIGN_OR_RETURN(ranges_, SplitHeads(g_.kv_heads, comm.size(), head_counts_));
  QKV_RETURN_IF_ERROR(ValidateStep(g_, in.q, in.scale, in.num_pages, in.tail_len, in.layer));
  if (out == nullptr) return Status::InvalidArgument("head parallel: out is null");
  if (in.summary_slab == nullptr || in.page_ids == nullptr || in.pages == nullptr)
    return Status::InvalidArgument("head parallel: rank " + std::to_string(comm.rank()) +
                                   ": summary_slab, page_ids or pages is null");
  Geometry local = g_;
  local.kv_heads = ranges_[comm.rank()].count;
  local.q_heads = local.kv_heads * g_.group();
  if (selector_ == nullptr || local.kv_heads != local_.kv_heads) {
    local_ = local;
    selector_ = std::make_unique<Selector>(local_, p_);
  }
  return Status::Ok();
}

Status HeadParallel::DecodeValid(Communicator& comm, const HeadShard& in, ParallelDecodeOutput* out) {
  QKV_RETURN_IF_ERROR(selector_->Select({in.q, in.summary_slab, in.page_ids, in.num_pages, in.layer},
                                        &out->selection));
  out->first_kv_head = ranges_[comm.rank()].first;
  int max_heads = 0;
  for (const HeadRange& r : ranges_) max_heads = std::max(max_heads, r.count);
  AttendOwn(in, out->selection, max_heads);
  const int64_t budget = std::min<int64_t>(p_.page_budget(in.layer, g_.page_size), std::numeric_limits<int32_t>::max());
  const StepHeader header{kTagOutputs, in.num_pages, in.layer,     in.tail_len,     g_.q_heads,
                          g_.kv_heads, g_.head_dim,  g_.page_size, int32_t(budget), int32_t(p_.gqa)};
  QKV_RETURN_IF_ERROR(exchange_.Gather(comm, header, mine_.data(), mine_.size() * sizeof(float)));
  all_.resize(mine_.size() * comm.size());
  for (int r = 0; r < comm.size(); ++r) exchange_.CopyPayload(r, all_.data() + r * mine_.size());
  Unpack(comm.size(), max_heads, out);
  return Status::Ok();
}

// mine_ := this rank's outputs and log-sum-exps, padded to max_heads KV heads
// so that every rank sends the same number of bytes.
void HeadParallel::AttendOwn(const HeadShard& in, const PageSelection& sel, int max_heads) {
  const int group = g_.group(), dim = g_.head_dim, heads = local_.kv_heads;
  const std::size_t max_q = std::size_t(max_heads) * group;
  mine_.assign(max_q * (dim + 1), 0.f);
  m_.resize(std::size_t(heads) * group);
  d_.resize(std::size_t(heads) * group);
  const HeldPages held{in.pages, heads, g_.page_size, dim, in.num_pages - 1, in.tail_len};
  for (int h = 0; h < heads; ++h) {
    idx_.assign(sel.row(h), sel.row(h) + sel.count(h));
    const std::size_t q0 = std::size_t(h) * group;
    AttendHeldPages(held, h, idx_, in.q + q0 * dim, group, in.scale, &refs_, mine_.data() + q0 * dim,
                    m_.data() + q0, d_.data() + q0);
  }
  float* lse = mine_.data() + max_q * dim;
  for (std::size_t i = 0; i < m_.size(); ++i) lse[i] = kernels::StateLse(m_[i], d_[i]);
}

// out->o, out->lse := every rank's query heads at their place in the model.
void HeadParallel::Unpack(int ranks, int max_heads, ParallelDecodeOutput* out) const {
  const int group = g_.group(), dim = g_.head_dim;
  const std::size_t max_q = std::size_t(max_heads) * group;
  out->o.resize(std::size_t(g_.q_heads) * dim);
  out->lse.resize(g_.q_heads);
  for (int r = 0; r < ranks; ++r) {
    const float* part = all_.data() + r * max_q * (dim + 1);
    const std::size_t q_first = std::size_t(ranges_[r].first) * group;
    const std::size_t q_count = std::size_t(ranges_[r].count) * group;
    std::copy(part, part + q_count * dim, out->o.begin() + q_first * dim);
    std::copy(part + max_q * dim, part + max_q * dim + q_count, out->lse.begin() + q_first);
  }
}

}  // namespace questkv
