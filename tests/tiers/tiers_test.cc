#include <gtest/gtest.h>

#include <set>

#include "tiers/arena.h"
#include "tiers/page_allocator.h"
#include "tiers/page_table.h"

namespace questkv {
namespace {

TEST(PageAllocator, RefcountsGenerationsAndBound) {
  PageAllocator a(3);
  std::set<PageId> ids;
  for (int i = 0; i < 3; ++i) ids.insert(*a.Allocate());
  EXPECT_EQ(ids.size(), 3u);
  EXPECT_EQ(a.Allocate().status().code(), Code::kResourceExhausted);
  const PageId id = *ids.begin();
  a.Ref(id);
  EXPECT_EQ(a.refcount(id), 2u);
  EXPECT_FALSE(a.Unref(id));
  const uint32_t gen = a.generation(id);
  EXPECT_TRUE(a.Unref(id));
  EXPECT_FALSE(a.live(id));
  EXPECT_EQ(a.generation(id), gen + 1);
  EXPECT_EQ(a.live_count(), 2u);
  EXPECT_EQ(*a.Allocate(), id);  // reused
}

TEST(SlotArena, BoundedSlotsAndPeak) {
  auto arena = SlotArena::Create(10, 2, "test");
  ASSERT_TRUE(arena.ok());
  auto s0 = (*arena)->Allocate(), s1 = (*arena)->Allocate();
  ASSERT_TRUE(s0.ok() && s1.ok());
  EXPECT_NE(*s0, *s1);
  EXPECT_EQ((*arena)->data(*s1) - (*arena)->data(*s0), *s1 > *s0 ? 10 : -10);
  auto s2 = (*arena)->Allocate();
  EXPECT_EQ(s2.status().code(), Code::kResourceExhausted);
  (*arena)->Free(*s0);
  EXPECT_EQ((*arena)->used(), 1u);
  EXPECT_EQ((*arena)->used_peak(), 2u);
  EXPECT_TRUE((*arena)->Allocate().ok());
  EXPECT_EQ(SlotArena::Create(0, 2, "x").status().code(), Code::kInvalidArgument);
}

TEST(PageTableCsr, FlattensListsWithLastPageLengths) {
  PageList a{{5, 6, 7}, 2 * 4 + 1}, b{{9}, 4}, c{{1, 2}, 5};
  PageTableCsr csr;
  csr.Assign({&a, &b, &c}, 4);
  EXPECT_EQ(csr.indptr, (std::vector<int32_t>{0, 3, 4, 6}));
  EXPECT_EQ(csr.indices, (std::vector<uint32_t>{5, 6, 7, 9, 1, 2}));
  EXPECT_EQ(csr.last_page_len, (std::vector<int32_t>{1, 4, 1}));
  EXPECT_EQ(csr.num_pages(2), 2);
  EXPECT_EQ(csr.pages(1)[0], 9u);
  EXPECT_EQ(a.sealed_pages(4), 2);
  EXPECT_EQ(b.sealed_pages(4), 1);
}

}  // namespace
}  // namespace questkv
