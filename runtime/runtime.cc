#include "runtime/runtime.h"

#include <algorithm>
#include <chrono>
#include <cassert>
#include <cmath>
#include <cstring>
#include <unordered_map>

#include "kernels/cpu/kernels_cpu.h"
#include "prefetch/tier_mover.h"
#include "runtime/cuda_backend.h"
#include "runtime/half.h"
#include "tiers/arena.h"
#include "tiers/disk_tier.h"
#include "tiers/hbm_cache.h"
#include "tiers/io_backend.h"
#include "tiers/page_allocator.h"
#include "tiers/page_table.h"

namespace questkv {

namespace {
std::string SeqName(SeqId id) { return "sequence " + std::to_string(id); }
using Clock = std::chrono::steady_clock;
double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
constexpr std::size_t kIoAlignFloats = 1024;  // 4096 bytes
// Whether two buffers of `bytes` each share a byte.
bool Overlap(const void* a, const void* b, std::size_t bytes) {
  const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + bytes && y < x + bytes;
}
}  // namespace

struct Runtime::Impl {
  Config config;
  Geometry g;
  PageAllocator ids;
  std::unique_ptr<SummarySlab> summaries;
  std::unique_ptr<HbmCache> hbm;    // tails (pinned) + cached head-pages
  std::unique_ptr<SlotArena> host;  // homes of sealed pages
  std::unique_ptr<DiskTier> disk;   // null without a disk tier
  std::unique_ptr<TierMover> mover;
  std::unique_ptr<CudaBackend> cuda;  // the data plane on the GPU; null on the CPU backend
  std::vector<uint8_t> homed;       // [ids.table_size()] sealed and given a host home
  std::vector<uint32_t> pending_seals;  // full pages whose seal waits for room
  Status seal_error;                    // why the last of them could not be sealed
  int64_t deferred_seals = 0;
  int64_t step = 0;                 // advances once per decode call
  struct Sequence {
    std::vector<PageList> layers;
    std::vector<uint32_t> partitions;  // hbm cache partition per layer
  };
  std::unordered_map<SeqId, Sequence> seqs;
  SeqId next_seq = 1;
  Selector selector;
  // Scratch, reused across calls.
  PageTableCsr csr;
  PageSelection next;  // runners-up of the last selection (prefetch)
  std::vector<const PageList*> lists;
  std::vector<uint32_t> list_partitions;
  std::vector<kernels::HeadPageRef> refs;
  std::vector<float> m, d, page_scratch;
  std::vector<float> q_copy;   // the queries, when the caller's q overlaps out
  int64_t attended = 0;        // tokens the last AttendRow read
  double attend_seconds = 0;   // of the last AttendRow: attention proper
  double row_seconds = 0;      // of the last AttendRow: all of it

  explicit Impl(const Config& c)
      : config(c), g(c.geometry), ids(c.max_pages), selector(c.geometry, c.policy),
        page_scratch(c.geometry.page_elems()) {}

  // Per-page tables grow with the ids handed out (PageAllocator's hook).
  Status GrowPageTables(uint32_t pages) {
    try {
      homed.resize(std::max<std::size_t>(homed.size(), pages), 0);
      mover->GrowPages(pages);
      if (hbm) hbm->GrowPages(pages);
    } catch (const std::bad_alloc&) {
      return Status::ResourceExhausted("page tables: out of memory growing to " + std::to_string(pages) + " page ids");
    }
    return Status::Ok();
  }

  Result<Sequence*> Find(SeqId id) {
    auto it = seqs.find(id);
    if (it == seqs.end()) return Status::NotFound(SeqName(id) + " does not exist");
    return &it->second;
  }
  Status CheckLayer(int layer) const {
    if (layer < 0 || layer >= g.layers)
      return Status::OutOfRange("layer " + std::to_string(layer) + " is outside 0.." + std::to_string(g.layers - 1));
    return Status::Ok();
  }
  std::size_t hp() const { return g.head_page_elems(); }

  // ---- pages -----------------------------------------------------------------

  // A fresh tail page: an id, pinned hbm slots for every head, an empty summary.
  Result<PageId> NewTail(uint32_t partition) {
    QKV_ASSIGN_OR_RETURN(PageId id, ids.Allocate());
    for (int h = 0; h < g.kv_heads; ++h) {
      auto slot = hbm->Insert(id, h, partition, step, /*pinned=*/true);
      if (!slot.ok()) {
        hbm->Drop(id);
        ids.Unref(id);
        return WithSealCause(slot.status());
      }
    }
    kernels::ResetSummaryCpu(summaries->page(id), g.kv_heads, g.head_dim);
    return id;
  }
  void Release(PageId id) {
    if (!ids.Unref(id)) return;
    mover->Drop(id);
    if (cuda) cuda->PageDied(id);
    homed[id] = 0;
    std::erase(pending_seals, id);
  }
  void ReleaseAll(const std::vector<PageId>& pages) {
    for (PageId id : pages) Release(id);
  }
  // Bytes of one stored summary element: f32 on the CPU backend.
  std::size_t SummaryElemBytes() const { return cuda ? g.summary_elem_bytes() : sizeof(float); }
  // After every fold or rebuild of a CPU-backend summary: with E4M3
  // summaries, its bounds rounded outward onto the grid.
  void SnapSummary(PageId id) {
    if (g.e4m3_summaries()) kernels::SnapSummaryE4m3Cpu(summaries->page(id), g.kv_heads, g.head_dim);
  }
  // Head h's K rows of a tail page (V rows follow at +S*D).
  float* TailHead(PageId id, int h) { return hbm->data(hbm->Lookup(id, h)); }

  // A new private tail holding the first `len` tokens of `src`, which is
  // sealed or else the tail of `src_partition`.
  Result<PageId> CopyToNewTail(PageId src, int len, uint32_t partition, uint32_t src_partition) {
    if (cuda) {
      QKV_ASSIGN_OR_RETURN(PageId dst, ids.Allocate());
      Status s = homed[src] ? mover->ReadPage(src, ids.generation(src), page_scratch.data(), step) : Status::Ok();
      if (s.ok())
        s = homed[src] ? cuda->TailFromHost(partition, dst, page_scratch.data(), len)
                       : cuda->CopyTail(src_partition, src, partition, dst, len);
      if (!s.ok()) {
        Release(dst);
        return s;
      }
      return dst;
    }
    QKV_RETURN_IF_ERROR(mover->ReadPage(src, ids.generation(src), page_scratch.data(), step));
    QKV_ASSIGN_OR_RETURN(PageId dst, NewTail(partition));
    const float* k_heads[kernels::kMaxKvHeads];
    for (int h = 0; h < g.kv_heads; ++h) {
      float* slot = TailHead(dst, h);
      std::memcpy(slot, page_scratch.data() + h * hp(), hp() * sizeof(float));
      std::memcpy(slot + hp(), page_scratch.data() + (g.kv_heads + h) * hp(), hp() * sizeof(float));
      k_heads[h] = slot;
    }
    kernels::RebuildSummaryHeadsCpu(k_heads, summaries->page(dst), g.kv_heads, g.head_dim, len);
    SnapSummary(dst);
    return dst;
  }

  // Gives a full page its host home; when host and disk are full (or the
  // disk fails) the page stays pinned in hbm (still correct) and is retried
  // later. False when it had to wait.
  bool Seal(PageId id) {
    Status s = mover->Seal(id, ids.generation(id), step);
    if (s.ok()) {
      homed[id] = 1;
      return true;
    }
    ++deferred_seals;
    pending_seals.push_back(id);
    seal_error = std::move(s);
    return false;
  }
  // Oldest first; the rest wait once one fails (they would fail alike).
  void RetryPendingSeals() {
    std::vector<uint32_t> retry;
    retry.swap(pending_seals);
    std::size_t i = 0;
    while (i < retry.size() && Seal(retry[i])) ++i;
    if (i < retry.size()) pending_seals.insert(pending_seals.end(), retry.begin() + i + 1, retry.end());
  }
  // An hbm slot refused while full pages wait in hbm for a host home: the
  // cause is the host and disk tiers, so the error is theirs.
  Status WithSealCause(Status s) const {
    if (s.code() != Code::kResourceExhausted || pending_seals.empty()) return s;
    return Status(seal_error.code(), std::to_string(pending_seals.size()) +
                                         " full pages wait in hbm for a host home and fill it: " +
                                         seal_error.message() + " (" + s.message() + ")");
  }

  // Writes n tokens into the list's pages, taking a fresh tail at each page
  // boundary and sealing pages as they fill — except the page that was the
  // tail when the call began, which is sealed only once everything else
  // succeeded: on failure it is cut back to its old length in place and the
  // pages this call made are released, so the list is as before.
  Status AppendToList(PageList& list, uint32_t partition, const float* k, const float* v, int64_t n) {
    const std::size_t row = std::size_t(g.kv_heads) * g.head_dim;
    const int64_t old_tokens = list.tokens;
    const std::size_t old_pages = list.pages.size();
    const PageId first = old_tokens % g.page_size ? list.pages.back() : kNoPage;
    float* k_heads[kernels::kMaxKvHeads];
    float* v_heads[kernels::kMaxKvHeads];
    for (int64_t done = 0; done < n;) {
      const int64_t pos = list.tokens;
      if (pos % g.page_size == 0) {
        auto id = NewTail(partition);
        if (!id.ok()) {
          UndoAppend(list, old_tokens, old_pages);
          return id.status();
        }
        list.pages.push_back(*id);
      }
      const PageId id = list.pages.back();
      const int offset = int(pos % g.page_size);
      const int take = int(std::min<int64_t>(n - done, g.page_size - offset));
      for (int h = 0; h < g.kv_heads; ++h) {
        k_heads[h] = TailHead(id, h);
        v_heads[h] = k_heads[h] + hp();
      }
      kernels::AppendTokensHeadsCpu(k_heads, v_heads, summaries->page(id), g.kv_heads, g.head_dim, offset,
                                    k + done * row, v + done * row, take);
      SnapSummary(id);
      done += take;
      list.tokens += take;
      if (offset + take == g.page_size && id != first) Seal(id);
    }
    if (first != kNoPage && list.tokens >= (old_tokens / g.page_size + 1) * g.page_size) Seal(first);
    return Status::Ok();
  }

  void UndoAppend(PageList& list, int64_t old_tokens, std::size_t old_pages) {
    for (std::size_t i = old_pages; i < list.pages.size(); ++i) Release(list.pages[i]);
    list.pages.resize(old_pages);
    list.tokens = old_tokens;
    if (old_tokens % g.page_size == 0) return;
    const PageId tail = list.pages.back();
    const float* k_heads[kernels::kMaxKvHeads];
    for (int h = 0; h < g.kv_heads; ++h) k_heads[h] = TailHead(tail, h);
    kernels::RebuildSummaryHeadsCpu(k_heads, summaries->page(tail), g.kv_heads, g.head_dim,
                                    int(old_tokens % g.page_size));
    SnapSummary(tail);
  }

  // The sequence an append of n tokens of k, v (host or device) goes to.
  Result<Sequence*> CheckAppend(SeqId seq, int layer, const void* k, const void* v, int64_t n) {
    QKV_ASSIGN_OR_RETURN(Sequence * s, Find(seq));
    QKV_RETURN_IF_ERROR(CheckLayer(layer));
    if (n < 1) return Status::InvalidArgument("append of " + std::to_string(n) + " tokens");
    if (!k || !v) return Status::InvalidArgument("null K or V pointer");
    return s;
  }

  // The CUDA backend's append; the pages it fills are sealed (homed) on return.
  Status AppendCuda(PageList& list, uint32_t partition, const void* k, const void* v, int64_t n, bool host_f32) {
    const int64_t first = list.tokens / g.page_size;
    QKV_RETURN_IF_ERROR(cuda->Append(partition, list, k, v, n, host_f32, step));
    for (int64_t p = first; p < list.tokens / g.page_size; ++p) homed[list.pages[p]] = 1;
    return Status::Ok();
  }

  // The CUDA backend's decode step over the checked batch (lists, list_partitions).
  Status DecodeCuda(int layer, const void* q, void* out, bool host_f32, bool dense,
                    std::vector<PageSelection>* selections, AttendStats* stats) {
    for (std::size_t i = 0; i < list_partitions.size(); ++i)
      for (std::size_t j = 0; j < i; ++j)
        if (list_partitions[i] == list_partitions[j])
          return Status::InvalidArgument("the CUDA backend needs distinct sequences in a batch");
    CudaBackend::Step st;
    st.partitions = list_partitions;
    st.lists = lists;
    st.layer = layer;
    st.dense = dense;
    st.q = q;
    st.out = out;
    st.host_f32 = host_f32;
    st.step = step;
    st.selections = selections;
    int64_t selected = 0;
    if (stats && stats->time_phases) {
      st.select_us = &stats->select_us;
      st.resolve_us = &stats->resolve_us;
      st.attend_us = &stats->attend_us;
    }
    st.selected = &selected;
    if (stats) st.graphs_captured = &stats->graphs_captured;
    QKV_RETURN_IF_ERROR(cuda->DecodeStep(st));
    if (stats) {
      const int64_t pages_budget = config.policy.page_budget(layer, g.page_size);
      stats->head_pages_selected += selected;
      for (const PageList* l : lists) {
        const int64_t pages = int64_t(l->pages.size());
        stats->head_pages_total += pages * g.kv_heads;
        if (!dense && !config.policy.is_dense(layer) && pages_budget < pages)
          stats->summary_bytes_read += pages * int64_t(g.summary_elems() * SummaryElemBytes());
      }
      // Whole head-pages (a tail is counted whole): what the kernel reads.
      stats->kv_bytes_read += selected * int64_t(2 * g.head_page_elems() * DTypeBytes(g.dtype));
    }
    return Status::Ok();
  }

  // ---- attention ---------------------------------------------------------------

  // Queries the call may read while it writes out: q itself, or a copy of
  // it when the two overlap (q == out is allowed on the host API).
  const float* Unaliased(const float* q, const float* out, std::size_t batch) {
    const std::size_t n = batch * g.q_heads * g.head_dim;
    if (!Overlap(q, out, n * sizeof(float))) return q;
    q_copy.assign(q, q + n);
    return q_copy.data();
  }

  Status CheckBatch(std::span<const SeqId> seqs_in, int layer, const float* q, const float* out) {
    QKV_RETURN_IF_ERROR(CheckLayer(layer));
    if (seqs_in.empty()) return Status::InvalidArgument("empty batch");
    if (!q || !out) return Status::InvalidArgument("null query or output pointer");
    lists.clear();
    list_partitions.clear();
    for (SeqId id : seqs_in) {
      QKV_ASSIGN_OR_RETURN(Sequence * s, Find(id));
      const PageList& list = s->layers[layer];
      if (list.tokens == 0)
        return Status::FailedPrecondition(SeqName(id) + " holds no token in layer " + std::to_string(layer));
      lists.push_back(&list);
      list_partitions.push_back(s->partitions[layer]);
    }
    csr.Assign(lists, g.page_size);
    return Status::Ok();
  }

  // Attends one (sequence, KV head) over the given logical pages, resolving
  // each through the tiers. `strict` refuses skipped pages (dense path). When
  // the host tier cannot take a page because earlier pages of the row are read
  // in place from it, the row so far is attended, those pointers released,
  // and the row continues: pages are merged in the same order, so the output
  // is bit for bit the same as in one piece.
  Status AttendRow(int b, int kv_head, const int32_t* logical, int n, const float* q, float* out, bool strict) {
    const uint32_t* pages = csr.pages(b);
    const int last = csr.num_pages(b) - 1;
    const int G = g.group();
    const std::size_t qoff = (std::size_t(b) * g.q_heads + std::size_t(kv_head) * G) * g.head_dim;
    const float scale = 1.f / std::sqrt(float(g.head_dim));
    m.resize(G);
    d.resize(G);
    kernels::AttendPagesCpu(q + qoff, G, g.head_dim, nullptr, 0, scale, out + qoff, m.data(), d.data());
    refs.clear();
    attended = 0;
    attend_seconds = 0;
    const auto row_start = Clock::now();
    auto flush = [&] {
      const auto t0 = Clock::now();
      kernels::AttendMorePagesCpu(q + qoff, G, g.head_dim, refs.data(), int(refs.size()), scale, out + qoff,
                                  m.data(), d.data());
      attend_seconds += Seconds(Clock::now() - t0);
      for (const kernels::HeadPageRef& r : refs) attended += r.len;
      refs.clear();
      mover->EndReads();
    };
    for (int i = 0; i < n; ++i) {
      const int p = logical[i];
      const PageId id = pages[p];
      auto src = mover->Resolve(id, ids.generation(id), kv_head, list_partitions[b], step);
      if (!src.ok() && src.status().code() == Code::kResourceExhausted && !refs.empty()) {
        flush();
        src = mover->Resolve(id, ids.generation(id), kv_head, list_partitions[b], step);
      }
      if (!src.ok()) {
        mover->EndReads();
        return src.status();
      }
      if (src->skipped && strict) return Status::Internal("dense attention cannot skip pages");
      if (src->skipped) continue;
      refs.push_back({src->k, src->v, p == last ? csr.last_page_len[b] : g.page_size});
    }
    flush();
    row_seconds = Seconds(Clock::now() - row_start);
    return Status::Ok();
  }

  // The CPU backend's decode step over the checked batch (csr, lists).
  Status DecodeCpu(int layer, const float* q, float* out, std::vector<PageSelection>* selections,
                   AttendStats* stats) {
    if (selections) selections->resize(std::size_t(csr.batch()));
    PageSelection local;
    for (int b = 0; b < csr.batch(); ++b) {
      PageSelection& sel = selections ? (*selections)[b] : local;
      SelectInput in;
      in.q = q + std::size_t(b) * g.q_heads * g.head_dim;
      in.summary_slab = summaries->base();
      in.page_ids = csr.pages(b);
      in.num_pages = csr.num_pages(b);
      in.layer = layer;
      const int prefetch = disk ? config.prefetch_pages : 0;
      const auto t0 = Clock::now();
      QKV_RETURN_IF_ERROR(selector.Select(in, &sel, &next, prefetch));
      if (stats) stats->select_us += 1e6 * Seconds(Clock::now() - t0);
      for (int h = 0; h < g.kv_heads; ++h) {
        QKV_RETURN_IF_ERROR(AttendRow(b, h, sel.row(h), sel.count(h), q, out, /*strict=*/false));
        const auto t1 = Clock::now();
        for (int i = 0; i < next.count(h); ++i) QKV_RETURN_IF_ERROR(mover->Prefetch(in.page_ids[next.row(h)[i]]));
        if (stats) {
          stats->attend_us += 1e6 * attend_seconds;
          stats->resolve_us += 1e6 * (row_seconds - attend_seconds + Seconds(Clock::now() - t1));
          stats->head_pages_selected += sel.count(h);
          stats->head_pages_total += in.num_pages;
          stats->kv_bytes_read += attended * g.head_dim * 2 * int64_t(sizeof(float));
        }
      }
      // The selector scores only when the budget is smaller than the page count.
      if (stats && !selector.scores().empty()) stats->summary_bytes_read += int64_t(in.num_pages) * int64_t(summaries->page_bytes());
    }
    return Status::Ok();
  }

  // Finite queries must give finite outputs: logits past float32's range
  // (huge keys or queries) would otherwise come back as NaN with an OK.
  Status CheckFinite(std::span<const SeqId> seqs, const float* q, const float* out) const {
    const std::size_t per_seq = std::size_t(g.q_heads) * g.head_dim;
    for (std::size_t i = 0; i < seqs.size() * per_seq; ++i) {
      if (std::isfinite(out[i])) continue;
      const std::size_t b = i / per_seq, head = i % per_seq / g.head_dim;
      const float* qh = q + i / g.head_dim * g.head_dim;
      const bool q_finite = std::all_of(qh, qh + g.head_dim, [](float x) { return std::isfinite(x); });
      return Status::InvalidArgument("attention output of " + SeqName(seqs[b]) + ", query head " + std::to_string(head) +
                                     " is not finite: " +
                                     (q_finite ? "its logits q·k/sqrt(D) overflow float32 (keys or queries too large) "
                                                 "or the keys hold NaN/inf"
                                               : "the query holds NaN/inf"));
    }
    return Status::Ok();
  }

  // A decode call runs in a step of its own: what it selects is protected
  // from eviction until it returns, and nothing else runs in that step.
  Status BeginStep() {
    ++step;
    RetryPendingSeals();
    return mover->Pump(step);
  }
  struct StepEnd {  // ends the decode call's step however the call returns
    Impl& impl;
    ~StepEnd() { ++impl.step; }
  };
};

Runtime::Runtime(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Runtime::~Runtime() = default;

namespace {
Result<std::unique_ptr<IoBackend>> MakeBackend(const Config& c) {
  switch (c.io_backend) {
    case IoBackendKind::kUring: return MakeUringBackend(c.io_queue_depth);
    case IoBackendKind::kPread: return MakePreadPoolBackend(4, c.io_queue_depth);
    case IoBackendKind::kAuto: break;
  }
  return MakeDefaultBackend(c.io_queue_depth);
}
}  // namespace

Result<std::unique_ptr<Runtime>> Runtime::Create(const Config& config, std::unique_ptr<IoBackend> io) {
  QKV_RETURN_IF_ERROR(config.Validate());
  try {
    return CreateValid(config, std::move(io));
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("out of memory creating a runtime for " + config.geometry.ToString() +
                                     ", max_pages " + std::to_string(config.max_pages));
  }
}

Result<std::unique_ptr<Runtime>> Runtime::CreateValid(const Config& config, std::unique_ptr<IoBackend> io) {
  const bool on_gpu = config.backend == Backend::kCuda;
  if (!on_gpu && config.geometry.dtype != DType::kF32)
    return Status::Unimplemented("the CPU backend stores K/V as f32; " +
                                 std::string(DTypeName(config.geometry.dtype)) + " needs the CUDA backend");
  const Geometry& g = config.geometry;
  auto impl = std::make_unique<Impl>(config);
  if (!on_gpu) {  // the CUDA backend keeps summaries and hbm on the device
    QKV_ASSIGN_OR_RETURN(impl->summaries, SummarySlab::Create(config.max_pages, g.kv_heads, g.head_dim));
    const std::size_t head_page_bytes = 2 * g.head_page_elems() * sizeof(float);
    const uint64_t all_heads = uint64_t(config.max_pages) * g.kv_heads;
    const uint64_t hbm_slots =
        config.hbm_bytes ? std::min<uint64_t>(config.hbm_bytes / head_page_bytes, all_heads) : all_heads;
    QKV_ASSIGN_OR_RETURN(impl->hbm, HbmCache::Create(uint32_t(hbm_slots), 2 * g.head_page_elems(), /*pages=*/0, g.kv_heads));
  }

  const std::size_t page_floats = (g.page_bytes() + sizeof(float) - 1) / sizeof(float);
  const std::size_t host_slot_elems = (page_floats + kIoAlignFloats - 1) / kIoAlignFloats * kIoAlignFloats;
  const std::size_t host_slot_bytes = host_slot_elems * sizeof(float);
  const uint64_t host_slots = config.host_bytes ? std::min<uint64_t>(config.host_bytes / host_slot_bytes, config.max_pages)
                                                : config.max_pages;
  if (host_slots < 2) return Status::InvalidArgument("host_bytes holds fewer than two 4096-aligned pages");
  // Homes of sealed pages: pinned and mapped for the GPU when there is one,
  // bound to the GPU's NUMA node (HostRegion).
  QKV_ASSIGN_OR_RETURN(impl->host, SlotArena::Create(host_slot_elems, uint32_t(host_slots), "host",
                                                     {.numa_node = -1, .pin_for_gpu = true}));

  if (!config.disk_dir.empty()) {
    if (!io) {
      QKV_ASSIGN_OR_RETURN(io, MakeBackend(config));
    }
    DiskTierOptions opts{config.disk_dir, config.disk_bytes, g.page_bytes()};
    QKV_ASSIGN_OR_RETURN(impl->disk, DiskTier::Open(opts, std::move(io)));
    QKV_RETURN_IF_ERROR(impl->disk->RegisterRegion(impl->host->base(), impl->host->bytes()));
  }
  impl->mover = std::make_unique<TierMover>(g, config.cold_miss, config.host_high_water, config.host_low_water,
                                            /*pages=*/0, impl->hbm.get(), impl->host.get(), impl->disk.get());
  Impl* I = impl.get();
  impl->ids.SetGrowHook([I](uint32_t pages) { return I->GrowPageTables(pages); });
  if (on_gpu) {
    QKV_ASSIGN_OR_RETURN(impl->cuda, CudaBackend::Create(config, &impl->ids, impl->mover.get(), impl->host.get()));
    CudaBackend* cuda = impl->cuda.get();
    impl->mover->SetHomeListener([cuda](uint32_t page, const void* home) { cuda->SetHome(page, home); });
  }
  return std::unique_ptr<Runtime>(new Runtime(std::move(impl)));
}

const Config& Runtime::config() const { return impl_->config; }

Result<SeqId> Runtime::CreateSequence() {
  Impl& I = *impl_;
  const SeqId id = I.next_seq++;
  Impl::Sequence& s = I.seqs[id];
  s.layers.resize(I.g.layers);
  for (int l = 0; l < I.g.layers; ++l) {
    if (!I.cuda) {
      s.partitions.push_back(I.hbm->AddPartition());
      continue;
    }
    auto part = I.cuda->AddPartition();
    if (!part.ok()) {
      for (uint32_t p : s.partitions) I.cuda->RemovePartition(p);
      I.seqs.erase(id);
      return part.status();
    }
    s.partitions.push_back(*part);
  }
  return id;
}

Result<SeqId> Runtime::CreateFromPrefix(SeqId parent, int64_t pages) {
  Impl& I = *impl_;
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * p, I.Find(parent));
  if (pages < 0) return Status::InvalidArgument("prefix of " + std::to_string(pages) + " pages");
  for (int l = 0; l < I.g.layers; ++l)
    if (p->layers[l].sealed_pages(I.g.page_size) < pages)
      return Status::OutOfRange(SeqName(parent) + " has " + std::to_string(p->layers[l].sealed_pages(I.g.page_size)) +
                                " sealed pages in layer " + std::to_string(l) + ", fewer than " + std::to_string(pages));
  QKV_ASSIGN_OR_RETURN(SeqId id, CreateSequence());
  Impl::Sequence& child = I.seqs[id];
  const Impl::Sequence& src = I.seqs[parent];
  for (int l = 0; l < I.g.layers; ++l) {
    PageList& dst = child.layers[l];
    dst.pages.assign(src.layers[l].pages.begin(), src.layers[l].pages.begin() + pages);
    dst.tokens = pages * I.g.page_size;
    for (PageId pid : dst.pages) I.ids.Ref(pid);
    if (I.cuda) QKV_RETURN_IF_ERROR(I.cuda->SetPages(child.partitions[l], dst.pages));
  }
  return id;
}

Result<SeqId> Runtime::Fork(SeqId parent) {
  Impl& I = *impl_;
  QKV_RETURN_IF_ERROR(I.Find(parent).status());
  QKV_ASSIGN_OR_RETURN(SeqId id, CreateSequence());
  Impl::Sequence& child = I.seqs[id];
  const Impl::Sequence& p = I.seqs[parent];
  // Copy every partial tail first, so a failure leaves nothing behind.
  std::vector<PageId> tails(I.g.layers, kNoPage);
  for (int l = 0; l < I.g.layers; ++l) {
    const PageList& src = p.layers[l];
    if (src.tokens % I.g.page_size == 0) continue;
    auto copy = I.CopyToNewTail(src.pages.back(), src.last_page_len(I.g.page_size), child.partitions[l],
                                p.partitions[l]);
    if (!copy.ok()) {
      for (PageId t : tails)
        if (t != kNoPage) I.Release(t);
      (void)Free(id);
      return copy.status();
    }
    tails[l] = *copy;
  }
  for (int l = 0; l < I.g.layers; ++l) {
    PageList& dst = child.layers[l];
    dst = p.layers[l];
    for (PageId& pid : dst.pages) {
      if (&pid == &dst.pages.back() && tails[l] != kNoPage) {
        pid = tails[l];
      } else {
        I.ids.Ref(pid);
      }
    }
    if (I.cuda) QKV_RETURN_IF_ERROR(I.cuda->SetPages(child.partitions[l], dst.pages));
  }
  return id;
}

Status Runtime::Rollback(SeqId seq, int64_t tokens) {
  Impl& I = *impl_;
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.Find(seq));
  if (tokens < 0) return Status::InvalidArgument("rollback by " + std::to_string(tokens) + " tokens");
  const int S = I.g.page_size;
  for (int l = 0; l < I.g.layers; ++l)
    if (s->layers[l].tokens < tokens)
      return Status::OutOfRange("rollback by " + std::to_string(tokens) + " tokens, but " + SeqName(seq) + " holds " +
                                std::to_string(s->layers[l].tokens) + " in layer " + std::to_string(l));
  // A new tail that is sealed (immutable, maybe shared, maybe not in hbm) is
  // replaced by a private copy of its kept tokens: make those copies first.
  std::vector<PageId> copies(I.g.layers, kNoPage);
  for (int l = 0; l < I.g.layers; ++l) {
    const PageList& list = s->layers[l];
    const int64_t keep = list.tokens - tokens;
    if (keep % S == 0) continue;
    const PageId tail = list.pages[keep / S];
    if (!I.homed[tail] && I.ids.refcount(tail) == 1) continue;  // still a pinned tail: edit in place
    auto copy = I.CopyToNewTail(tail, int(keep % S), s->partitions[l], s->partitions[l]);
    if (!copy.ok()) {
      for (PageId c : copies)
        if (c != kNoPage) I.Release(c);
      return copy.status();
    }
    copies[l] = *copy;
  }
  for (int l = 0; l < I.g.layers; ++l) {
    PageList& list = s->layers[l];
    const int64_t keep = list.tokens - tokens;
    const std::size_t keep_pages = std::size_t((keep + S - 1) / S);
    for (std::size_t i = keep_pages; i < list.pages.size(); ++i) I.Release(list.pages[i]);
    list.pages.resize(keep_pages);
    list.tokens = keep;
    if (keep % S == 0) continue;
    PageId& tail = list.pages.back();
    if (copies[l] != kNoPage) {
      I.Release(tail);
      tail = copies[l];
      continue;
    }
    assert(!I.cuda || I.homed[tail] == 0);
    std::erase(I.pending_seals, tail);  // a full page awaiting its seal is a tail again
    if (I.cuda) {
      QKV_RETURN_IF_ERROR(I.cuda->TruncateTail(s->partitions[l], tail, int(keep % S)));
      continue;
    }
    const float* k_heads[kernels::kMaxKvHeads];
    for (int h = 0; h < I.g.kv_heads; ++h) k_heads[h] = I.TailHead(tail, h);
    kernels::RebuildSummaryHeadsCpu(k_heads, I.summaries->page(tail), I.g.kv_heads, I.g.head_dim, int(keep % S));
    I.SnapSummary(tail);
  }
  if (I.cuda)
    for (int l = 0; l < I.g.layers; ++l) QKV_RETURN_IF_ERROR(I.cuda->SetPages(s->partitions[l], s->layers[l].pages));
  return Status::Ok();
}

Status Runtime::Free(SeqId seq) {
  Impl& I = *impl_;
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.Find(seq));
  for (PageList& list : s->layers) I.ReleaseAll(list.pages);
  for (uint32_t part : s->partitions) {
    if (I.cuda) {
      I.cuda->RemovePartition(part);
    } else {
      I.hbm->RemovePartition(part);
    }
  }
  I.seqs.erase(seq);
  return Status::Ok();
}

Status Runtime::Append(SeqId seq, int layer, const float* k, const float* v, int64_t n) {
  Impl& I = *impl_;
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.CheckAppend(seq, layer, k, v, n));
  PageList& list = s->layers[layer];
  // The page being filled is a private pinned tail: fork and rollback copy.
  assert(list.tokens % I.g.page_size == 0 ||
         (I.ids.refcount(list.pages.back()) == 1 && !I.homed[list.pages.back()]));
  if (I.cuda) return I.AppendCuda(list, s->partitions[layer], k, v, n, /*host_f32=*/true);
  return I.AppendToList(list, s->partitions[layer], k, v, n);
}

Status Runtime::AppendDevice(SeqId seq, int layer, const void* k, const void* v, int64_t n) {
  Impl& I = *impl_;
  if (!I.cuda) return Status::FailedPrecondition("AppendDevice needs the CUDA backend");
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.CheckAppend(seq, layer, k, v, n));
  return I.AppendCuda(s->layers[layer], s->partitions[layer], k, v, n, /*host_f32=*/false);
}

Status Runtime::DecodeAttention(std::span<const SeqId> seqs, int layer, const float* q_in, float* out,
                                std::vector<PageSelection>* selections, AttendStats* stats) {
  Impl& I = *impl_;
  QKV_RETURN_IF_ERROR(I.CheckBatch(seqs, layer, q_in, out));
  const float* q = I.Unaliased(q_in, out, seqs.size());
  QKV_RETURN_IF_ERROR(I.BeginStep());
  const Impl::StepEnd end{I};
  QKV_RETURN_IF_ERROR(I.cuda ? I.DecodeCuda(layer, q, out, /*host_f32=*/true, /*dense=*/false, selections, stats)
                             : I.DecodeCpu(layer, q, out, selections, stats));
  return I.CheckFinite(seqs, q, out);
}

Status Runtime::DecodeAttentionDevice(std::span<const SeqId> seqs, int layer, const void* q, void* out,
                                      std::vector<PageSelection>* selections, AttendStats* stats) {
  Impl& I = *impl_;
  if (!I.cuda) return Status::FailedPrecondition("DecodeAttentionDevice needs the CUDA backend");
  QKV_RETURN_IF_ERROR(I.CheckBatch(seqs, layer, static_cast<const float*>(q), static_cast<const float*>(out)));
  const std::size_t bytes = seqs.size() * I.g.q_heads * I.g.head_dim * DTypeBytes(I.g.dtype);
  if (Overlap(q, out, bytes))
    return Status::InvalidArgument("q and out overlap: the device path reads q while it writes out");
  QKV_RETURN_IF_ERROR(I.BeginStep());
  const Impl::StepEnd end{I};
  return I.DecodeCuda(layer, q, out, /*host_f32=*/false, /*dense=*/false, selections, stats);
}

Status Runtime::Synchronize() {
  Impl& I = *impl_;
  return I.cuda ? I.cuda->Synchronize() : Status::Ok();
}

void* Runtime::cuda_stream() const { return impl_->cuda ? impl_->cuda->stream() : nullptr; }

Result<double> Runtime::TimeDenseOffload(std::span<const SeqId> seqs, int layer, std::size_t max_bytes, int reps,
                                         int64_t* bytes) {
  Impl& I = *impl_;
  if (!I.cuda) return Status::FailedPrecondition("TimeDenseOffload needs the CUDA backend");
  QKV_RETURN_IF_ERROR(I.CheckLayer(layer));
  if (reps < 1 || !bytes) return Status::InvalidArgument("reps must be >= 1 and bytes non-null");
  std::vector<const PageList*> lists;
  for (SeqId id : seqs) {
    QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.Find(id));
    lists.push_back(&s->layers[layer]);
  }
  return I.cuda->TimeDenseOffload(lists, max_bytes, reps, bytes);
}

Status Runtime::DenseAttention(std::span<const SeqId> seqs, int layer, const float* q_in, float* out) {
  Impl& I = *impl_;
  QKV_RETURN_IF_ERROR(I.CheckBatch(seqs, layer, q_in, out));
  const float* q = I.Unaliased(q_in, out, seqs.size());
  QKV_RETURN_IF_ERROR(I.BeginStep());
  const Impl::StepEnd end{I};
  if (I.cuda) {
    if (I.config.cold_miss != ColdMissPolicy::kStrict && I.disk)
      return Status::FailedPrecondition("dense attention on the CUDA backend needs the strict cold-miss policy");
    QKV_RETURN_IF_ERROR(I.DecodeCuda(layer, q, out, /*host_f32=*/true, /*dense=*/true, nullptr, nullptr));
    return I.CheckFinite(seqs, q, out);
  }
  const ColdMissPolicy policy = I.config.cold_miss;
  std::vector<int32_t> all;
  for (int b = 0; b < I.csr.batch(); ++b) {
    all.resize(I.csr.num_pages(b));
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = int32_t(i);
    for (int h = 0; h < I.g.kv_heads; ++h)
      QKV_RETURN_IF_ERROR(I.AttendRow(b, h, all.data(), int(all.size()), q, out, policy == ColdMissPolicy::kStrict));
  }
  return I.CheckFinite(seqs, q, out);
}

Result<int64_t> Runtime::Length(SeqId seq, int layer) const {
  auto& I = const_cast<Impl&>(*impl_);
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.Find(seq));
  QKV_RETURN_IF_ERROR(I.CheckLayer(layer));
  return s->layers[layer].tokens;
}

Result<std::vector<uint32_t>> Runtime::Pages(SeqId seq, int layer) const {
  auto& I = const_cast<Impl&>(*impl_);
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.Find(seq));
  QKV_RETURN_IF_ERROR(I.CheckLayer(layer));
  return s->layers[layer].pages;
}

Result<DenseView> Runtime::Gather(SeqId seq, int layer) const {
  auto& I = const_cast<Impl&>(*impl_);
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.Find(seq));
  QKV_RETURN_IF_ERROR(I.CheckLayer(layer));
  const PageList& list = s->layers[layer];
  const Geometry& g = I.g;
  DenseView view;
  view.tokens = int(list.tokens);
  const std::size_t T = std::size_t(list.tokens), D = g.head_dim;
  view.k.resize(std::size_t(g.kv_heads) * T * D);
  view.v.resize(view.k.size());
  std::vector<float> converted(g.dtype == DType::kF32 ? 0 : g.page_elems());
  for (std::size_t p = 0; p < list.pages.size(); ++p) {
    const PageId id = list.pages[p];
    if (I.cuda && !I.homed[id]) {
      QKV_RETURN_IF_ERROR(I.cuda->ReadTail(s->partitions[layer], id, I.page_scratch.data()));
    } else {
      QKV_RETURN_IF_ERROR(I.mover->ReadPage(id, I.ids.generation(id), I.page_scratch.data(), I.step));
    }
    const float* page = I.page_scratch.data();
    if (!converted.empty()) {
      ToFloats(page, g.dtype, converted.size(), converted.data());
      page = converted.data();
    }
    const int len = p + 1 == list.pages.size() ? list.last_page_len(g.page_size) : g.page_size;
    for (int h = 0; h < g.kv_heads; ++h) {
      const std::size_t dst = (std::size_t(h) * T + p * g.page_size) * D;
      std::memcpy(view.k.data() + dst, page + h * I.hp(), len * D * sizeof(float));
      std::memcpy(view.v.data() + dst, page + (g.kv_heads + h) * I.hp(), len * D * sizeof(float));
    }
  }
  return view;
}

Result<std::vector<float>> Runtime::Summary(uint32_t page_id) const {
  const Impl& I = *impl_;
  if (!I.ids.live(page_id)) return Status::NotFound("page " + std::to_string(page_id) + " is not live");
  if (I.cuda) {
    std::vector<float> out(I.g.summary_elems());
    const PageId one[1] = {page_id};
    QKV_RETURN_IF_ERROR(I.cuda->ReadSummaries(one, out.data()));
    return out;
  }
  const float* s = I.summaries->page(page_id);
  return std::vector<float>(s, s + I.g.summary_elems());
}

Result<std::vector<float>> Runtime::Scores(SeqId seq, int layer, const float* q) const {
  auto& I = const_cast<Impl&>(*impl_);
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.Find(seq));
  QKV_RETURN_IF_ERROR(I.CheckLayer(layer));
  if (!q) return Status::InvalidArgument("null query pointer");
  const Geometry& g = I.g;
  const PageList& list = s->layers[layer];
  const int P = int(list.pages.size()), G = g.group();
  std::vector<float> scores(std::size_t(g.q_heads) * P);
  // The CUDA backend's summaries live on the device: score a compact copy.
  std::vector<float> compact;
  std::vector<uint32_t> local;
  const float* slab = I.cuda ? nullptr : I.summaries->base();
  const uint32_t* ids = list.pages.data();
  if (I.cuda) {
    compact.resize(std::size_t(P) * g.summary_elems());
    QKV_RETURN_IF_ERROR(I.cuda->ReadSummaries(list.pages, compact.data()));
    for (int p = 0; p < P; ++p) local.push_back(uint32_t(p));
    slab = compact.data();
    ids = local.data();
  }
  for (int h = 0; h < g.kv_heads; ++h)
    kernels::ScorePagesCpu(q + std::size_t(h) * G * g.head_dim, G, g.head_dim, slab, g.kv_heads, h, ids, P,
                           scores.data() + std::size_t(h) * G * P, g.e4m3_summaries());
  return scores;
}

TierStats Runtime::tier_stats() const {
  const Impl& I = *impl_;
  const MoverStats& m = I.mover->stats();
  TierStats t;
  t.host_to_hbm_bytes = m.bytes.host_to_hbm;
  t.hbm_to_host_bytes = m.bytes.hbm_to_host;
  t.host_to_disk_bytes = m.bytes.host_to_disk;
  t.disk_to_host_bytes = m.bytes.disk_to_host;
  if (I.cuda) {
    // hbm is the device's: its counters and its slot pool.
    const CudaCounters c = I.cuda->counters();
    t.host_to_hbm_bytes = c.bytes_host_to_hbm;
    t.hbm_hits = c.hits, t.hbm_misses = c.misses_host + c.misses_disk, t.hbm_evictions = c.evictions;
    t.cold_misses = c.misses_disk, t.cold_stalls = c.cold_stalls, t.pages_skipped = c.pages_skipped;
    t.hbm_capacity_bytes = c.slots_capacity * c.slot_bytes, t.hbm_peak_bytes = c.slots_peak * c.slot_bytes;
    t.hbm_used_bytes = c.slots_used * c.slot_bytes;
  } else {
    const HbmStats& h = I.hbm->stats();
    const uint64_t hs = I.hbm->slot_bytes();
    t.hbm_hits = h.hits, t.hbm_misses = h.misses, t.hbm_evictions = h.evictions, t.hbm_bypasses = h.bypasses;
    t.cold_misses = m.cold_misses, t.cold_stalls = m.cold_stalls, t.pages_skipped = m.pages_skipped;
    t.hbm_capacity_bytes = h.slots_capacity * hs, t.hbm_peak_bytes = h.slots_peak * hs, t.hbm_used_bytes = h.slots_used * hs;
  }
  t.demotions = m.demotions, t.promotions = m.promotions, t.clean_drops = m.clean_drops, t.prefetches = m.prefetches;
  t.deferred_seals = I.deferred_seals;
  t.demotion_orders = m.demotion_orders;
  t.io_errors = m.io_errors, t.corruptions = m.corruptions;
  const uint64_t ps = I.host->slot_bytes();
  t.host_capacity_bytes = m.host_slots_capacity * ps, t.host_peak_bytes = m.host_slots_peak * ps;
  t.host_used_bytes = m.host_slots_used * ps;
  if (I.disk) {
    const DiskStats& d = I.disk->stats();
    const uint64_t ds = I.disk->slot_bytes();
    t.disk_capacity_bytes = d.slots_capacity * ds, t.disk_peak_bytes = d.slots_peak * ds, t.disk_used_bytes = d.slots_used * ds;
  }
  t.summary_bytes = uint64_t(I.ids.live_count()) * I.g.summary_elems() * I.SummaryElemBytes();
  return t;
}

uint32_t Runtime::live_pages() const { return impl_->ids.live_count(); }
std::size_t Runtime::live_sequences() const { return impl_->seqs.size(); }

}  // namespace questkv
