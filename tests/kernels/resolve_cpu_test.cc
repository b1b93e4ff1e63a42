// ResolveCpu against a plain model of its rule written here with maps and
// lists (residency as a map, claims as "first entry to miss", victims as the
// first eligible slots of the partition's list), over several steps of random
// selections with shared pages, disk homes, pinned tails and partitions too
// small for the misses. Also checks invariants that hold whatever the rule:
// residency is a bijection, tails never move, every slot handed to attention
// holds the right bytes, counters add up.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "kernels/cpu/kernels_cpu.h"

namespace questkv::kernels {
namespace {

using resolve::Counters;
using resolve::Request;

struct Case {
  int batch, kv_heads, piece_bytes;
  int pages_per_seq, cache_slots, budget;
  double cold_frac;
  int shared_pages;  // sequences 0 and 1 share this many leading pages
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << "B" << c.batch << "_H" << c.kv_heads << "_P" << c.piece_bytes << "_n" << c.pages_per_seq << "_slots"
      << c.cache_slots << "_K" << c.budget << "_cold" << int(c.cold_frac * 100) << "_shared" << c.shared_pages;
}

// Tables and bytes of a small world; every PageId has "true" bytes, and a
// host home unless its home is disk.
struct World {
  int B = 0, H = 0;
  std::size_t piece = 0;
  std::vector<int32_t> page_indptr;
  std::vector<uint32_t> page_ids;
  std::vector<std::vector<uint8_t>> truth;  // [PageId] [2][H][piece]
  std::vector<const void*> host_addr;
  std::vector<int32_t> hbm_slot;
  std::vector<uint32_t> slot_page;
  std::vector<int32_t> slot_head;
  std::vector<int64_t> last_use;
  std::vector<uint8_t> pinned;
  std::vector<int32_t> part_indptr, part_slots;
  std::vector<uint8_t> pool;
  int64_t slots() const { return int64_t(slot_page.size()); }
  const uint8_t* TrueBytes(uint32_t page, int head, int kv) const {
    return truth[page].data() + (std::size_t(kv) * H + head) * piece;
  }
};

World MakeWorld(const Case& c, std::mt19937& rng) {
  World w;
  w.B = c.batch;
  w.H = c.kv_heads;
  w.piece = std::size_t(c.piece_bytes);
  const int n = c.pages_per_seq;
  const int shared = c.batch >= 2 ? std::min(c.shared_pages, n - 1) : 0;
  const int total = c.batch * n - (c.batch >= 2 ? shared : 0);
  std::vector<uint32_t> ids(total);
  for (int i = 0; i < total; ++i) ids[i] = uint32_t(i);
  std::shuffle(ids.begin(), ids.end(), rng);
  w.page_indptr.push_back(0);
  int next = 0;
  for (int b = 0; b < c.batch; ++b) {
    for (int i = 0; i < n; ++i)
      w.page_ids.push_back(b == 1 && i < shared ? w.page_ids[i] : ids[next++]);
    w.page_indptr.push_back(int32_t(w.page_ids.size()));
  }
  std::uniform_int_distribution<int> byte(0, 255);
  std::bernoulli_distribution cold(c.cold_frac);
  w.truth.resize(total);
  w.host_addr.assign(total, nullptr);
  for (int p = 0; p < total; ++p) {
    w.truth[p].resize(2 * w.H * w.piece);
    for (auto& x : w.truth[p]) x = uint8_t(byte(rng));
    if (!cold(rng)) w.host_addr[p] = w.truth[p].data();
  }
  w.hbm_slot.assign(std::size_t(total) * w.H, -1);
  // Per sequence: H pinned tail slots and cache_slots cached ones, shuffled;
  // about half the cache slots start filled with pages of that sequence.
  w.part_indptr.push_back(0);
  auto add_slot = [&](uint32_t page, int head, bool pin, int64_t use) {
    const int32_t s = int32_t(w.slot_page.size());
    w.slot_page.push_back(page);
    w.slot_head.push_back(head);
    w.pinned.push_back(pin);
    w.last_use.push_back(use);
    w.pool.resize(w.pool.size() + 2 * w.piece, 0xEE);
    if (page != resolve::kEmptySlot) {
      w.hbm_slot[std::size_t(page) * w.H + head] = s;
      for (int kv = 0; kv < 2; ++kv)
        std::copy_n(w.TrueBytes(page, head, kv), w.piece, w.pool.data() + (std::size_t(s) * 2 + kv) * w.piece);
    }
    return s;
  };
  std::uniform_int_distribution<int> old_step(-3, -1);
  for (int b = 0; b < c.batch; ++b) {
    std::vector<int32_t> list;
    const uint32_t tail = w.page_ids[w.page_indptr[b] + n - 1];
    for (int h = 0; h < w.H; ++h) list.push_back(add_slot(tail, h, true, -1));
    for (int i = 0; i < c.cache_slots; ++i) {
      uint32_t page = resolve::kEmptySlot;
      int head = 0;
      if (i % 2 == 0) {
        page = w.page_ids[w.page_indptr[b] + std::uniform_int_distribution<int>(0, n - 2)(rng)];
        head = std::uniform_int_distribution<int>(0, w.H - 1)(rng);
        if (w.hbm_slot[std::size_t(page) * w.H + head] >= 0) page = resolve::kEmptySlot;
      }
      list.push_back(add_slot(page, head, false, page == resolve::kEmptySlot ? -1 : old_step(rng)));
    }
    std::shuffle(list.begin(), list.end(), rng);
    w.part_slots.insert(w.part_slots.end(), list.begin(), list.end());
    w.part_indptr.push_back(int32_t(w.part_slots.size()));
  }
  return w;
}

struct Selection {
  std::vector<int32_t> indptr, count, pages;
};

// Up to `budget` random pages per row plus the tail, ascending; rows get
// spare capacity past their count, filled with junk the call must ignore.
Selection MakeSelection(const World& w, int budget, std::mt19937& rng) {
  Selection s;
  s.indptr.push_back(0);
  for (int b = 0; b < w.B; ++b) {
    const int n = w.page_indptr[b + 1] - w.page_indptr[b];
    for (int h = 0; h < w.H; ++h) {
      std::set<int> chosen{n - 1};
      const int k = std::uniform_int_distribution<int>(0, std::min(budget, n - 1))(rng);
      while (int(chosen.size()) < k + 1) chosen.insert(std::uniform_int_distribution<int>(0, n - 2)(rng));
      s.pages.insert(s.pages.end(), chosen.begin(), chosen.end());
      const int spare = std::uniform_int_distribution<int>(0, 2)(rng);
      for (int i = 0; i < spare; ++i) s.pages.push_back(n + 1000);  // out of range: must not be read
      s.count.push_back(int32_t(chosen.size()));
      s.indptr.push_back(int32_t(s.pages.size()));
    }
  }
  return s;
}

struct Outcome {
  std::vector<int32_t> out_slots, out_count;
  std::vector<Request> cold, bypass;
  int32_t cold_count = 0, bypass_count = 0;
  Counters counters{};
};

Outcome RunTwin(World& w, const Selection& s, int64_t step, bool strict, int queue_capacity, Counters counters) {
  Outcome o;
  o.out_slots.assign(s.pages.size(), -7);
  o.out_count.assign(s.count.size(), -7);
  o.cold.resize(queue_capacity);
  o.bypass.resize(queue_capacity);
  o.counters = counters;
  ResolveCpuParams p;
  p.batch = w.B;
  p.kv_heads = w.H;
  p.piece_bytes = w.piece;
  p.step = step;
  p.strict = strict;
  p.page_indptr = w.page_indptr.data();
  p.page_ids = w.page_ids.data();
  p.sel_indptr = s.indptr.data();
  p.sel_count = s.count.data();
  p.sel_pages = s.pages.data();
  p.host_addr = w.host_addr.data();
  p.hbm_slot = w.hbm_slot.data();
  p.slot_page = w.slot_page.data();
  p.slot_head = w.slot_head.data();
  p.slot_last_use = w.last_use.data();
  p.slot_pinned = w.pinned.data();
  p.part_indptr = w.part_indptr.data();
  p.part_slots = w.part_slots.data();
  p.slots = w.pool.data();
  p.out_slots = o.out_slots.data();
  p.out_count = o.out_count.data();
  p.cold = o.cold.data();
  p.cold_count = &o.cold_count;
  p.bypass = o.bypass.data();
  p.bypass_count = &o.bypass_count;
  p.queue_capacity = queue_capacity;
  p.counters = &o.counters;
  ResolveCpu(p);
  o.cold.resize(std::min(o.cold_count, queue_capacity));
  o.bypass.resize(std::min(o.bypass_count, queue_capacity));
  return o;
}

// The model: the same rule, written as directly as possible.
Outcome RunModel(World& w, const Selection& s, int64_t step, bool strict, int queue_capacity, Counters c) {
  Outcome o;
  o.out_slots.assign(s.pages.size(), -7);
  o.counters = c;
  const int H = w.H, rows = w.B * H;
  using Key = std::pair<uint32_t, int>;
  std::map<Key, int32_t> resident;
  for (int32_t sl = 0; sl < w.slots(); ++sl)
    if (w.slot_page[sl] != resolve::kEmptySlot) resident[{w.slot_page[sl], w.slot_head[sl]}] = sl;
  struct Entry {
    int row, e;
    uint32_t page;
    int kind;  // 0 hit, 1 cold, 2 miss
  };
  std::vector<Entry> entries;
  std::map<Key, int> owner;  // first entry to miss each head-page
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < s.count[r]; ++i) {
      const int e = s.indptr[r] + i;
      const int b = r / H;
      const uint32_t page = w.page_ids[w.page_indptr[b] + s.pages[e]];
      const Key key{page, r % H};
      int kind = 2;
      if (resident.count(key)) {
        kind = 0;
        w.last_use[resident[key]] = step;
      } else if (!w.host_addr[page]) {
        kind = 1;
      } else if (!owner.count(key)) {
        owner[key] = e;
      }
      entries.push_back({r, e, page, kind});
    }
  for (int b = 0; b < w.B; ++b) {
    std::vector<Entry> mine;
    for (const Entry& x : entries)
      if (x.row / H == b && x.kind == 2 && owner[{x.page, x.row % H}] == x.e) mine.push_back(x);
    std::vector<int32_t> list(w.part_slots.begin() + w.part_indptr[b], w.part_slots.begin() + w.part_indptr[b + 1]);
    std::vector<int32_t> victims;
    for (int32_t sl : list)
      if (!w.pinned[sl] && w.last_use[sl] != step) victims.push_back(sl);
    for (std::size_t k = 0; k < mine.size() && k < victims.size(); ++k) {
      const int32_t sl = victims[k];
      const Key key{mine[k].page, mine[k].row % H};
      if (w.slot_page[sl] != resolve::kEmptySlot) {
        resident.erase({w.slot_page[sl], w.slot_head[sl]});
        w.hbm_slot[std::size_t(w.slot_page[sl]) * H + w.slot_head[sl]] = -1;
        ++o.counters.evictions;
      }
      resident[key] = sl;
      w.hbm_slot[std::size_t(key.first) * H + key.second] = sl;
      w.slot_page[sl] = key.first;
      w.slot_head[sl] = key.second;
      w.last_use[sl] = step;
      for (int kv = 0; kv < 2; ++kv)
        std::copy_n(w.TrueBytes(key.first, key.second, kv), w.piece, w.pool.data() + (std::size_t(sl) * 2 + kv) * w.piece);
      o.counters.bytes_host_to_hbm += 2 * w.piece;
    }
    if (mine.empty()) continue;  // nothing placed: the list is left as it is
    std::stable_partition(list.begin(), list.end(), [&](int32_t sl) { return w.last_use[sl] != step; });
    std::copy(list.begin(), list.end(), w.part_slots.begin() + w.part_indptr[b]);
  }
  o.out_count.assign(rows, 0);
  for (const Entry& x : entries) {
    const Request req{x.page, x.row % H, x.row, x.e};
    ++o.counters.selected;
    if (x.kind == 1) {
      ++o.counters.misses_disk;
      ++(strict ? o.counters.cold_stalls : o.counters.pages_skipped);
      o.cold.push_back(req);
      continue;
    }
    ++(x.kind == 0 ? o.counters.hits : o.counters.misses_host);
    auto it = resident.find({x.page, x.row % H});
    if (it == resident.end()) {
      ++o.counters.bypasses;
      o.bypass.push_back(req);
      continue;
    }
    o.out_slots[s.indptr[x.row] + o.out_count[x.row]++] = it->second;
  }
  o.cold_count = int32_t(o.cold.size());
  o.bypass_count = int32_t(o.bypass.size());
  for (auto* q : {&o.cold, &o.bypass}) {
    if (int(q->size()) > queue_capacity) {
      o.counters.queue_overflows += q->size() - queue_capacity;
      q->resize(queue_capacity);
    }
  }
  return o;
}

bool SameRequests(const std::vector<Request>& a, const std::vector<Request>& b) {
  auto key = [](const Request& r) { return std::tie(r.page, r.head, r.row, r.entry); };
  return a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin(), [&](const Request& x, const Request& y) { return key(x) == key(y); });
}

bool SameCounters(const Counters& a, const Counters& b) { return std::memcmp(&a, &b, sizeof(Counters)) == 0; }

void CheckInvariants(const World& w, const World& before, const Selection& s, const Outcome& o) {
  // Residency is a bijection between cells >= 0 and occupied slots.
  for (int64_t sl = 0; sl < w.slots(); ++sl)
    if (w.slot_page[sl] != resolve::kEmptySlot) {
      ASSERT_EQ(w.hbm_slot[std::size_t(w.slot_page[sl]) * w.H + w.slot_head[sl]], sl);
    }
  for (std::size_t c = 0; c < w.hbm_slot.size(); ++c) {
    const int32_t sl = w.hbm_slot[c];
    if (sl < 0) continue;
    ASSERT_EQ(std::size_t(w.slot_page[sl]) * w.H + w.slot_head[sl], c);
  }
  // Tails never move.
  for (int64_t sl = 0; sl < w.slots(); ++sl)
    if (w.pinned[sl]) {
      ASSERT_EQ(w.slot_page[sl], before.slot_page[sl]);
    }
  // Each list is a permutation of the one before.
  for (int b = 0; b < w.B; ++b) {
    std::vector<int32_t> x(w.part_slots.begin() + w.part_indptr[b], w.part_slots.begin() + w.part_indptr[b + 1]);
    std::vector<int32_t> y(before.part_slots.begin() + w.part_indptr[b], before.part_slots.begin() + w.part_indptr[b + 1]);
    std::sort(x.begin(), x.end());
    std::sort(y.begin(), y.end());
    ASSERT_EQ(x, y);
  }
  // Every slot handed to attention holds its head-page's true bytes, and each
  // used entry is attended, cold or bypassed.
  int64_t accounted = 0;
  for (int r = 0; r < w.B * w.H; ++r) {
    accounted += o.out_count[r];
    int j = 0;
    for (int i = 0; i < s.count[r] && j < o.out_count[r]; ++i) {
      const int e = s.indptr[r] + i;
      const uint32_t page = w.page_ids[w.page_indptr[r / w.H] + s.pages[e]];
      if (w.hbm_slot[std::size_t(page) * w.H + r % w.H] < 0) continue;  // cold or bypass
      const int32_t sl = o.out_slots[s.indptr[r] + j++];
      ASSERT_EQ(w.slot_page[sl], page);
      for (int kv = 0; kv < 2; ++kv)
        ASSERT_EQ(0, std::memcmp(w.pool.data() + (std::size_t(sl) * 2 + kv) * w.piece, w.TrueBytes(page, r % w.H, kv), w.piece))
            << "row " << r << " entry " << e;
    }
    ASSERT_EQ(j, o.out_count[r]);
  }
  EXPECT_EQ(accounted + o.cold_count + o.bypass_count, std::accumulate(s.count.begin(), s.count.end(), int64_t(0)));
}

class ResolveCpuTest : public ::testing::TestWithParam<Case> {};

TEST_P(ResolveCpuTest, MatchesModelOverSteps) {
  const Case c = GetParam();
  for (uint64_t seed : {1u, 2u, 3u}) {
    std::mt19937 rng(uint32_t(seed * 7919 + c.batch));
    World twin = MakeWorld(c, rng);
    World model = twin;
    Counters ct{}, cm{};
    for (int64_t step = 0; step < 6; ++step) {
      SCOPED_TRACE(::testing::Message() << "seed " << seed << " step " << step);
      const Selection s = MakeSelection(twin, c.budget, rng);
      const bool strict = step % 2 == 1;
      const int cap = int(step % 3 == 2 ? 3 : s.pages.size());  // small queues overflow
      const World before = twin;
      const Outcome a = RunTwin(twin, s, step, strict, cap, ct);
      const Outcome b = RunModel(model, s, step, strict, cap, cm);
      ct = a.counters;
      cm = b.counters;
      ASSERT_EQ(twin.hbm_slot, model.hbm_slot);
      ASSERT_EQ(twin.slot_page, model.slot_page);
      ASSERT_EQ(twin.slot_head, model.slot_head);
      ASSERT_EQ(twin.last_use, model.last_use);
      ASSERT_EQ(twin.part_slots, model.part_slots);
      ASSERT_EQ(twin.pool, model.pool);
      ASSERT_EQ(a.out_count, b.out_count);
      for (int r = 0; r < twin.B * twin.H; ++r)
        for (int j = 0; j < a.out_count[r]; ++j) ASSERT_EQ(a.out_slots[s.indptr[r] + j], b.out_slots[s.indptr[r] + j]);
      ASSERT_EQ(a.cold_count, b.cold_count);
      ASSERT_EQ(a.bypass_count, b.bypass_count);
      ASSERT_TRUE(SameRequests(a.cold, b.cold));
      ASSERT_TRUE(SameRequests(a.bypass, b.bypass));
      ASSERT_TRUE(SameCounters(a.counters, b.counters));
      CheckInvariants(twin, before, s, a);
      EXPECT_EQ(a.counters.selected, a.counters.hits + a.counters.misses_host + a.counters.misses_disk);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, ResolveCpuTest,
    ::testing::Values(
        Case{1, 1, 16, 5, 2, 3, 0.0, 0},        // tiny partition: most misses bypass
        Case{3, 2, 48, 17, 6, 9, 0.2, 4},      // odd sizes, shared prefix, cold pages
        Case{7, 3, 60, 23, 40, 12, 0.1, 8},    // piece not a multiple of 16 (CPU only)
        Case{2, 4, 256, 40, 0, 20, 0.0, 10},   // no cache slots: every host miss bypasses
        Case{4, 1, 4096, 64, 200, 32, 0.3, 16}, // roomy partitions, many cold
        Case{5, 2, 32, 9, 3, 8, 0.0, 8}));      // all of a partition selected: exhausted

// A partition whose every unpinned slot is selected this step cannot take a
// miss: the miss is a counted bypass and the tail stays.
TEST(ResolveCpu, ExhaustedPartitionBypassesAndKeepsTail) {
  const Case c{1, 1, 16, 4, 2, 4, 0.0, 0};
  std::mt19937 rng(5);
  World w = MakeWorld(c, rng);
  // Make pages 0 and 1 resident in the two cache slots, then select 0, 1, 2 and the tail.
  const int32_t tail_slot = int32_t(std::find(w.pinned.begin(), w.pinned.end(), 1) - w.pinned.begin());
  int k = 0;
  for (int32_t sl = 0; sl < w.slots(); ++sl) {
    if (w.pinned[sl]) continue;
    if (w.slot_page[sl] != resolve::kEmptySlot) w.hbm_slot[w.slot_page[sl]] = -1;
    const uint32_t page = w.page_ids[k++];
    w.slot_page[sl] = page;
    w.slot_head[sl] = 0;
    w.hbm_slot[page] = sl;
    std::copy_n(w.TrueBytes(page, 0, 0), 16, w.pool.data() + sl * 32);
    std::copy_n(w.TrueBytes(page, 0, 1), 16, w.pool.data() + sl * 32 + 16);
  }
  Selection s{{0, 4}, {4}, {0, 1, 2, 3}};
  const Outcome o = RunTwin(w, s, 10, false, 8, Counters{});
  EXPECT_EQ(o.out_count[0], 3);
  EXPECT_EQ(o.bypass_count, 1);
  ASSERT_EQ(o.bypass.size(), 1u);
  EXPECT_EQ(o.bypass[0].page, w.page_ids[2]);
  EXPECT_EQ(o.bypass[0].entry, 2);
  EXPECT_EQ(o.counters.bypasses, 1u);
  EXPECT_EQ(o.counters.evictions, 0u);
  EXPECT_EQ(w.slot_page[tail_slot], w.page_ids[3]);
  EXPECT_EQ(w.hbm_slot[w.page_ids[2]], -1);
}

}  // namespace
}  // namespace questkv::kernels
