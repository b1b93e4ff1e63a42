// Resolve, the CPU twin of kernels/cuda/resolve.cu. The rule, in three phases
// that the device runs as separate launches:
//
//  1. classify, every used entry e of every row (b, h), page = page_ids[...]:
//       hit   hbm_slot[page][h] >= 0: slot_last_use[slot] = step
//       cold  not cached, host_addr[page] == null (home on disk)
//       miss  not cached, home in host: claims the cell, hbm_slot = min(cell,
//             INT32_MIN + e), so the lowest entry missing a head-page owns it
//             (a page shared by sequences is fetched once).
//  2. assign, per sequence b (partitions are disjoint slot lists): the owned
//     misses of b's rows, in entry order, take in turn the slots of b's list
//     that are neither pinned nor used at `step` (after phase 1), in list
//     order (least recently used first). A taken slot's old head-page loses
//     its residency (an eviction if the slot held one); the slot gets the new
//     head-page, last_use = step. Owners left without a slot release their
//     claim (cell = -1): a bypass. Then the list is reordered stably: slots
//     not used at `step` first, then those used (hit or filled), each group
//     in its old order — the LRU order for the next step. A sequence with no
//     owned miss leaves its list as it is (lists may hold every page of a
//     long sequence; its hits' recency stays in last_use).
//  3. finalize, per row: every miss reads its cell (its owner's slot, or -1);
//     entries with a slot are written to out_slots in selection order, cold
//     entries go to the cold queue, misses without a slot to the bypass queue.
// The copy of each filled slot's K and V from the home runs after phase 2.
#include <algorithm>
#include <climits>
#include <cstring>
#include <vector>

#include "kernels/cpu/kernels_cpu.h"

namespace questkv::kernels {
namespace {

enum State : uint8_t { kIdle, kHit, kCold, kMiss };
constexpr int32_t kClaimBase = INT32_MIN;

void Push(resolve::Request* queue, int32_t* count, int capacity, resolve::Request r, resolve::Counters* c) {
  if (*count < capacity) queue[*count] = r; else ++c->queue_overflows;
  ++*count;
}

}  // namespace

void ResolveCpu(const ResolveCpuParams& p) {
  const int H = p.kv_heads, rows = p.batch * H;
  const int64_t entries = p.sel_indptr[rows];
  std::vector<uint8_t> state(std::size_t(entries), kIdle);
  std::vector<uint32_t> page_of(std::size_t(entries), 0);
  auto used = [&](int r) {
    const int cap = p.sel_indptr[r + 1] - p.sel_indptr[r];
    return p.sel_count ? std::min(p.sel_count[r], cap) : cap;
  };
  auto cell = [&](int64_t e, int r) -> int32_t& { return p.hbm_slot[std::size_t(page_of[e]) * H + r % H]; };

  // 1. classify
  for (int r = 0; r < rows; ++r) {
    const int b = r / H;
    for (int i = 0; i < used(r); ++i) {
      const int64_t e = p.sel_indptr[r] + i;
      page_of[e] = p.page_ids[p.page_indptr[b] + p.sel_pages[e]];
      int32_t& c = cell(e, r);
      if (c >= 0) {
        state[e] = kHit;
        p.slot_last_use[c] = p.step;
      } else if (p.host_addr[page_of[e]] == nullptr) {
        state[e] = kCold;
      } else {
        state[e] = kMiss;
        c = std::min(c, int32_t(kClaimBase + e));
      }
    }
  }

  // 2. assign, then reorder each partition's list
  const std::size_t piece = p.piece_bytes;
  auto* pool = static_cast<uint8_t*>(p.slots);
  for (int b = 0; b < p.batch; ++b) {
    std::vector<int64_t> owners;
    for (int r = b * H; r < (b + 1) * H; ++r)
      for (int i = 0; i < used(r); ++i) {
        const int64_t e = p.sel_indptr[r] + i;
        if (state[e] == kMiss && cell(e, r) == int32_t(kClaimBase + e)) owners.push_back(e);
      }
    if (owners.empty()) continue;  // no miss to place: the list stays as it is
    int32_t* const part = p.part_lists ? p.part_lists[b] : p.part_slots + p.part_indptr[b];
    std::vector<int32_t> list(part, part + (p.part_indptr[b + 1] - p.part_indptr[b]));
    std::size_t k = 0;
    for (int32_t s : list) {
      if (k == owners.size()) break;
      if (p.slot_pinned[s] || p.slot_last_use[s] == p.step) continue;
      const int64_t e = owners[k++];
      const int h = int(std::upper_bound(p.sel_indptr, p.sel_indptr + rows + 1, e) - p.sel_indptr - 1) % H;
      if (p.slot_page[s] != resolve::kEmptySlot) {
        p.hbm_slot[std::size_t(p.slot_page[s]) * H + p.slot_head[s]] = -1;
        ++p.counters->evictions;
      }
      p.slot_page[s] = page_of[e];
      p.slot_head[s] = h;
      p.slot_last_use[s] = p.step;
      p.hbm_slot[std::size_t(page_of[e]) * H + h] = s;
      const auto* home = static_cast<const uint8_t*>(p.host_addr[page_of[e]]);
      std::memcpy(pool + std::size_t(s) * 2 * piece, home + std::size_t(h) * piece, piece);
      std::memcpy(pool + (std::size_t(s) * 2 + 1) * piece, home + std::size_t(H + h) * piece, piece);
      p.counters->bytes_host_to_hbm += 2 * piece;
    }
    for (; k < owners.size(); ++k) {
      const int64_t e = owners[k];
      const int h = int(std::upper_bound(p.sel_indptr, p.sel_indptr + rows + 1, e) - p.sel_indptr - 1) % H;
      p.hbm_slot[std::size_t(page_of[e]) * H + h] = -1;
    }
    int32_t* out = part;
    for (int32_t s : list)
      if (p.slot_last_use[s] != p.step) *out++ = s;
    for (int32_t s : list)
      if (p.slot_last_use[s] == p.step) *out++ = s;
  }

  // 3. finalize
  *p.cold_count = 0;
  *p.bypass_count = 0;
  resolve::Counters& c = *p.counters;
  for (int r = 0; r < rows; ++r) {
    int n = 0;
    for (int i = 0; i < used(r); ++i) {
      const int64_t e = p.sel_indptr[r] + i;
      const resolve::Request req{page_of[e], r % H, r, int32_t(e)};
      ++c.selected;
      if (state[e] == kCold) {
        ++c.misses_disk;
        ++(p.strict ? c.cold_stalls : c.pages_skipped);
        Push(p.cold, p.cold_count, p.queue_capacity, req, &c);
        continue;
      }
      const int32_t s = cell(e, r);
      ++(state[e] == kHit ? c.hits : c.misses_host);
      if (s < 0) {
        ++c.bypasses;
        Push(p.bypass, p.bypass_count, p.queue_capacity, req, &c);
        continue;
      }
      p.out_slots[p.sel_indptr[r] + n++] = s;
    }
    p.out_count[r] = n;
  }
}

}  // namespace questkv::kernels
