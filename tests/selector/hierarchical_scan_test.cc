// SelectionPolicy::group_pages: the hierarchical scan against the flat scan
// on the same summaries. Selections (and the re-rank's candidates) must be
// identical for every GQA mode, group size, budget and summary dtype, and the
// scores it did read must be the flat scan's bits. Where keys are local (a few
// runs of pages stand out along the query), it must read far fewer boxes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cpu/kernels_cpu.h"
#include "selector/select.h"
#include "tests/testing/reference.h"

namespace questkv {
namespace {

constexpr int kHkv = 2, kD = 32;

// Page boxes [PageId][Hkv][2][D] around per-page centres; pages in `hot`
// runs sit `lift` further along the direction u. PageIds are shuffled
// against logical order.
struct Pages {
  std::vector<float> slab;
  std::vector<uint32_t> ids;
};
Pages MakePages(int n, double lift, int hot_runs, bool e4m3, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  const auto u = test::RandomNormal(kD, seed + 1);
  std::vector<bool> hot(n, false);
  for (int r = 0; r < hot_runs && n > 0; ++r) {
    const int start = int(rng() % n), len = 1 + int(rng() % 6);
    for (int i = start; i < std::min(n, start + len); ++i) hot[i] = true;
  }
  Pages p;
  p.ids.resize(n);
  std::iota(p.ids.begin(), p.ids.end(), 0u);
  std::shuffle(p.ids.begin(), p.ids.end(), rng);
  p.slab.resize(std::size_t(n) * kHkv * 2 * kD);
  for (int i = 0; i < n; ++i)
    for (int h = 0; h < kHkv; ++h) {
      float* box = p.slab.data() + (std::size_t(p.ids[i]) * kHkv + h) * 2 * kD;
      for (int d = 0; d < kD; ++d) {
        const float c = 0.5f * normal(rng) + (hot[i] ? float(lift) * u[d] : 0.f);
        const float w = 0.3f * std::abs(normal(rng));
        box[d] = c - w, box[kD + d] = c + w;
      }
    }
  if (e4m3) kernels::SnapSummaryE4m3Cpu(p.slab.data(), n * kHkv, kD);
  return p;
}

// Group boxes over runs of B logical pages, built here from the page boxes.
std::vector<float> GroupBoxes(const Pages& p, int B) {
  const int n = int(p.ids.size()), groups = (n + B - 1) / B;
  std::vector<float> out(std::size_t(groups) * kHkv * 2 * kD);
  for (int g = 0; g < groups; ++g)
    for (int h = 0; h < kHkv; ++h) {
      float* box = out.data() + (std::size_t(g) * kHkv + h) * 2 * kD;
      for (int d = 0; d < kD; ++d) box[d] = INFINITY, box[kD + d] = -INFINITY;
      for (int i = g * B; i < std::min(n, (g + 1) * B); ++i) {
        const float* src = p.slab.data() + (std::size_t(p.ids[i]) * kHkv + h) * 2 * kD;
        for (int d = 0; d < kD; ++d) box[d] = std::min(box[d], src[d]), box[kD + d] = std::max(box[kD + d], src[kD + d]);
      }
    }
  return out;
}

Geometry Geo(int q_heads, bool e4m3) {
  Geometry g;
  g.layers = 1, g.q_heads = q_heads, g.kv_heads = kHkv, g.head_dim = kD, g.page_size = 16;
  g.summary_dtype = e4m3 ? SummaryDType::kE4M3 : SummaryDType::kKv;
  return g;
}

struct Outcome {
  PageSelection sel;
  std::vector<float> scores;
  int64_t boxes = 0;
};

Outcome SelectWith(const Geometry& g, const SelectionPolicy& pol, const Pages& p, const float* q, const float* groups) {
  Selector s(g, pol);
  SelectInput in;
  in.q = q, in.summary_slab = p.slab.data(), in.page_ids = p.ids.data(), in.num_pages = int(p.ids.size());
  in.group_slab = groups;
  if (pol.rerank > 0)  // exact scores that disagree with the bound's order
    in.exact_scores = [&](int h, std::span<const int32_t> pages, float* exact) {
      for (std::size_t i = 0; i < pages.size(); ++i) exact[i] = float((pages[i] * 7919 + h * 31) % 101);
      return Status::Ok();
    };
  Outcome o;
  EXPECT_TRUE(s.Select(in, &o.sel).ok());
  o.scores = s.scores();
  o.boxes = s.boxes_read();
  return o;
}

TEST(HierarchicalScan, SelectsExactlyWhatTheFlatScanSelects) {
  int cases = 0;
  for (bool e4m3 : {false, true})
    for (GqaMode gqa : {GqaMode::kMax, GqaMode::kMean, GqaMode::kUnion})
      for (int B : {2, 3, 8, 32})
        for (int trial = 0; trial < 12; ++trial) {
          const uint64_t seed = 1000 * B + 10 * trial + int(gqa) + (e4m3 ? 7 : 0);
          std::mt19937_64 rng(seed);
          const Geometry g = Geo(8, e4m3);
          SelectionPolicy pol;
          pol.dense_layers = {};
          pol.gqa = gqa;
          pol.sink_pages = int(rng() % 3);
          pol.local_pages = 1 + int(rng() % 3);
          const int n = 1 + int(rng() % 400);
          pol.token_budget = int64_t(16) * int(rng() % 40);
          pol.rerank = gqa != GqaMode::kUnion && trial % 3 == 0 ? 2.5 : 0;
          const Pages p = MakePages(n, trial % 2 ? 4.0 : 0.0, 3, e4m3, seed);
          const auto groups = GroupBoxes(p, B);
          // Queries along the hot direction on odd trials; ties on some.
          auto q = test::RandomNormal(std::size_t(g.q_heads) * kD, seed + 2);
          const auto u = test::RandomNormal(kD, seed + 1);  // MakePages' direction
          if (trial % 2)
            for (std::size_t i = 0; i < q.size(); ++i) q[i] = u[i % kD] + 0.3f * q[i];
          if (trial % 4 == 2) std::fill(q.begin(), q.end(), 0.f);
          const Outcome flat = SelectWith(g, pol, p, q.data(), nullptr);
          pol.group_pages = B;
          const Outcome grouped = SelectWith(g, pol, p, q.data(), groups.data());
          ASSERT_EQ(grouped.sel.indptr, flat.sel.indptr) << "case " << cases;
          ASSERT_EQ(grouped.sel.pages, flat.sel.pages) << "case " << cases;
          ASSERT_EQ(grouped.scores.size(), flat.scores.size());
          for (std::size_t i = 0; i < flat.scores.size(); ++i)
            if (grouped.scores[i] != -INFINITY) {
              ASSERT_EQ(grouped.scores[i], flat.scores[i]);
            }
          ++cases;
        }
}

// A group whose bound equals the K-th score found so far may hold a page
// that ties it at a lower index, which the flat scan prefers: it is read.
TEST(HierarchicalScan, AGroupBoundEqualToTheKthScoreIsRead) {
  const Geometry g = Geo(2, false);
  SelectionPolicy pol;
  pol.dense_layers = {};
  pol.sink_pages = 0, pol.local_pages = 1;
  pol.token_budget = 3 * 16;  // the tail page and 2 more
  Pages p;
  p.ids.resize(16);
  std::iota(p.ids.begin(), p.ids.end(), 0u);
  p.slab.assign(16 * kHkv * 2 * kD, 0.f);
  for (auto [page, x] : {std::pair{1, 10.f}, {9, 12.f}, {10, 10.f}})
    for (int h = 0; h < kHkv; ++h) p.slab[(page * kHkv + h) * 2 * kD + kD] = x;  // max of dim 0
  std::vector<float> q(std::size_t(g.q_heads) * kD, 0.f);
  q[0] = q[kD] = 1.f;
  const Outcome flat = SelectWith(g, pol, p, q.data(), nullptr);
  pol.group_pages = 4;
  const auto groups = GroupBoxes(p, 4);
  const Outcome grouped = SelectWith(g, pol, p, q.data(), groups.data());
  ASSERT_EQ(flat.sel.pages, (std::vector<int32_t>{1, 9, 15, 1, 9, 15}));
  EXPECT_EQ(grouped.sel.pages, flat.sel.pages);
}

// Local keys at a long context: one read of the groups' boxes plus the pages
// of the few groups that can hold a winner.
TEST(HierarchicalScan, ReadsFewBoxesWhereKeysAreLocal) {
  for (bool e4m3 : {false, true})
    for (GqaMode gqa : {GqaMode::kMax, GqaMode::kMean, GqaMode::kUnion}) {
      const Geometry g = Geo(4, e4m3);
      SelectionPolicy pol;
      pol.dense_layers = {};
      pol.gqa = gqa;
      pol.token_budget = 16 * 16;
      const Pages p = MakePages(8192, 6.0, 4, e4m3, 99);
      const auto u = test::RandomNormal(kD, 100);
      std::vector<float> q(std::size_t(g.q_heads) * kD);
      for (int h = 0; h < g.q_heads; ++h)
        for (int d = 0; d < kD; ++d) q[h * kD + d] = u[d];
      const Outcome flat = SelectWith(g, pol, p, q.data(), nullptr);
      pol.group_pages = 16;
      const auto groups = GroupBoxes(p, 16);
      const Outcome grouped = SelectWith(g, pol, p, q.data(), groups.data());
      ASSERT_EQ(grouped.sel.pages, flat.sel.pages);
      EXPECT_EQ(flat.boxes, 8192 * kHkv);
      EXPECT_LT(grouped.boxes, flat.boxes / 8) << "e4m3 " << e4m3 << " gqa " << int(gqa) << ": " << grouped.boxes;
    }
}

}  // namespace
}  // namespace questkv
