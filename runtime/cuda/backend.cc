// The CUDA backend: device buffers, pinned staging, table edits, counters,
// the dense-offload timing, and its factory.
#include "runtime/cuda/backend.h"

#include <cstdio>

namespace questkv::cuda_backend {

Status CudaBackendImpl::Init() {
  const int H = g_.kv_heads;
  if (g_.head_dim != 64 && g_.head_dim != 128 && g_.head_dim != 256)
    return Status::InvalidArgument("the CUDA backend supports head_dim 64, 128, 256, not " + std::to_string(g_.head_dim));
  if (g_.page_size != 8 && g_.page_size != 16 && g_.page_size != 32 && g_.page_size != 64)
    return Status::InvalidArgument("the CUDA backend supports page_size 8, 16, 32, 64, not " + std::to_string(g_.page_size));
  const int G = g_.group();
  if (G < 1 || G > 8)
    return Status::InvalidArgument("the CUDA backend supports GQA groups 1 to 8, not " + std::to_string(G));
  if (c_.policy.group_pages != 0)
    return Status::Unimplemented("the CUDA backend selects by the flat Quest scan: group_pages needs the CPU backend");
  const SelectionPolicy& sp = c_.policy;
  if (sp.unread_bound_mass != 0 &&
      (sp.gqa == GqaMode::kUnion || sp.rerank > 0 || sp.block_selection == BlockSelection::kShared))
    return Status::Unimplemented(
        "the CUDA backend sets adaptive budgets per KV head of one position with gqa max or mean: with gqa union, "
        "rerank or shared block selection they need the CPU backend");
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return Status::FailedPrecondition("no usable CUDA device");
  if (!host_->region().pinned())
    return Status::FailedPrecondition("the host tier is not pinned and mapped for the GPU");
  int dev = 0;
  QKV_CUDA(cudaGetDevice(&dev));
  QKV_CUDA(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, dev));
  QKV_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  for (cudaEvent_t& e : ev_) QKV_CUDA(cudaEventCreate(&e));
  for (Report& r : reports_) QKV_CUDA(cudaEventCreateWithFlags(&r.done, cudaEventDisableTiming));
  mover_->SetDeviceReads({[this] { return ReadsQueued(); }, [this](bool wait) { return ReadsDone(wait); }});
  void* hd = nullptr;
  host_base_ = reinterpret_cast<const char*>(host_->base());
  QKV_CUDA(cudaHostGetDevicePointer(&hd, host_->base(), 0));
  host_dev_ = static_cast<char*>(hd);

  const std::size_t slot_bytes = 2 * piece();
  const int64_t want = c_.hbm_bytes ? int64_t(c_.hbm_bytes / slot_bytes)
                                    : int64_t(c_.max_pages) * H + int64_t(kStagingPages) * H;
  const int64_t min_slots = int64_t(kStagingPages) * H + 2 * H;
  if (want < min_slots)
    return Status::InvalidArgument("hbm_bytes holds " + std::to_string(want) + " head-page slots; the CUDA backend needs " +
                                   std::to_string(min_slots) + " or more (prefill staging plus one tail)");
  if (want >= INT32_MAX) return Status::InvalidArgument("hbm_bytes holds more than 2^31 head-page slots");
  slots_ = want;
  const std::size_t P = c_.max_pages;
  QKV_RETURN_IF_ERROR(pool_.Reserve(std::size_t(slots_) * slot_bytes));
  QKV_RETURN_IF_ERROR(summaries_.Reserve(P * summary_bytes()));
  QKV_RETURN_IF_ERROR(hbm_slot_.Reserve(P * H * sizeof(int32_t)));
  QKV_RETURN_IF_ERROR(host_addr_.Reserve(P * sizeof(void*)));
  QKV_RETURN_IF_ERROR(slot_page_.Reserve(slots_ * sizeof(uint32_t)));
  QKV_RETURN_IF_ERROR(slot_head_.Reserve(slots_ * sizeof(int32_t)));
  QKV_RETURN_IF_ERROR(slot_last_use_.Reserve(slots_ * sizeof(int64_t)));
  QKV_RETURN_IF_ERROR(slot_pinned_.Reserve(slots_));
  QKV_RETURN_IF_ERROR(counters_.Reserve(sizeof(kc::ResolveCounters)));
  QKV_RETURN_IF_ERROR(scratch_counters_.Reserve(sizeof(kc::ResolveCounters)));
  QKV_RETURN_IF_ERROR(adaptive_counters_.Reserve(sizeof(kc::AdaptiveCounters)));
  QKV_CUDA(cudaMemsetAsync(hbm_slot_.as(), 0xFF, hbm_slot_.bytes(), stream_));
  QKV_CUDA(cudaMemsetAsync(host_addr_.as(), 0, host_addr_.bytes(), stream_));
  QKV_CUDA(cudaMemsetAsync(slot_page_.as(), 0xFF, slot_page_.bytes(), stream_));
  QKV_CUDA(cudaMemsetAsync(slot_head_.as(), 0, slot_head_.bytes(), stream_));
  QKV_CUDA(cudaMemsetAsync(slot_last_use_.as(), 0xFF, slot_last_use_.bytes(), stream_));
  QKV_CUDA(cudaMemsetAsync(slot_pinned_.as(), 0, slot_pinned_.bytes(), stream_));
  QKV_CUDA(cudaMemsetAsync(counters_.as(), 0, counters_.bytes(), stream_));
  QKV_CUDA(cudaMemsetAsync(adaptive_counters_.as(), 0, adaptive_counters_.bytes(), stream_));
  // Staging slots are pinned (never victims, never in a list).
  for (int64_t s = 0; s < int64_t(kStagingPages) * H; ++s) staging_.push_back(int32_t(s));
  QKV_CUDA(cudaMemsetAsync(slot_pinned_.as(), 1, staging_.size(), stream_));
  for (int64_t s = slots_ - 1; s >= int64_t(staging_.size()); --s) free_.push_back(int32_t(s));
  stage_cap_ = 64u << 20;
  QKV_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&stage_), stage_cap_, cudaHostAllocMapped | cudaHostAllocPortable));
  void* sd = nullptr;
  QKV_CUDA(cudaHostGetDevicePointer(&sd, stage_, 0));
  stage_dev_ = static_cast<char*>(sd);
  parts_.emplace_back();  // partition 0 is never handed out
  return Sync();
}

void* CudaBackendImpl::StageAlloc(std::size_t bytes) {
  bytes = Align256(std::max<std::size_t>(bytes, 1));
  if (stage_used_ + bytes > stage_cap_) {
    if (!Sync().ok()) return nullptr;
    if (bytes > stage_cap_) {
      cudaFreeHost(stage_);
      stage_ = nullptr;
      stage_cap_ = std::max(bytes, 2 * stage_cap_);
      if (cudaHostAlloc(reinterpret_cast<void**>(&stage_), stage_cap_, cudaHostAllocMapped | cudaHostAllocPortable) !=
          cudaSuccess)
        return nullptr;
      void* sd = nullptr;
      cudaHostGetDevicePointer(&sd, stage_, 0);
      stage_dev_ = static_cast<char*>(sd);
    }
  }
  void* p = stage_ + stage_used_;
  stage_used_ += bytes;
  return p;
}

Status CudaBackendImpl::Sync() {
  kc::ResolveCounters c{};
  if (unchecked_async_)
    QKV_CUDA(cudaMemcpyAsync(&c, counters_.as(), sizeof(c), cudaMemcpyDeviceToHost, stream_));
  QKV_CUDA(cudaStreamSynchronize(stream_));
  SettleStreamMarks();
  stage_used_ = 0;
  reads_done_ = reads_queued_;
  for (auto& [ticket, e] : ticket_events_) spare_events_.push_back(e);
  ticket_events_.clear();
  if (unchecked_async_) {
    unchecked_async_ = false;
    if (c.bypasses > bypasses_seen_ && async_error_.ok()) async_error_ = NoSlotFault(c.bypasses - bypasses_seen_);
    bypasses_seen_ = c.bypasses;
  }
  return Status::Ok();
}

void CudaBackendImpl::MarkStream(int mark) {
  if (!c_.cuda_profile_host) return;
  StreamProfile& sp = stream_prof_;
  if (sp.marks.size() >= 4096) {  // an engine that never waits: settle here (profiling only)
    if (cudaEventSynchronize(sp.marks.back().second) == cudaSuccess) SettleStreamMarks();
  }
  cudaEvent_t e = nullptr;
  if (!sp.spare.empty()) {
    e = sp.spare.back();
    sp.spare.pop_back();
  } else if (cudaEventCreate(&e) != cudaSuccess) {
    return;
  }
  if (cudaEventRecord(e, stream_) != cudaSuccess) {
    sp.spare.push_back(e);
    return;
  }
  sp.marks.emplace_back(mark, e);
}

// The marks' spans once their events are done (after a wait on the stream).
void CudaBackendImpl::SettleStreamMarks() {
  StreamProfile& sp = stream_prof_;
  for (std::size_t i = 1; i < sp.marks.size(); ++i) {
    float ms = 0;
    const int span = StreamProfile::SpanOf(sp.marks[i - 1].first, sp.marks[i].first);
    if (span < 0 || cudaEventElapsedTime(&ms, sp.marks[i - 1].second, sp.marks[i].second) != cudaSuccess) continue;
    sp.us[span].push_back(1e3f * ms);
  }
  for (const auto& m : sp.marks) sp.spare.push_back(m.second);
  sp.marks.clear();
}

// A call that returns before the device is done with it: its ticket, and
// an event that says when it is done.
Status CudaBackendImpl::TicketCall() {
  cudaEvent_t e = nullptr;
  QKV_RETURN_IF_ERROR(RecordEvent(&e));
  ticket_events_.emplace_back(++reads_queued_, e);
  return Status::Ok();
}

Status CudaBackendImpl::RecordEvent(cudaEvent_t* e) {
  if (spare_events_.empty()) {
    QKV_CUDA(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  } else {
    *e = spare_events_.back();
    spare_events_.pop_back();
  }
  if (const cudaError_t r = cudaEventRecord(*e, stream_); r != cudaSuccess) {
    spare_events_.push_back(*e);
    return CudaStatus("cudaEventRecord", r);
  }
  return Status::Ok();
}

Result<uint64_t> CudaBackendImpl::ReadsDone(bool wait) {
  if (wait && !ticket_events_.empty()) QKV_CUDA(cudaEventSynchronize(ticket_events_.back().second));
  while (!ticket_events_.empty()) {
    const auto [ticket, e] = ticket_events_.front();
    const cudaError_t q = cudaEventQuery(e);
    if (q == cudaErrorNotReady) break;
    QKV_CUDA(q);
    reads_done_ = ticket;
    spare_events_.push_back(e);
    ticket_events_.pop_front();
  }
  return reads_done_;
}

Status CudaBackendImpl::Upload(void* dev_dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return Status::Ok();
  void* st = StageAlloc(bytes);
  if (!st) return Status::ResourceExhausted("pinned staging of " + std::to_string(bytes) + " bytes");
  std::memcpy(st, src, bytes);
  QKV_CUDA(cudaMemcpyAsync(dev_dst, st, bytes, cudaMemcpyHostToDevice, stream_));
  return Status::Ok();
}

Status CudaBackendImpl::FlushUpdates() {
  // Most calls have none: an empty index's clear() still sweeps its buckets.
  if (clears_.empty() && sets_.empty() && set_index_.empty()) return Status::Ok();
  const kc::DeviceTables t{hbm_slot_.as<int32_t>(), slot_page_.as<uint32_t>(), slot_head_.as<int32_t>(),
                           slot_last_use_.as<int64_t>(), slot_pinned_.as<uint8_t>(), g_.kv_heads};
  for (std::vector<kc::TableUpdate>* ops : {&clears_, &sets_}) {
    if (ops->empty()) continue;
    auto* st = static_cast<kc::TableUpdate*>(StageAlloc(ops->size() * sizeof(kc::TableUpdate)));
    if (!st) return Status::ResourceExhausted("pinned staging for table updates");
    std::memcpy(st, ops->data(), ops->size() * sizeof(kc::TableUpdate));
    QKV_CUDA(kc::LaunchTableUpdates(static_cast<kc::TableUpdate*>(StageDev(st)), int(ops->size()), t, stream_));
    ops->clear();
  }
  // clear() sweeps every bucket, and prefill leaves millions of them: at 1M
  // tokens that sweep cost each decode call hundreds of µs. A large index is
  // dropped instead.
  if (set_index_.bucket_count() > 4096)
    set_index_ = {};
  else
    set_index_.clear();
  return Status::Ok();
}

Result<double> CudaBackendImpl::TimeDenseOffload(std::span<const PageList* const> lists, std::size_t max_bytes,
                                                 int reps, int64_t* bytes) {
  QKV_RETURN_IF_ERROR(EndSeals(/*wait=*/true));  // every sealed page readable
  const int H = g_.kv_heads;
  const std::size_t head_page = 2 * piece();
  std::vector<kc::GatherJob> jobs;
  int64_t total = 0;
  for (const PageList* l : lists)
    for (PageId page : l->pages) {
      total += int64_t(H) * int64_t(head_page);
      const void* home = mover_->HostHome(page);
      if (!home || (jobs.size() + H) * head_page > max_bytes) continue;
      const char* d = static_cast<const char*>(home_dev(home));
      for (int h = 0; h < H; ++h)
        jobs.push_back({d + std::size_t(h) * piece(), d + std::size_t(H + h) * piece(),
                        reinterpret_cast<void*>(jobs.size() * head_page)});  // offset, rebased below
    }
  if (jobs.empty()) return Status::FailedPrecondition("no page has a host home to stream from");
  DevBuf dst, meta;
  QKV_RETURN_IF_ERROR(dst.Reserve(jobs.size() * head_page, /*in_graphs=*/false));
  for (kc::GatherJob& j : jobs) j.dst = dst.as<char>() + reinterpret_cast<uintptr_t>(j.dst);
  QKV_RETURN_IF_ERROR(meta.Reserve(jobs.size() * sizeof(kc::GatherJob) + 16, /*in_graphs=*/false));
  const int32_t n = int32_t(jobs.size());
  QKV_CUDA(cudaMemcpyAsync(meta.as(), jobs.data(), jobs.size() * sizeof(kc::GatherJob), cudaMemcpyHostToDevice, stream_));
  auto* count = reinterpret_cast<int32_t*>(meta.as<char>() + jobs.size() * sizeof(kc::GatherJob));
  QKV_CUDA(cudaMemcpyAsync(count, &n, 4, cudaMemcpyHostToDevice, stream_));
  std::vector<float> ms;
  for (int r = 0; r <= reps; ++r) {  // the first is a warm-up
    QKV_CUDA(cudaEventRecord(ev_[0], stream_));
    QKV_CUDA(kc::LaunchGather(meta.as<kc::GatherJob>(), count, piece(), sms_, stream_));
    QKV_CUDA(cudaEventRecord(ev_[1], stream_));
    QKV_RETURN_IF_ERROR(Sync());
    float t = 0;
    QKV_CUDA(cudaEventElapsedTime(&t, ev_[0], ev_[1]));
    if (r > 0) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double measured = double(jobs.size() * head_page);
  *bytes = total;
  return 1e3 * double(ms[ms.size() / 2]) * double(total) / measured;
}

BackendCounters CudaBackendImpl::counters() {
  kc::ResolveCounters c{};
  cudaMemcpyAsync(&c, counters_.as(), sizeof(c), cudaMemcpyDeviceToHost, stream_);
  cudaStreamSynchronize(stream_);
  BackendCounters out;
  out.selected = int64_t(c.selected);
  out.hits = int64_t(c.hits);
  out.misses = int64_t(c.misses_host + c.misses_disk);
  out.cold_misses = int64_t(c.misses_disk);
  out.evictions = int64_t(c.evictions) + extra_evictions_;
  out.bytes_host_to_hbm = int64_t(c.bytes_host_to_hbm) + extra_bytes_;
  out.cold_stalls = int64_t(c.cold_stalls) + skips_waited_;
  out.pages_skipped = int64_t(c.pages_skipped) - skips_waited_;
  out.deadline_waits = deadline_waits_;
  out.slots_capacity = uint64_t(slots_);
  out.slots_used = uint64_t(slots_ - int64_t(free_.size()));
  out.slots_peak = slots_peak_;
  out.slot_bytes = 2 * piece();
  return out;
}

}  // namespace questkv::cuda_backend

namespace questkv {

Result<std::unique_ptr<DataPlane>> MakeCudaBackend(const Config& config, PageAllocator* ids, TierMover* mover,
                                                   SlotArena* host) {
  auto impl = std::make_unique<cuda_backend::CudaBackendImpl>(config, ids, mover, host);
  QKV_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<DataPlane>(std::move(impl));
}

}  // namespace questkv
