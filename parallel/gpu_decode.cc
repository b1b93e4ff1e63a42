// GpuDecoder (parallel/gpu_decode.h): set-up, loading and the per-layer
// plans. Plain C++ against the CUDA runtime; the steps themselves are in
// gpu_decode_step.cc, the kernels in kernels/cuda and parallel/gpu_kernels.cu.
#include "parallel/gpu_decode.h"

#include <cstddef>
#include <string>

#include "parallel/gpu_decode_impl.h"

namespace questkv {

namespace gpu_decode {

Status CudaStatus(const char* what, cudaError_t e) {
  if (e == cudaSuccess) return Status::Ok();
  // Reported here, so cleared: left as this thread's last error, it would come
  // back from the next launcher's cudaGetLastError as that launch's failure
  // (sticky errors, a faulted context, stay whatever is done).
  (void)cudaGetLastError();
  std::string m = std::string(what) + ": " + cudaGetErrorString(e);
  if (e == cudaErrorInvalidValue && !kc::LastErrorMessage().empty()) m += " (" + kc::LastErrorMessage() + ")";
  if (e == cudaErrorMemoryAllocation) return Status::ResourceExhausted(m);
  return Status::Internal(m);
}

}  // namespace gpu_decode

namespace {

namespace kc = kernels::cuda;
namespace gd = gpu_decode;

}  // namespace

GpuDecoder::Impl::~Impl() {
  // Runs before the members (buffers, plans) are freed, so they are freed on
  // this device. Errors here are not reported, but they are cleared: a failed
  // call leaves its error for the next cudaGetLastError of this thread, which
  // every kernel launcher returns.
  if (cudaSetDevice(dev) != cudaSuccess) (void)cudaGetLastError();
  if (stream && cudaStreamSynchronize(stream) != cudaSuccess) (void)cudaGetLastError();
  for (cudaEvent_t e : ev)
    if (e) cudaEventDestroy(e);
  if (stream) cudaStreamDestroy(stream);
}

Status GpuDecoder::Impl::Init() {
  QKV_CUDA(cudaSetDevice(dev));
  QKV_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev));
  QKV_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (cudaEvent_t& e : ev) QKV_CUDA(cudaEventCreate(&e));
  const int B = batch_size();
  local_first.assign(1, 0);
  std::vector<int32_t> lens_host;
  std::vector<int64_t> keys_host;
  for (int b = 0; b < B; ++b) {
    const int n = batch[b].num_pages;
    std::vector<int32_t> own;
    if (o.mode == GpuParallelMode::kContext) {
      QKV_ASSIGN_OR_RETURN(own, ShardPages(o.layout, n, ranks, rank));
    } else {
      own.resize(n);
      for (int i = 0; i < n; ++i) own[i] = i;
    }
    for (int32_t page : own) {
      local_global.push_back(page);
      lens_host.push_back(page == n - 1 ? batch[b].tail_len : g.page_size);
      keys_host.push_back((int64_t(b) << 32) | page);
    }
    local_first.push_back(int64_t(local_global.size()));
  }
  const int64_t local = int64_t(local_global.size());
  pool = {local, heads, first_head, g.kv_heads, g.page_size, g.head_dim};
  QKV_RETURN_IF_ERROR(slots.Resize(std::size_t(local) * heads * 2 * g.head_page_elems(), /*zero=*/true));
  QKV_RETURN_IF_ERROR(summaries.Resize(std::size_t(local + 1) * heads * 2 * g.head_dim, /*zero=*/true));
  QKV_RETURN_IF_ERROR(lens.Assign(lens_host));
  QKV_RETURN_IF_ERROR(page_keys.Assign(keys_host));
  if (o.mode == GpuParallelMode::kHead) {
    std::vector<int32_t> indptr(1, 0), slot_of(std::size_t(local) * heads), tails;
    std::vector<uint32_t> ids(local);
    for (int b = 0; b < B; ++b) {
      indptr.push_back(int32_t(local_first[b + 1]));
      tails.push_back(batch[b].tail_len);
    }
    for (int64_t i = 0; i < local; ++i) ids[i] = uint32_t(i);
    for (std::size_t i = 0; i < slot_of.size(); ++i) slot_of[i] = int32_t(i);
    QKV_RETURN_IF_ERROR(page_indptr.Assign(indptr));
    QKV_RETURN_IF_ERROR(page_ids.Assign(ids));
    QKV_RETURN_IF_ERROR(hbm_slot.Assign(slot_of));
    QKV_RETURN_IF_ERROR(last_len.Assign(tails));
  }
  const std::size_t q_elems = std::size_t(B) * held_q_heads() * g.head_dim;
  const std::size_t attend_q = std::size_t(B) * (o.mode == GpuParallelMode::kContext ? g.q_heads : held_q_heads());
  QKV_RETURN_IF_ERROR(q_host.Resize(q_elems));
  QKV_RETURN_IF_ERROR(q32.Resize(q_elems));
  QKV_RETURN_IF_ERROR(q16.Resize(q_elems));
  QKV_RETURN_IF_ERROR(o16.Resize(attend_q * g.head_dim));
  QKV_RETURN_IF_ERROR(lse.Resize(attend_q));
  QKV_RETURN_IF_ERROR(o_host.Resize(attend_q * g.head_dim));
  QKV_RETURN_IF_ERROR(lse_host.Resize(attend_q));
  return Status::Ok();
}

Status GpuDecoder::Impl::BuildSummaries() {
  QKV_CUDA(gd::LaunchBuildSummaries(pool, slots.get(), lens.get(), summaries.get(), stream));
  QKV_CUDA(cudaStreamSynchronize(stream));
  return Status::Ok();
}

GpuDecoder::GpuDecoder(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GpuDecoder::~GpuDecoder() = default;

Result<std::unique_ptr<GpuDecoder>> GpuDecoder::Create(const Geometry& g, const SelectionPolicy& p,
                                                       const GpuDecodeOptions& options, int ranks, int rank,
                                                       std::span<const GpuSequence> batch) {
  if (ranks < 1 || rank < 0 || rank >= ranks)
    return Status::InvalidArgument("GpuDecoder: rank " + std::to_string(rank) + " of " + std::to_string(ranks));
  if (batch.empty()) return Status::InvalidArgument("GpuDecoder: empty batch");
  if (g.summary_dtype != SummaryDType::kKv)
    return Status::Unimplemented("GpuDecoder: summaries are kept in f16; " +
                                 std::string(SummaryDTypeName(g.summary_dtype)) + " summaries are the runtime's only");
  for (std::size_t b = 0; b < batch.size(); ++b)
    if (batch[b].num_pages < 1 || batch[b].tail_len < 1 || batch[b].tail_len > g.page_size)
      return Status::InvalidArgument("GpuDecoder: sequence " + std::to_string(b) + " has " +
                                     std::to_string(batch[b].num_pages) + " pages, tail of " +
                                     std::to_string(batch[b].tail_len) + " tokens (pages >= 1, tail 1.." +
                                     std::to_string(g.page_size) + ")");
  std::string why;
  kc::AttendPlan probe;
  if (!kc::PlanAttend({g.kv_heads, g.kv_heads, g.group(), g.head_dim, g.page_size, DType::kF16}, 1, 1, &probe,
                      &why))
    return Status::InvalidArgument("GpuDecoder: " + why);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) {
    (void)cudaGetLastError();
    return Status::FailedPrecondition("GpuDecoder: no CUDA device");
  }
  auto impl = std::make_unique<Impl>();
  impl->g = g;
  impl->p = p;
  impl->o = options;
  impl->ranks = ranks;
  impl->rank = rank;
  impl->dev = options.device >= 0 ? options.device : rank % devices;
  if (impl->dev >= devices)
    return Status::InvalidArgument("GpuDecoder: device " + std::to_string(impl->dev) + " of " +
                                   std::to_string(devices));
  impl->batch.assign(batch.begin(), batch.end());
  impl->heads = g.kv_heads;
  if (options.mode == GpuParallelMode::kHead) {
    QKV_ASSIGN_OR_RETURN(impl->head_ranges, SplitHeads(g.kv_heads, ranks, options.head_counts));
    impl->first_head = impl->head_ranges[rank].first;
    impl->heads = impl->head_ranges[rank].count;
  }
  QKV_RETURN_IF_ERROR(impl->Init());
  QKV_RETURN_IF_ERROR(impl->PlanAll());
  return std::unique_ptr<GpuDecoder>(new GpuDecoder(std::move(impl)));
}

int GpuDecoder::device() const { return impl_->dev; }

std::size_t GpuDecoder::resident_bytes() const { return impl_->slots.bytes() + impl_->summaries.bytes(); }

const GpuStepTimes& GpuDecoder::last_times() const { return impl_->times; }

Status GpuDecoder::LoadSequence(int b, const float* const* pages) {
  Impl& m = *impl_;
  if (b < 0 || b >= m.batch_size() || pages == nullptr)
    return Status::InvalidArgument("GpuDecoder::LoadSequence: sequence " + std::to_string(b) + " of " +
                                   std::to_string(m.batch_size()) + (pages ? "" : ", pages null"));
  QKV_CUDA(cudaSetDevice(m.dev));
  const std::size_t hp = m.g.head_page_elems();  // one K (or V) of one head
  const std::size_t per_page = std::size_t(m.heads) * 2 * hp;
  const int64_t first = m.local_first[b], n = m.local_first[b + 1] - first;
  gd::Pinned<__half> staging;
  QKV_RETURN_IF_ERROR(staging.Resize(std::size_t(n) * per_page));
  for (int64_t i = 0; i < n; ++i) {
    const float* page = pages[m.local_global[first + i]];
    if (page == nullptr) return Status::InvalidArgument("GpuDecoder::LoadSequence: a page pointer is null");
    for (int hl = 0; hl < m.heads; ++hl)
      for (int kv = 0; kv < 2; ++kv) {
        const float* src = page + (std::size_t(kv) * m.g.kv_heads + m.first_head + hl) * hp;
        __half* dst = staging.get() + i * per_page + (std::size_t(hl) * 2 + kv) * hp;
        for (std::size_t e = 0; e < hp; ++e) dst[e] = __float2half_rn(src[e]);
      }
  }
  QKV_CUDA(cudaMemcpy(m.slots.get() + first * per_page, staging.get(), staging.bytes(), cudaMemcpyHostToDevice));
  return m.BuildSummaries();
}

Status GpuDecoder::FillRandom(uint64_t seed) {
  Impl& m = *impl_;
  QKV_CUDA(cudaSetDevice(m.dev));
  QKV_CUDA(gd::LaunchFillRandom(m.pool, m.page_keys.get(), seed, m.slots.get(), m.stream));
  return m.BuildSummaries();
}

// ---- per-layer plans ----------------------------------------------------------

// Every layer's plan, at creation: Decode then allocates nothing (see
// Impl::plan_store). A plan depends on the layer only through its dense flag
// and page budget, so layers of the same policy share one.
Status GpuDecoder::Impl::PlanAll() {
  for (int layer = 0; layer < g.layers; ++layer) QKV_RETURN_IF_ERROR(PlanFor(layer).status());
  return Status::Ok();
}

// The device must be current (dev).
Result<gd::LayerPlan*> GpuDecoder::Impl::PlanFor(int layer) {
  if (auto it = plans.find(layer); it != plans.end()) return it->second;
  const std::pair<bool, int64_t> key{p.is_dense(layer), p.page_budget(layer, g.page_size)};
  if (auto it = plan_store.find(key); it != plan_store.end()) return plans[layer] = it->second.get();
  auto lp = std::make_unique<LayerPlan>();
  if (o.mode == GpuParallelMode::kContext) {
    for (const GpuSequence& s : batch) lp->steps.push_back(PlanContextStep(g, p, layer, s.num_pages));
    QKV_RETURN_IF_ERROR(PlanContextSelect(lp.get()));
    QKV_RETURN_IF_ERROR(PlanContextAttend(lp.get()));
  } else {
    QKV_RETURN_IF_ERROR(PlanHead(layer, lp.get()));
  }
  return plans[layer] = (plan_store[key] = std::move(lp)).get();
}

// LaunchSelect over the ranked sequences' candidate lists: the local pages
// outside sink and local window, ascending, then a dummy page (the zero
// summary past the last local page) that the select's one-page local window
// takes, so exactly the k best candidates are ranked. kUnion ranks each query
// head alone: group 1 over G copies of the batch, copy g holding query head g.
Status GpuDecoder::Impl::PlanContextSelect(LayerPlan* lp) {
  for (int b = 0; b < batch_size(); ++b)
    if (lp->steps[b].k > 0) {
      if (!lp->ranked.empty() && lp->steps[b].k != lp->k)
        return Status::Internal("GpuDecoder: sequences of one layer rank different top-K shares");
      lp->ranked.push_back(b);
      lp->k = lp->steps[b].k;
    }
  if (lp->ranked.empty()) return Status::Ok();
  const bool unioned = p.gqa == GqaMode::kUnion;
  const int copies = unioned ? g.group() : 1, br = int(lp->ranked.size()), rows = lp->steps[0].rows;
  const uint32_t dummy = uint32_t(local_global.size());
  std::vector<int32_t> indptr(1, 0), global, counts, offsets;
  std::vector<uint32_t> ids;
  for (int c = 0; c < copies; ++c)
    for (int rb = 0; rb < br; ++rb) {
      const int b = lp->ranked[rb];
      for (int64_t i = local_first[b]; i < local_first[b + 1]; ++i)
        if (!lp->steps[b].fixed(local_global[i], batch[b].num_pages)) {
          ids.push_back(uint32_t(i));
          global.push_back(local_global[i]);
        }
      ids.push_back(dummy);
      global.push_back(-1);
      indptr.push_back(int32_t(ids.size()));
      counts.push_back(indptr.back() - indptr[indptr.size() - 2]);
      for (int h = 0; h < g.kv_heads; ++h)
        offsets.push_back((rb * rows + (unioned ? h * g.group() + c : h)) * lp->k);
    }
  kc::SelectShape& s = lp->select_shape;
  s = {copies * br, g.kv_heads, unioned ? 1 : g.group(), g.head_dim, g.page_size, lp->k + 1, 0, 1,
       unioned ? GqaMode::kMax : p.gqa, false};
  std::string why;
  if (!kc::PlanSelect(s, counts.data(), num_sms, &lp->select, &why))
    return Status::InvalidArgument("GpuDecoder: " + why);
  const std::size_t q_elems = std::size_t(br) * g.q_heads * g.head_dim;
  const std::size_t cands = std::size_t(br) * rows * lp->k;
  QKV_RETURN_IF_ERROR(lp->list_indptr.Assign(indptr));
  QKV_RETURN_IF_ERROR(lp->list_ids.Assign(ids));
  QKV_RETURN_IF_ERROR(lp->list_global.Assign(global));
  QKV_RETURN_IF_ERROR(lp->row_offset.Assign(offsets));
  QKV_RETURN_IF_ERROR(lp->sel_indptr.Assign(lp->select.out_indptr));
  QKV_RETURN_IF_ERROR(lp->sel_pages.Resize(lp->select.out_indptr.back()));
  QKV_RETURN_IF_ERROR(lp->sel_count.Resize(lp->select.out_indptr.size() - 1));
  QKV_RETURN_IF_ERROR(lp->select_ws.Resize(lp->select.workspace_bytes));
  QKV_RETURN_IF_ERROR(lp->q_select.Resize(q_elems));
  QKV_RETURN_IF_ERROR(lp->q_select_host.Resize(q_elems));
  QKV_RETURN_IF_ERROR(lp->cand.Resize(cands));
  return lp->cand_host.Resize(cands);
}

// Attention rows (sequence, KV head) over this rank's selected pages: at
// most its own pages, and at most what a selection row can hold.
Status GpuDecoder::Impl::PlanContextAttend(LayerPlan* lp) {
  const int B = batch_size(), rows_per_head = lp->steps[0].rows / g.kv_heads;
  int max_pages = 0;
  std::size_t entries = 0;
  for (int b = 0; b < B; ++b) {
    const ContextStepPlan& st = lp->steps[b];
    const int own = int(local_first[b + 1] - local_first[b]);
    const int bound = st.dense ? own : std::min(own, st.sink + st.local + rows_per_head * st.k);
    max_pages = std::max(max_pages, bound);
    entries += std::size_t(bound) * g.kv_heads;
  }
  std::string why;
  if (!kc::PlanAttend({B * g.kv_heads, g.kv_heads, g.group(), g.head_dim, g.page_size, DType::kF16}, max_pages,
                      num_sms, &lp->attend, &why))
    return Status::InvalidArgument("GpuDecoder: " + why);
  QKV_RETURN_IF_ERROR(lp->attend_ws.Resize(lp->attend.workspace_bytes, /*zero=*/true));
  QKV_RETURN_IF_ERROR(lp->att_indptr_host.Resize(std::size_t(B) * g.kv_heads + 1));
  QKV_RETURN_IF_ERROR(lp->att_slots_host.Resize(entries));
  QKV_RETURN_IF_ERROR(lp->att_last_host.Resize(B));
  QKV_RETURN_IF_ERROR(lp->att_indptr.Resize(std::size_t(B) * g.kv_heads + 1));
  QKV_RETURN_IF_ERROR(lp->att_slots.Resize(entries));
  return lp->att_last.Resize(B);
}

Status GpuDecoder::Impl::PlanHead(int layer, LayerPlan* lp) {
  const int B = batch_size();
  std::vector<int32_t> counts;
  for (const GpuSequence& s : batch) counts.push_back(s.num_pages);
  kc::SelectShape& s = lp->select_shape;
  s = {B,
       heads,
       g.group(),
       g.head_dim,
       g.page_size,
       p.page_budget(layer, g.page_size),
       p.sink_pages,
       p.local_pages,
       p.gqa,
       p.is_dense(layer)};
  std::string why;
  if (!kc::PlanSelect(s, counts.data(), num_sms, &lp->select, &why))
    return Status::InvalidArgument("GpuDecoder: " + why);
  const std::vector<int32_t>& ind = lp->select.out_indptr;
  int max_pages = 0;
  for (std::size_t r = 0; r + 1 < ind.size(); ++r) max_pages = std::max(max_pages, ind[r + 1] - ind[r]);
  if (!kc::PlanAttend({B * heads, heads, g.group(), g.head_dim, g.page_size, DType::kF16}, max_pages, num_sms,
                      &lp->attend, &why))
    return Status::InvalidArgument("GpuDecoder: " + why);
  QKV_RETURN_IF_ERROR(lp->attend_ws.Resize(lp->attend.workspace_bytes, /*zero=*/true));
  QKV_RETURN_IF_ERROR(lp->sel_indptr.Assign(ind));
  QKV_RETURN_IF_ERROR(lp->sel_pages.Resize(ind.back()));
  QKV_RETURN_IF_ERROR(lp->sel_slots.Resize(ind.back()));
  QKV_RETURN_IF_ERROR(lp->sel_count.Resize(ind.size() - 1));
  QKV_RETURN_IF_ERROR(lp->select_ws.Resize(lp->select.workspace_bytes));
  QKV_RETURN_IF_ERROR(lp->sel_pages_host.Resize(ind.back()));
  return lp->sel_count_host.Resize(ind.size() - 1);
}

}  // namespace questkv
