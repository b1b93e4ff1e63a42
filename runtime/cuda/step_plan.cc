// The CUDA backend's decode step: the entry point and its host-side plan
// (shapes, lists grown, buffers, header, resolve parameters).
#include "runtime/cuda/backend.h"

#include <cmath>

namespace questkv::cuda_backend {

// ---- the decode step ---------------------------------------------------------------

Status CudaBackendImpl::DecodeStep(const Step& st) {
  if (st.dense && c_.cold_miss != ColdMissPolicy::kStrict && mover_->has_disk())
    return Status::FailedPrecondition("dense attention on the CUDA backend needs the strict cold-miss policy");
  StepArgs a{st.partitions, st.lists, st.layer, st.dense, st.q, st.out, st.host_f32, st.step, st.selections,
             !st.shared_blocks.empty()};
  AttendStats* stats = st.stats;
  int64_t selected = 0;
  if (stats && stats->time_phases) {
    a.select_us = &stats->select_us;
    a.resolve_us = &stats->resolve_us;
    a.attend_us = &stats->attend_us;
  }
  a.selected = &selected;
  if (stats) a.graphs_captured = &stats->graphs_captured;
  a.adaptive = stats;
  if (Status run = RunStep(a); !run.ok()) {
    // Rows sharing a list attend together only when the list can hold their
    // selections' union at once: else they go in halves, down to one row
    // of each list a launch, each needing what one row selects.
    // (A shared block selects as one: its rows never go apart.)
    if (run.code() != Code::kResourceExhausted || !st.host_f32 || a.shared) return run;
    std::vector<int> first, second;
    for (std::size_t i = 0; i < st.partitions.size(); ++i) {
      const auto rows = std::count(st.partitions.begin(), st.partitions.end(), st.partitions[i]);
      const auto rank = std::count(st.partitions.begin(), st.partitions.begin() + i, st.partitions[i]);
      (2 * rank < rows ? first : second).push_back(int(i));
    }
    if (second.empty()) return run;  // one row per list: nothing to split
    QKV_RETURN_IF_ERROR(DecodeRows(st, first));
    return DecodeRows(st, second);
  }
  if (!stats) return Status::Ok();
  const int64_t pages_budget = c_.policy.page_budget(st.layer, g_.page_size);
  stats->head_pages_selected += selected;
  for (std::size_t r = 0; r < st.lists.size(); ++r) {
    const int64_t pages = int64_t(st.lists[r]->pages.size());
    stats->head_pages_total += pages * g_.kv_heads;
    // A shared block scores once, over its last row's pages.
    const bool scores = !a.shared || r + 1 == st.lists.size() || st.partitions[r + 1] != st.partitions[r];
    if (scores && !st.dense && !c_.policy.is_dense(st.layer) && pages_budget < pages) {
      stats->summary_bytes_read += pages * int64_t(summary_bytes());
      // The re-rank reads its candidates' keys.
      if (c_.policy.rerank > 0) {
        const int64_t fixed = std::min<int64_t>(c_.policy.sink_pages + std::max(c_.policy.local_pages, 1), pages);
        stats->rerank_key_bytes += RerankCandidates(c_.policy.rerank, pages_budget - fixed, pages - fixed) *
                                   g_.kv_heads * int64_t(piece());
      }
    }
  }
  // Whole head-pages (a tail is counted whole): what the kernel reads.
  stats->kv_bytes_read += selected * int64_t(2 * piece());
  return Status::Ok();
}

// The step's rows `rows` (host q and out) as a step of their own.
Status CudaBackendImpl::DecodeRows(const Step& st, const std::vector<int>& rows) {
  const std::size_t row = std::size_t(g_.q_heads) * g_.head_dim;
  const float* q = static_cast<const float*>(st.q);
  float* out = static_cast<float*>(st.out);
  if (st.selections) st.selections->resize(st.partitions.size());
  std::vector<uint32_t> parts;
  std::vector<const PageList*> lists;
  std::vector<float> pq(rows.size() * row), pout(rows.size() * row);
  std::vector<PageSelection> psel;
  for (std::size_t j = 0; j < rows.size(); ++j) {
    parts.push_back(st.partitions[rows[j]]);
    lists.push_back(st.lists[rows[j]]);
    std::copy_n(q + rows[j] * row, row, pq.data() + j * row);
  }
  Step part = st;
  part.partitions = parts;
  part.lists = lists;
  part.q = pq.data();
  part.out = pout.data();
  part.selections = st.selections ? &psel : nullptr;
  QKV_RETURN_IF_ERROR(DecodeStep(part));
  for (std::size_t j = 0; j < rows.size(); ++j) {
    std::copy_n(pout.data() + j * row, row, out + rows[j] * row);
    if (st.selections) (*st.selections)[rows[j]] = std::move(psel[j]);
  }
  return Status::Ok();
}

Status CudaBackendImpl::RunStep(const StepArgs& s) {
  if (!async_error_.ok()) return std::exchange(async_error_, Status::Ok());
  // A call split in rows (DecodeRows) counts its pump once.
  const HostClock::Time begun = std::exchange(step_begun_, HostClock::Time{});
  StepPlan p(prof_, begun == HostClock::Time{} ? std::chrono::steady_clock::now() : begun);
  p.clock.Mark(kPump);
  QKV_RETURN_IF_ERROR(PlanStep(s, p));
  QKV_RETURN_IF_ERROR(GrowLists(s, p));
  QKV_RETURN_IF_ERROR(PlanResolveAndAttend(s, p));
  QKV_RETURN_IF_ERROR(ReserveStepBuffers(s, p));
  PackHeader(s, p);
  if (const std::size_t had = header_.bytes(); p.hdr.size() * 4 > had) {
    header_held_.clear();  // a new block: its bytes are unknown
    QKV_RETURN_IF_ERROR(header_.Grow(p.hdr.size() * 4));
  }
  p.d_hdr = header_.as<int32_t>();
  p.clock.Mark(kBuffers);  // and the resolve/attend plans, the header, pinned io
  MarkStream(kMarkTables);
  QKV_RETURN_IF_ERROR(FlushUpdates());
  p.clock.Mark(kFlush);
  p.q = s.host_f32 ? (g_.dtype == DType::kF32 ? q_f32_.as() : q_.as()) : s.q;
  p.rp = ResolveParamsFor(s, p);
  QKV_RETURN_IF_ERROR(Launch(s, p));
  MarkStream(kMarkReport);
  if (p.note) QKV_RETURN_IF_ERROR(QueueReport(s, p));
  MarkStream(kMarkAfterCall);
  if (p.async) {
    QKV_RETURN_IF_ERROR(TicketCall());
    unchecked_async_ = true;  // its bypasses are checked at the next wait (Sync)
    // entries: exact for max/mean and dense; union rows, shared blocks' rows and adaptive
    // rows may use less.
    if (s.selected) *s.selected += p.entries;
    p.clock.Mark(kLaunch);
    // The reports of all but the newest kReportsInFlight - 1 calls; the
    // device runs those meanwhile.
    QKV_RETURN_IF_ERROR(TakeReports(/*keep=*/kReportsInFlight - 1, nullptr, &p.clock));
    QKV_RETURN_IF_ERROR(EndSeals(/*wait=*/false));
    p.clock.Mark(kReadback);
    return Status::Ok();
  }
  QKV_RETURN_IF_ERROR(ReadBack(s, p));
  QKV_RETURN_IF_ERROR(ReturnSelections(s, p));
  int64_t reported = 0;
  QKV_RETURN_IF_ERROR(TakeReports(/*keep=*/0, &reported));
  QKV_RETURN_IF_ERROR(EndSeals(/*wait=*/false));
  // entries: exact for max/mean and dense; union rows, shared blocks' rows and
  // adaptive rows (their capacities) may use less, so adaptive rows count
  // what they read back. A block step's report counts its lists' unions, not
  // its rows.
  if (s.selected && !p.want_sel) {
    if (p.note && !p.block) {
      *s.selected += reported;
    } else if (p.shape.keep_scores) {
      const int32_t* count = reinterpret_cast<const int32_t*>(io_ + p.io.sel_count);
      for (int r = 0; r < p.rows; ++r)
        *s.selected += std::min(count[r], p.splan.out_indptr[r + 1] - p.splan.out_indptr[r]);
    } else {
      *s.selected += p.entries;
    }
  }
  p.clock.Mark(kReadback);  // selections, timings, reports
  return Status::Ok();
}

// Host-only plans: the batch's page counts, the select plan and each row's
// selection bound.
Status CudaBackendImpl::PlanStep(const StepArgs& s, StepPlan& p) {
  const int B = int(s.lists.size()), H = g_.kv_heads, S = g_.page_size;
  p.B = B;
  p.rows = B * H;
  p.qelems = std::size_t(B) * g_.q_heads * g_.head_dim;
  p.dt = g_.dtype;
  p.counts.resize(B);
  p.last_len.resize(B);
  p.page_indptr.assign(B + 1, 0);
  for (int b = 0; b < B; ++b) {
    p.counts[b] = int32_t(s.lists[b]->pages.size());
    p.last_len[b] = s.lists[b]->last_page_len(S);
    p.page_indptr[b + 1] = p.page_indptr[b] + p.counts[b];
  }
  kc::SelectShape& shape = p.shape;
  shape.batch = B;
  shape.kv_heads = H;
  shape.group = kgroup();
  p.padded = padded();
  shape.head_dim = g_.head_dim;
  shape.page_size = S;
  shape.page_budget = c_.policy.page_budget(s.layer, S);
  shape.sink_pages = c_.policy.sink_pages;
  shape.local_pages = c_.policy.local_pages;
  shape.gqa = c_.policy.gqa;
  shape.dense = s.dense || c_.policy.is_dense(s.layer);
  shape.split_long_rows = c_.cuda_split_long_rows;
  shape.mma_scores = c_.cuda_mma_scores;
  shape.chain = c_.cuda_chain_kernels;
  // Adaptive budgets read the select's scores after it.
  shape.keep_scores = c_.policy.unread_bound_mass > 0 && !shape.dense;
  if (shape.keep_scores && shape.page_budget > kc::kAdaptiveMaxPages)
    return Status::InvalidArgument("adaptive budgets: layer " + std::to_string(s.layer) + "'s budget is " +
                                   std::to_string(shape.page_budget) + " pages, the CUDA backend takes at most " +
                                   std::to_string(kc::kAdaptiveMaxPages));
  std::string err;
  if (!kc::PlanSelect(shape, p.counts.data(), sms_, &p.splan, &err)) return Status::InvalidArgument(err);
  // Rows within the budget choose every page: nothing to re-rank unless one is longer.
  p.rerank = c_.policy.rerank > 0 && !shape.dense && shape.gqa != GqaMode::kUnion &&
             shape.page_budget < p.splan.max_pages;
  if (p.rerank) {
    p.wshape = kc::RerankShape(shape, c_.policy.rerank);
    if (!kc::PlanSelect(p.wshape, p.counts.data(), sms_, &p.wplan, &err)) return Status::InvalidArgument(err);
    for (int r = 0; r < p.rows; ++r)
      p.max_listed = std::max(p.max_listed, p.wplan.out_indptr[r + 1] - p.wplan.out_indptr[r]);
    if (p.max_listed > 16384)
      return Status::InvalidArgument("rerank: " + std::to_string(p.max_listed) +
                                     " candidates a row, the CUDA backend re-ranks at most 16384");
  }
  PlanLists(s, p);
  p.shared = s.shared && p.block;
  if (p.shared) QKV_RETURN_IF_ERROR(PlanShared(p));
  p.entries = p.splan.out_indptr[p.rows];
  p.max_row = 0;
  for (int r = 0; r < p.rows; ++r)
    p.max_row = std::max(p.max_row, p.splan.out_indptr[r + 1] - p.splan.out_indptr[r]);
  PlanUnion(p);
  return Status::Ok();
}

// The resolve's sequences: one per distinct list; a list's page table is
// its longest row's (the others' views are prefixes of it).
void CudaBackendImpl::PlanLists(const StepArgs& s, StepPlan& p) {
  const int B = p.B;
  std::vector<int32_t>& list_of = p.list_of;
  list_of.assign(B, 0);
  p.lists.clear();
  for (int b = 0; b < B; ++b) {
    const auto it = std::find(p.lists.begin(), p.lists.end(), s.partitions[b]);
    list_of[b] = int(it - p.lists.begin());
    if (it == p.lists.end()) p.lists.push_back(s.partitions[b]);
  }
  p.L = int(p.lists.size());
  p.block = p.L < B;
  p.members_indptr.assign(p.L + 1, 0);
  for (int b = 0; b < B; ++b) ++p.members_indptr[list_of[b] + 1];
  for (int l = 0; l < p.L; ++l) p.members_indptr[l + 1] += p.members_indptr[l];
  p.members.assign(B, 0);
  std::vector<int32_t> fill(p.members_indptr.begin(), p.members_indptr.end() - 1);
  for (int b = 0; b < B; ++b) p.members[fill[list_of[b]]++] = b;
  p.list_start.assign(p.L + 1, p.page_indptr[B]);
  p.list_pages.assign(p.L, 0);
  for (int b = 0; b < B; ++b) {
    const int l = list_of[b];
    if (p.counts[b] >= p.list_pages[l]) {
      p.list_pages[l] = p.counts[b];
      p.list_start[l] = p.page_indptr[b];
    }
  }
}

// Shared blocks: each list (a block's rows, consecutive, its last the
// longest) selects once with its rows' queries, rows members_indptr[l] ..
// members_indptr[l + 1] - 1; a row may hold its list's selection below its
// own local window, and that window.
Status CudaBackendImpl::PlanShared(StepPlan& p) {
  const int L = p.L, H = g_.kv_heads;
  if (p.rerank)
    return Status::Unimplemented("the CUDA backend re-ranks each row on its own: shared block selection with "
                                 "rerank needs the CPU backend");
  p.lpage_indptr.assign(L + 1, 0);
  int positions = 1;
  for (int l = 0; l < L; ++l) {
    const int32_t m0 = p.members_indptr[l], m1 = p.members_indptr[l + 1];
    for (int32_t m = m0; m < m1; ++m)
      if (p.members[m] != m || p.counts[m] > p.counts[m1 - 1])
        return Status::Internal("a shared block's rows are not consecutive views of one list");
    p.lpage_indptr[l + 1] = p.lpage_indptr[l] + p.list_pages[l];
    positions = std::max(positions, m1 - m0);
  }
  p.lshape = p.shape;
  p.lshape.batch = L;
  p.lshape.positions = positions;
  std::string err;
  if (!kc::PlanSelect(p.lshape, p.list_pages.data(), sms_, &p.lplan, &err)) return Status::InvalidArgument(err);
  const int local = std::max(c_.policy.local_pages, 1);
  std::vector<int32_t>& rows = p.splan.out_indptr;
  rows.assign(1, 0);
  for (int b = 0; b < p.B; ++b) {
    const int32_t n = p.counts[b], window = std::min(local, n);
    for (int h = 0; h < H; ++h) {
      const int ur = p.list_of[b] * H + h;
      const int32_t listed = p.lplan.out_indptr[ur + 1] - p.lplan.out_indptr[ur];
      rows.push_back(rows.back() + std::min(n, std::min(listed, n - window) + window));
    }
  }
  return Status::Ok();
}

// A block step's union rows: what its rows of one head may select together
// (shared: the list's selection and the local windows of its rows, which
// start no lower than its first row's).
void CudaBackendImpl::PlanUnion(StepPlan& p) {
  const int H = g_.kv_heads;
  if (!p.block) {
    p.uentries = p.entries;
    return;
  }
  const std::vector<int32_t>& sel = p.splan.out_indptr;
  p.usel_indptr.assign(std::size_t(p.L) * H + 1, 0);
  for (int l = 0; l < p.L; ++l)
    for (int h = 0; h < H; ++h) {
      const int ur = l * H + h;
      int64_t cap = 0;
      for (int32_t m = p.members_indptr[l]; m < p.members_indptr[l + 1]; ++m)
        cap += sel[p.members[m] * H + h + 1] - sel[p.members[m] * H + h];
      if (p.shared) {
        const int32_t first = p.counts[p.members[p.members_indptr[l]]];
        const int32_t window_start = first - std::min(std::max(c_.policy.local_pages, 1), first);
        cap = std::min<int64_t>(
            cap, int64_t(p.lplan.out_indptr[ur + 1] - p.lplan.out_indptr[ur]) + (p.list_pages[l] - window_start));
      }
      p.usel_indptr[ur + 1] = p.usel_indptr[ur] + int32_t(std::min<int64_t>(cap, p.list_pages[l]));
    }
  p.uentries = p.usel_indptr.back();
}

// Each list holds at least what its rows may select outside pinned slots.
// (Needs first: a list grown here may lend only beyond its own need.)
Status CudaBackendImpl::GrowLists(const StepArgs& s, StepPlan& p) {
  const int L = p.L, H = g_.kv_heads;
  const std::vector<int32_t>& sel_indptr = p.block ? p.usel_indptr : p.splan.out_indptr;
  std::vector<int64_t> prev_need(L);
  for (int l = 0; l < L; ++l) {
    prev_need[l] = parts_[p.lists[l]].last_need;
    parts_[p.lists[l]].last_need = sel_indptr[(l + 1) * H] - sel_indptr[l * H] - PinnedSelected(s, p, l);
  }
  p.clock.Mark(kPlan);
  for (int l = 0; l < L; ++l) parts_[p.lists[l]].stepping = true;
  Status grown = Status::Ok();
  for (int l = 0; l < L && grown.ok(); ++l) grown = GrowList(p.lists[l]);
  for (int l = 0; l < L; ++l) parts_[p.lists[l]].stepping = false;
  if (!grown.ok()) {
    for (int l = 0; l < L; ++l) parts_[p.lists[l]].last_need = prev_need[l];  // as before the call
    return grown;
  }
  p.clock.Mark(kGrow);
  p.part_indptr.assign(L + 1, 0);
  for (int l = 0; l < L; ++l) p.part_indptr[l + 1] = p.part_indptr[l] + int32_t(parts_[p.lists[l]].owned.size());
  return Status::Ok();
}

// Head-pages of list l's selection that stay in pinned slots, never in the
// list: the tail and held draft pages, at the end of its longest row. A row
// always selects its last page (its local window); a dense row every page.
int64_t CudaBackendImpl::PinnedSelected(const StepArgs& s, const StepPlan& p, int l) const {
  const uint32_t part = p.lists[l];
  const Partition& P = parts_[part];
  const PageList* longest = nullptr;
  for (int32_t m = p.members_indptr[l]; m < p.members_indptr[l + 1]; ++m)
    if (p.counts[p.members[m]] == p.list_pages[l]) longest = s.lists[p.members[m]];
  if (!longest) return 0;
  const std::vector<PageId>& pages = longest->pages;
  const std::size_t reach = p.shape.dense ? pages.size() : std::min<std::size_t>(1, pages.size());
  std::size_t n = 0;
  for (; n < reach; ++n) {
    const PageId page = pages[pages.size() - 1 - n];
    const auto held = held_.find(page);
    if (page != P.tail_page && (held == held_.end() || held->second.part != part)) break;
  }
  return int64_t(n) * g_.kv_heads;
}

Status CudaBackendImpl::PlanResolveAndAttend(const StepArgs& s, StepPlan& p) {
  p.strict = c_.cold_miss == ColdMissPolicy::kStrict;
  p.skip_limit = !p.strict && c_.deadline_skip_limit < 1 && mover_->has_disk();
  p.cold_waits = (p.strict || p.skip_limit) && mover_->has_disk();
  // The attention fetches the misses itself (their PCIe round trips overlap
  // its reads of the hits), unless a strict step resolves twice: its first
  // resolve's fills must land before the second classifies them as hits.
  // A block step's rows attend slots of the union's resolve: filled first.
  p.fill_in_attention = !p.cold_waits && !p.block && c_.cuda_fill_in_attention;
  // The first misses of a call (up to kStageBytes of head-pages; a recent
  // query's ~55 a layer, a topic query's ~850) are fetched while the victims
  // are chosen; the attention reads any beyond from their homes.
  const int stage_pages = c_.cuda_stage_misses ? int(kStageBytes / (2 * piece())) : 0;
  kc::ResolveShape rshape{p.L, g_.kv_heads, g_.page_size, g_.head_dim, p.dt,
                          p.strict ? ColdMissPolicy::kStrict : ColdMissPolicy::kDeadline, p.fill_in_attention,
                          stage_pages};
  rshape.chain = c_.cuda_chain_kernels;
  // The gather on every SM: within a step nothing runs beside it (the
  // attention waits for it), so the half-grid default, which leaves SMs to
  // work on other streams, would only slow it.
  std::string err;
  if (!kc::PlanResolve(rshape, p.uentries, p.part_indptr[p.L], sms_, sms_, &p.rplan, &err))
    return Status::InvalidArgument(err);
  kc::AttendShape ashape{p.rows, g_.kv_heads, kgroup(), g_.head_dim, g_.page_size, p.dt};
  ashape.chain = c_.cuda_chain_kernels;
  if (!kc::PlanAttend(ashape, std::max(p.max_row, 1), sms_, &p.aplan, &err))
    return Status::InvalidArgument(err);
  // The caller's selections come back with the call; the mover's (its
  // demotion order, and the cold misses to promote) in a report.
  p.want_sel = s.selections != nullptr;
  p.note = mover_->has_disk();
  // A step whose phases are to be timed is launched directly (see Launch).
  p.timed = s.select_us || s.resolve_us || s.attend_us;
  // Nothing on the host waits for this step: it returns once enqueued (see
  // the header: host homes stay put under it).
  p.async = !s.host_f32 && !p.want_sel && !p.timed && !p.cold_waits;
  return Status::Ok();
}

// Device buffers for this shape, and the pinned area a synchronous step
// reads back into: f32 out, the cumulative counters and the selection.
Status CudaBackendImpl::ReserveStepBuffers(const StepArgs& s, StepPlan& p) {
  const std::size_t qbytes = p.qelems * DTypeBytes(g_.dtype);
  QKV_RETURN_IF_ERROR(q_.Grow(qbytes));
  QKV_RETURN_IF_ERROR(o_.Grow(qbytes));
  if (p.padded) {
    const std::size_t pbytes = std::size_t(p.rows) * kgroup() * g_.head_dim * DTypeBytes(g_.dtype);
    QKV_RETURN_IF_ERROR(qpad_.Grow(pbytes));
    QKV_RETURN_IF_ERROR(opad_.Grow(pbytes));
  }
  QKV_RETURN_IF_ERROR(sel_pages_.Grow(std::max<int64_t>(p.entries, 1) * 4));
  // The attention's slots and counts: the resolve's, or a block step's
  // BlockSlots written over them (a union row holds at most its rows'
  // entries, and there are fewer lists than rows).
  QKV_RETURN_IF_ERROR(res_slots_.Grow(std::max<int64_t>(p.entries, 1) * 4));
  QKV_RETURN_IF_ERROR(sel_count_.Grow(p.rows * 4));
  QKV_RETURN_IF_ERROR(res_count_.Grow(p.rows * 4));
  if (p.block) {
    QKV_RETURN_IF_ERROR(usel_pages_.Grow(std::max<int64_t>(p.uentries, 1) * 4));
    QKV_RETURN_IF_ERROR(usel_count_.Grow(std::size_t(p.L) * g_.kv_heads * 4));
  }
  p.qcap = int(std::max<int64_t>(p.uentries, 1));
  p.qbytes_req = Align256(std::size_t(p.qcap) * sizeof(kc::ResolveRequest));
  QKV_RETURN_IF_ERROR(queues_.Grow(2 * p.qbytes_req + 256));
  QKV_RETURN_IF_ERROR(sel_ws_.Grow(
      std::max<std::size_t>({p.splan.workspace_bytes, p.wplan.workspace_bytes, p.lplan.workspace_bytes, 1})));
  if (p.shared) {
    QKV_RETURN_IF_ERROR(shared_pages_.Grow(std::max<int64_t>(p.lplan.out_indptr.back(), 1) * 4));
    QKV_RETURN_IF_ERROR(shared_count_.Grow(std::size_t(p.L) * g_.kv_heads * 4));
    p.list_ids = parts_[p.lists[0]].pages.as<uint32_t>();
    if (p.L > 1) {
      QKV_RETURN_IF_ERROR(list_pages_.Grow(std::size_t(p.lpage_indptr[p.L]) * 4));
      p.list_ids = list_pages_.as<uint32_t>();
    }
  }
  if (p.rerank) {
    QKV_RETURN_IF_ERROR(cand_pages_.Grow(std::max<int64_t>(p.wplan.out_indptr[p.rows], 1) * 4));
    QKV_RETURN_IF_ERROR(cand_count_.Grow(p.rows * 4));
    QKV_RETURN_IF_ERROR(rerank_ws_.Grow(std::max<int64_t>(p.wplan.out_indptr[p.rows], 1) * 4));
  }
  QKV_RETURN_IF_ERROR(res_ws_.Grow(std::max<std::size_t>(p.rplan.workspace_bytes, 1)));
  if (att_ws_.bytes() < p.aplan.workspace_bytes) {
    QKV_RETURN_IF_ERROR(Sync());
    QKV_RETURN_IF_ERROR(att_ws_.Grow(p.aplan.workspace_bytes));
    att_ws_zeroed_ = 0;
  }
  // The attention's counters lie before its partials, where a launch of
  // fewer rows wrote partials: zeroed again for more rows (in stream order,
  // before the launch, graph or not).
  if (att_ws_zeroed_ < p.aplan.counter_bytes) QKV_CUDA(cudaMemsetAsync(att_ws_.as(), 0, p.aplan.counter_bytes, stream_));
  if (p.aplan.counter_bytes > 0) att_ws_zeroed_ = p.aplan.counter_bytes;  // its partials follow
  IoLayout& io = p.io;
  io.out = 0;
  io.totals = io.out + Align256(s.host_f32 ? p.qelems * 4 : 0);
  io.adaptive = io.totals + Align256(sizeof(kc::ResolveCounters));
  io.sel_pages = io.adaptive + Align256(p.shape.keep_scores ? sizeof(kc::AdaptiveCounters) : 0);
  io.sel_count = io.sel_pages + Align256(p.want_sel ? p.entries * 4 : 0);
  // Adaptive rows' counts come back too: their capacities overstate them.
  io.bytes = io.sel_count + Align256(p.want_sel || p.shape.keep_scores ? p.rows * 4 : 0);
  if (!p.async) QKV_RETURN_IF_ERROR(ReserveIo(io.bytes));
  // Page ids: one sequence reads its mirror in place; a batch is copied together.
  p.page_ids = parts_[s.partitions[0]].pages.as<uint32_t>();
  if (p.B > 1) {
    QKV_RETURN_IF_ERROR(batch_pages_.Grow(std::size_t(p.page_indptr[p.B]) * 4));
    p.page_ids = batch_pages_.as<uint32_t>();
  }
  if (s.host_f32) {
    QKV_RETURN_IF_ERROR(q_f32_.Grow(p.qelems * 4));
    if (g_.dtype != DType::kF32) QKV_RETURN_IF_ERROR(o_f32_.Grow(p.qelems * 4));
  }
  return Status::Ok();
}

// Header: page_indptr [B+1] | sel_indptr [rows+1] | cand_indptr [rows+1]
// (re-rank) | part_indptr [L+1] | last_len [B] | list_start [L+1] |
// usel_indptr [L*Hkv+1] and members_indptr [L+1] | members [B] (block) |
// lsel_indptr [L*Hkv+1], lpage_indptr [L+1], list_of [B] (shared) |
// part_lists [L] (pointers) | use mark (int64) | rows' page tables [B]
// (pointers, B > 1) | lists' page tables [L] (pointers, shared and L > 1).
// The use mark is new at every launch, not the decode step: the resolve's
// victims are the list slots not marked by this launch, and a caller may
// decode one list several times a step.
void CudaBackendImpl::PackHeader(const StepArgs& s, StepPlan& p) {
  std::vector<int32_t>& hdr = p.hdr;
  hdr.assign(p.page_indptr.begin(), p.page_indptr.end());
  p.o_sel = hdr.size();
  hdr.insert(hdr.end(), p.splan.out_indptr.begin(), p.splan.out_indptr.end());
  p.o_cand = hdr.size();
  if (p.rerank) hdr.insert(hdr.end(), p.wplan.out_indptr.begin(), p.wplan.out_indptr.end());
  p.o_part = hdr.size();
  hdr.insert(hdr.end(), p.part_indptr.begin(), p.part_indptr.end());
  p.o_last = hdr.size();
  hdr.insert(hdr.end(), p.last_len.begin(), p.last_len.end());
  p.o_lstart = hdr.size();
  hdr.insert(hdr.end(), p.list_start.begin(), p.list_start.end());
  if (p.block) {
    p.o_usel = hdr.size();
    hdr.insert(hdr.end(), p.usel_indptr.begin(), p.usel_indptr.end());
    p.o_members = hdr.size();
    hdr.insert(hdr.end(), p.members_indptr.begin(), p.members_indptr.end());
    hdr.insert(hdr.end(), p.members.begin(), p.members.end());
  }
  if (p.shared) {
    p.o_lsel = hdr.size();
    hdr.insert(hdr.end(), p.lplan.out_indptr.begin(), p.lplan.out_indptr.end());
    p.o_lpages = hdr.size();
    hdr.insert(hdr.end(), p.lpage_indptr.begin(), p.lpage_indptr.end());
    p.o_listof = hdr.size();
    hdr.insert(hdr.end(), p.list_of.begin(), p.list_of.end());
  }
  if (hdr.size() % 2) hdr.push_back(0);
  p.o_lists = hdr.size();
  hdr.resize(hdr.size() + 2 * p.L + 2);
  for (int l = 0; l < p.L; ++l) {
    int32_t* list = parts_[p.lists[l]].list.as<int32_t>();
    std::memcpy(hdr.data() + p.o_lists + 2 * l, &list, sizeof(list));
  }
  p.o_step = p.o_lists + 2 * p.L;
  p.use_mark = ++use_marks_;
  std::memcpy(hdr.data() + p.o_step, &p.use_mark, sizeof(int64_t));
  if (p.B > 1) {  // each row's page table, gathered into batch_pages_
    p.o_srcs = hdr.size();
    hdr.resize(hdr.size() + 2 * p.B);
    for (int b = 0; b < p.B; ++b) {
      const uint32_t* src = parts_[s.partitions[b]].pages.as<uint32_t>();
      std::memcpy(hdr.data() + p.o_srcs + 2 * b, &src, sizeof(src));
    }
  }
  if (p.shared && p.L > 1) {  // each list's page table, gathered into list_pages_
    p.o_lsrcs = hdr.size();
    hdr.resize(hdr.size() + 2 * p.L);
    for (int l = 0; l < p.L; ++l) {
      const uint32_t* src = parts_[p.lists[l]].pages.as<uint32_t>();
      std::memcpy(hdr.data() + p.o_lsrcs + 2 * l, &src, sizeof(src));
    }
  }
}

kc::ResolveParams CudaBackendImpl::ResolveParamsFor(const StepArgs& s, const StepPlan& p) {
  char* qb = queues_.as<char>();
  kc::ResolveParams rp;
  rp.step = p.use_mark;
  rp.step_ptr = reinterpret_cast<const int64_t*>(p.d_hdr + p.o_step);
  rp.page_indptr = p.d_hdr + p.o_lstart;
  rp.page_ids = p.page_ids;
  rp.sel_indptr = p.d_hdr + (p.block ? p.o_usel : p.o_sel);
  rp.sel_count = (p.block ? usel_count_ : sel_count_).as<int32_t>();
  rp.sel_pages = (p.block ? usel_pages_ : sel_pages_).as<int32_t>();
  rp.host_addr = host_addr_.as<const void* const>();
  rp.hbm_slot = hbm_slot_.as<int32_t>();
  rp.slot_page = slot_page_.as<uint32_t>();
  rp.slot_head = slot_head_.as<int32_t>();
  rp.slot_last_use = slot_last_use_.as<int64_t>();
  rp.slot_pinned = slot_pinned_.as<uint8_t>();
  rp.part_indptr = p.d_hdr + p.o_part;
  rp.part_lists = reinterpret_cast<int32_t* const*>(p.d_hdr + p.o_lists);
  rp.slots = pool_.as();
  rp.out_slots = res_slots_.as<int32_t>();
  rp.out_count = res_count_.as<int32_t>();
  rp.cold = reinterpret_cast<kc::ResolveRequest*>(qb);
  rp.bypass = reinterpret_cast<kc::ResolveRequest*>(qb + p.qbytes_req);
  rp.cold_count = reinterpret_cast<int32_t*>(qb + 2 * p.qbytes_req);
  rp.bypass_count = rp.cold_count + 1;
  rp.queue_capacity = p.qcap;
  rp.counters = counters_.as<kc::ResolveCounters>();
  rp.workspace = res_ws_.as();
  return rp;
}


}  // namespace questkv::cuda_backend
