// The CUDA backend: append, fork and rollback tails, page and summary reads.
#include "runtime/cuda/backend.h"

#include "kernels/cpu/kernels_cpu.h"
#include "core/half.h"

namespace questkv::cuda_backend {

// ---- append --------------------------------------------------------------------------

Status CudaBackendImpl::ConvertIn(const void* host_f32, std::size_t elems, DevBuf& f32, DevBuf& out,
                                  const void** dev) {
  const std::size_t bytes = elems * DTypeBytes(g_.dtype);
  QKV_RETURN_IF_ERROR(out.Reserve(bytes, /*in_graphs=*/false));
  if (g_.dtype == DType::kF32) {
    QKV_RETURN_IF_ERROR(Upload(out.as(), host_f32, bytes));
  } else {
    QKV_RETURN_IF_ERROR(f32.Reserve(elems * 4, /*in_graphs=*/false));
    QKV_RETURN_IF_ERROR(Upload(f32.as(), host_f32, elems * 4));
    QKV_CUDA(kc::LaunchConvert(f32.as(), DType::kF32, out.as(), g_.dtype, elems, stream_));
  }
  *dev = out.as();
  return Status::Ok();
}

// Tokens [t0, t1) of the list's token positions, K/V rows at k, v (device,
// model dtype); every page they touch already has its slots.
Status CudaBackendImpl::LaunchAppendRange(Partition& P, int64_t t0, int64_t t1, const void* k, const void* v) {
  // The kernel reads the pages' slots: their table updates go first.
  QKV_RETURN_IF_ERROR(FlushUpdates());
  return LaunchAppendOne(nullptr, int32_t(t0), P.pages.as<uint32_t>(), int(t1 - t0), k, v);
}

// The append kernel for one sequence: n rows of K and V from token position
// `start` into the pages page_ids; hdr (device) {0, n, start, 0, pages} or,
// null, the same carried in the launch.
Status CudaBackendImpl::LaunchAppendOne(const int32_t* hdr, int32_t start, const uint32_t* page_ids, int n,
                                        const void* k, const void* v) {
  kc::AppendParams p;
  p.kv_dtype = g_.dtype;
  p.summary_dtype = sum_dtype();
  p.chain = c_.cuda_chain_kernels;
  p.batch = 1;
  p.kv_heads = g_.kv_heads;
  p.page_size = g_.page_size;
  p.head_dim = g_.head_dim;
  p.max_new_tokens = n;
  if (hdr) {
    p.append_indptr = hdr;
    p.start_pos = hdr + 2;
    p.page_indptr = hdr + 3;
  }
  p.start = start;
  p.page_ids = page_ids;
  p.hbm_slot = hbm_slot_.as<int32_t>();
  p.k = k;
  p.v = v;
  p.slots = pool_.as();
  p.summaries = summaries_.as();
  QKV_CUDA(kc::LaunchAppend(p, stream_));
  return Status::Ok();
}

Status CudaBackendImpl::Append(uint32_t part, PageList& list, const void* k, const void* v, int64_t n, bool host_f32,
                               int64_t step, bool hold) {
  HostClock clock(n < g_.page_size ? append_prof_ : fill_prof_);
  QKV_RETURN_IF_ERROR(EndSeals(/*wait=*/sealing_.size() >= kMaxSealsInFlight));
  MarkStream(n < g_.page_size ? kMarkAppend : kMarkFill);
  AppendPlan a;
  a.k = k, a.v = v, a.host_f32 = host_f32, a.hold = hold;
  a.old_tokens = list.tokens, a.end = list.tokens + n;
  a.old_pages = int64_t(list.pages.size());
  a.total_pages = (a.end + g_.page_size - 1) / g_.page_size;
  if (a.total_pages > INT32_MAX / 2) return Status::OutOfRange("sequence too long for one layer's page table");
  if (hold) {
    // Every page the drafts fill keeps Hkv slots until it is accepted or
    // rolled back (an old tail that fills leaves its slots to it and takes
    // fresh ones): all of them free before anything changes.
    const int64_t filled = a.end / g_.page_size - a.old_tokens / g_.page_size;
    const int64_t need = filled * g_.kv_heads;
    QKV_RETURN_IF_ERROR(Reclaim(need, need, /*except=*/0, /*below_need=*/true));
    if (int64_t(free_.size()) < need)
      return Status::ResourceExhausted("hbm: " + std::to_string(filled) + " pages of draft tokens need " +
                                       std::to_string(need) + " head-page slots, " + std::to_string(free_.size()) +
                                       " free of " + std::to_string(slots_));
  }
  QKV_RETURN_IF_ERROR(ReserveAppend(list, step, a));
  clock.Mark(kAppendReserve);
  // Device work. The page mirror first.
  Partition& P = parts_[part];
  QKV_RETURN_IF_ERROR(GrowPages(P, a.total_pages));
  QKV_RETURN_IF_ERROR(Upload(P.pages.as<uint32_t>() + a.old_pages, a.fresh.data(), a.fresh.size() * 4));
  P.pages_len = a.total_pages;
  clock.Mark(kAppendMirror);
  QKV_RETURN_IF_ERROR(AppendToOldTail(part, a));
  clock.Mark(kAppendTail);
  QKV_RETURN_IF_ERROR(AppendFreshPages(part, a));
  clock.Mark(kAppendFresh);
  QKV_RETURN_IF_ERROR(FlushUpdates());
  QKV_RETURN_IF_ERROR(ExtendList(part, a.resident));
  QKV_RETURN_IF_ERROR(EndSealsLater(a.sealing));
  list.pages.insert(list.pages.end(), a.fresh.begin(), a.fresh.end());
  list.tokens = a.end;
  clock.Mark(kAppendFinish);
  MarkStream(kMarkAfterAppend);
  return Status::Ok();
}

// Everything that can fail on the host comes first: ids, then host homes for
// every page this call fills. On failure nothing is kept.
Status CudaBackendImpl::ReserveAppend(const PageList& list, int64_t step, AppendPlan& a) {
  const int S = g_.page_size;
  auto drop_fresh = [&] {
    for (PageId id : a.fresh) ids_->Unref(id);
  };
  for (int64_t p = a.old_pages; p < a.total_pages; ++p) {
    auto id = ids_->Allocate();
    if (!id.ok()) {
      drop_fresh();
      return id.status();
    }
    a.fresh.push_back(*id);
  }
  for (int64_t p = a.old_tokens / S; p < a.end / S && !a.hold; ++p) {
    const PageId id = p < a.old_pages ? list.pages[p] : a.fresh[p - a.old_pages];
    auto home = BeginSeal(id, step);
    if (!home.ok()) {
      for (const AppendPlan::Sealing& s : a.sealing) mover_->Drop(s.page);
      drop_fresh();
      return home.status();
    }
    a.sealing.push_back({id, p, *home});
  }
  return Status::Ok();
}

// Copies every page sealed up to logical page `last_logical` from its slots
// (tail, resident, or the staging slots from `first_staged` on) into its home.
Status CudaBackendImpl::SealThrough(const Partition& P, AppendPlan& a, int64_t last_logical, int64_t first_staged) {
  const int H = g_.kv_heads;
  std::vector<kc::SealJob> jobs;
  for (; a.next_seal < a.sealing.size() && a.sealing[a.next_seal].logical <= last_logical; ++a.next_seal) {
    const AppendPlan::Sealing& s = a.sealing[a.next_seal];
    char* home = static_cast<char*>(home_dev(s.home));
    for (int h = 0; h < H; ++h) {
      const auto r = a.resident_at.find(s.page);
      const int32_t slot = s.page == P.tail_page    ? P.tail[h]
                           : r != a.resident_at.end() ? a.resident[r->second + h]
                                                      : staging_[(s.logical - first_staged) * H + h];
      jobs.push_back({slot_ptr(slot), home + std::size_t(h) * piece(), home + std::size_t(H + h) * piece()});
    }
  }
  return LaunchSeals(jobs);
}

Status CudaBackendImpl::LaunchSeals(const std::vector<kc::SealJob>& jobs) {
  if (jobs.empty()) return Status::Ok();
  auto* st = static_cast<kc::SealJob*>(StageAlloc(jobs.size() * sizeof(kc::SealJob)));
  if (!st) return Status::ResourceExhausted("pinned staging for seal jobs");
  std::memcpy(st, jobs.data(), jobs.size() * sizeof(kc::SealJob));
  QKV_CUDA(kc::LaunchSealCopy(static_cast<kc::SealJob*>(StageDev(st)), int(jobs.size()), piece(), stream_));
  return Status::Ok();
}

Result<void*> CudaBackendImpl::BeginSeal(PageId page, int64_t step) {
  auto home = mover_->SealBegin(page, ids_->generation(page), step);
  if (home.ok() || home.status().code() != Code::kResourceExhausted || sealing_.empty()) return home;
  QKV_RETURN_IF_ERROR(EndSeals(/*wait=*/true));
  return mover_->SealBegin(page, ids_->generation(page), step);
}

Status CudaBackendImpl::EndSealsLater(std::span<const AppendPlan::Sealing> seals) {
  if (seals.empty()) return Status::Ok();  // nothing the host reads changed
  SealBatch b;
  QKV_RETURN_IF_ERROR(RecordEvent(&b.done));
  for (const AppendPlan::Sealing& s : seals) {
    SetHome(s.page, s.home);
    b.pages.push_back(s.page);
    sealing_.insert(s.page);
  }
  seal_batches_.push_back(std::move(b));
  return Status::Ok();
}

Status CudaBackendImpl::EndSeals(bool wait) {
  while (!seal_batches_.empty()) {
    SealBatch& b = seal_batches_.front();
    if (wait) {
      QKV_CUDA(cudaEventSynchronize(b.done));
    } else if (const cudaError_t q = cudaEventQuery(b.done); q == cudaErrorNotReady) {
      break;
    } else {
      QKV_CUDA(q);
    }
    for (PageId page : b.pages) {
      sealing_.erase(page);
      mover_->SealEnd(page);
    }
    spare_events_.push_back(b.done);
    seal_batches_.pop_front();
  }
  return Status::Ok();
}

// Tokens [t0, t1) of the call's K and V on the device in the model dtype.
Status CudaBackendImpl::AppendRows(const AppendPlan& a, int64_t t0, int64_t t1, const void** kd, const void** vd) {
  const std::size_t row = std::size_t(g_.kv_heads) * g_.head_dim;
  const std::size_t off = std::size_t(t0 - a.old_tokens) * row, elems = std::size_t(t1 - t0) * row;
  if (!a.host_f32) {
    *kd = static_cast<const char*>(a.k) + off * DTypeBytes(g_.dtype);
    *vd = static_cast<const char*>(a.v) + off * DTypeBytes(g_.dtype);
    return Status::Ok();
  }
  QKV_RETURN_IF_ERROR(ConvertIn(static_cast<const float*>(a.k) + off, elems, kv_f32_, kv_in_, kd));
  return ConvertIn(static_cast<const float*>(a.v) + off, elems, kv_f32_, v_in_, vd);
}

// The old tail, in its tail slots, up to its page boundary.
Status CudaBackendImpl::AppendToOldTail(uint32_t part, AppendPlan& a) {
  Partition& P = parts_[part];
  const int S = g_.page_size;
  a.t = a.old_tokens;
  if (a.old_tokens % S == 0) return Status::Ok();
  const int64_t t1 = std::min(a.end, (a.old_tokens / S + 1) * S);
  const void *kd, *vd;
  QKV_RETURN_IF_ERROR(AppendRows(a, a.t, t1, &kd, &vd));
  QKV_RETURN_IF_ERROR(LaunchAppendRange(P, a.t, t1, kd, vd));
  QKV_RETURN_IF_ERROR(SealThrough(P, a, t1 / S - 1, 0));
  // A filled tail keeps its slots while the pool has slots for a fresh tail
  // (a draft's room is checked by Append): held, for a draft, or joining the
  // list unpinned, as a full fresh page does. Every row's local window
  // selects it at the next step; handing its slots to the next page made it
  // miss there, a host read, or under `deadline` a skip while its seal was in
  // flight.
  if (t1 % S == 0 && (a.hold || int64_t(free_.size()) >= g_.kv_heads)) {
    const PageId page = P.tail_page;
    if (a.hold) {
      held_[page] = {part, std::move(P.tail)};
    } else {
      a.resident_at[page] = a.resident.size();
      for (const int32_t slot : P.tail) {
        Set(slot_pinned_.as<uint8_t>() + slot, 0, kc::TableOp::kSet8);
        a.resident.push_back(slot);
      }
    }
    tail_owner_.erase(page);
    P.tail_page = kNoPage;
    P.tail = TakePinnedSlots(nullptr);
  }
  a.t = t1;
  return Status::Ok();
}

// Fresh pages, kStagingPages at a time; a partial last page takes the tail
// slots. Full pages keep free slots (they stay resident, joining the list at
// the end) while the pool has them; the rest pass through staging.
Status CudaBackendImpl::AppendFreshPages(uint32_t part, AppendPlan& a) {
  Partition& P = parts_[part];
  const int S = g_.page_size, H = g_.kv_heads;
  for (int64_t p0 = a.old_pages; p0 < a.total_pages; p0 += kStagingPages) {
    const int64_t p1 = std::min<int64_t>(a.total_pages, p0 + kStagingPages);
    std::vector<PageId> chunk;
    for (int64_t p = p0; p < p1; ++p) {
      const PageId id = a.fresh[p - a.old_pages];
      chunk.push_back(id);
      const bool partial_last = p == a.total_pages - 1 && a.end % S != 0;
      if (partial_last) {
        QKV_RETURN_IF_ERROR(AssignTail(part, id));
      } else if (a.hold) {  // room checked by Append
        held_[id] = {part, TakePinnedSlots(&id)};
      } else if (int64_t(free_.size()) >= H) {
        a.resident_at[id] = a.resident.size();
        for (int h = 0; h < H; ++h) {
          a.resident.push_back(free_.back());
          free_.pop_back();
          SetSlot(a.resident.back(), id, h);
        }
      } else {
        for (int h = 0; h < H; ++h) Set(hbm_cell(id, h), staging_[(p - p0) * H + h], kc::TableOp::kSet32);
      }
    }
    QKV_RETURN_IF_ERROR(FlushUpdates());
    QKV_CUDA(kc::LaunchResetSummaries(summaries_.as(), sum_dtype(), P.pages.as<uint32_t>() + p0, int(p1 - p0), H,
                                      g_.head_dim, stream_));
    const int64_t t1 = std::min(a.end, p1 * S);
    const void *kd, *vd;
    QKV_RETURN_IF_ERROR(AppendRows(a, a.t, t1, &kd, &vd));
    QKV_RETURN_IF_ERROR(LaunchAppendRange(P, a.t, t1, kd, vd));
    QKV_RETURN_IF_ERROR(SealThrough(P, a, p1 - 1, p0));
    // Staged pages leave the staging slots (their homes hold them now).
    for (PageId id : chunk)
      if (id != P.tail_page && !a.resident_at.count(id) && !held_.count(id))
        for (int h = 0; h < H; ++h) Set(hbm_cell(id, h), -1, kc::TableOp::kSet32);
    a.t = t1;
  }
  return Status::Ok();
}

std::vector<int32_t> CudaBackendImpl::TakePinnedSlots(const PageId* page) {
  std::vector<int32_t> slots(free_.end() - g_.kv_heads, free_.end());
  free_.resize(free_.size() - g_.kv_heads);
  for (int h = 0; h < g_.kv_heads; ++h) {
    Set(slot_pinned_.as<uint8_t>() + slots[h], 1, kc::TableOp::kSet8);
    if (page) SetSlot(slots[h], *page, h);
  }
  slots_peak_ = std::max<uint64_t>(slots_peak_, uint64_t(slots_ - int64_t(free_.size())));
  return slots;
}

// An accepted draft page: its bytes from its slots into a home, then the
// slots join its partition's list as a cached page.
Status CudaBackendImpl::SealHeld(PageId page) {
  const auto it = held_.find(page);
  if (it == held_.end()) return Status::Ok();
  QKV_ASSIGN_OR_RETURN(void* home, BeginSeal(page, step_));
  const int H = g_.kv_heads;
  std::vector<kc::SealJob> jobs;
  char* dst = static_cast<char*>(home_dev(home));
  for (int h = 0; h < H; ++h)
    jobs.push_back({slot_ptr(it->second.slots[h]), dst + std::size_t(h) * piece(), dst + std::size_t(H + h) * piece()});
  QKV_RETURN_IF_ERROR(FlushUpdates());
  if (Status s = LaunchSeals(jobs); !s.ok()) {
    mover_->Drop(page);
    return s;
  }
  const AppendPlan::Sealing seal{page, 0, home};
  QKV_RETURN_IF_ERROR(EndSealsLater({&seal, 1}));
  const Held held = std::move(it->second);
  held_.erase(it);
  for (int32_t s : held.slots) Set(slot_pinned_.as<uint8_t>() + s, 0, kc::TableOp::kSet8);
  return ExtendList(held.part, held.slots);  // (the pinned marks clear at the flush before the next step)
}

// ---- fork, rollback, reads ----------------------------------------------------------

// Rebuilds a page's summary from the first `len` keys of its heads (host
// bytes [Hkv][S][D] in the model dtype) with the CPU twin, and uploads it.
Status CudaBackendImpl::RebuildSummary(const void* k_heads_host, PageId page, int len) {
  const int H = g_.kv_heads;
  const std::size_t hp = g_.head_page_elems();
  std::vector<float> keys(H * hp), summary(g_.summary_elems());
  ToFloats(k_heads_host, g_.dtype, keys.size(), keys.data());
  const float* heads[kernels::kMaxKvHeads];
  for (int h = 0; h < H; ++h) heads[h] = keys.data() + h * hp;
  kernels::RebuildSummaryHeadsCpu(heads, summary.data(), H, g_.head_dim, len);
  char* dst = summaries_.as<char>() + std::size_t(page) * summary_bytes();
  if (e4m3()) {  // rounded outward on the host, as the append kernel rounds
    std::vector<uint8_t> codes(summary.size());
    kernels::EncodeSummaryE4m3Cpu(summary.data(), H, g_.head_dim, codes.data());
    return Upload(dst, codes.data(), codes.size());
  }
  // Through f32 on the device, converted exactly (the values are keys' values).
  QKV_RETURN_IF_ERROR(summary_f32_.Reserve(summary.size() * sizeof(float), /*in_graphs=*/false));
  QKV_RETURN_IF_ERROR(Upload(summary_f32_.as(), summary.data(), summary.size() * sizeof(float)));
  QKV_CUDA(kc::LaunchConvert(summary_f32_.as(), DType::kF32, dst, sum_dtype(), summary.size(), stream_));
  return Status::Ok();
}

Status CudaBackendImpl::CopyTail(uint32_t src_part, PageId src, uint32_t dst_part, PageId dst, int len, int64_t) {
  Partition &A = parts_[src_part], &B = parts_[dst_part];
  assert(A.tail_page == src);
  QKV_RETURN_IF_ERROR(AssignTail(dst_part, dst));
  QKV_RETURN_IF_ERROR(FlushUpdates());
  for (int h = 0; h < g_.kv_heads; ++h)
    QKV_CUDA(cudaMemcpyAsync(slot_ptr(B.tail[h]), slot_ptr(A.tail[h]), 2 * piece(), cudaMemcpyDeviceToDevice, stream_));
  const std::size_t sb = summary_bytes();
  QKV_CUDA(cudaMemcpyAsync(summaries_.as<char>() + std::size_t(dst) * sb, summaries_.as<char>() + std::size_t(src) * sb,
                           sb, cudaMemcpyDeviceToDevice, stream_));
  (void)len;  // the summary of the first len tokens is the source's: the tail holds exactly len
  return Sync();
}

Status CudaBackendImpl::TailFromHost(uint32_t part, PageId dst, const void* page, int len, int64_t) {
  Partition& P = parts_[part];
  const int H = g_.kv_heads;
  QKV_RETURN_IF_ERROR(AssignTail(part, dst));
  QKV_RETURN_IF_ERROR(FlushUpdates());
  const char* bytes = static_cast<const char*>(page);
  for (int h = 0; h < H; ++h) {
    QKV_RETURN_IF_ERROR(Upload(slot_ptr(P.tail[h]), bytes + std::size_t(h) * piece(), piece()));
    QKV_RETURN_IF_ERROR(Upload(slot_ptr(P.tail[h]) + piece(), bytes + std::size_t(H + h) * piece(), piece()));
  }
  QKV_RETURN_IF_ERROR(RebuildSummary(bytes, dst, len));
  return Sync();
}

Status CudaBackendImpl::TruncateTail(uint32_t part, PageId tail, int len) {
  Partition& P = parts_[part];
  if (const auto it = held_.find(tail); it != held_.end()) {  // a rollback into a held draft page: the new tail
    if (P.tail_page != kNoPage) return Status::Internal("a held page is cut while its partition has a tail");
    ReleaseSlots(P.tail);
    P.tail = std::move(it->second.slots);
    held_.erase(it);
    P.tail_page = tail;
    tail_owner_[tail] = part;
  }
  assert(P.tail_page == tail);
  // The kept tokens appended anew: their K and V gathered from the tail
  // slots into append rows [len][Hkv][D], the page's box emptied, then the
  // append kernel writes them back and folds the box: the summary appending
  // only them made (the same arithmetic, E4M3 rounding included). All on the
  // stream: nothing waits.
  const int H = g_.kv_heads;
  const std::size_t row = std::size_t(g_.head_dim) * DTypeBytes(g_.dtype);
  QKV_RETURN_IF_ERROR(kv_in_.Reserve(std::size_t(len) * H * row, /*in_graphs=*/false));
  QKV_RETURN_IF_ERROR(v_in_.Reserve(std::size_t(len) * H * row, /*in_graphs=*/false));
  QKV_RETURN_IF_ERROR(FlushUpdates());  // hbm_slot names the tail's slots
  kc::PageRowsParams rows;
  rows.slots = pool_.as();
  rows.hbm_slot = hbm_slot_.as<int32_t>();
  rows.page = tail;
  rows.kv_heads = H;
  rows.len = len;
  rows.row_bytes = row;
  rows.piece_bytes = piece();
  rows.k_out = kv_in_.as();
  rows.v_out = v_in_.as();
  QKV_CUDA(kc::LaunchPageRows(rows, stream_));
  // append_indptr {0, len}, start_pos {0}, page_indptr {0, 1}, page_ids {tail}.
  const int32_t hdr[6] = {0, len, 0, 0, 1, int32_t(tail)};
  auto* st = static_cast<int32_t*>(StageAlloc(sizeof(hdr)));
  if (!st) return Status::ResourceExhausted("pinned staging");
  std::memcpy(st, hdr, sizeof(hdr));
  const int32_t* d = static_cast<const int32_t*>(StageDev(st));
  const uint32_t* ids = reinterpret_cast<const uint32_t*>(d + 5);
  QKV_CUDA(kc::LaunchResetSummaries(summaries_.as(), sum_dtype(), ids, 1, H, g_.head_dim, stream_));
  return LaunchAppendOne(d, 0, ids, len, kv_in_.as(), v_in_.as());
}

Status CudaBackendImpl::ReadUnsealed(uint32_t part, PageId page, void* dst) {
  Partition& P = parts_[part];
  const auto held = held_.find(page);
  if (P.tail_page != page && held == held_.end())
    return Status::Internal("page " + std::to_string(page) + " has no home and is not in the partition's slots");
  const std::vector<int32_t>& slots = P.tail_page == page ? P.tail : held->second.slots;
  QKV_RETURN_IF_ERROR(FlushUpdates());
  char* out = static_cast<char*>(dst);
  const int H = g_.kv_heads;
  for (int h = 0; h < H; ++h) {
    QKV_CUDA(cudaMemcpyAsync(out + std::size_t(h) * piece(), slot_ptr(slots[h]), piece(), cudaMemcpyDeviceToHost, stream_));
    QKV_CUDA(cudaMemcpyAsync(out + std::size_t(H + h) * piece(), slot_ptr(slots[h]) + piece(), piece(),
                             cudaMemcpyDeviceToHost, stream_));
  }
  return Sync();
}

Status CudaBackendImpl::ReadSummaries(std::span<const PageId> pages, float* dst) {
  QKV_RETURN_IF_ERROR(FlushUpdates());
  const std::size_t elems = g_.summary_elems();
  std::vector<char> raw(pages.size() * summary_bytes());
  for (std::size_t i = 0; i < pages.size(); ++i)
    QKV_CUDA(cudaMemcpyAsync(raw.data() + i * summary_bytes(), summaries_.as<char>() + std::size_t(pages[i]) * summary_bytes(),
                             summary_bytes(), cudaMemcpyDeviceToHost, stream_));
  QKV_RETURN_IF_ERROR(Sync());
  if (e4m3())
    kernels::DecodeSummaryE4m3Cpu(reinterpret_cast<const uint8_t*>(raw.data()), pages.size() * elems, dst);
  else
    ToFloats(raw.data(), g_.dtype, pages.size() * elems, dst);
  return Status::Ok();
}

}  // namespace questkv::cuda_backend
