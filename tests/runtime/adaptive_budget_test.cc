// Adaptive budgets through the runtime (CPU backend): the AttendStats counts
// agree with the selections the call returns, the cap is the token budget,
// and a runtime whose rule is off decodes as before.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "questkv/runtime.h"
#include "tests/testing/reference.h"

namespace questkv {
namespace {

Config Base(double unread) {
  Config c;
  c.geometry.layers = 1, c.geometry.q_heads = 4, c.geometry.kv_heads = 2, c.geometry.head_dim = 16;
  c.geometry.page_size = 4;
  c.policy.token_budget = 24 * 4;
  c.policy.sink_pages = 1;
  c.policy.local_pages = 2;
  c.policy.dense_layers = {};
  c.policy.unread_bound_mass = unread;
  c.policy.adaptive_floor = 5 * 4;
  c.max_pages = 4096;
  return c;
}

TEST(AdaptiveBudget, StatsAgreeWithTheSelections) {
  auto made = Runtime::Create(Base(0.2));
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  Runtime& rt = **made;
  std::vector<SeqId> seqs;
  for (int b = 0; b < 3; ++b) {
    seqs.push_back(*rt.CreateSequence());
    const int64_t n = 300 + 90 * b;
    auto k = test::RandomNormal(n * 2 * 16, b), v = test::RandomNormal(n * 2 * 16, 10 + b);
    // Some sequences hold a few keys far along one direction: their bounds stand out.
    if (b != 1)
      for (int64_t t = 40; t < 48; ++t)
        for (int i = 0; i < 32; ++i) k[t * 32 + i] += 6.f;
    ASSERT_TRUE(rt.Append(seqs.back(), 0, k.data(), v.data(), n).ok());
  }
  int64_t rankings = 0, pages = 0, max_pages = 0, capped = 0;
  for (int step = 0; step < 5; ++step) {
    std::vector<float> q(3 * 4 * 16, 1.f), out(q.size());
    auto noise = test::RandomNormal(q.size(), 100 + step);
    for (std::size_t i = 0; i < q.size(); ++i) q[i] += 0.3f * noise[i];
    std::vector<PageSelection> sels;
    AttendStats st;
    ASSERT_TRUE(rt.DecodeAttention(seqs, 0, q.data(), out.data(), &sels, &st).ok());
    ASSERT_EQ(st.adaptive_rankings, 3 * 2);
    int64_t sum = 0, mx = 0, hist_total = 0, caps = 0;
    for (const PageSelection& s : sels)
      for (int h = 0; h < 2; ++h) {
        const int chosen = s.count(h) - 3;  // beside 1 sink + 2 local
        EXPECT_GE(chosen, 5 - 3);           // the floor: 5 pages' worth of tokens
        EXPECT_LE(chosen, 24 - 3);          // the cap: the token budget
        sum += chosen, mx = std::max<int64_t>(mx, chosen), caps += chosen == 24 - 3;
        EXPECT_GT(st.adaptive_hist[chosen], 0);
      }
    for (int64_t c : st.adaptive_hist) hist_total += c;
    EXPECT_EQ(st.adaptive_pages, sum);
    EXPECT_EQ(st.adaptive_pages_max, mx);
    EXPECT_EQ(st.adaptive_cap_hits, caps);
    EXPECT_EQ(hist_total, st.adaptive_rankings);
    rankings += st.adaptive_rankings, pages += sum, max_pages = std::max(max_pages, mx), capped += caps;
  }
  EXPECT_LT(pages, rankings * (24 - 3)) << "every ranking took the cap";
  EXPECT_GT(max_pages, 5 - 3) << "every ranking stopped at the floor";
}

TEST(AdaptiveBudget, OffLeavesTheStatsEmpty) {
  auto made = Runtime::Create(Base(0));
  ASSERT_TRUE(made.ok());
  const SeqId s = *(*made)->CreateSequence();
  auto k = test::RandomNormal(200 * 32, 1);
  ASSERT_TRUE((*made)->Append(s, 0, k.data(), k.data(), 200).ok());
  std::vector<float> q(4 * 16, 0.5f), out(q.size());
  AttendStats st;
  const SeqId one[] = {s};
  ASSERT_TRUE((*made)->DecodeAttention(one, 0, q.data(), out.data(), nullptr, &st).ok());
  EXPECT_EQ(st.adaptive_rankings, 0);
  EXPECT_EQ(st.head_pages_selected, 2 * 24);
}

}  // namespace
}  // namespace questkv
