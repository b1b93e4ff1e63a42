// ContextParallel over 1-8 threaded ranks against the single-rank Selector +
// AttendPagesCpu: the same selections bit for bit, outputs within 1e-5
// (the merge order across ranks differs), over GQA groups 1/4/8, the three
// GQA modes, both shard layouts, one page, fewer pages than ranks, partial
// tails, budgets below and above the page count, and tied scores. Each rank
// sees only its own pages, summaries (its own slab and PageIds) and K/V.
#include "parallel/context_parallel.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "parallel/inprocess_group.h"
#include "tests/parallel/parallel_test_util.h"

namespace questkv {
namespace {

using test::Sequence;
using test::Share;
using test::ShareOf;

struct RankOutputs {
  std::vector<Status> statuses;
  std::vector<ParallelDecodeOutput> outs;
};

// Runs the step on `ranks` threads; `spoil`, when given, edits each rank's
// input first (the bad-input tests).
RankOutputs RunContextParallel(const Sequence& s, const SelectionPolicy& p, int layer, ShardLayout layout, int ranks,
                               const std::function<void(int, ContextShard*)>& spoil = nullptr) {
  auto group = InProcessGroup::Create(ranks).value();
  std::vector<Share> shares;
  for (int r = 0; r < ranks; ++r) shares.push_back(ShareOf(s, layout, ranks, r));
  RankOutputs run;
  run.outs.resize(ranks);
  run.statuses = group->Run([&](Communicator& comm) {
    ContextShard in = test::ShardInput(s, shares[comm.rank()], layer);
    if (spoil) spoil(comm.rank(), &in);
    ContextParallel cp(s.g, p, layout);
    return cp.Decode(comm, in, &run.outs[comm.rank()]);
  });
  return run;
}

// Every rank: the reference's selection exactly, the same output bits as
// rank 0, and outputs within 1e-5 of the reference per query head (bit for
// bit with one rank, where nothing is merged across ranks).
void ExpectMatches(const Sequence& s, const test::Reference& ref, const RankOutputs& run, const std::string& what) {
  const Geometry& g = s.g;
  const bool exact = run.outs.size() == 1;
  for (std::size_t r = 0; r < run.outs.size(); ++r) {
    ASSERT_TRUE(run.statuses[r].ok()) << what << " rank " << r << ": " << run.statuses[r].ToString();
    const ParallelDecodeOutput& out = run.outs[r];
    EXPECT_EQ(out.first_kv_head, 0);
    EXPECT_EQ(test::Rows(out.selection, 0, g.kv_heads), test::Rows(ref.selection, 0, g.kv_heads))
        << what << " rank " << r;
    ASSERT_EQ(out.o.size(), ref.o.size());
    ASSERT_EQ(out.lse.size(), ref.lse.size());
    EXPECT_EQ(std::memcmp(out.o.data(), run.outs[0].o.data(), out.o.size() * sizeof(float)), 0) << what;
    for (int h = 0; h < g.q_heads; ++h) {
      const float* got = out.o.data() + std::size_t(h) * g.head_dim;
      const float* want = ref.o.data() + std::size_t(h) * g.head_dim;
      if (exact) {
        EXPECT_EQ(std::memcmp(got, want, g.head_dim * sizeof(float)), 0) << what << " head " << h;
        EXPECT_EQ(out.lse[h], ref.lse[h]) << what << " head " << h;
      } else {
        EXPECT_LE(test::RelL2Error(got, want, g.head_dim), 1e-5) << what << " rank " << r << " head " << h;
        EXPECT_NEAR(out.lse[h], ref.lse[h], 1e-5 * std::max(1.f, std::fabs(ref.lse[h]))) << what << " head " << h;
      }
    }
  }
}

struct Case {
  int num_pages;
  int tail_len;
  int budget_pages;
  int sink;
  int local;
  int patterns;  // > 0: pages repeat, scores tie
  int layer;     // 0 is dense
};

// Page counts 1, below the rank counts, odd; tails partly filled; budgets
// that cover everything, leave no top-K share, or fall below sink + local.
const Case kCases[] = {
    {1, 3, 4, 1, 1, 0, 1},    {2, 4, 1, 0, 1, 0, 1},   {3, 1, 2, 1, 1, 0, 1},    {5, 1, 3, 1, 1, 0, 1},
    {7, 2, 4, 1, 1, 0, 1},    {37, 3, 9, 1, 2, 0, 1},  {64, 4, 20, 2, 4, 0, 1},  {100, 1, 12, 0, 1, 0, 1},
    {50, 2, 60, 1, 2, 0, 1},  {40, 3, 3, 1, 2, 0, 1},  {40, 3, 2, 2, 2, 0, 1},   {30, 2, 8, 1, 2, 3, 1},
    {17, 1, 6, 0, 1, 2, 1},   {23, 3, 5, 1, 1, 0, 0},  {9, 2, 8, 1, 1, 0, 1},
};

using Params = std::tuple<int, int, GqaMode, ShardLayout>;  // ranks, group, mode, layout

class ContextParallelSweep : public ::testing::TestWithParam<Params> {};

TEST_P(ContextParallelSweep, MatchesSingleRank) {
  const auto [ranks, group, mode, layout] = GetParam();
  const Geometry g = test::MakeGeometry(2, group);
  uint64_t seed = 1000 + ranks * 31 + group * 7 + int(mode);
  for (const Case& c : kCases) {
    const Sequence s = test::MakeSequence(g, c.num_pages, c.tail_len, seed++, c.patterns);
    const SelectionPolicy p = test::MakePolicy(c.budget_pages, c.sink, c.local, mode, g.page_size);
    const test::Reference ref = test::SingleRank(s, p, c.layer);
    const RankOutputs run = RunContextParallel(s, p, c.layer, layout, ranks);
    ExpectMatches(s, ref, run,
                  "pages " + std::to_string(c.num_pages) + " budget " + std::to_string(c.budget_pages) +
                      " ties " + std::to_string(c.patterns) + " layer " + std::to_string(c.layer));
  }
}

INSTANTIATE_TEST_SUITE_P(
    RanksGroupsModes, ContextParallelSweep,
    ::testing::Combine(::testing::Values(1, 2, 3, 4, 8), ::testing::Values(1, 4, 8),
                       ::testing::Values(GqaMode::kMax, GqaMode::kMean, GqaMode::kUnion),
                       ::testing::Values(ShardLayout::kContiguous, ShardLayout::kRoundRobin)),
    [](const ::testing::TestParamInfo<Params>& info) {
      return "R" + std::to_string(std::get<0>(info.param)) + "_G" + std::to_string(std::get<1>(info.param)) + "_" +
             std::string(GqaModeName(std::get<2>(info.param))) + "_" +
             (std::get<3>(info.param) == ShardLayout::kContiguous ? "contiguous" : "roundrobin");
    });

// Every score equal: the global top-K must be the lowest pages outside sink
// and local, however the ranks split them.
TEST(ContextParallel, AllScoresTiedPicksLowestPages) {
  const Geometry g = test::MakeGeometry(2, 4);
  const Sequence s = test::MakeSequence(g, 29, 2, 77, /*patterns=*/1);
  const SelectionPolicy p = test::MakePolicy(7, 1, 2, GqaMode::kMax, g.page_size);
  for (int ranks : {2, 3, 8})
    for (ShardLayout layout : {ShardLayout::kContiguous, ShardLayout::kRoundRobin}) {
      const RankOutputs run = RunContextParallel(s, p, 1, layout, ranks);
      ASSERT_TRUE(run.statuses[0].ok()) << run.statuses[0].ToString();
      for (int h = 0; h < g.kv_heads; ++h)
        EXPECT_EQ(test::Rows(run.outs[0].selection, h, 1)[0], (std::vector<int>{0, 1, 2, 3, 4, 27, 28}));
    }
}

// The budget is global: with more ranks the selection does not grow.
TEST(ContextParallel, BudgetDoesNotGrowWithRanks) {
  const Geometry g = test::MakeGeometry(2, 4);
  const Sequence s = test::MakeSequence(g, 200, 4, 88);
  const SelectionPolicy p = test::MakePolicy(16, 1, 4, GqaMode::kMean, g.page_size);
  for (int ranks : {1, 2, 4, 8}) {
    const RankOutputs run = RunContextParallel(s, p, 1, ShardLayout::kContiguous, ranks);
    ASSERT_TRUE(run.statuses[0].ok()) << run.statuses[0].ToString();
    for (int h = 0; h < g.kv_heads; ++h) EXPECT_EQ(run.outs[0].selection.count(h), 16) << ranks << " ranks";
  }
}

// Against the double-precision masked attention of tests/testing: the
// selected pages' tokens (tail respected) and nothing else.
TEST(ContextParallel, OutputsMatchDenseMaskedReference) {
  const Geometry g = test::MakeGeometry(2, 4, /*page_size=*/5, /*head_dim=*/32);
  const Sequence s = test::MakeSequence(g, 41, 3, 99);
  const SelectionPolicy p = test::MakePolicy(10, 1, 2, GqaMode::kUnion, g.page_size);
  const RankOutputs run = RunContextParallel(s, p, 1, ShardLayout::kRoundRobin, 3);
  ASSERT_TRUE(run.statuses[0].ok()) << run.statuses[0].ToString();
  const int tokens = (s.num_pages - 1) * g.page_size + s.tail_len;
  const std::size_t head_page = g.head_page_elems();
  for (int h = 0; h < g.kv_heads; ++h) {
    std::vector<float> k(std::size_t(s.num_pages) * head_page), v(k.size());
    for (int i = 0; i < s.num_pages; ++i) {
      std::memcpy(k.data() + i * head_page, s.pages[i].data() + h * head_page, head_page * sizeof(float));
      std::memcpy(v.data() + i * head_page, s.pages[i].data() + (g.kv_heads + h) * head_page,
                  head_page * sizeof(float));
    }
    const std::vector<int> pages = test::Rows(run.outs[0].selection, h, 1)[0];
    for (int gi = 0; gi < g.group(); ++gi) {
      const int hq = h * g.group() + gi;
      const auto want = test::MaskedAttention(s.q.data() + hq * g.head_dim, k.data(), v.data(), tokens, g.head_dim,
                                              g.page_size, pages, test::Scale(g));
      const std::vector<float> want_f(want.begin(), want.end());
      EXPECT_LE(test::RelL2Error(run.outs[0].o.data() + hq * g.head_dim, want_f.data(), g.head_dim), 1e-5);
    }
  }
}

// ---- bad input: a clear error on the rank at fault, no hang for the others ----

// Runs 3 ranks where rank 1's input is edited by `spoil`.
std::vector<Status> RunWithBadRank(void (*spoil)(ContextShard*)) {
  const Geometry g = test::MakeGeometry(2, 4);
  const Sequence s = test::MakeSequence(g, 20, 2, 5);
  const SelectionPolicy p = test::MakePolicy(6, 1, 1, GqaMode::kMax, g.page_size);
  return RunContextParallel(s, p, 1, ShardLayout::kContiguous, 3, [&](int rank, ContextShard* in) {
           if (rank == 1) spoil(in);
         }).statuses;
}

void ExpectRankOneAtFault(const std::vector<Status>& st, const std::string& needle) {
  EXPECT_EQ(st[1].code(), Code::kInvalidArgument) << st[1].ToString();
  EXPECT_NE(st[1].message().find(needle), std::string::npos) << st[1].ToString();
  for (int r : {0, 2}) EXPECT_FALSE(st[r].ok()) << "rank " << r;
}

TEST(ContextParallel, RejectsBadInputWithoutHanging) {
  ExpectRankOneAtFault(RunWithBadRank([](ContextShard* in) { in->num_local += 1; }), "gives it");
  ExpectRankOneAtFault(RunWithBadRank([](ContextShard* in) { in->q = nullptr; }), "q is null");
  ExpectRankOneAtFault(RunWithBadRank([](ContextShard* in) { in->tail_len = 0; }), "tail_len");
  ExpectRankOneAtFault(RunWithBadRank([](ContextShard* in) { in->scale = 0.f; }), "scale");
  ExpectRankOneAtFault(RunWithBadRank([](ContextShard* in) { in->layer = 7; }), "layer");
  ExpectRankOneAtFault(RunWithBadRank([](ContextShard* in) { in->page_ids = nullptr; }), "null");
}

// Rank 1 sees another tail length: the exchange's header reports it on
// every rank.
TEST(ContextParallel, RanksDisagreeingOnTheStepFailEverywhere) {
  const Geometry g = test::MakeGeometry(2, 1);
  const Sequence s = test::MakeSequence(g, 12, 2, 6);
  const SelectionPolicy p = test::MakePolicy(5, 1, 1, GqaMode::kMax, g.page_size);
  const RankOutputs run = RunContextParallel(s, p, 1, ShardLayout::kRoundRobin, 2, [](int rank, ContextShard* in) {
    if (rank == 1) in->tail_len = 1;
  });
  for (const Status& st : run.statuses) {
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.ToString();
    EXPECT_NE(st.message().find("tail_len"), std::string::npos) << st.ToString();
  }
}

TEST(ContextParallel, RejectsNullOutput) {
  const Geometry g = test::MakeGeometry(1, 1);
  const Sequence s = test::MakeSequence(g, 3, 1, 7);
  auto group = InProcessGroup::Create(1).value();
  const Share share = ShareOf(s, ShardLayout::kContiguous, 1, 0);
  ContextParallel cp(g, test::MakePolicy(2, 1, 1, GqaMode::kMax, g.page_size), ShardLayout::kContiguous);
  EXPECT_EQ(cp.Decode(group->comm(0), test::ShardInput(s, share, 1), nullptr).code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace questkv
