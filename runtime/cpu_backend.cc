// The CPU backend: a bounded host arena of head-page slots stands in for hbm
// (HbmCache: pinned tails plus a segmented-LRU cache per partition), the
// summaries live in a host slab as f32, and kernels/cpu do the work. It runs
// the whole runtime, tier moves and disk I/O included, where there is no GPU.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <unordered_map>

#include "kernels/cpu/kernels_cpu.h"
#include "prefetch/tier_mover.h"
#include "runtime/backend.h"
#include "tiers/arena.h"
#include "tiers/hbm_cache.h"
#include "tiers/page_allocator.h"

namespace questkv {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Where attention reads one head-page from this step.
struct HeadSource {
  const float* k = nullptr;  // [S][D]
  const float* v = nullptr;  // [S][D]
  bool skipped = false;      // deadline policy: not available this step
};

class CpuBackend final : public DataPlane {
 public:
  CpuBackend(const Config& c, PageAllocator* ids, TierMover* mover, std::unique_ptr<SummarySlab> summaries,
             std::unique_ptr<HbmCache> hbm)
      : c_(c), g_(c.geometry), ids_(ids), mover_(mover), summaries_(std::move(summaries)), hbm_(std::move(hbm)),
        selector_(c.geometry, c.policy) {}

  Result<uint32_t> AddPartition() override { return hbm_->AddPartition(); }
  void RemovePartition(uint32_t part) override {
    hbm_->RemovePartition(part);
    groups_.erase(part);
  }
  void GrowPages(uint32_t pages) override { hbm_->GrowPages(pages); }
  void PageDied(PageId page) override {
    hbm_->Drop(page);
    std::erase(pending_seals_, page);
    std::erase(held_, page);
  }
  void SetHome(PageId, const void*) override {}  // attention reads homes through the mover
  Status SetPages(uint32_t, std::span<const PageId>) override { return Status::Ok(); }

  Status Append(uint32_t part, PageList& list, const void* k, const void* v, int64_t n, bool host_f32,
                int64_t step, bool hold) override;
  Status SealHeld(PageId page) override {
    if (std::erase(held_, page)) Seal(page);  // a seal that waits for room is retried later
    return Status::Ok();
  }
  Status CopyTail(uint32_t src_part, PageId src, uint32_t dst_part, PageId dst, int len, int64_t step) override {
    QKV_RETURN_IF_ERROR(ReadPage(src_part, src, page_scratch_.data(), step));
    return TailFromHost(dst_part, dst, page_scratch_.data(), len, step);
  }
  Status TailFromHost(uint32_t part, PageId dst, const void* page, int len, int64_t step) override;
  Status TruncateTail(uint32_t part, PageId tail, int len) override;
  Status ReadPage(uint32_t part, PageId page, void* dst, int64_t step) override;
  Status ReadSummaries(std::span<const PageId> pages, float* dst) override {
    for (std::size_t i = 0; i < pages.size(); ++i)
      std::memcpy(dst + i * g_.summary_elems(), summaries_->page(pages[i]), summaries_->page_bytes());
    return Status::Ok();
  }
  std::size_t summary_elem_bytes() const override { return sizeof(float); }

  void BeginStep(int64_t step) override {
    step_ = step;
    RetryPendingSeals();
  }
  Status DecodeStep(const Step& s) override;
  BackendCounters counters() override;

 private:
  std::size_t hp() const { return g_.head_page_elems(); }
  float* TailHead(PageId id, int h) { return hbm_->data(hbm_->Lookup(id, h)); }
  // Pinned hbm slots for every head of a fresh tail, and an empty summary.
  Status PinTail(uint32_t part, PageId id);
  Result<PageId> NewTail(uint32_t part);
  // With E4M3 summaries, the bounds rounded outward onto the grid after
  // every fold or rebuild.
  void SnapSummary(PageId id) {
    if (g_.e4m3_summaries()) kernels::SnapSummaryE4m3Cpu(summaries_->page(id), g_.kv_heads, g_.head_dim);
  }
  void RebuildTailSummary(PageId tail, int len);
  bool Seal(PageId id);
  void SealOrHold(PageId id, bool hold) {
    if (hold) {
      held_.push_back(id);  // its slots stay pinned
    } else {
      Seal(id);
    }
  }
  void RetryPendingSeals();
  Status WithSealCause(Status s) const;
  void UndoAppend(PageList& list, int64_t old_tokens, std::size_t old_pages);
  // `wait`: a page on disk is promoted and waited for, else skipped.
  Result<HeadSource> Resolve(PageId page, int head, uint32_t part, bool wait);
  // Attends one (sequence, KV head) within its call: its cold misses are
  // skipped while the call's allowance lasts, waited for after.
  Status AttendRow(int b, int kv_head, const int32_t* logical, int n, const float* q, float* out);
  // Selected head-pages of row b's KV head h (logical pages) whose home is
  // disk (or mid-promotion): the cold misses attending them would meet.
  int64_t CountCold(int b, int h, const int32_t* logical, int n);
  // Starts row b's call at a layer, `rows(h)` giving its selection of KV
  // head h: how many cold misses it may skip. Strict: none. Deadline: up to
  // deadline_skip_limit of its selected head-pages, and none (it waits for
  // them all) when the cold misses it would meet pass that; the allowance
  // also bounds misses that appear during the call (a page demoted while
  // the call waits for another).
  template <class Rows>
  void BeginCall(int b, Rows rows) {
    call_stalls_ = mover_->stats().cold_stalls;
    if (c_.cold_miss == ColdMissPolicy::kStrict) {
      skips_left_ = 0;
      return;
    }
    skips_left_ = INT64_MAX;
    if (c_.deadline_skip_limit >= 1 || !mover_->has_disk()) return;
    int64_t selected = 0, cold = 0;
    for (int h = 0; h < g_.kv_heads; ++h) {
      const auto [logical, n] = rows(h);
      selected += n;
      cold += CountCold(b, h, logical, n);
    }
    const auto allowed = int64_t(std::floor(c_.deadline_skip_limit * double(selected)));
    skips_left_ = cold > allowed ? 0 : allowed;
  }
  // Ends the call: a deadline call that waited is counted.
  void EndCall() {
    if (c_.cold_miss == ColdMissPolicy::kDeadline && mover_->stats().cold_stalls > call_stalls_) ++deadline_waits_;
  }
  Status Decode(const Step& s);
  // One selection for rows [b, b + n) of a shared block, over row b + n - 1's
  // pages, from every row's queries: the block's selector ranks them as one
  // group of n * G query heads per KV head.
  Status SelectShared(const Step& s, int b, int n, PageSelection* out, PageSelection* next, int next_pages,
                      int64_t* boxes_rebuilt);
  // Whether a selection of n pages at `layer` takes group boxes: the
  // hierarchical scan is on and the selection ranks the pages.
  bool TakesGroupBoxes(int layer, int n) const {
    return c_.policy.group_pages > 0 && !c_.policy.is_dense(layer) && c_.policy.page_budget(layer, g_.page_size) < n;
  }
  // The re-rank's exact scores (SelectInput::exact_scores) for row b of the
  // CSR: each candidate page's max logit over its valid keys per query head
  // of the group (`group` heads of q for this KV head), aggregated by the
  // GQA mode; NaN for a page skipped under `deadline`.
  std::function<Status(int, std::span<const int32_t>, float*)> ExactScorer(const float* q, int group, int b);
  Status Dense(const Step& s);
  static void CountAdaptive(const Selector& sel, AttendStats* stats) {
    for (std::size_t i = 0; i < sel.adaptive_pages().size(); ++i) {
      const int pages = sel.adaptive_pages()[i];
      ++stats->adaptive_rankings;
      stats->adaptive_pages += pages;
      stats->adaptive_pages_max = std::max<int64_t>(stats->adaptive_pages_max, pages);
      stats->adaptive_cap_hits += sel.adaptive_capped()[i];
      ++stats->adaptive_hist[std::min(pages, AttendStats::kAdaptiveHistPages)];
    }
  }
  // The hierarchical scan's group boxes (SelectInput::group_slab) for the n
  // pages `ids` of partition `part`: a group is rebuilt from its page boxes
  // when its pages changed (ids, generations) or one of them was unsealed
  // when it was built (a tail's box grows, then seals); *rebuilt counts the
  // page boxes read to do so.
  const float* GroupSlab(uint32_t part, const uint32_t* ids, int n, int64_t* rebuilt);
  struct GroupBoxes {
    std::vector<std::pair<PageId, uint32_t>> pages;  // (id, generation) per logical page
    std::vector<int> count;                          // pages per group when built; -1: not reusable
    std::vector<float> boxes;                        // [group][Hkv][2][D]
  };

  Config c_;
  Geometry g_;
  PageAllocator* ids_;
  TierMover* mover_;
  std::unique_ptr<SummarySlab> summaries_;
  std::unique_ptr<HbmCache> hbm_;  // tails (pinned) + cached head-pages
  std::vector<uint32_t> pending_seals_;  // full pages whose seal waits for room
  std::vector<uint32_t> held_;           // full pages of drafts, unsealed until accepted
  Status seal_error_;                    // why the last of them could not be sealed
  int64_t deferred_seals_ = 0;
  int64_t skips_left_ = 0;      // cold misses the current call may still skip
  int64_t call_stalls_ = 0;     // the mover's cold stalls when it began
  int64_t deadline_waits_ = 0;  // deadline calls that waited past their limit
  int64_t step_ = 0;
  Selector selector_;
  std::map<int, Selector> block_selectors_;  // shared blocks, by rows
  std::unordered_map<uint32_t, GroupBoxes> groups_;  // by partition
  std::vector<float> block_q_;
  // Scratch, reused across calls.
  PageTableCsr csr_;
  std::vector<const PageList*> lists_;
  std::vector<uint32_t> parts_;
  PageSelection next_;  // runners-up of the last selection (prefetch)
  std::vector<kernels::HeadPageRef> refs_;
  std::vector<float> m_, d_, page_scratch_ = std::vector<float>(g_.page_elems());
  int64_t attended_ = 0;        // tokens the last AttendRow read
  double attend_seconds_ = 0;   // of the last AttendRow: attention proper
  double row_seconds_ = 0;      // of the last AttendRow: all of it
};

// ---- tails and seals --------------------------------------------------------------

Status CpuBackend::PinTail(uint32_t part, PageId id) {
  for (int h = 0; h < g_.kv_heads; ++h) {
    auto slot = hbm_->Insert(id, h, part, step_, /*pinned=*/true);
    if (!slot.ok()) {
      hbm_->Drop(id);
      return WithSealCause(slot.status());
    }
  }
  kernels::ResetSummaryCpu(summaries_->page(id), g_.kv_heads, g_.head_dim);
  return Status::Ok();
}

Result<PageId> CpuBackend::NewTail(uint32_t part) {
  QKV_ASSIGN_OR_RETURN(PageId id, ids_->Allocate());
  if (Status s = PinTail(part, id); !s.ok()) {
    ids_->Unref(id);
    return s;
  }
  return id;
}

Status CpuBackend::TailFromHost(uint32_t part, PageId dst, const void* page, int len, int64_t step) {
  step_ = step;
  QKV_RETURN_IF_ERROR(PinTail(part, dst));
  const float* src = static_cast<const float*>(page);
  for (int h = 0; h < g_.kv_heads; ++h) {
    float* slot = TailHead(dst, h);
    std::memcpy(slot, src + h * hp(), hp() * sizeof(float));
    std::memcpy(slot + hp(), src + (g_.kv_heads + h) * hp(), hp() * sizeof(float));
  }
  RebuildTailSummary(dst, len);
  return Status::Ok();
}

void CpuBackend::RebuildTailSummary(PageId tail, int len) {
  const float* k_heads[kernels::kMaxKvHeads];
  for (int h = 0; h < g_.kv_heads; ++h) k_heads[h] = TailHead(tail, h);
  kernels::RebuildSummaryHeadsCpu(k_heads, summaries_->page(tail), g_.kv_heads, g_.head_dim, len);
  SnapSummary(tail);
}

Status CpuBackend::TruncateTail(uint32_t, PageId tail, int len) {
  std::erase(pending_seals_, tail);  // a full page awaiting its seal is a tail again
  std::erase(held_, tail);
  RebuildTailSummary(tail, len);
  return Status::Ok();
}

Status CpuBackend::ReadPage(uint32_t, PageId page, void* dst, int64_t step) {
  bool in_hbm = true;
  for (int h = 0; h < g_.kv_heads && in_hbm; ++h) in_hbm = hbm_->Lookup(page, h) != HbmCache::kNone;
  if (!in_hbm) return mover_->ReadPage(page, ids_->generation(page), dst, step);
  float* out = static_cast<float*>(dst);
  for (int h = 0; h < g_.kv_heads; ++h) {
    const float* s = hbm_->data(hbm_->Lookup(page, h));
    std::memcpy(out + h * hp(), s, hp() * sizeof(float));
    std::memcpy(out + (g_.kv_heads + h) * hp(), s + hp(), hp() * sizeof(float));
  }
  return Status::Ok();
}

// Gives a full page its host home and turns its pinned slots into cached
// ones; when host and disk are full (or the disk fails) the page stays
// pinned in hbm (still correct) and is retried later. False when it waits.
bool CpuBackend::Seal(PageId id) {
  auto home = mover_->SealBegin(id, ids_->generation(id), step_);
  if (!home.ok()) {
    ++deferred_seals_;
    pending_seals_.push_back(id);
    seal_error_ = home.status();
    return false;
  }
  float* dst = static_cast<float*>(*home);
  for (int h = 0; h < g_.kv_heads; ++h) {
    const int32_t s = hbm_->Lookup(id, h);
    std::memcpy(dst + h * hp(), hbm_->data(s), hp() * sizeof(float));
    std::memcpy(dst + (g_.kv_heads + h) * hp(), hbm_->data(s) + hp(), hp() * sizeof(float));
    hbm_->Unpin(s, step_);
  }
  mover_->SealEnd(id);
  return true;
}

// Oldest first; the rest wait once one fails (they would fail alike).
void CpuBackend::RetryPendingSeals() {
  std::vector<uint32_t> retry;
  retry.swap(pending_seals_);
  std::size_t i = 0;
  while (i < retry.size() && Seal(retry[i])) ++i;
  if (i < retry.size()) pending_seals_.insert(pending_seals_.end(), retry.begin() + i + 1, retry.end());
}

// An hbm slot refused while full pages wait in hbm for a host home: the
// cause is the host and disk tiers, so the error is theirs.
Status CpuBackend::WithSealCause(Status s) const {
  if (s.code() != Code::kResourceExhausted || pending_seals_.empty()) return s;
  return Status(seal_error_.code(), std::to_string(pending_seals_.size()) +
                                        " full pages wait in hbm for a host home and fill it: " +
                                        seal_error_.message() + " (" + s.message() + ")");
}

// ---- append -------------------------------------------------------------------------

// Writes n tokens into the list's pages, taking a fresh tail at each page
// boundary and sealing pages as they fill — except the page that was the
// tail when the call began, which is sealed only once everything else
// succeeded: on failure it is cut back to its old length in place and the
// pages this call made are released, so the list is as before.
Status CpuBackend::Append(uint32_t part, PageList& list, const void* k_in, const void* v_in, int64_t n, bool,
                          int64_t step, bool hold) {
  step_ = step;
  const float* k = static_cast<const float*>(k_in);
  const float* v = static_cast<const float*>(v_in);
  const std::size_t row = std::size_t(g_.kv_heads) * g_.head_dim;
  const int64_t old_tokens = list.tokens;
  const std::size_t old_pages = list.pages.size();
  list.pages.reserve(old_pages + std::size_t((n + g_.page_size - 1) / g_.page_size) + 1);
  const PageId first = old_tokens % g_.page_size ? list.pages.back() : kNoPage;
  float* k_heads[kernels::kMaxKvHeads];
  float* v_heads[kernels::kMaxKvHeads];
  for (int64_t done = 0; done < n;) {
    const int64_t pos = list.tokens;
    if (pos % g_.page_size == 0) {
      auto id = NewTail(part);
      if (!id.ok()) {
        UndoAppend(list, old_tokens, old_pages);
        return id.status();
      }
      list.pages.push_back(*id);
    }
    const PageId id = list.pages.back();
    const int offset = int(pos % g_.page_size);
    const int take = int(std::min<int64_t>(n - done, g_.page_size - offset));
    for (int h = 0; h < g_.kv_heads; ++h) {
      k_heads[h] = TailHead(id, h);
      v_heads[h] = k_heads[h] + hp();
    }
    kernels::AppendTokensHeadsCpu(k_heads, v_heads, summaries_->page(id), g_.kv_heads, g_.head_dim, offset,
                                  k + done * row, v + done * row, take);
    SnapSummary(id);
    done += take;
    list.tokens += take;
    if (offset + take == g_.page_size && id != first) SealOrHold(id, hold);
  }
  if (first != kNoPage && list.tokens >= (old_tokens / g_.page_size + 1) * g_.page_size) SealOrHold(first, hold);
  return Status::Ok();
}

void CpuBackend::UndoAppend(PageList& list, int64_t old_tokens, std::size_t old_pages) {
  for (std::size_t i = old_pages; i < list.pages.size(); ++i) {
    const PageId id = list.pages[i];
    if (!ids_->Unref(id)) continue;
    mover_->Drop(id);
    PageDied(id);
  }
  list.pages.resize(old_pages);
  list.tokens = old_tokens;
  if (old_tokens % g_.page_size) RebuildTailSummary(list.pages.back(), int(old_tokens % g_.page_size));
}

// ---- the decode step ------------------------------------------------------------------

Result<HeadSource> CpuBackend::Resolve(PageId page, int head, uint32_t part, bool wait) {
  mover_->NoteSelected(page, step_);
  const std::size_t n = hp();
  if (const int32_t s = hbm_->Lookup(page, head); s != HbmCache::kNone) {
    ++hbm_->stats().hits;
    hbm_->Touch(s, step_);
    return HeadSource{hbm_->data(s), hbm_->data(s) + n, false};
  }
  ++hbm_->stats().misses;
  QKV_ASSIGN_OR_RETURN(const void* home_bytes, mover_->HomeForMiss(page, ids_->generation(page), step_, wait));
  if (!home_bytes) return HeadSource{nullptr, nullptr, true};
  const float* home = static_cast<const float*>(home_bytes);
  const float* k = home + head * n;
  const float* v = home + (g_.kv_heads + head) * n;
  mover_->CountHostToHbm(int64_t(2 * n * sizeof(float)));
  auto slot = hbm_->Insert(page, head, part, step_, false);
  if (!slot.ok()) {
    // Nothing evictable: attend from the host home in place (zero-copy).
    ++hbm_->stats().bypasses;
    mover_->ReadInPlace(page);
    return HeadSource{k, v, false};
  }
  float* dst = hbm_->data(*slot);
  std::memcpy(dst, k, n * sizeof(float));
  std::memcpy(dst + n, v, n * sizeof(float));
  return HeadSource{dst, dst + n, false};
}

int64_t CpuBackend::CountCold(int b, int h, const int32_t* logical, int n) {
  const uint32_t* pages = csr_.pages(b);
  int64_t cold = 0;
  for (int i = 0; i < n; ++i) {
    const uint32_t page = pages[logical[i]];
    cold += hbm_->Lookup(page, h) == HbmCache::kNone && !mover_->HostHome(page);
  }
  return cold;
}

// Attends one (sequence, KV head) over the given logical pages, resolving
// each through the tiers, waiting for cold misses or skipping them. When
// the host tier cannot take a page because earlier pages of the row are read
// in place from it, the row so far is attended, those pointers released,
// and the row continues: pages are merged in the same order, so the output
// is bit for bit the same as in one piece.
Status CpuBackend::AttendRow(int b, int kv_head, const int32_t* logical, int n, const float* q, float* out) {
  const uint32_t* pages = csr_.pages(b);
  const int last = csr_.num_pages(b) - 1;
  const int G = g_.group();
  const std::size_t qoff = (std::size_t(b) * g_.q_heads + std::size_t(kv_head) * G) * g_.head_dim;
  const float scale = 1.f / std::sqrt(float(g_.head_dim));
  m_.resize(G);
  d_.resize(G);
  kernels::AttendPagesCpu(q + qoff, G, g_.head_dim, nullptr, 0, scale, out + qoff, m_.data(), d_.data());
  refs_.clear();
  attended_ = 0;
  attend_seconds_ = 0;
  const auto row_start = Clock::now();
  auto flush = [&] {
    const auto t0 = Clock::now();
    kernels::AttendMorePagesCpu(q + qoff, G, g_.head_dim, refs_.data(), int(refs_.size()), scale, out + qoff,
                                m_.data(), d_.data());
    attend_seconds_ += Seconds(Clock::now() - t0);
    for (const kernels::HeadPageRef& r : refs_) attended_ += r.len;
    refs_.clear();
    mover_->EndReads();
  };
  for (int i = 0; i < n; ++i) {
    const int p = logical[i];
    auto src = Resolve(pages[p], kv_head, parts_[b], skips_left_ <= 0);
    if (!src.ok() && src.status().code() == Code::kResourceExhausted && !refs_.empty()) {
      flush();
      src = Resolve(pages[p], kv_head, parts_[b], skips_left_ <= 0);
    }
    if (!src.ok()) {
      mover_->EndReads();
      return src.status();
    }
    if (src->skipped) {
      --skips_left_;
      continue;
    }
    refs_.push_back({src->k, src->v, p == last ? csr_.last_page_len[b] : g_.page_size});
  }
  flush();
  row_seconds_ = Seconds(Clock::now() - row_start);
  return Status::Ok();
}

Status CpuBackend::DecodeStep(const Step& s) {
  step_ = s.step;
  lists_.assign(s.lists.begin(), s.lists.end());
  parts_.assign(s.partitions.begin(), s.partitions.end());
  csr_.Assign(lists_, g_.page_size);
  return s.dense ? Dense(s) : Decode(s);
}

Status CpuBackend::Decode(const Step& s) {
  const float* q = static_cast<const float*>(s.q);
  float* out = static_cast<float*>(s.out);
  AttendStats* stats = s.stats;
  if (s.selections) s.selections->resize(std::size_t(csr_.batch()));
  const int prefetch = mover_->has_disk() ? c_.prefetch_pages : 0;
  PageSelection local, shared;
  std::size_t next_block = 0;
  int block_end = 0;
  for (int b = 0; b < csr_.batch(); ++b) {
    PageSelection& sel = s.selections ? (*s.selections)[b] : local;
    const uint32_t* page_ids = csr_.pages(b);
    const int num_pages = csr_.num_pages(b);
    const uint32_t* next_ids = page_ids;  // the list next_ indexes
    int64_t boxes_read = 0, boxes_rebuilt = 0;  // this row's selection's summary reads
    const auto t0 = Clock::now();
    if (s.shared_blocks.empty()) {
      SelectInput in;
      in.q = q + std::size_t(b) * g_.q_heads * g_.head_dim;
      in.summary_slab = summaries_->base();
      in.page_ids = page_ids;
      in.num_pages = num_pages;
      in.layer = s.layer;
      if (c_.policy.rerank > 0) in.exact_scores = ExactScorer(in.q, g_.group(), b);
      if (TakesGroupBoxes(s.layer, num_pages)) in.group_slab = GroupSlab(parts_[b], page_ids, num_pages, &boxes_rebuilt);
      QKV_RETURN_IF_ERROR(selector_.Select(in, &sel, &next_, prefetch));
      boxes_read = selector_.boxes_read();
      if (stats) CountAdaptive(selector_, stats);
      if (stats) stats->rerank_key_bytes += selector_.reranked() * int64_t(g_.page_size) * g_.head_dim * 4;
    } else {
      if (b == block_end) {  // a block starts: rows [b, b + n)
        if (next_block >= s.shared_blocks.size()) return Status::Internal("shared blocks cover fewer rows than the batch");
        const int n = s.shared_blocks[next_block++];
        block_end = b + n;
        QKV_RETURN_IF_ERROR(SelectShared(s, b, n, &shared, &next_, prefetch, &boxes_rebuilt));
        boxes_read = block_selectors_.at(n).boxes_read();
        if (stats) CountAdaptive(block_selectors_.at(n), stats);
        if (stats)
          stats->rerank_key_bytes += block_selectors_.at(n).reranked() * int64_t(g_.page_size) * g_.head_dim * 4;
        next_ids = csr_.pages(block_end - 1);
      } else {
        next_.indptr.assign(g_.kv_heads + 1, 0);  // prefetched with the block's first row
        next_.pages.clear();
      }
      // This position's share: the block's pages within its causal view,
      // and its own local window (its own token's page among them).
      const int local_start = num_pages - std::min(std::max(c_.policy.local_pages, 1), num_pages);
      sel.indptr.assign(1, 0);
      sel.pages.clear();
      for (int h = 0; h < g_.kv_heads; ++h) {
        for (int i = 0; i < shared.count(h); ++i)
          if (shared.row(h)[i] < local_start) sel.pages.push_back(shared.row(h)[i]);
        for (int p = local_start; p < num_pages; ++p) sel.pages.push_back(p);
        sel.indptr.push_back(int32_t(sel.pages.size()));
      }
    }
    if (stats) stats->select_us += 1e6 * Seconds(Clock::now() - t0);
    BeginCall(b, [&](int h) { return std::pair(sel.row(h), sel.count(h)); });
    for (int h = 0; h < g_.kv_heads; ++h) {
      QKV_RETURN_IF_ERROR(AttendRow(b, h, sel.row(h), sel.count(h), q, out));
      const auto t1 = Clock::now();
      for (int i = 0; i < next_.count(h); ++i) QKV_RETURN_IF_ERROR(mover_->Prefetch(next_ids[next_.row(h)[i]]));
      if (stats) {
        stats->attend_us += 1e6 * attend_seconds_;
        stats->resolve_us += 1e6 * (row_seconds_ - attend_seconds_ + Seconds(Clock::now() - t1));
        stats->head_pages_selected += sel.count(h);
        stats->head_pages_total += num_pages;
        stats->kv_bytes_read += attended_ * g_.head_dim * 2 * int64_t(sizeof(float));
      }
    }
    EndCall();
    // The selector scores only when the budget is smaller than the page count;
    // a shared block scores once, over its last row's pages.
    if (stats)
      stats->summary_bytes_read += (boxes_read * int64_t(summaries_->page_bytes()) / g_.kv_heads) +
                                   boxes_rebuilt * int64_t(summaries_->page_bytes());
  }
  return Status::Ok();
}

Status CpuBackend::SelectShared(const Step& s, int b, int n, PageSelection* out, PageSelection* next,
                                int next_pages, int64_t* boxes_rebuilt) {
  if (n < 1 || b + n > csr_.batch()) return Status::Internal("a shared block past the batch");
  auto it = block_selectors_.find(n);
  if (it == block_selectors_.end()) {
    Geometry gb = g_;
    gb.q_heads = n * g_.q_heads;
    it = block_selectors_.emplace(n, Selector(gb, c_.policy)).first;
  }
  // Rows [b, b + n) of [rows][Hq][D] regrouped as [Hkv][n][G][D]: KV head h's
  // group is every position's G query heads.
  const int G = g_.group(), D = g_.head_dim;
  const float* q = static_cast<const float*>(s.q);
  block_q_.resize(std::size_t(n) * g_.q_heads * D);
  for (int h = 0; h < g_.kv_heads; ++h)
    for (int p = 0; p < n; ++p)
      std::memcpy(block_q_.data() + ((std::size_t(h) * n + p) * G) * D,
                  q + (std::size_t(b + p) * g_.q_heads + std::size_t(h) * G) * D, std::size_t(G) * D * sizeof(float));
  SelectInput in;
  in.q = block_q_.data();
  in.summary_slab = summaries_->base();
  in.page_ids = csr_.pages(b + n - 1);
  in.num_pages = csr_.num_pages(b + n - 1);
  in.layer = s.layer;
  if (c_.policy.rerank > 0) in.exact_scores = ExactScorer(in.q, n * G, b + n - 1);
  if (TakesGroupBoxes(s.layer, in.num_pages))
    in.group_slab = GroupSlab(parts_[b + n - 1], in.page_ids, in.num_pages, boxes_rebuilt);
  return it->second.Select(in, out, next, next_pages);
}

const float* CpuBackend::GroupSlab(uint32_t part, const uint32_t* ids, int n, int64_t* rebuilt) {
  const int B = c_.policy.group_pages, groups = (n + B - 1) / B, H = g_.kv_heads, D = g_.head_dim;
  const std::size_t box = g_.summary_elems();  // [Hkv][2][D]
  GroupBoxes& gb = groups_[part];
  if (gb.pages.size() < std::size_t(groups) * B) gb.pages.resize(std::size_t(groups) * B, {kNoPage, 0});
  if (gb.count.size() < std::size_t(groups)) gb.count.resize(groups, 0);
  if (gb.boxes.size() < std::size_t(groups) * box) gb.boxes.resize(std::size_t(groups) * box);
  for (int grp = 0; grp < groups; ++grp) {
    const int p0 = grp * B, count = std::min(B, n - p0);
    // Reused only when built over these sealed pages (immutable): count -1
    // marks a group built over a page still filling.
    bool same = gb.count[grp] == count;
    for (int j = 0; j < count && same; ++j)
      same = gb.pages[p0 + j] == std::pair<PageId, uint32_t>(ids[p0 + j], ids_->generation(ids[p0 + j]));
    if (same) continue;
    float* dst = gb.boxes.data() + std::size_t(grp) * box;
    for (int h = 0; h < H; ++h) {
      std::fill_n(dst + h * 2 * D, D, std::numeric_limits<float>::infinity());
      std::fill_n(dst + h * 2 * D + D, D, -std::numeric_limits<float>::infinity());
    }
    bool sealed = true;
    for (int j = 0; j < count; ++j) {
      sealed = sealed && mover_->sealed(ids[p0 + j]);
      const float* src = summaries_->page(ids[p0 + j]);
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) {
          float& lo = dst[h * 2 * D + d];
          float& hi = dst[h * 2 * D + D + d];
          lo = std::min(lo, src[h * 2 * D + d]);
          hi = std::max(hi, src[h * 2 * D + D + d]);
        }
      gb.pages[p0 + j] = {ids[p0 + j], ids_->generation(ids[p0 + j])};
    }
    // A box built over a page still filling is stale once that page gains
    // keys, sealed or not: such a group is never reused.
    gb.count[grp] = sealed ? count : -1;
    *rebuilt += count;
  }
  return gb.boxes.data();
}

std::function<Status(int, std::span<const int32_t>, float*)> CpuBackend::ExactScorer(const float* q, int group,
                                                                                     int b) {
  return [this, q, group, b](int h, std::span<const int32_t> pages, float* exact) -> Status {
    const int D = g_.head_dim, last = csr_.num_pages(b) - 1;
    for (std::size_t i = 0; i < pages.size(); ++i) {
      const int p = pages[i];
      QKV_ASSIGN_OR_RETURN(const HeadSource src, Resolve(csr_.pages(b)[p], h, parts_[b], c_.cold_miss == ColdMissPolicy::kStrict));
      if (src.skipped) {
        exact[i] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const int len = p == last ? csr_.last_page_len[b] : g_.page_size;
      float agg = c_.policy.gqa == GqaMode::kMax ? -std::numeric_limits<float>::infinity() : 0.f;
      for (int gi = 0; gi < group; ++gi) {
        const float* qh = q + (std::size_t(h) * group + gi) * D;
        float best = -std::numeric_limits<float>::infinity();
        for (int t = 0; t < len; ++t) {
          float dot = 0;
          for (int d = 0; d < D; ++d) dot += qh[d] * src.k[std::size_t(t) * D + d];
          best = std::max(best, dot);
        }
        agg = c_.policy.gqa == GqaMode::kMax ? std::max(agg, best) : agg + best / float(group);
      }
      exact[i] = agg;
    }
    return Status::Ok();
  };
}

Status CpuBackend::Dense(const Step& s) {
  const float* q = static_cast<const float*>(s.q);
  float* out = static_cast<float*>(s.out);
  std::vector<int32_t> all;
  for (int b = 0; b < csr_.batch(); ++b) {
    all.resize(csr_.num_pages(b));
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = int32_t(i);
    BeginCall(b, [&](int) { return std::pair(all.data(), int(all.size())); });
    for (int h = 0; h < g_.kv_heads; ++h) QKV_RETURN_IF_ERROR(AttendRow(b, h, all.data(), int(all.size()), q, out));
    EndCall();
  }
  return Status::Ok();
}

BackendCounters CpuBackend::counters() {
  const HbmStats& h = hbm_->stats();
  const MoverStats& m = mover_->stats();
  BackendCounters c;
  c.hits = h.hits, c.misses = h.misses, c.evictions = h.evictions, c.bypasses = h.bypasses;
  c.bytes_host_to_hbm = m.bytes_host_to_hbm;
  c.cold_misses = m.cold_misses, c.cold_stalls = m.cold_stalls, c.pages_skipped = m.pages_skipped;
  c.deferred_seals = deferred_seals_, c.deadline_waits = deadline_waits_;
  c.slots_capacity = h.slots_capacity, c.slots_used = h.slots_used, c.slots_peak = h.slots_peak;
  c.slot_bytes = hbm_->slot_bytes();
  return c;
}

}  // namespace

Result<std::unique_ptr<DataPlane>> MakeCpuBackend(const Config& config, PageAllocator* ids, TierMover* mover) {
  const Geometry& g = config.geometry;
  if (g.dtype != DType::kF32)
    return Status::Unimplemented("the CPU backend stores K/V as f32; " + std::string(DTypeName(g.dtype)) +
                                 " needs the CUDA backend");
  QKV_ASSIGN_OR_RETURN(auto summaries, SummarySlab::Create(config.max_pages, g.kv_heads, g.head_dim));
  const std::size_t head_page_bytes = 2 * g.head_page_elems() * sizeof(float);
  const uint64_t all_heads = uint64_t(config.max_pages) * g.kv_heads;
  const uint64_t slots = config.hbm_bytes ? std::min<uint64_t>(config.hbm_bytes / head_page_bytes, all_heads) : all_heads;
  QKV_ASSIGN_OR_RETURN(auto hbm, HbmCache::Create(uint32_t(slots), 2 * g.head_page_elems(), /*pages=*/0, g.kv_heads));
  return std::unique_ptr<DataPlane>(new CpuBackend(config, ids, mover, std::move(summaries), std::move(hbm)));
}

}  // namespace questkv
