// ShardPages / LocalPageIndex: every page owned by exactly one rank, in
// ascending order, at the index LocalPageIndex names; SplitHeads: contiguous
// ranges covering every KV head, and clear errors for impossible splits.
#include "parallel/shard.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

namespace questkv {
namespace {

TEST(ShardPages, EveryPageHasExactlyOneOwner) {
  for (ShardLayout layout : {ShardLayout::kContiguous, ShardLayout::kRoundRobin})
    for (int ranks : {1, 2, 3, 4, 8})
      for (int n : {0, 1, 2, 3, 7, 8, 9, 64, 101}) {
        std::vector<int> owner(n, -1);
        for (int r = 0; r < ranks; ++r) {
          const std::vector<int32_t> pages = ShardPages(layout, n, ranks, r).value();
          EXPECT_TRUE(std::is_sorted(pages.begin(), pages.end()));
          // Balanced within one page.
          EXPECT_LE(int(pages.size()), (n + ranks - 1) / ranks);
          EXPECT_GE(int(pages.size()), n / ranks);
          for (int i = 0; i < int(pages.size()); ++i) {
            ASSERT_EQ(owner[pages[i]], -1) << "page " << pages[i] << " owned twice";
            owner[pages[i]] = r;
            EXPECT_EQ(LocalPageIndex(layout, n, ranks, r, pages[i]), i);
          }
        }
        for (int p = 0; p < n; ++p) {
          ASSERT_GE(owner[p], 0) << "page " << p << " of " << n << " unowned";
          for (int r = 0; r < ranks; ++r)
            if (r != owner[p]) {
              EXPECT_EQ(LocalPageIndex(layout, n, ranks, r, p), -1);
            }
        }
      }
}

TEST(ShardPages, RejectsBadArguments) {
  EXPECT_EQ(ShardPages(ShardLayout::kContiguous, 10, 0, 0).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(ShardPages(ShardLayout::kContiguous, 10, 2, 2).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(ShardPages(ShardLayout::kRoundRobin, 10, 2, -1).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(ShardPages(ShardLayout::kRoundRobin, -1, 2, 0).status().code(), Code::kInvalidArgument);
}

TEST(SplitHeads, BalancedContiguousRanges) {
  const std::vector<HeadRange> r = SplitHeads(8, 3).value();
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].first, 0);
  EXPECT_EQ(r[0].count, 3);
  EXPECT_EQ(r[1].first, 3);
  EXPECT_EQ(r[1].count, 3);
  EXPECT_EQ(r[2].first, 6);
  EXPECT_EQ(r[2].count, 2);
  const std::vector<HeadRange> one = SplitHeads(5, 5).value();
  for (int i = 0; i < 5; ++i) EXPECT_EQ(one[i].first, i);
}

TEST(SplitHeads, ExplicitCounts) {
  const std::vector<int> counts = {1, 4, 3};
  const std::vector<HeadRange> r = SplitHeads(8, 3, counts).value();
  EXPECT_EQ(r[1].first, 1);
  EXPECT_EQ(r[2].first, 5);
  EXPECT_EQ(r[2].count, 3);
}

TEST(SplitHeads, RejectsImpossibleSplits) {
  EXPECT_EQ(SplitHeads(8, 0).status().code(), Code::kInvalidArgument);
  const Status more = SplitHeads(2, 3).status();
  EXPECT_EQ(more.code(), Code::kInvalidArgument);
  EXPECT_NE(more.message().find("3 ranks for 2 KV heads"), std::string::npos) << more.ToString();
  const std::vector<int> short_counts = {4, 3};
  EXPECT_EQ(SplitHeads(8, 3, short_counts).status().code(), Code::kInvalidArgument);
  const std::vector<int> wrong_sum = {4, 3, 2};
  EXPECT_EQ(SplitHeads(8, 3, wrong_sum).status().code(), Code::kInvalidArgument);
  const std::vector<int> zero = {8, 0, 0};
  EXPECT_EQ(SplitHeads(8, 3, zero).status().code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace questkv
