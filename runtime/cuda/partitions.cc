// The CUDA backend: partitions and their slot lists.
#include "runtime/cuda/backend.h"

namespace questkv::cuda_backend {

// ---- partitions ------------------------------------------------------------------

Result<uint32_t> CudaBackendImpl::AddPartition() {
  const int H = g_.kv_heads;
  QKV_RETURN_IF_ERROR(Reclaim(H, H, 0, /*below_need=*/true));
  if (int64_t(free_.size()) < H)
    return Status::ResourceExhausted("hbm: no free slots for a new tail (" + std::to_string(slots_) + " slots)");
  uint32_t id;
  if (!free_parts_.empty()) {
    id = free_parts_.back();
    free_parts_.pop_back();
  } else {
    id = uint32_t(parts_.size());
    parts_.emplace_back();
  }
  Partition& P = parts_[id];
  P = Partition{};
  P.live = true;
  P.tail = TakePinnedSlots(nullptr);
  // Now: a queued set would land after a later release of these slots.
  QKV_RETURN_IF_ERROR(FlushUpdates());
  return id;
}

void CudaBackendImpl::RemovePartition(uint32_t part) {
  Partition& P = parts_[part];
  ReleaseSlots(P.tail);
  ReleaseSlots(P.owned);
  for (auto it = held_.begin(); it != held_.end();) {
    if (it->second.part != part) {
      ++it;
      continue;
    }
    ReleaseSlots(it->second.slots);
    it = held_.erase(it);
  }
  // A set still queued for these slots (e.g. the pinned flag) must not land after the release.
  (void)FlushUpdates();
  (void)Sync();
  if (P.tail_page != kNoPage) tail_owner_.erase(P.tail_page);
  P = Partition{};
  free_parts_.push_back(part);
}

Status CudaBackendImpl::GrowPages(Partition& P, int64_t len) {
  if (int64_t(P.pages.bytes() / 4) >= len) return Status::Ok();
  DevBuf bigger;
  QKV_RETURN_IF_ERROR(bigger.Reserve(std::size_t(std::max<int64_t>(2 * len, 64)) * 4, /*in_graphs=*/false));
  if (P.pages_len)
    QKV_CUDA(cudaMemcpyAsync(bigger.as(), P.pages.as(), P.pages_len * 4, cudaMemcpyDeviceToDevice, stream_));
  QKV_RETURN_IF_ERROR(Sync());  // the old block may still be read by queued work
  P.pages = std::move(bigger);
  return Status::Ok();
}

Status CudaBackendImpl::SetPages(uint32_t part, std::span<const PageId> pages) {
  Partition& P = parts_[part];
  QKV_RETURN_IF_ERROR(GrowPages(P, int64_t(pages.size())));
  QKV_RETURN_IF_ERROR(Upload(P.pages.as(), pages.data(), pages.size() * 4));
  P.pages_len = int64_t(pages.size());
  return Status::Ok();
}

// The list must hold `last_need` slots. A growing list also aims at its
// Target: up to three times as many more, so that it grows rarely and caches
// beyond one step's selection, within an equal share of the pool (as the
// tier model, tiers/hbm_cache.h, shares it). It takes free slots first, then
// what other lists hold beyond their targets (pages left resident by
// prefill: without this, the first layers prefilled kept the whole pool and
// every later layer got exactly one step's selection, no cache at all), and
// only for its need what others hold beyond their last step's need; least
// recently used first.
int64_t CudaBackendImpl::Share() const {
  const int64_t live = int64_t(parts_.size()) - 1 - int64_t(free_parts_.size());  // partition 0 is never live
  return (slots_ - int64_t(staging_.size())) / std::max<int64_t>(live, 1);
}

Status CudaBackendImpl::GrowList(uint32_t part) {
  Partition& P = parts_[part];
  const int64_t need = P.last_need;
  const int64_t have = int64_t(P.owned.size());
  if (have >= need) return Status::Ok();
  const int64_t add = need - have;
  const int64_t want = std::max(add, Target(P, Share()) - have);
  QKV_RETURN_IF_ERROR(Reclaim(add, want, part, /*below_need=*/true));
  if (int64_t(free_.size()) < add) {
    // Where the pool is: what could not be taken, and why.
    int64_t lists = 0, stepping = 0, tails = 0, drafts = 0;
    for (uint32_t q = 1; q < parts_.size(); ++q) {
      if (!parts_[q].live) continue;
      lists += int64_t(parts_[q].owned.size());
      if (parts_[q].stepping) stepping += int64_t(parts_[q].owned.size());
      tails += int64_t(parts_[q].tail.size());
    }
    for (const auto& [page, h] : held_) drafts += int64_t(h.slots.size());
    return Status::ResourceExhausted(
        "hbm too small: a (sequence, layer) needs " + std::to_string(need) +
        " head-page slots for one step's selection, " + std::to_string(have) + " held and " +
        std::to_string(free_.size()) + " free of " + std::to_string(slots_) + "; lists hold " + std::to_string(lists) +
        " (this step's " + std::to_string(stepping) + "), tails " + std::to_string(tails) + ", draft pages " +
        std::to_string(drafts) + ", staging " + std::to_string(staging_.size()) +
        " (raise hbm_bytes or lower the budget)");
  }
  const int64_t take = std::min<int64_t>(int64_t(free_.size()), want);
  std::vector<int32_t> fresh(free_.end() - take, free_.end());
  free_.resize(free_.size() - take);
  DevBuf list;
  QKV_RETURN_IF_ERROR(list.Reserve(std::size_t(2 * (have + take)) * 4, /*in_graphs=*/false));  // room to extend
  QKV_RETURN_IF_ERROR(Upload(list.as(), fresh.data(), fresh.size() * 4));
  if (have)
    QKV_CUDA(cudaMemcpyAsync(list.as<int32_t>() + take, P.list.as(), have * 4, cudaMemcpyDeviceToDevice, stream_));
  QKV_RETURN_IF_ERROR(Sync());
  P.list = std::move(list);
  P.owned.insert(P.owned.end(), fresh.begin(), fresh.end());
  slots_peak_ = std::max<uint64_t>(slots_peak_, uint64_t(slots_ - int64_t(free_.size())));
  return Status::Ok();
}

// Slots (already holding pages) join the list at its most recently used end:
// in place while the list's block has room (a sealed page a step: no
// allocation, no wait), else in a block twice as large.
Status CudaBackendImpl::ExtendList(uint32_t part, const std::vector<int32_t>& slots) {
  if (slots.empty()) return Status::Ok();
  Partition& P = parts_[part];
  const int64_t have = int64_t(P.owned.size());
  const std::size_t bytes = std::size_t(have) * 4 + slots.size() * 4;
  if (P.list.bytes() < bytes) {
    DevBuf list;
    QKV_RETURN_IF_ERROR(list.Reserve(std::max<std::size_t>(2 * bytes, 256), /*in_graphs=*/false));
    if (have) QKV_CUDA(cudaMemcpyAsync(list.as(), P.list.as(), have * 4, cudaMemcpyDeviceToDevice, stream_));
    QKV_RETURN_IF_ERROR(Sync());  // queued work may still read the old block
    P.list = std::move(list);
  }
  QKV_RETURN_IF_ERROR(Upload(P.list.as<int32_t>() + have, slots.data(), slots.size() * 4));
  P.owned.insert(P.owned.end(), slots.begin(), slots.end());
  slots_peak_ = std::max<uint64_t>(slots_peak_, uint64_t(slots_ - int64_t(free_.size())));
  return Status::Ok();
}

// Until `want` slots are free: lists give back what they hold beyond their
// targets; then, until `must` are, what they hold beyond their last step's
// need (pages cached on the side); then, where the caller asks, what lists
// outside the step being planned hold at all: their pages miss at their next
// step, which takes slots back the same way. Pinned slots (tails, held
// drafts) and a step's lists that fit would otherwise keep the pool from a
// list that needs a few.
Status CudaBackendImpl::Reclaim(int64_t must, int64_t want, uint32_t except, bool below_need) {
  const int64_t share = Share();
  enum Keep { kTarget, kNeed, kNothing };
  for (const Keep keep : {kTarget, kNeed, kNothing}) {
    if (keep == kNothing && !below_need) break;
    const int64_t goal = keep == kTarget ? want : must;
    for (uint32_t q = 1; q < parts_.size() && int64_t(free_.size()) < goal; ++q) {
      const Partition& Q = parts_[q];
      if (q == except || !Q.live || (keep == kNothing && Q.stepping)) continue;
      const int64_t kept = keep == kTarget ? Target(Q, share) : keep == kNeed ? Q.last_need : 0;
      const int64_t surplus = int64_t(Q.owned.size()) - kept;
      if (surplus > 0) QKV_RETURN_IF_ERROR(Shrink(q, std::min<int64_t>(surplus, goal - int64_t(free_.size()))));
    }
  }
  return Status::Ok();
}

// The k least recently used slots of a list go back to the free pool (their
// pages lose residency). Only between steps: nothing of the list is in use.
Status CudaBackendImpl::Shrink(uint32_t part, int64_t k) {
  Partition& P = parts_[part];
  const int64_t n = int64_t(P.owned.size());
  std::vector<int32_t> lru(k);
  QKV_RETURN_IF_ERROR(FlushUpdates());
  QKV_CUDA(cudaMemcpyAsync(lru.data(), P.list.as(), k * 4, cudaMemcpyDeviceToHost, stream_));
  DevBuf list;
  QKV_RETURN_IF_ERROR(list.Reserve(std::size_t(std::max<int64_t>(n - k, 1)) * 4, /*in_graphs=*/false));
  if (n > k)
    QKV_CUDA(cudaMemcpyAsync(list.as(), P.list.as<int32_t>() + k, (n - k) * 4, cudaMemcpyDeviceToDevice, stream_));
  QKV_RETURN_IF_ERROR(Sync());
  P.list = std::move(list);
  ReleaseSlots(lru);
  QKV_RETURN_IF_ERROR(FlushUpdates());
  std::sort(lru.begin(), lru.end());
  std::erase_if(P.owned, [&](int32_t s) { return std::binary_search(lru.begin(), lru.end(), s); });
  return Status::Ok();
}

// The tail slots take `page`; the page they held loses its residency.
Status CudaBackendImpl::AssignTail(uint32_t part, PageId page) {
  Partition& P = parts_[part];
  for (int h = 0; h < g_.kv_heads; ++h) {
    if (P.tail_page != kNoPage && P.tail_page != page) Set(hbm_cell(P.tail_page, h), -1, kc::TableOp::kSet32);
    SetSlot(P.tail[h], page, h);
  }
  if (P.tail_page != kNoPage) tail_owner_.erase(P.tail_page);
  P.tail_page = page;
  tail_owner_[page] = part;
  return Status::Ok();
}

}  // namespace questkv::cuda_backend
