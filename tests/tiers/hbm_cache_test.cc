// HbmCache against a plain model of its rules: segmented LRU within a
// partition (slots hit since filled protected, up to 3/4 of it), a fair
// share per partition, nothing used this step or pinned is evicted.
#include "tiers/hbm_cache.h"

#include <gtest/gtest.h>

#include <map>
#include <random>

namespace questkv {
namespace {

std::unique_ptr<HbmCache> Make(uint32_t slots, int heads = 1) {
  auto c = HbmCache::Create(slots, 8, 256, heads);
  EXPECT_TRUE(c.ok());
  return std::move(*c);
}

TEST(HbmCache, EvictsLeastRecentlyUsedWithinAPartition) {
  auto c = Make(3);
  const uint32_t p = c->AddPartition();
  for (uint32_t page = 0; page < 3; ++page) ASSERT_TRUE(c->Insert(page, 0, p, page, false).ok());
  c->Touch(c->Lookup(0, 0), 5);  // page 0 becomes most recent; page 1 is now the LRU
  ASSERT_TRUE(c->Insert(3, 0, p, 6, false).ok());
  EXPECT_EQ(c->Lookup(1, 0), HbmCache::kNone);
  EXPECT_NE(c->Lookup(0, 0), HbmCache::kNone);
  EXPECT_NE(c->Lookup(2, 0), HbmCache::kNone);
  EXPECT_EQ(c->stats().evictions, 1);
}

// A one-off burst of pages (a topic query) displaces itself, not the pages
// the recent queries hit again — which LRU would evict first (they are older).
TEST(HbmCache, HitSlotsOutliveAOneOffBurst) {
  auto c = Make(4);
  const uint32_t p = c->AddPartition();
  ASSERT_TRUE(c->Insert(0, 0, p, 0, false).ok());
  ASSERT_TRUE(c->Insert(1, 0, p, 0, false).ok());
  c->Touch(c->Lookup(0, 0), 1);
  c->Touch(c->Lookup(1, 0), 1);
  ASSERT_TRUE(c->Insert(10, 0, p, 2, false).ok());
  ASSERT_TRUE(c->Insert(11, 0, p, 2, false).ok());
  for (uint32_t page = 12; page < 20; ++page) {
    ASSERT_TRUE(c->Insert(page, 0, p, int64_t(page) - 9, false).ok());  // steps 3..10
    EXPECT_EQ(c->Lookup(page - 2, 0), HbmCache::kNone) << page;          // the oldest fresh page went
    EXPECT_NE(c->Lookup(page - 1, 0), HbmCache::kNone) << page;
  }
  EXPECT_NE(c->Lookup(0, 0), HbmCache::kNone);
  EXPECT_NE(c->Lookup(1, 0), HbmCache::kNone);
  EXPECT_EQ(c->stats().evictions, 8);
}

// At most 3/4 of a partition is protected: past that, the least recently hit
// slot is unprotected again (the most recent of the unprotected). And a
// protected slot still goes when nothing else may (all else used this step).
TEST(HbmCache, ProtectedShareIsCappedAndNeverBlocksAnInsert) {
  auto c = Make(4);
  const uint32_t p = c->AddPartition();
  for (uint32_t page = 0; page < 4; ++page) ASSERT_TRUE(c->Insert(page, 0, p, 0, false).ok());
  for (uint32_t page = 0; page < 3; ++page) c->Touch(c->Lookup(page, 0), 1);  // 3 of 4 protected
  c->Touch(c->Lookup(3, 0), 2);  // a 4th: page 0, the least recently hit, is unprotected again
  ASSERT_TRUE(c->Insert(4, 0, p, 3, false).ok());
  EXPECT_EQ(c->Lookup(0, 0), HbmCache::kNone);
  for (uint32_t page = 1; page < 5; ++page) EXPECT_NE(c->Lookup(page, 0), HbmCache::kNone) << page;
  ASSERT_TRUE(c->Insert(5, 0, p, 4, false).ok());  // then the unprotected page 4 (page 1 is older)
  EXPECT_EQ(c->Lookup(4, 0), HbmCache::kNone);
  EXPECT_NE(c->Lookup(1, 0), HbmCache::kNone);

  auto d = Make(3);
  const uint32_t q = d->AddPartition();
  ASSERT_TRUE(d->Insert(0, 0, q, 0, false).ok());
  ASSERT_TRUE(d->Insert(1, 0, q, 0, false).ok());
  d->Touch(d->Lookup(0, 0), 1);                    // protected
  ASSERT_TRUE(d->Insert(2, 0, q, 2, false).ok());  // used at step 2
  d->Touch(d->Lookup(1, 0), 2);                    // used at step 2
  ASSERT_TRUE(d->Insert(3, 0, q, 2, false).ok());  // only the protected page 0 may go
  EXPECT_EQ(d->Lookup(0, 0), HbmCache::kNone);
  EXPECT_EQ(d->Insert(4, 0, q, 2, false).status().code(), Code::kResourceExhausted);
  for (uint32_t page = 1; page < 4; ++page) EXPECT_NE(d->Lookup(page, 0), HbmCache::kNone) << page;
}

TEST(HbmCache, NeverEvictsWhatThisStepUsedOrAPinnedTail) {
  auto c = Make(3);
  const uint32_t p = c->AddPartition();
  ASSERT_TRUE(c->Insert(0, 0, p, 1, true).ok());  // tail
  ASSERT_TRUE(c->Insert(1, 0, p, 7, false).ok());
  ASSERT_TRUE(c->Insert(2, 0, p, 7, false).ok());
  auto r = c->Insert(3, 0, p, 7, false);
  EXPECT_EQ(r.status().code(), Code::kResourceExhausted);
  EXPECT_NE(c->Lookup(0, 0), HbmCache::kNone);
  EXPECT_NE(c->Lookup(1, 0), HbmCache::kNone);
  EXPECT_NE(c->Lookup(2, 0), HbmCache::kNone);
  // Next step, page 1 (least recent) may go; the pinned tail never.
  ASSERT_TRUE(c->Insert(3, 0, p, 8, false).ok());
  EXPECT_EQ(c->Lookup(1, 0), HbmCache::kNone);
  EXPECT_NE(c->Lookup(0, 0), HbmCache::kNone);
}

TEST(HbmCache, OneLongPartitionCannotEvictAnothersShare) {
  auto c = Make(8);
  const uint32_t a = c->AddPartition(), b = c->AddPartition();
  for (uint32_t page = 0; page < 3; ++page) ASSERT_TRUE(c->Insert(100 + page, 0, b, 0, false).ok());
  // a streams many pages: it may fill its own share (4) and the free slot, but
  // b keeps at least its share (its 3 slots are under it).
  for (uint32_t page = 0; page < 40; ++page) ASSERT_TRUE(c->Insert(page, 0, a, 1 + page, false).ok());
  for (uint32_t page = 0; page < 3; ++page) EXPECT_NE(c->Lookup(100 + page, 0), HbmCache::kNone);
  EXPECT_LE(c->partition_slots(a), 5u);
  // b, under its share, takes back from a (over its share) instead of itself.
  ASSERT_TRUE(c->Insert(103, 0, b, 100, false).ok());
  for (uint32_t page = 0; page < 4; ++page) EXPECT_NE(c->Lookup(100 + page, 0), HbmCache::kNone);
  EXPECT_EQ(c->partition_slots(a), 4u);
}

TEST(HbmCache, DropAndUnpinKeepAccountingExact) {
  auto c = Make(4, 2);
  const uint32_t p = c->AddPartition();
  for (int h = 0; h < 2; ++h) ASSERT_TRUE(c->Insert(5, h, p, 0, true).ok());
  EXPECT_EQ(c->stats().slots_pinned, 2u);
  c->Unpin(c->Lookup(5, 0), 1);
  c->Unpin(c->Lookup(5, 1), 1);
  EXPECT_EQ(c->stats().slots_pinned, 0u);
  EXPECT_EQ(c->partition_slots(p), 2u);
  c->Drop(5);
  EXPECT_EQ(c->Lookup(5, 0), HbmCache::kNone);
  EXPECT_EQ(c->Lookup(5, 1), HbmCache::kNone);
  EXPECT_EQ(c->stats().slots_used, 0u);
  EXPECT_EQ(c->partition_slots(p), 0u);
  c->RemovePartition(p);
}

TEST(HbmCache, RandomOperationsKeepAccountingExact) {
  // Residency and slot counts stay exact under random inserts and touches.
  std::mt19937 rng(7);
  auto c = Make(16);
  std::vector<uint32_t> parts = {c->AddPartition(), c->AddPartition(), c->AddPartition()};
  int64_t step = 0;
  for (int i = 0; i < 3000; ++i) {
    if (i % 7 == 0) ++step;
    const uint32_t part = parts[rng() % parts.size()];
    const uint32_t page = part * 20 + rng() % 20;
    if (int32_t s = c->Lookup(page, 0); s != HbmCache::kNone) {
      c->Touch(s, step);
      continue;
    }
    auto r = c->Insert(page, 0, part, step, false);
    if (r.ok()) {
      EXPECT_EQ(c->Lookup(page, 0), *r);
    }
    uint32_t total = 0;
    for (uint32_t p : parts) total += c->partition_slots(p);
    ASSERT_EQ(total, c->stats().slots_used);
    ASSERT_LE(c->stats().slots_used, 16u);
  }
}

// The segmented-LRU rule as a plain model: every cached head-page with its
// last use, protected flag and a recency stamp (renewed when it enters a
// list's most recent end); victims by the smallest stamp among unprotected,
// then protected, slots not used this step. Random steps of selections over
// one partition must evict exactly what the model evicts.
TEST(HbmCache, SegmentedLruMatchesAPlainModel) {
  constexpr uint32_t kSlots = 16, kPages = 40;
  struct Entry {
    int64_t last = 0, stamp = 0;
    bool guarded = false;
  };
  for (uint32_t seed : {1u, 2u, 3u}) {
    std::mt19937 rng(seed);
    auto c = Make(kSlots);
    const uint32_t p = c->AddPartition();
    std::map<uint32_t, Entry> model;
    int64_t clock = 0;
    auto victim = [&](int64_t step) -> int64_t {
      for (const bool guarded : {false, true}) {
        int64_t best = -1, best_stamp = 0;
        for (const auto& [page, e] : model)
          if (e.guarded == guarded && (best < 0 || e.stamp < best_stamp)) best = page, best_stamp = e.stamp;
        // The list's oldest must be evictable, else none of that list is tried.
        if (best >= 0 && model[uint32_t(best)].last < step) return best;
      }
      return -1;
    };
    for (int64_t step = 0; step < 400; ++step) {
      const int n = 1 + int(rng() % (kSlots / 2));
      for (int i = 0; i < n; ++i) {
        const uint32_t page = rng() % kPages;
        SCOPED_TRACE(::testing::Message() << "seed " << seed << " step " << step << " page " << page);
        if (auto it = model.find(page); it != model.end()) {
          ASSERT_NE(c->Lookup(page, 0), HbmCache::kNone);
          c->Touch(c->Lookup(page, 0), step);
          it->second.last = step;
          it->second.guarded = true;
          it->second.stamp = ++clock;
          int guarded = 0;
          for (const auto& [q, e] : model) guarded += e.guarded;
          if (guarded * 4 > int(kSlots) * 3) {  // the least recently hit is unprotected again
            Entry* oldest = nullptr;
            for (auto& [q, e] : model)
              if (e.guarded && (!oldest || e.stamp < oldest->stamp)) oldest = &e;
            oldest->guarded = false;
            oldest->stamp = ++clock;
          }
          continue;
        }
        const auto got = c->Insert(page, 0, p, step, false);
        if (model.size() == kSlots) {
          const int64_t v = victim(step);
          ASSERT_EQ(got.ok(), v >= 0);
          if (v < 0) continue;
          model.erase(uint32_t(v));
          EXPECT_EQ(c->Lookup(uint32_t(v), 0), HbmCache::kNone) << "victim " << v;
        } else {
          ASSERT_TRUE(got.ok());
        }
        model[page] = Entry{step, ++clock, false};
      }
      for (uint32_t page = 0; page < kPages; ++page)
        ASSERT_EQ(c->Lookup(page, 0) != HbmCache::kNone, model.count(page) == 1) << "page " << page;
    }
  }
}

}  // namespace
}  // namespace questkv
