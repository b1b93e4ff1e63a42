// GpuDecoder, context parallel, over 1-3 threaded ranks (InProcessGroup; the
// ranks share the GPUs there are, so this runs on a one-GPU machine) against
// the single-rank Selector + CPU attention: the same selections bit for bit,
// outputs within 2e-3, over GQA groups 1/4/8, the three GQA modes, both shard
// layouts, a ragged batch holding one page, fewer pages than ranks, partial
// tails and budgets below and above the page count, a dense layer, and tied
// scores. Skipped without a GPU.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "tests/parallel_cuda/gpu_decode_test_util.h"

namespace questkv {
namespace {

struct Case {
  int kv_heads, group, head_dim, page_size;
  GqaMode mode;
  ShardLayout layout;
  int ranks;
};

std::string Name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  const char* modes[] = {"max", "mean", "union"};
  char name[96];
  std::snprintf(name, sizeof name, "h%dg%dd%ds%d_%s_%s_r%d", c.kv_heads, c.group, c.head_dim, c.page_size,
                modes[int(c.mode)], c.layout == ShardLayout::kContiguous ? "contig" : "rr", c.ranks);
  return name;
}

class GpuContextTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override { QKV_REQUIRE_GPU(); }
};

TEST_P(GpuContextTest, MatchesSingleRank) {
  const Case c = GetParam();
  const Geometry g = test::MakeGeometry(c.kv_heads, c.group, c.page_size, c.head_dim);
  GpuDecodeOptions o;
  o.mode = GpuParallelMode::kContext;
  o.layout = c.layout;
  test::ExpectLayersMatch(test::MakeGpuBatch(g, test::OddLengths(c.page_size), 77),
                          test::MakePolicy(10, 1, 2, c.mode, g.page_size), o, c.ranks);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuContextTest,
                         ::testing::Values(Case{2, 1, 64, 8, GqaMode::kMax, ShardLayout::kContiguous, 1},
                                           Case{2, 1, 64, 8, GqaMode::kMax, ShardLayout::kContiguous, 2},
                                           Case{2, 4, 64, 16, GqaMode::kMean, ShardLayout::kRoundRobin, 2},
                                           Case{1, 8, 128, 8, GqaMode::kUnion, ShardLayout::kContiguous, 2},
                                           Case{2, 4, 64, 16, GqaMode::kUnion, ShardLayout::kRoundRobin, 3},
                                           Case{8, 4, 128, 16, GqaMode::kMax, ShardLayout::kContiguous, 2},
                                           Case{3, 4, 64, 8, GqaMode::kMax, ShardLayout::kRoundRobin, 2},
                                           Case{2, 8, 64, 8, GqaMode::kMean, ShardLayout::kContiguous, 1},
                                           Case{1, 4, 256, 32, GqaMode::kMean, ShardLayout::kContiguous, 2}),
                         Name);

// Whole pages repeat, so scores tie across ranks: the winners must still be
// the lower pages, as TopKCpu breaks ties.
TEST(GpuContextTies, TiesGoToTheLowerPage) {
  QKV_REQUIRE_GPU();
  const Geometry g = test::MakeGeometry(2, 4, 8, 64);
  const test::GpuBatch batch = test::MakeGpuBatch(g, {{90, 4}, {41, 8}}, 5, /*patterns=*/3);
  for (GqaMode mode : {GqaMode::kMax, GqaMode::kUnion})
    for (ShardLayout layout : {ShardLayout::kContiguous, ShardLayout::kRoundRobin}) {
      const SelectionPolicy p = test::MakePolicy(12, 1, 2, mode, g.page_size);
      GpuDecodeOptions o;
      o.layout = layout;
      const test::GpuRun run = test::RunInProcess(batch, p, o, 2, 1);
      test::ExpectMatches(batch, test::References(batch, p, 1), run,
                          "mode " + std::to_string(int(mode)) + " layout " + std::to_string(int(layout)));
    }
}

// Two ranks against one: the same selection, outputs within 2e-3 of each
// other, and several steps on one decoder give the same bits.
TEST(GpuContextSteps, TwoRanksAgreeWithOneAndRepeat) {
  QKV_REQUIRE_GPU();
  const Geometry g = test::MakeGeometry(2, 4, 16, 64);
  const test::GpuBatch batch = test::MakeGpuBatch(g, {{300, 7}}, 11);
  const SelectionPolicy p = test::MakePolicy(20, 1, 4, GqaMode::kMax, g.page_size);
  const GpuDecodeOptions o;
  const test::GpuRun one = test::RunInProcess(batch, p, o, 1, 1);
  const test::GpuRun two = test::RunInProcess(batch, p, o, 2, 1);
  ASSERT_TRUE(one.statuses[0].ok()) << one.statuses[0].ToString();
  ASSERT_TRUE(two.statuses[0].ok()) << two.statuses[0].ToString();
  EXPECT_EQ(test::Rows(two.outs[0][0].selection, 0, 2), test::Rows(one.outs[0][0].selection, 0, 2));
  for (int h = 0; h < g.q_heads; ++h)
    EXPECT_LE(test::RelL2Error(two.outs[0][0].o.data() + h * g.head_dim, one.outs[0][0].o.data() + h * g.head_dim,
                               g.head_dim),
              2e-3);
  auto group = InProcessGroup::Create(2).value();
  const std::vector<Status> st = group->Run([&](Communicator& comm) {
    QKV_ASSIGN_OR_RETURN(auto decoder, GpuDecoder::Create(g, p, o, 2, comm.rank(), batch.shapes));
    QKV_RETURN_IF_ERROR(decoder->LoadSequence(0, batch.seqs[0].page_ptrs.data()));
    std::vector<ParallelDecodeOutput> first, again;
    QKV_RETURN_IF_ERROR(decoder->Decode(comm, batch.q.data(), 1, test::Scale(g), &first));
    QKV_RETURN_IF_ERROR(decoder->Decode(comm, batch.q.data(), 0, test::Scale(g), &again));
    QKV_RETURN_IF_ERROR(decoder->Decode(comm, batch.q.data(), 1, test::Scale(g), &again));
    if (again[0].o != first[0].o || again[0].selection.pages != first[0].selection.pages)
      return Status::Internal("a repeated step differs");
    if (decoder->last_times().total_us <= 0) return Status::Internal("no step time");
    return Status::Ok();
  });
  for (const Status& s : st) EXPECT_TRUE(s.ok()) << s.ToString();
}

TEST(GpuContextErrors, BadSizesAndArguments) {
  QKV_REQUIRE_GPU();
  const Geometry g = test::MakeGeometry(2, 4, 16, 24);  // head_dim 24: no CUDA kernel
  const SelectionPolicy p = test::MakePolicy(10, 1, 2, GqaMode::kMax, g.page_size);
  const std::vector<GpuSequence> seqs = {{4, 3}};
  EXPECT_EQ(GpuDecoder::Create(g, p, {}, 1, 0, seqs).status().code(), Code::kInvalidArgument);
  const Geometry ok = test::MakeGeometry(2, 4, 16, 64);
  EXPECT_EQ(GpuDecoder::Create(ok, p, {}, 2, 2, seqs).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(GpuDecoder::Create(ok, p, {}, 1, 0, {}).status().code(), Code::kInvalidArgument);
  const std::vector<GpuSequence> bad_tail = {{4, 17}};
  EXPECT_EQ(GpuDecoder::Create(ok, p, {}, 1, 0, bad_tail).status().code(), Code::kInvalidArgument);
  // A rank that fails on its own aborts the group instead of leaving the other waiting.
  const test::GpuBatch batch = test::MakeGpuBatch(ok, {{20, 2}}, 3);
  auto group = InProcessGroup::Create(2).value();
  const std::vector<Status> st = group->Run([&](Communicator& comm) {
    QKV_ASSIGN_OR_RETURN(auto decoder, GpuDecoder::Create(ok, p, {}, 2, comm.rank(), batch.shapes));
    std::vector<ParallelDecodeOutput> out;
    return decoder->Decode(comm, batch.q.data(), comm.rank() == 0 ? 1 : 7, test::Scale(ok), &out);
  });
  EXPECT_EQ(st[1].code(), Code::kInvalidArgument) << st[1].ToString();
  EXPECT_FALSE(st[0].ok());
}

}  // namespace
}  // namespace questkv
