// GpuDecoder's decode steps (parallel/gpu_decode.h): context parallel
// (select on the device, candidates exchanged, attend the winners, states
// merged in rank order) and head parallel (select and attend on the device,
// outputs gathered).
#include <cmath>
#include <limits>
#include <string>

#include "parallel/gpu_decode_impl.h"

namespace questkv {

namespace {

namespace kc = kernels::cuda;
namespace gd = gpu_decode;

constexpr int32_t kTagCandidates = 4;
constexpr int32_t kTagStates = 5;
constexpr int32_t kTagOutputs = 6;

}  // namespace

Status GpuDecoder::Decode(Communicator& comm, const float* q, int layer, float scale,
                          std::vector<ParallelDecodeOutput>* out) {
  Impl& m = *impl_;
  const auto t0 = std::chrono::steady_clock::now();
  m.times = {};
  Status st = ValidateStep(m.g, q, scale, m.batch[0].num_pages, m.batch[0].tail_len, layer);
  if (st.ok() && out == nullptr) st = Status::InvalidArgument("GpuDecoder::Decode: out is null");
  if (st.ok() && (comm.size() != m.ranks || comm.rank() != m.rank))
    st = Status::InvalidArgument("GpuDecoder::Decode: made for rank " + std::to_string(m.rank) + " of " +
                                 std::to_string(m.ranks) + ", called as rank " + std::to_string(comm.rank()) +
                                 " of " + std::to_string(comm.size()));
  if (st.ok()) st = gd::CudaStatus("cudaSetDevice", cudaSetDevice(m.dev));
  gd::LayerPlan* lp = nullptr;
  if (st.ok()) {
    Result<gd::LayerPlan*> planned = m.PlanFor(layer);
    st = planned.status();
    if (planned.ok()) lp = *planned;
  }
  if (st.ok()) st = m.UploadQ(q);
  QKV_RETURN_IF_ERROR(AbortIfError(comm, st));
  out->resize(m.batch.size());
  st = m.o.mode == GpuParallelMode::kContext ? m.DecodeContext(comm, *lp, layer, scale, out)
                                              : m.DecodeHead(comm, *lp, layer, scale, out);
  m.times.total_us = gd::MicrosSince(t0);
  return AbortIfError(comm, st);
}

StepHeader GpuDecoder::Impl::Header(int tag, int layer, int top_k) const {
  int32_t pages = 0, tails = 0;
  for (const GpuSequence& s : batch) {
    pages += s.num_pages;
    tails += s.tail_len;
  }
  return {tag, pages, layer, tails, g.q_heads, g.kv_heads, g.head_dim, g.page_size, top_k, int32_t(p.gqa)};
}

Status GpuDecoder::Impl::Gather(Communicator& comm, const StepHeader& h, const void* payload, std::size_t bytes) {
  const auto t0 = std::chrono::steady_clock::now();
  Status st = exchange.Gather(comm, h, payload, bytes);
  times.exchange_us += gd::MicrosSince(t0);
  return st;
}

// q_host, q32 := the held query heads of q ([batch][Hq][D]); q16 := q32 in f16.
Status GpuDecoder::Impl::UploadQ(const float* q) {
  const std::size_t dim = g.head_dim, held = std::size_t(held_q_heads()) * dim;
  for (int b = 0; b < batch_size(); ++b)
    std::memcpy(q_host.get() + b * held, q + (std::size_t(b) * g.q_heads + std::size_t(first_head) * g.group()) * dim,
                held * sizeof(float));
  QKV_RETURN_IF_ERROR(gd::CopyAsync(q32, q_host, q_host.size(), stream));
  QKV_CUDA(kc::LaunchConvert(q32.get(), DType::kF32, q16.get(), DType::kF16, q32.size(), stream));
  return Status::Ok();
}

// LaunchSelect's arguments for the layer's select over the page lists given;
// with slot_of (hbm_slot, [PageId][heads]), the chosen pages' slots too.
kc::SelectParams GpuDecoder::Impl::SelectArgs(LayerPlan& lp, const float* q, const int32_t* lists_indptr,
                                              const uint32_t* lists_ids, const int32_t* slot_of) const {
  kc::SelectParams sp;
  sp.shape = lp.select_shape;
  sp.q_dtype = DType::kF32;
  sp.summary_dtype = DType::kF16;
  sp.q = q;
  sp.summaries = summaries.get();
  sp.page_indptr = lists_indptr;
  sp.page_ids = lists_ids;
  sp.hbm_slot = slot_of;
  sp.out_indptr = lp.sel_indptr.get();
  sp.out_pages = lp.sel_pages.get();
  sp.out_slots = slot_of ? lp.sel_slots.get() : nullptr;
  sp.out_count = lp.sel_count.get();
  sp.workspace = lp.select_ws.get();
  return sp;
}

// RunAttend's arguments: q16 over the slot pool into o16 and lse.
kc::AttendParams GpuDecoder::Impl::AttendArgs(LayerPlan& lp, float scale, const int32_t* indptr,
                                              const int32_t* count, const int32_t* slot_ids,
                                              const int32_t* last) const {
  kc::AttendParams ap;
  ap.scale = scale;
  ap.q = q16.get();
  ap.slots = slots.get();
  ap.indptr = indptr;
  ap.count = count;
  ap.slot_ids = slot_ids;
  ap.last_len = last;
  ap.o = o16.get();
  ap.lse = lse.get();
  ap.workspace = lp.attend_ws.get();
  return ap;
}

// Called once the stream has finished the step. An elapsed time that cannot
// be read is reported as 0 and its error cleared: left set, it would come
// back from the next kernel launcher's cudaGetLastError as that launch's.
void GpuDecoder::Impl::ReadDeviceTimes(bool selected) {
  auto elapsed_us = [](cudaEvent_t a, cudaEvent_t b) {
    float ms = 0.f;
    if (cudaEventElapsedTime(&ms, a, b) == cudaSuccess) return 1e3 * ms;
    (void)cudaGetLastError();
    return 0.0;
  };
  times.select_gpu_us = selected ? elapsed_us(ev[0], ev[1]) : 0.0;
  times.attend_gpu_us = elapsed_us(ev[2], ev[3]);
}

// ---- context parallel --------------------------------------------------------------

Status GpuDecoder::Impl::DecodeContext(Communicator& comm, LayerPlan& lp, int layer, float scale,
                                       std::vector<ParallelDecodeOutput>* out) {
  QKV_RETURN_IF_ERROR(SelectContext(comm, lp, layer));
  for (int b = 0; b < batch_size(); ++b) {
    (*out)[b].first_kv_head = 0;
    EmitContextSelection(g, lp.steps[b], batch[b].num_pages, winners[b], &(*out)[b].selection);
  }
  QKV_RETURN_IF_ERROR(AttendContext(lp, scale, *out));
  QKV_RETURN_IF_ERROR(MergeContext(comm, layer, lp.k, out));
  ReadDeviceTimes(!lp.ranked.empty());
  return Status::Ok();
}

// winners[b] := each ranked sequence's global top-K per ranking row (empty
// rows for the others), from every rank's candidates.
Status GpuDecoder::Impl::SelectContext(Communicator& comm, LayerPlan& lp, int layer) {
  const int B = batch_size(), dim = g.head_dim, group = g.group();
  winners.resize(B);
  for (int b = 0; b < B; ++b) winners[b].assign(lp.steps[b].rows, {});
  if (lp.ranked.empty()) return Status::Ok();
  const bool unioned = p.gqa == GqaMode::kUnion;
  const int br = int(lp.ranked.size()), rows = lp.steps[0].rows;
  // The select's queries, per ranked sequence [Hkv][G][D]; under kUnion
  // [G copies][ranked][Hkv][D], copy c holding query head h * G + c.
  float* qs = lp.q_select_host.get();
  for (int c = 0; c < (unioned ? group : 1); ++c)
    for (int rb = 0; rb < br; ++rb) {
      const float* qb = q_host.get() + std::size_t(lp.ranked[rb]) * g.q_heads * dim;
      if (!unioned) {
        std::memcpy(qs + std::size_t(rb) * g.q_heads * dim, qb, std::size_t(g.q_heads) * dim * sizeof(float));
        continue;
      }
      for (int h = 0; h < g.kv_heads; ++h)
        std::memcpy(qs + ((std::size_t(c) * br + rb) * g.kv_heads + h) * dim, qb + (std::size_t(h) * group + c) * dim,
                    dim * sizeof(float));
    }
  QKV_RETURN_IF_ERROR(gd::CopyAsync(lp.q_select, lp.q_select_host, lp.q_select.size(), stream));
  const kc::SelectParams sp = SelectArgs(lp, lp.q_select.get(), lp.list_indptr.get(), lp.list_ids.get(), nullptr);
  gd::CandidateParams cp;
  cp.rows = lp.select_shape.batch * g.kv_heads;
  cp.kv_heads = g.kv_heads;
  cp.group = lp.select_shape.group;
  cp.head_dim = dim;
  cp.k = lp.k;
  cp.mean = lp.select_shape.gqa == GqaMode::kMean;
  cp.q = lp.q_select.get();
  cp.summaries = summaries.get();
  cp.page_indptr = lp.list_indptr.get();
  cp.page_ids = lp.list_ids.get();
  cp.global_page = lp.list_global.get();
  cp.sel_indptr = lp.sel_indptr.get();
  cp.sel_pages = lp.sel_pages.get();
  cp.sel_count = lp.sel_count.get();
  cp.row_offset = lp.row_offset.get();
  cp.out = lp.cand.get();
  QKV_CUDA(cudaEventRecord(ev[0], stream));
  QKV_CUDA(kc::LaunchSelect(lp.select, sp, stream));
  QKV_CUDA(gd::LaunchCandidateScores(cp, stream));
  QKV_CUDA(cudaEventRecord(ev[1], stream));
  QKV_RETURN_IF_ERROR(gd::CopyAsync(lp.cand_host, lp.cand, lp.cand.size(), stream));
  QKV_CUDA(cudaStreamSynchronize(stream));
  const std::size_t sent = lp.cand.size();
  QKV_RETURN_IF_ERROR(Gather(comm, Header(kTagCandidates, layer, lp.k), lp.cand_host.get(),
                             sent * sizeof(PageCandidate)));
  lp.gathered.resize(sent * comm.size());
  for (int r = 0; r < comm.size(); ++r) exchange.CopyPayload(r, lp.gathered.data() + r * sent);
  for (int rb = 0; rb < br; ++rb)
    for (int row = 0; row < rows; ++row)
      merge.GlobalRow(lp.gathered.data() + (std::size_t(rb) * rows + row) * lp.k, sent, comm.size(), lp.k,
                      &winners[lp.ranked[rb]][row]);
  return Status::Ok();
}

// o16, lse (then o_host, lse_host) := this rank's partial states over the
// selected pages it owns, rows (sequence, KV head).
Status GpuDecoder::Impl::AttendContext(LayerPlan& lp, float scale, const std::vector<ParallelDecodeOutput>& out) {
  const int hkv = g.kv_heads;
  int32_t* indptr = lp.att_indptr_host.get();
  int32_t* ids = lp.att_slots_host.get();
  std::size_t e = 0;
  indptr[0] = 0;
  for (int b = 0; b < batch_size(); ++b) {
    const int n = batch[b].num_pages;
    const PageSelection& sel = out[b].selection;
    for (int h = 0; h < hkv; ++h) {
      for (int i = 0; i < sel.count(h); ++i) {
        const int li = LocalPageIndex(o.layout, n, ranks, rank, sel.row(h)[i]);
        if (li < 0) continue;
        if (e == lp.att_slots.size()) return Status::Internal("GpuDecoder: more attended pages than planned");
        ids[e++] = int32_t((local_first[b] + li) * hkv + h);
      }
      indptr[b * hkv + h + 1] = int32_t(e);
    }
    // The tail, when held, is the last entry of each of its rows.
    lp.att_last_host.get()[b] = LocalPageIndex(o.layout, n, ranks, rank, n - 1) >= 0 ? batch[b].tail_len : g.page_size;
  }
  QKV_RETURN_IF_ERROR(gd::CopyAsync(lp.att_indptr, lp.att_indptr_host, lp.att_indptr.size(), stream));
  QKV_RETURN_IF_ERROR(gd::CopyAsync(lp.att_slots, lp.att_slots_host, e, stream));
  QKV_RETURN_IF_ERROR(gd::CopyAsync(lp.att_last, lp.att_last_host, lp.att_last.size(), stream));
  const kc::AttendParams ap =
      AttendArgs(lp, scale, lp.att_indptr.get(), nullptr, lp.att_slots.get(), lp.att_last.get());
  QKV_CUDA(cudaEventRecord(ev[2], stream));
  QKV_CUDA(kc::RunAttend(lp.attend, ap, stream));
  QKV_CUDA(cudaEventRecord(ev[3], stream));
  QKV_RETURN_IF_ERROR(gd::CopyAsync(o_host, o16, o16.size(), stream));
  QKV_RETURN_IF_ERROR(gd::CopyAsync(lse_host, lse, lse.size(), stream));
  QKV_CUDA(cudaStreamSynchronize(stream));
  return Status::Ok();
}

// out[b].o, lse := every rank's partial states, as (o, m = lse, d = 1) or the
// empty state, merged in rank order.
Status GpuDecoder::Impl::MergeContext(Communicator& comm, int layer, int top_k,
                                      std::vector<ParallelDecodeOutput>* out) {
  const int B = batch_size(), hq = g.q_heads, dim = g.head_dim;
  const std::size_t per_seq = std::size_t(hq) * (dim + 2);
  mine.resize(per_seq * B);
  for (int b = 0; b < B; ++b) {
    float* o = mine.data() + b * per_seq;
    float* m = o + std::size_t(hq) * dim;
    for (std::size_t i = 0; i < std::size_t(hq) * dim; ++i) o[i] = __half2float(o_host.get()[b * hq * dim + i]);
    for (int h = 0; h < hq; ++h) {
      const float l = lse_host.get()[b * hq + h];
      const bool empty = std::isinf(l) && l < 0;
      m[h] = l;
      m[hq + h] = empty ? 0.f : 1.f;
    }
  }
  QKV_RETURN_IF_ERROR(Gather(comm, Header(kTagStates, layer, top_k), mine.data(), mine.size() * sizeof(float)));
  all.resize(mine.size() * comm.size());
  for (int r = 0; r < comm.size(); ++r) exchange.CopyPayload(r, all.data() + r * mine.size());
  for (int b = 0; b < B; ++b) {
    (*out)[b].o.resize(std::size_t(hq) * dim);
    (*out)[b].lse.resize(hq);
    MergeRankStates(all.data() + b * per_seq, mine.size(), comm.size(), hq, dim, (*out)[b].o.data(),
                    (*out)[b].lse.data());
  }
  return Status::Ok();
}

// ---- head parallel -------------------------------------------------------------------

Status GpuDecoder::Impl::DecodeHead(Communicator& comm, LayerPlan& lp, int layer, float scale,
                                    std::vector<ParallelDecodeOutput>* out) {
  const kc::SelectParams sp = SelectArgs(lp, q32.get(), page_indptr.get(), page_ids.get(), hbm_slot.get());
  const kc::AttendParams ap =
      AttendArgs(lp, scale, lp.sel_indptr.get(), lp.sel_count.get(), lp.sel_slots.get(), last_len.get());
  QKV_CUDA(cudaEventRecord(ev[0], stream));
  QKV_CUDA(kc::LaunchSelect(lp.select, sp, stream));
  QKV_CUDA(cudaEventRecord(ev[1], stream));
  QKV_CUDA(cudaEventRecord(ev[2], stream));
  QKV_CUDA(kc::RunAttend(lp.attend, ap, stream));
  QKV_CUDA(cudaEventRecord(ev[3], stream));
  QKV_RETURN_IF_ERROR(gd::CopyAsync(o_host, o16, o16.size(), stream));
  QKV_RETURN_IF_ERROR(gd::CopyAsync(lse_host, lse, lse.size(), stream));
  if (o.selection_to_host) {
    QKV_RETURN_IF_ERROR(gd::CopyAsync(lp.sel_pages_host, lp.sel_pages, lp.sel_pages.size(), stream));
    QKV_RETURN_IF_ERROR(gd::CopyAsync(lp.sel_count_host, lp.sel_count, lp.sel_count.size(), stream));
  }
  QKV_CUDA(cudaStreamSynchronize(stream));
  // This rank's outputs and log-sum-exps per sequence, padded to the widest
  // rank's heads so that every rank sends the same bytes.
  int max_heads = 0;
  for (const HeadRange& r : head_ranges) max_heads = std::max(max_heads, r.count);
  const int group = g.group(), dim = g.head_dim, held = held_q_heads();
  const std::size_t max_q = std::size_t(max_heads) * group, per_seq = max_q * (dim + 1);
  mine.assign(per_seq * batch_size(), 0.f);
  for (int b = 0; b < batch_size(); ++b) {
    float* dst = mine.data() + b * per_seq;
    for (std::size_t i = 0; i < std::size_t(held) * dim; ++i) dst[i] = __half2float(o_host.get()[b * held * dim + i]);
    std::copy(lse_host.get() + b * held, lse_host.get() + (b + 1) * held, dst + max_q * dim);
  }
  const int64_t budget = std::min<int64_t>(p.page_budget(layer, g.page_size), std::numeric_limits<int32_t>::max());
  QKV_RETURN_IF_ERROR(Gather(comm, Header(kTagOutputs, layer, int32_t(budget)), mine.data(), mine.size() * sizeof(float)));
  all.resize(mine.size() * comm.size());
  for (int r = 0; r < comm.size(); ++r) exchange.CopyPayload(r, all.data() + r * mine.size());
  UnpackHead(lp, comm.size(), out);
  ReadDeviceTimes(true);
  return Status::Ok();
}

// out[b] := every rank's outputs at their query heads; this rank's selection
// rows (when read back).
void GpuDecoder::Impl::UnpackHead(const LayerPlan& lp, int ranks_now, std::vector<ParallelDecodeOutput>* out) const {
  int max_heads = 0;
  for (const HeadRange& r : head_ranges) max_heads = std::max(max_heads, r.count);
  const int group = g.group(), dim = g.head_dim, B = batch_size();
  const std::size_t max_q = std::size_t(max_heads) * group, per_seq = max_q * (dim + 1);
  for (int b = 0; b < B; ++b) {
    ParallelDecodeOutput& ob = (*out)[b];
    ob.o.resize(std::size_t(g.q_heads) * dim);
    ob.lse.resize(g.q_heads);
    for (int r = 0; r < ranks_now; ++r) {
      const float* part = all.data() + (std::size_t(r) * B + b) * per_seq;
      const std::size_t q_first = std::size_t(head_ranges[r].first) * group;
      const std::size_t q_count = std::size_t(head_ranges[r].count) * group;
      std::copy(part, part + q_count * dim, ob.o.begin() + q_first * dim);
      std::copy(part + max_q * dim, part + max_q * dim + q_count, ob.lse.begin() + q_first);
    }
    ob.first_kv_head = first_head;
    ob.selection.indptr.assign(1, 0);
    ob.selection.pages.clear();
    if (!o.selection_to_host) continue;
    for (int h = 0; h < heads; ++h) {
      const int row = b * heads + h;
      const int32_t* pages = lp.sel_pages_host.get() + lp.select.out_indptr[row];
      ob.selection.pages.insert(ob.selection.pages.end(), pages, pages + lp.sel_count_host.get()[row]);
      ob.selection.indptr.push_back(int32_t(ob.selection.pages.size()));
    }
  }
}

}  // namespace questkv
