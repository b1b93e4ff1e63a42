// The CUDA backend's decode step: enqueue (direct or from a graph), cold
// misses under strict, read-back and selections.
#include "runtime/cuda/backend.h"

#include <cmath>

namespace questkv::cuda_backend {

// The first n cold-miss requests into p.cold (n: the device's count, read back).
Status CudaBackendImpl::ReadCold(StepPlan& p, int32_t n) {
  p.cold.resize(std::clamp(n, 0, p.qcap));
  if (!p.cold.empty()) {
    QKV_CUDA(cudaMemcpyAsync(p.cold.data(), p.rp.cold, p.cold.size() * sizeof(kc::ResolveRequest),
                             cudaMemcpyDeviceToHost, stream_));
    QKV_RETURN_IF_ERROR(Sync());
  }
  return Status::Ok();
}

// A skip-limited call's lists (a sequence, or the rows sharing a list, at
// this layer): a list whose cold misses pass the limit's share of its
// selected head-pages waits for all of them, the others skip theirs (their
// promotions start from the call's report, as under deadline). `used`: the
// select's entries per resolve row (a list's KV heads), read back with the
// cold count.
void CudaBackendImpl::ChooseSkips(StepPlan& p, const std::vector<int32_t>& used) {
  p.skipped.clear();
  if (p.cold.empty()) return;
  const int H = g_.kv_heads, rows = p.L * H;
  const int32_t* cap = p.hdr.data() + (p.block ? p.o_usel : p.o_sel);  // capacities from the host's header
  std::vector<int64_t> selected(p.L, 0), cold(p.L, 0);
  for (int r = 0; r < rows; ++r) selected[r / H] += std::min(used[r], cap[r + 1] - cap[r]);
  for (const kc::ResolveRequest& r : p.cold) ++cold[r.row / H];
  std::vector<bool> waits(p.L);
  for (int l = 0; l < p.L; ++l) {
    waits[l] = double(cold[l]) > c_.deadline_skip_limit * double(selected[l]);
    deadline_waits_ += waits[l];
  }
  std::vector<kc::ResolveRequest> wait;
  for (const kc::ResolveRequest& r : p.cold) {
    if (waits[r.row / H]) {
      wait.push_back(r);
    } else {
      p.skipped.push_back(r.entry);
    }
  }
  std::sort(p.skipped.begin(), p.skipped.end());
  skips_waited_ += int64_t(wait.size());
  p.cold = std::move(wait);
}

// Cold misses under strict (or past a skip limit): promote, publish,
// resolve again (hits stay hits). The re-runs count on scratch counters;
// only their traffic is kept. A skip-limited call skips in every round only
// what it chose to skip in the first: a page that leaves the host while the
// call waits (made room for another) is waited for too.
Status CudaBackendImpl::SettleCold(const StepArgs& s, StepPlan& p) {
  std::vector<int32_t> used;
  for (int round = 0;; ++round) {
    int32_t n = 0;
    QKV_CUDA(cudaMemcpyAsync(&n, p.rp.cold_count, 4, cudaMemcpyDeviceToHost, stream_));
    // A skip-limited call's first wait also brings the select's counts.
    const bool choose = p.skip_limit && round == 0;
    if (choose) {
      used.resize(std::size_t(p.L) * g_.kv_heads);
      QKV_CUDA(cudaMemcpyAsync(used.data(), p.rp.sel_count, used.size() * 4, cudaMemcpyDeviceToHost, stream_));
    }
    QKV_RETURN_IF_ERROR(Sync());
    QKV_RETURN_IF_ERROR(ReadCold(p, n));
    if (choose) {
      ChooseSkips(p, used);
    } else if (p.skip_limit) {
      std::erase_if(p.cold, [&](const kc::ResolveRequest& r) {
        return std::binary_search(p.skipped.begin(), p.skipped.end(), r.entry);
      });
    }
    if (p.cold.empty()) return Status::Ok();
    if (round > 64) return Status::Internal("cold misses do not settle");
    // Every read in flight before waiting for any.
    for (const kc::ResolveRequest& r : p.cold) QKV_RETURN_IF_ERROR(mover_->Prefetch(r.page, /*ahead=*/false));
    for (const kc::ResolveRequest& r : p.cold)
      QKV_RETURN_IF_ERROR(mover_->EnsureHost(r.page, ids_->generation(r.page), s.step));
    QKV_RETURN_IF_ERROR(FlushUpdates());
    QKV_CUDA(cudaMemsetAsync(scratch_counters_.as(), 0, scratch_counters_.bytes(), stream_));
    kc::ResolveParams again = p.rp;
    again.counters = scratch_counters_.as<kc::ResolveCounters>();
    QKV_CUDA(kc::LaunchResolve(p.rplan, again, stream_));
    kc::ResolveCounters sc;
    QKV_CUDA(cudaMemcpyAsync(&sc, scratch_counters_.as(), sizeof(sc), cudaMemcpyDeviceToHost, stream_));
    QKV_RETURN_IF_ERROR(Sync());
    extra_bytes_ += int64_t(sc.bytes_host_to_hbm);
    extra_evictions_ += int64_t(sc.evictions);
  }
}

Status CudaBackendImpl::PadQ(const StepPlan& p) {
  const std::size_t e = DTypeBytes(p.dt), head = std::size_t(g_.head_dim) * e;
  const int G = g_.group(), K = kgroup();
  const std::size_t rows = std::size_t(p.rows), src_pitch = G * head, dst_pitch = K * head;
  char* dst = qpad_.as<char>();
  QKV_CUDA(cudaMemcpy2DAsync(dst, dst_pitch, p.q, src_pitch, src_pitch, rows, cudaMemcpyDeviceToDevice, stream_));
  if (c_.policy.gqa == GqaMode::kMean) {
    QKV_CUDA(cudaMemset2DAsync(dst + src_pitch, dst_pitch, 0, (K - G) * head, rows, stream_));
  } else {
    for (int g = G; g < K; ++g)
      QKV_CUDA(cudaMemcpy2DAsync(dst + g * head, dst_pitch, p.q, src_pitch, head, rows, cudaMemcpyDeviceToDevice,
                                 stream_));
  }
  return Status::Ok();
}

Status CudaBackendImpl::UnpadOut(const StepPlan& p, void* out) {
  const std::size_t head = std::size_t(g_.head_dim) * DTypeBytes(p.dt);
  const std::size_t pitch = g_.group() * head;
  QKV_CUDA(cudaMemcpy2DAsync(out, pitch, opad_.as(), kgroup() * head, pitch, std::size_t(p.rows),
                             cudaMemcpyDeviceToDevice, stream_));
  return Status::Ok();
}

// The step's device work: select -> resolve -> attend, with the batch's page
// ids gathered and q and out converted. Captured once per shape and replayed
// when graphs are on and nothing in it waits for the host. Inputs (header,
// host q) go up before it from the staging, readbacks are enqueued after it:
// a graph holds no per-call host address.
Status CudaBackendImpl::Enqueue(const StepArgs& s, StepPlan& p, bool capturing) {
  if (p.B > 1)
    QKV_CUDA(kc::LaunchGatherPageIds(reinterpret_cast<const uint32_t* const*>(p.d_hdr + p.o_srcs), p.d_hdr, p.B,
                                     batch_pages_.as<uint32_t>(), stream_));
  if (s.host_f32 && g_.dtype != DType::kF32)
    QKV_CUDA(kc::LaunchConvert(q_f32_.as(), DType::kF32, q_.as(), p.dt, p.qelems, stream_));
  if (p.padded) QKV_RETURN_IF_ERROR(PadQ(p));
  const void* kq = p.padded ? qpad_.as() : p.q;  // the kernels' q: [rows][kgroup][D]
  // Phase timing only when launched directly: cudaEventElapsedTime refuses
  // events recorded by a graph's nodes (cudaErrorInvalidValue).
  if (p.timed) QKV_CUDA(cudaEventRecord(ev_[0], stream_));
  kc::SelectParams sp;
  sp.shape = p.shape;
  sp.q_dtype = p.dt;
  sp.summary_dtype = sum_dtype();
  sp.q = kq;
  sp.summaries = summaries_.as();
  sp.page_indptr = p.d_hdr;
  sp.page_ids = p.page_ids;
  sp.out_indptr = p.d_hdr + p.o_sel;
  sp.out_pages = sel_pages_.as<int32_t>();
  sp.out_count = sel_count_.as<int32_t>();
  sp.workspace = sel_ws_.as();
  if (p.shared) {  // each list's selection for all its rows, then each row's share
    if (p.L > 1)
      QKV_CUDA(kc::LaunchGatherPageIds(reinterpret_cast<const uint32_t* const*>(p.d_hdr + p.o_lsrcs),
                                       p.d_hdr + p.o_lpages, p.L, list_pages_.as<uint32_t>(), stream_));
    kc::SelectParams lp = sp;
    lp.shape = p.lshape;
    lp.page_indptr = p.d_hdr + p.o_lpages;
    lp.page_ids = p.list_ids;
    lp.q_rows = p.d_hdr + p.o_members;  // members_indptr: a list's rows are consecutive
    lp.out_indptr = p.d_hdr + p.o_lsel;
    lp.out_pages = shared_pages_.as<int32_t>();
    lp.out_count = shared_count_.as<int32_t>();
    QKV_CUDA(kc::LaunchSelect(p.lplan, lp, stream_));
    kc::BlockShareParams bs;
    bs.rows = p.rows;
    bs.kv_heads = g_.kv_heads;
    bs.local_pages = c_.policy.local_pages;
    bs.page_indptr = p.d_hdr;
    bs.list_of = p.d_hdr + p.o_listof;
    bs.shared_indptr = lp.out_indptr;
    bs.shared_count = lp.out_count;
    bs.shared_pages = lp.out_pages;
    bs.out_indptr = sp.out_indptr;
    bs.out_pages = sp.out_pages;
    bs.out_count = sp.out_count;
    QKV_CUDA(kc::LaunchBlockShare(bs, stream_));
  } else if (p.rerank) {  // the candidates, then the best of them
    kc::SelectParams wide = sp;
    wide.shape = p.wshape;
    wide.out_indptr = p.d_hdr + p.o_cand;
    wide.out_pages = cand_pages_.as<int32_t>();
    wide.out_count = cand_count_.as<int32_t>();
    QKV_CUDA(kc::LaunchSelect(p.wplan, wide, stream_));
    kc::RerankParams rr;
    rr.shape = p.shape;
    rr.kv_dtype = p.dt;
    rr.summary_dtype = sum_dtype();
    rr.q = kq;
    rr.summaries = summaries_.as();
    rr.page_indptr = p.d_hdr;
    rr.page_ids = p.page_ids;
    rr.last_len = p.d_hdr + p.o_last;
    rr.hbm_slot = hbm_slot_.as<int32_t>();
    rr.slots = pool_.as();
    rr.host_addr = host_addr_.as<const void* const>();
    rr.cand_indptr = p.d_hdr + p.o_cand;
    rr.cand_pages = cand_pages_.as<int32_t>();
    rr.cand_count = cand_count_.as<int32_t>();
    rr.max_listed = p.max_listed;
    rr.workspace = rerank_ws_.as<float>();
    rr.out_indptr = sp.out_indptr;
    rr.out_pages = sp.out_pages;
    rr.out_count = sp.out_count;
    QKV_CUDA(kc::LaunchRerank(rr, stream_));
  } else {
    QKV_CUDA(kc::LaunchSelect(p.splan, sp, stream_));
    if (p.shape.keep_scores) {  // adaptive budgets: each row narrowed by its bound masses
      kc::AdaptiveParams ad;
      ad.shape = p.shape;
      ad.unread_bound_mass = c_.policy.unread_bound_mass;
      ad.floor_tokens = c_.policy.adaptive_floor;
      ad.scores = sel_ws_.as<float>();
      ad.page_indptr = p.d_hdr;
      ad.out_indptr = sp.out_indptr;
      ad.out_pages = sp.out_pages;
      ad.out_count = sp.out_count;
      ad.counters = adaptive_counters_.as<kc::AdaptiveCounters>();
      if (p.padded && c_.policy.gqa == GqaMode::kMean) ad.mean_heads = g_.group();  // PadQ's zero heads
      QKV_CUDA(kc::LaunchAdaptive(ad, stream_));
    }
  }
  if (p.timed) QKV_CUDA(cudaEventRecord(ev_[1], stream_));
  if (p.block) {  // each list's rows' selections, united
    kc::BlockUnionParams up;
    up.lists = p.L;
    up.kv_heads = g_.kv_heads;
    up.max_pages = *std::max_element(p.list_pages.begin(), p.list_pages.end());
    up.members_indptr = p.d_hdr + p.o_members;
    up.members = p.d_hdr + p.o_members + p.L + 1;
    up.sel_indptr = sp.out_indptr;
    up.sel_count = sp.out_count;
    up.sel_pages = sp.out_pages;
    up.out_indptr = p.rp.sel_indptr;
    up.out_pages = usel_pages_.as<int32_t>();
    up.out_count = usel_count_.as<int32_t>();
    QKV_CUDA(kc::LaunchBlockUnion(up, stream_));
  }
  QKV_CUDA(kc::LaunchResolve(p.rplan, p.rp, stream_));
  if (!capturing && p.cold_waits) QKV_RETURN_IF_ERROR(SettleCold(s, p));
  if (p.block) {  // each row's own entries' slots, now filled, over the union rows' (read by nothing after)
    kc::BlockSlotsParams bp;
    bp.rows = p.rows;
    bp.kv_heads = g_.kv_heads;
    bp.sel_indptr = sp.out_indptr;
    bp.sel_count = sp.out_count;
    bp.sel_pages = sp.out_pages;
    bp.page_indptr = p.d_hdr;
    bp.page_ids = p.page_ids;
    bp.hbm_slot = hbm_slot_.as<int32_t>();
    bp.out_slots = res_slots_.as<int32_t>();
    bp.out_count = res_count_.as<int32_t>();
    QKV_CUDA(kc::LaunchBlockSlots(bp, stream_));
  }
  if (p.timed) QKV_CUDA(cudaEventRecord(ev_[2], stream_));
  kc::AttendParams ap;
  ap.scale = 1.f / std::sqrt(float(g_.head_dim));
  ap.q = kq;
  ap.slots = pool_.as();
  ap.indptr = p.d_hdr + p.o_sel;
  ap.count = res_count_.as<int32_t>();
  ap.slot_ids = res_slots_.as<int32_t>();
  ap.last_len = p.d_hdr + p.o_last;
  void* const out = s.host_f32 ? o_.as() : s.out;
  ap.o = p.padded ? opad_.as() : out;
  ap.workspace = att_ws_.as();
  const kc::ResolveFillList fills = kc::ResolveFills(p.rplan, res_ws_.as());
  if (p.fill_in_attention) ap.fills = fills.jobs;
  if (const cudaError_t e = kc::RunAttend(p.aplan, ap, stream_); e != cudaSuccess) {
    // The resolve named slots for the misses: they get their bytes anyway.
    if (p.fill_in_attention) kc::LaunchGather(fills.jobs, fills.count, piece(), sms_, stream_, c_.cuda_chain_kernels);
    return CudaStatus("RunAttend", e);
  }
  if (p.padded) QKV_RETURN_IF_ERROR(UnpadOut(p, out));
  if (p.timed) QKV_CUDA(cudaEventRecord(ev_[3], stream_));
  if (s.host_f32 && g_.dtype != DType::kF32)
    QKV_CUDA(kc::LaunchConvert(o_.as(), p.dt, o_f32_.as(), DType::kF32, p.qelems, stream_));
  return Status::Ok();
}

// Inputs up (a header only when it changed, and without a copy when it fits
// in a launch's parameters), then the step: replayed from its graph, or
// launched directly when it waits for the host or is timed.
Status CudaBackendImpl::Launch(const StepArgs& s, StepPlan& p) {
  // A header the device holds already goes up again only when it changed:
  // one sequence's page counts and lengths are most often the layer before's.
  if (p.hdr != header_held_) {
    header_held_.clear();
    if (p.hdr.size() <= std::size_t(kc::kLaunchInts))
      QKV_CUDA(kc::LaunchWriteInts(header_.as<int32_t>(), p.hdr.data(), int(p.hdr.size()), stream_));
    else
      QKV_RETURN_IF_ERROR(Upload(header_.as(), p.hdr.data(), p.hdr.size() * 4));
    header_held_ = p.hdr;
  }
  if (s.host_f32) QKV_RETURN_IF_ERROR(Upload(q_f32_.as(), s.q, p.qelems * 4));
  if (!c_.cuda_graphs || p.cold_waits || p.timed) {
    MarkStream(kMarkDirect);
    return Enqueue(s, p, false);
  }
  // Everything a captured step bakes in: shapes, buffers, pointers; and the
  // sizes (page counts, list lengths) that an update in place may change.
  std::vector<int64_t> shape = {p.B, p.shape.dense, p.shape.page_budget, s.host_f32,
                                int64_t(reinterpret_cast<uintptr_t>(s.host_f32 ? nullptr : s.q)),
                                int64_t(reinterpret_cast<uintptr_t>(s.host_f32 ? nullptr : s.out))};
  std::vector<int64_t> sizes;
  for (int b = 0; b < p.B; ++b) {
    shape.push_back(s.partitions[b]);
    shape.push_back(int64_t(reinterpret_cast<uintptr_t>(parts_[s.partitions[b]].pages.as())));
    sizes.push_back(p.counts[b]);
  }
  for (int l = 0; l < p.L; ++l) sizes.push_back(p.part_indptr[l + 1] - p.part_indptr[l]);
  const int64_t captured = graphs_captured_;
  QKV_ASSIGN_OR_RETURN(cudaGraphExec_t exec, GraphFor(shape, sizes, [&] { return Enqueue(s, p, true); }));
  if (s.graphs_captured) *s.graphs_captured += graphs_captured_ - captured;
  MarkStream(kMarkGraph);  // after any capture: a step's span is its replay
  QKV_CUDA(cudaGraphLaunch(exec, stream_));
  return Status::Ok();
}

// A synchronous step's outputs, counts and selection back to the host, then
// its bypass check and phase timings.
Status CudaBackendImpl::ReadBack(const StepArgs& s, StepPlan& p) {
  const IoLayout& io = p.io;
  if (s.host_f32)
    QKV_CUDA(cudaMemcpyAsync(io_ + io.out, g_.dtype != DType::kF32 ? o_f32_.as() : o_.as(), p.qelems * 4,
                             cudaMemcpyDeviceToHost, stream_));
  QKV_CUDA(cudaMemcpyAsync(io_ + io.totals, counters_.as(), sizeof(kc::ResolveCounters), cudaMemcpyDeviceToHost,
                           stream_));
  if (p.shape.keep_scores) {  // the counts since the last read, then zero again
    auto* ad = adaptive_counters_.as<kc::AdaptiveCounters>();
    QKV_CUDA(cudaMemcpyAsync(io_ + io.adaptive, ad, sizeof(kc::AdaptiveCounters), cudaMemcpyDeviceToHost, stream_));
    QKV_CUDA(cudaMemsetAsync(ad, 0, sizeof(kc::AdaptiveCounters), stream_));
  }
  if (p.want_sel)
    QKV_CUDA(cudaMemcpyAsync(io_ + io.sel_pages, sel_pages_.as(), p.entries * 4, cudaMemcpyDeviceToHost, stream_));
  if (p.want_sel || p.shape.keep_scores)
    QKV_CUDA(cudaMemcpyAsync(io_ + io.sel_count, sel_count_.as(), p.rows * 4, cudaMemcpyDeviceToHost, stream_));
  p.clock.Mark(kLaunch);
  unchecked_async_ = false;  // checked below, from the counters read back with the outputs
  QKV_RETURN_IF_ERROR(Sync());
  p.clock.Mark(kDeviceWait);
  if (s.host_f32) std::memcpy(s.out, io_ + io.out, p.qelems * 4);
  // Bypasses since the last check: this step's and any earlier asynchronous
  // step's, reported now.
  kc::ResolveCounters totals;
  std::memcpy(&totals, io_ + io.totals, sizeof(totals));
  const uint64_t bypassed = totals.bypasses - bypasses_seen_;
  bypasses_seen_ = totals.bypasses;
  if (p.shape.keep_scores && s.adaptive) {  // what the adaptive rows chose since the last call that waited
    kc::AdaptiveCounters got;
    std::memcpy(&got, io_ + io.adaptive, sizeof(got));
    AttendStats* a = s.adaptive;
    static_assert(kc::kAdaptiveHistPages == AttendStats::kAdaptiveHistPages);
    a->adaptive_rankings += int64_t(got.rankings);
    a->adaptive_pages += int64_t(got.pages);
    a->adaptive_pages_max = std::max(a->adaptive_pages_max, int64_t(got.pages_max));
    a->adaptive_cap_hits += int64_t(got.cap_hits);
    for (int i = 0; i <= kc::kAdaptiveHistPages; ++i) a->adaptive_hist[i] += int64_t(got.hist[i]);
  }
  if (bypassed > 0) return NoSlotFault(bypassed);
  if (p.timed) {
    float a = 0, b = 0, c = 0;
    QKV_CUDA(cudaEventElapsedTime(&a, ev_[0], ev_[1]));
    QKV_CUDA(cudaEventElapsedTime(&b, ev_[1], ev_[2]));
    QKV_CUDA(cudaEventElapsedTime(&c, ev_[2], ev_[3]));
    if (s.select_us) *s.select_us += 1e3 * a;
    if (s.resolve_us) *s.resolve_us += 1e3 * b;
    if (s.attend_us) *s.attend_us += 1e3 * c;
  }
  return Status::Ok();
}

// The caller's selections, read back into io_ (read in place: io_ stays
// put until the next step).
Status CudaBackendImpl::ReturnSelections(const StepArgs& s, StepPlan& p) {
  if (!p.want_sel) return Status::Ok();
  const int H = g_.kv_heads;
  const std::vector<int32_t>& sel_indptr = p.splan.out_indptr;
  const int32_t* sel_pages = reinterpret_cast<const int32_t*>(io_ + p.io.sel_pages);
  const int32_t* sel_count = reinterpret_cast<const int32_t*>(io_ + p.io.sel_count);
  s.selections->resize(p.B);
  for (int b = 0; b < p.B; ++b) {
    PageSelection& out = (*s.selections)[b];
    out.indptr.assign(1, 0);
    out.pages.clear();
    for (int h = 0; h < H; ++h) {
      const int r = b * H + h;
      const int n = std::min(sel_count[r], sel_indptr[r + 1] - sel_indptr[r]);
      const int32_t* row = sel_pages + sel_indptr[r];
      out.pages.insert(out.pages.end(), row, row + n);
      if (s.selected) *s.selected += n;
      out.indptr.push_back(int32_t(out.pages.size()));
    }
  }
  return Status::Ok();
}

// Cold-miss requests a report carries: a call's first ones (a miss beyond
// them is missed again and promoted then).
constexpr int kReportedColdMisses = 16384;

// The step's report into the next buffer (applying what it held first).
Status CudaBackendImpl::QueueReport(const StepArgs& s, const StepPlan& p) {
  Report* r = &reports_[0];
  for (Report& x : reports_)
    if (!x.pending || x.seq < r->seq) r = &x;  // a free buffer, else the oldest
  if (r->pending) {
    QKV_CUDA(cudaEventSynchronize(r->done));
    QKV_RETURN_IF_ERROR(ApplyReport(*r, nullptr));
  }
  const bool dense = p.shape.dense;
  const int rows = p.L * g_.kv_heads;  // what the resolve saw: a block step's lists' union rows
  r->cold_cap = std::min(p.qcap, kReportedColdMisses);
  r->o_counts = Align256(std::size_t(p.uentries) * 4);
  r->o_cold_count = r->o_counts + Align256(std::size_t(rows) * 4);
  r->o_cold = r->o_cold_count + 256;
  const std::size_t bytes = r->o_cold + std::size_t(r->cold_cap) * sizeof(kc::ResolveRequest);
  if (bytes > r->cap) {  // nothing queued writes it: it was applied above
    const std::size_t cap = std::max(bytes, 2 * r->cap);
    if (r->host) cudaFreeHost(r->host);
    r->host = nullptr;
    r->cap = 0;
    QKV_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&r->host), cap, cudaHostAllocMapped | cudaHostAllocPortable));
    r->cap = cap;
    void* dev = nullptr;
    QKV_CUDA(cudaHostGetDevicePointer(&dev, r->host, 0));
    r->dev = static_cast<char*>(dev);
  }
  kc::StepReportParams rp;
  rp.sel_indptr = p.rp.sel_indptr;
  rp.sel_count = p.rp.sel_count;
  rp.sel_pages = p.rp.sel_pages;
  rp.page_indptr = p.rp.page_indptr;
  rp.page_ids = p.page_ids;
  rp.rows = rows;
  rp.kv_heads = g_.kv_heads;
  rp.first_head_only = dense;  // each row of a dense layer selects every page
  rp.cold = p.rp.cold;
  rp.cold_count = p.rp.cold_count;
  r->note = ReportNotes(s.layer, s.step);
  rp.pages = r->note ? reinterpret_cast<uint32_t*>(r->dev) : nullptr;
  rp.counts = reinterpret_cast<int32_t*>(r->dev + r->o_counts);
  rp.cold_out_count = reinterpret_cast<int32_t*>(r->dev + r->o_cold_count);
  rp.cold_out = reinterpret_cast<kc::ResolveRequest*>(r->dev + r->o_cold);
  rp.cold_cap = r->cold_cap;
  QKV_CUDA(kc::LaunchStepReport(rp, stream_));
  QKV_CUDA(cudaEventRecord(r->done, stream_));
  r->pending = true;
  r->seq = ++report_seq_;
  r->step = s.step;
  r->strict = p.strict;
  r->first_head_only = dense;
  r->rows = rows;
  r->kv_heads = g_.kv_heads;
  r->sel_indptr = p.block ? p.usel_indptr : p.splan.out_indptr;
  r->page_counts = p.list_pages;
  return Status::Ok();
}

bool CudaBackendImpl::ReportNotes(int layer, int64_t step) {
  if (!c_.policy.is_dense(layer)) return true;
  if (dense_noted_step_.size() <= std::size_t(layer)) dense_noted_step_.resize(layer + 1, INT64_MIN);
  int64_t& last = dense_noted_step_[layer];
  const int64_t interval = kDenseNoteModelSteps * 2 * std::max(1, g_.layers);  // two runtime steps a call
  if (last != INT64_MIN && step >= last && step - last < interval) return false;
  last = step;
  return true;
}

Status CudaBackendImpl::TakeReports(int keep, int64_t* selected, HostClock* clock) {
  for (;;) {
    Report* oldest = nullptr;
    int pending = 0;
    for (Report& x : reports_) {
      if (!x.pending) continue;
      ++pending;
      if (!oldest || x.seq < oldest->seq) oldest = &x;
    }
    if (pending <= keep) return Status::Ok();
    if (clock) clock->Mark(kReadback);
    QKV_CUDA(cudaEventSynchronize(oldest->done));
    if (clock) clock->Mark(kReportWait);
    QKV_RETURN_IF_ERROR(ApplyReport(*oldest, pending == 1 ? selected : nullptr));
  }
}

// A report to the mover: each selected page noted once (a row that selected
// every page of its sequence notes them all, so the other rows need not: at
// 1M tokens a dense layer's 8 rows were 524K scattered writes a call), and
// under `deadline` the cold misses' promotions started.
Status CudaBackendImpl::ApplyReport(Report& r, int64_t* selected) {
  r.pending = false;
  const uint32_t* pages = reinterpret_cast<const uint32_t*>(r.host);
  const int32_t* counts = reinterpret_cast<const int32_t*>(r.host + r.o_counts);
  const int B = int(r.page_counts.size()), H = r.kv_heads;
  for (int b = 0; b < B; ++b) {
    bool noted_all = false;
    for (int h = 0; h < H; ++h) {
      const int row = b * H + h;
      const int n = counts[row];
      if (selected) *selected += n;
      if (!r.note || noted_all || (r.first_head_only && h > 0)) continue;
      mover_->NoteSelected(std::span<const uint32_t>(pages + r.sel_indptr[row], std::size_t(std::max(n, 0))), r.step);
      noted_all = n == r.page_counts[b];
    }
  }
  int32_t cold = 0;
  std::memcpy(&cold, r.host + r.o_cold_count, sizeof(cold));
  if (r.strict || cold <= 0) return Status::Ok();
  const auto* req = reinterpret_cast<const kc::ResolveRequest*>(r.host + r.o_cold);
  for (int i = 0; i < std::min(cold, r.cold_cap); ++i) QKV_RETURN_IF_ERROR(mover_->Prefetch(req[i].page, /*ahead=*/false));
  return Status::Ok();
}

}  // namespace questkv::cuda_backend
