// RerankCandidates: the re-rank's candidate count, one definition for the
// CPU selector, the CUDA widened select and both backends' byte counts.
#include "core/constants.h"

#include <gtest/gtest.h>

#include <cstdint>

namespace questkv {
namespace {

TEST(RerankCandidates, IsTheCeilingOfRerankTimesKWithinThePagesLeft) {
  EXPECT_EQ(RerankCandidates(2.0, 10, 100), 20);
  EXPECT_EQ(RerankCandidates(1.5, 3, 100), 5);   // ceil(4.5)
  EXPECT_EQ(RerankCandidates(1.0, 7, 100), 7);   // c = 1: the budget itself
  EXPECT_EQ(RerankCandidates(2.0, 10, 15), 15);  // no more than the pages beyond sink and local
  EXPECT_EQ(RerankCandidates(1e6, 5, 7), 7);
}

TEST(RerankCandidates, IsZeroWhenOffOrWhenNothingIsRanked) {
  EXPECT_EQ(RerankCandidates(0.0, 10, 100), 0);  // off: plain Quest
  EXPECT_EQ(RerankCandidates(2.0, 0, 100), 0);   // the budget is all sink and local
  EXPECT_EQ(RerankCandidates(2.0, -3, 100), 0);
  EXPECT_EQ(RerankCandidates(2.0, 10, 0), 0);    // every page is sink or local
}

}  // namespace
}  // namespace questkv
