// HeadParallel over 1-8 threaded ranks against the single-rank Selector +
// AttendPagesCpu: each rank holds only its KV heads' queries, summaries and
// K/V; its selection rows and every gathered output must equal the
// single-rank run bit for bit, with equal and unequal head counts, GQA
// groups 1/4/8 and the three GQA modes. More ranks than KV heads, and head
// counts that do not add up, are clear errors on every rank.
#include "parallel/head_parallel.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "parallel/inprocess_group.h"
#include "tests/parallel/parallel_test_util.h"

namespace questkv {
namespace {

using test::Sequence;

// The sequence narrowed to KV heads [first, first + count): what one rank of
// a head-parallel group holds.
struct HeadShare {
  std::vector<float> slab;
  std::vector<std::vector<float>> pages;
  std::vector<const float*> page_ptrs;
};

HeadShare HeadShareOf(const Sequence& s, HeadRange range) {
  const Geometry& g = s.g;
  const std::size_t head_summary = 2 * std::size_t(g.head_dim), head_page = g.head_page_elems();
  HeadShare share;
  const std::size_t slab_pages = s.slab.size() / g.summary_elems();
  share.slab.resize(slab_pages * range.count * head_summary);
  for (std::size_t id = 0; id < slab_pages; ++id)
    std::memcpy(share.slab.data() + id * range.count * head_summary,
                s.slab.data() + id * g.summary_elems() + range.first * head_summary,
                range.count * head_summary * sizeof(float));
  for (const auto& page : s.pages) {
    std::vector<float> mine(2 * range.count * head_page);
    for (int kv = 0; kv < 2; ++kv)
      std::memcpy(mine.data() + kv * range.count * head_page,
                  page.data() + (kv * g.kv_heads + range.first) * head_page, range.count * head_page * sizeof(float));
    share.pages.push_back(std::move(mine));
  }
  for (const auto& p : share.pages) share.page_ptrs.push_back(p.data());
  return share;
}

struct RankOutputs {
  std::vector<Status> statuses;
  std::vector<ParallelDecodeOutput> outs;
};

RankOutputs RunHeadParallel(const Sequence& s, const SelectionPolicy& p, int layer, int ranks,
                    const std::vector<int>& counts = {}) {
  auto group = InProcessGroup::Create(ranks).value();
  RankOutputs run;
  run.outs.resize(ranks);
  run.statuses = group->Run([&](Communicator& comm) {
    HeadParallel hp(s.g, p, counts);
    QKV_ASSIGN_OR_RETURN(const HeadRange range, hp.HeadsOf(comm.size(), comm.rank()));
    const HeadShare share = HeadShareOf(s, range);
    HeadShard in;
    in.q = s.q.data() + std::size_t(range.first) * s.g.group() * s.g.head_dim;
    in.summary_slab = share.slab.data();
    in.page_ids = s.ids.data();
    in.pages = share.page_ptrs.data();
    in.num_pages = s.num_pages;
    in.tail_len = s.tail_len;
    in.layer = layer;
    in.scale = test::Scale(s.g);
    return hp.Decode(comm, in, &run.outs[comm.rank()]);
  });
  return run;
}

void ExpectBitIdentical(const Sequence& s, const test::Reference& ref, const RankOutputs& run, const std::string& what) {
  const Geometry& g = s.g;
  int next_head = 0;
  for (std::size_t r = 0; r < run.outs.size(); ++r) {
    ASSERT_TRUE(run.statuses[r].ok()) << what << " rank " << r << ": " << run.statuses[r].ToString();
    const ParallelDecodeOutput& out = run.outs[r];
    const int count = int(out.selection.indptr.size()) - 1;
    EXPECT_EQ(out.first_kv_head, next_head) << what;
    EXPECT_EQ(test::Rows(out.selection, 0, count), test::Rows(ref.selection, out.first_kv_head, count))
        << what << " rank " << r;
    next_head += count;
    ASSERT_EQ(out.o.size(), ref.o.size());
    EXPECT_EQ(std::memcmp(out.o.data(), ref.o.data(), ref.o.size() * sizeof(float)), 0) << what << " rank " << r;
    EXPECT_EQ(std::memcmp(out.lse.data(), ref.lse.data(), ref.lse.size() * sizeof(float)), 0) << what;
  }
  EXPECT_EQ(next_head, g.kv_heads) << what;
}

using Params = std::tuple<int, int, GqaMode>;  // ranks, group, mode

class HeadParallelSweep : public ::testing::TestWithParam<Params> {};

TEST_P(HeadParallelSweep, BitIdenticalToSingleRank) {
  const auto [ranks, group, mode] = GetParam();
  uint64_t seed = 5000 + ranks * 13 + group * 3 + int(mode);
  // 8 KV heads divide evenly over 1, 2, 4, 8 ranks; 11 leaves unequal shares.
  for (int kv_heads : {8, 11}) {
    const Geometry g = test::MakeGeometry(kv_heads, group, /*page_size=*/3, /*head_dim=*/20);
    for (const auto& [n, tail, budget, layer] : {std::tuple{1, 2, 4, 1}, std::tuple{9, 1, 4, 1},
                                                std::tuple{33, 3, 7, 1}, std::tuple{20, 2, 30, 1},
                                                std::tuple{14, 3, 4, 0}}) {
      const Sequence s = test::MakeSequence(g, n, tail, seed++);
      const SelectionPolicy p = test::MakePolicy(budget, 1, 2, mode, g.page_size);
      ExpectBitIdentical(s, test::SingleRank(s, p, layer), RunHeadParallel(s, p, layer, ranks),
                         "Hkv " + std::to_string(kv_heads) + " pages " + std::to_string(n));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(RanksGroupsModes, HeadParallelSweep,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 8), ::testing::Values(1, 4, 8),
                                            ::testing::Values(GqaMode::kMax, GqaMode::kMean, GqaMode::kUnion)),
                         [](const ::testing::TestParamInfo<Params>& info) {
                           return "R" + std::to_string(std::get<0>(info.param)) + "_G" +
                                  std::to_string(std::get<1>(info.param)) + "_" +
                                  std::string(GqaModeName(std::get<2>(info.param)));
                         });

TEST(HeadParallel, ExplicitUnequalHeadCounts) {
  const Geometry g = test::MakeGeometry(8, 4);
  const Sequence s = test::MakeSequence(g, 25, 2, 41, /*patterns=*/4);  // tied scores too
  const SelectionPolicy p = test::MakePolicy(6, 1, 1, GqaMode::kUnion, g.page_size);
  ExpectBitIdentical(s, test::SingleRank(s, p, 1), RunHeadParallel(s, p, 1, 3, {1, 5, 2}), "counts 1,5,2");
}

TEST(HeadParallel, MoreRanksThanKvHeadsFailsOnEveryRank) {
  const Geometry g = test::MakeGeometry(2, 4);
  const Sequence s = test::MakeSequence(g, 6, 1, 42);
  const SelectionPolicy p = test::MakePolicy(3, 1, 1, GqaMode::kMax, g.page_size);
  auto group = InProcessGroup::Create(3).value();
  std::vector<ParallelDecodeOutput> outs(3);
  const std::vector<Status> st = group->Run([&](Communicator& comm) {
    HeadParallel hp(g, p);
    EXPECT_EQ(hp.HeadsOf(comm.size(), comm.rank()).status().code(), Code::kInvalidArgument);
    HeadShard in;  // never looked at: the split fails first
    return hp.Decode(comm, in, &outs[comm.rank()]);
  });
  for (const Status& x : st) {
    EXPECT_FALSE(x.ok());
    EXPECT_NE(x.message().find("3 ranks for 2 KV heads"), std::string::npos) << x.ToString();
  }
}

TEST(HeadParallel, BadCountsAndInputs) {
  const Geometry g = test::MakeGeometry(4, 2);
  const Sequence s = test::MakeSequence(g, 6, 1, 43);
  const SelectionPolicy p = test::MakePolicy(3, 1, 1, GqaMode::kMax, g.page_size);
  EXPECT_EQ(HeadParallel(g, p, {1, 1}).HeadsOf(2, 0).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(HeadParallel(g, p).HeadsOf(2, 2).status().code(), Code::kInvalidArgument);
  const RankOutputs bad_counts = RunHeadParallel(s, p, 1, 2, {3, 2});
  for (const Status& x : bad_counts.statuses) EXPECT_EQ(x.code(), Code::kInvalidArgument) << x.ToString();

  auto group = InProcessGroup::Create(2).value();
  std::vector<ParallelDecodeOutput> outs(2);
  const std::vector<Status> st = group->Run([&](Communicator& comm) {
    HeadParallel hp(g, p);
    const HeadShare share = HeadShareOf(s, hp.HeadsOf(2, comm.rank()).value());
    HeadShard in;
    in.q = s.q.data();
    in.summary_slab = share.slab.data();
    in.page_ids = s.ids.data();
    in.pages = share.page_ptrs.data();
    in.num_pages = s.num_pages;
    in.tail_len = comm.rank() == 1 ? g.page_size + 1 : s.tail_len;
    in.layer = 1;
    in.scale = test::Scale(g);
    return hp.Decode(comm, in, &outs[comm.rank()]);
  });
  EXPECT_EQ(st[1].code(), Code::kInvalidArgument);
  EXPECT_NE(st[1].message().find("tail_len"), std::string::npos) << st[1].ToString();
  EXPECT_FALSE(st[0].ok());
}

}  // namespace
}  // namespace questkv
