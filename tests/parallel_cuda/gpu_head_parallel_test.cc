// GpuDecoder, head parallel, over 1-3 threaded ranks (InProcessGroup, ranks
// sharing the GPUs there are) against the single-rank Selector + CPU
// attention: each rank's selection rows equal the Selector's for its heads,
// every rank holds every query head's output within 2e-3, over GQA groups
// 1/4/8, the three GQA modes, balanced and given head splits, and the same
// ragged batch as the context-parallel suite. Skipped without a GPU.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/parallel_cuda/gpu_decode_test_util.h"

namespace questkv {
namespace {

struct Case {
  int kv_heads, group, head_dim, page_size;
  GqaMode mode;
  int ranks;
  std::vector<int> counts;  // empty: balanced
};

class GpuHeadTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override { QKV_REQUIRE_GPU(); }
};

TEST_P(GpuHeadTest, MatchesSingleRank) {
  const Case& c = GetParam();
  const Geometry g = test::MakeGeometry(c.kv_heads, c.group, c.page_size, c.head_dim);
  GpuDecodeOptions o;
  o.mode = GpuParallelMode::kHead;
  o.head_counts = c.counts;
  test::ExpectLayersMatch(test::MakeGpuBatch(g, test::OddLengths(c.page_size), 91),
                          test::MakePolicy(10, 1, 2, c.mode, g.page_size), o, c.ranks);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuHeadTest,
                         ::testing::Values(Case{2, 1, 64, 8, GqaMode::kMax, 1, {}},
                                           Case{2, 4, 64, 8, GqaMode::kMax, 2, {}},
                                           Case{3, 4, 64, 16, GqaMode::kMean, 2, {}},
                                           Case{8, 4, 128, 16, GqaMode::kUnion, 2, {5, 3}},
                                           Case{4, 8, 64, 8, GqaMode::kMax, 3, {1, 2, 1}},
                                           Case{1, 8, 128, 32, GqaMode::kMean, 1, {}}));

TEST(GpuHeadErrors, MoreRanksThanHeads) {
  QKV_REQUIRE_GPU();
  const Geometry g = test::MakeGeometry(2, 4, 16, 64);
  const SelectionPolicy p = test::MakePolicy(10, 1, 2, GqaMode::kMax, g.page_size);
  GpuDecodeOptions o;
  o.mode = GpuParallelMode::kHead;
  const std::vector<GpuSequence> seqs = {{4, 3}};
  EXPECT_EQ(GpuDecoder::Create(g, p, o, 3, 0, seqs).status().code(), Code::kInvalidArgument);
  o.head_counts = {1, 2};
  EXPECT_EQ(GpuDecoder::Create(g, p, o, 2, 0, seqs).status().code(), Code::kInvalidArgument);
}

// Without the selection read back (the benchmark's setting) the outputs are
// the same and the selection rows are left empty.
TEST(GpuHeadOptions, SelectionStaysOnTheDevice) {
  QKV_REQUIRE_GPU();
  const Geometry g = test::MakeGeometry(2, 4, 16, 64);
  const test::GpuBatch batch = test::MakeGpuBatch(g, {{50, 9}}, 4);
  const SelectionPolicy p = test::MakePolicy(10, 1, 2, GqaMode::kMax, g.page_size);
  GpuDecodeOptions o;
  o.mode = GpuParallelMode::kHead;
  const test::GpuRun with = test::RunInProcess(batch, p, o, 2, 1);
  o.selection_to_host = false;
  const test::GpuRun without = test::RunInProcess(batch, p, o, 2, 1);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(with.statuses[r].ok() && without.statuses[r].ok());
    EXPECT_EQ(without.outs[r][0].o, with.outs[r][0].o);
    EXPECT_TRUE(without.outs[r][0].selection.pages.empty());
    EXPECT_EQ(without.outs[r][0].selection.indptr.size(), 1u);
  }
}

}  // namespace
}  // namespace questkv
