// SelectionPolicy::unread_bound_mass against its definition
// (test::AdaptiveDefinition, from a full sort): per ranking, the fewest top
// pages (at least the floor, at most the cap) whose bound masses
// exp(U/sqrt(D)) leave at most the given share of all ranked pages' mass
// unread; selected = sink ∪ local ∪ those.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "kernels/cpu/kernels_cpu.h"
#include "selector/select.h"
#include "tests/testing/reference.h"

namespace questkv {
namespace {

constexpr int kHkv = 2, kD = 16;

TEST(AdaptiveBudget, SelectsWhatItsDefinitionSelects) {
  int flat_capped = 0, peaked_below_cap = 0;
  for (GqaMode gqa : {GqaMode::kMax, GqaMode::kMean, GqaMode::kUnion})
    for (int trial = 0; trial < 30; ++trial) {
      std::mt19937_64 rng(100 * trial + int(gqa));
      Geometry g;
      g.layers = 1, g.q_heads = 4, g.kv_heads = kHkv, g.head_dim = kD, g.page_size = 16;
      SelectionPolicy pol;
      pol.dense_layers = {};
      pol.gqa = gqa;
      pol.sink_pages = 1, pol.local_pages = 2;
      const int n = 8 + int(rng() % 200);
      pol.token_budget = 16 * (4 + int(rng() % 40));
      pol.unread_bound_mass = std::vector<double>{0.01, 0.1, 0.5}[trial % 3];
      pol.adaptive_floor = 16 * int(rng() % 6);
      // Boxes: flat (every bound alike) on some trials, a few standing out on others.
      const bool peaked = trial % 2;
      std::vector<float> slab = test::RandomNormal(std::size_t(n) * kHkv * 2 * kD, trial);
      for (int p = 0; p < n; ++p)
        for (int h = 0; h < kHkv; ++h) {
          float* box = slab.data() + (std::size_t(p) * kHkv + h) * 2 * kD;
          const float lift = peaked && p % 17 == 3 ? 12.f : 0.f;
          for (int d = 0; d < kD; ++d) {
            const float c = 0.3f * box[d] + lift, w = 0.2f * std::abs(box[kD + d]);
            box[d] = c - w, box[kD + d] = c + w;
          }
        }
      std::vector<uint32_t> ids(n);
      std::iota(ids.begin(), ids.end(), 0u);
      std::vector<float> q(std::size_t(g.q_heads) * kD, 1.f);
      for (float& x : q) x += 0.3f * std::normal_distribution<float>()(rng);
      Selector sel(g, pol);
      SelectInput in;
      in.q = q.data(), in.summary_slab = slab.data(), in.page_ids = ids.data(), in.num_pages = n;
      PageSelection out;
      ASSERT_TRUE(sel.Select(in, &out).ok());
      // The definition, from the selector's own scores (scoring has its own tests).
      const auto& scores = sel.scores();
      if (scores.empty()) {  // a budget covering every page: no ranking
        EXPECT_TRUE(sel.adaptive_pages().empty());
        EXPECT_EQ(out.count(0), n);
        continue;
      }
      std::set<int> fixed;
      for (int i = 0; i < std::min(pol.sink_pages, n); ++i) fixed.insert(i);
      for (int i = std::max(0, n - pol.local_pages); i < n; ++i) fixed.insert(i);
      const int budget = int(pol.page_budget(0, 16)), cap = std::max(0, budget - int(fixed.size()));
      const int floor_k = std::clamp(int(pol.adaptive_floor / 16) - int(fixed.size()), 0, cap);
      const int G = g.group();
      std::size_t ranking = 0;
      for (int h = 0; h < kHkv; ++h) {
        std::set<int> row(out.row(h), out.row(h) + out.count(h)), want;
        const int rankings = gqa == GqaMode::kUnion ? G : 1;
        for (int r = 0; r < rankings; ++r, ++ranking) {
          // The ranking's scores as the selector aggregates them (float, in head order).
          std::vector<float> s(n);
          for (int i = 0; i < n; ++i) {
            const float* col = scores.data() + std::size_t(h * G) * n + i;
            if (gqa == GqaMode::kUnion) {
              s[i] = col[std::size_t(r) * n];
              continue;
            }
            float a = col[0];
            for (int gi = 1; gi < G; ++gi) a = gqa == GqaMode::kMean ? a + col[std::size_t(gi) * n] : std::max(a, col[std::size_t(gi) * n]);
            s[i] = gqa == GqaMode::kMean ? a / float(G) : a;
          }
          int k = 0;
          for (int p : test::AdaptiveDefinition(s, std::vector<int>(fixed.begin(), fixed.end()), pol.unread_bound_mass,
                                                floor_k, cap, kD, &k))
            want.insert(p);
          ASSERT_LT(ranking, sel.adaptive_pages().size());
          EXPECT_EQ(sel.adaptive_pages()[ranking], k) << "trial " << trial << " head " << h;
          EXPECT_EQ(sel.adaptive_capped()[ranking], k == cap);
          if (!peaked && k == cap) ++flat_capped;
          if (peaked && k < cap) ++peaked_below_cap;
        }
        EXPECT_EQ(row, want) << "trial " << trial << " head " << h;
      }
      EXPECT_EQ(sel.adaptive_pages().size(), ranking);
    }
  // The rule does what it is for: flat bounds run to the cap, peaked ones stop early.
  EXPECT_GT(flat_capped, 20);
  EXPECT_GT(peaked_below_cap, 20);
}

TEST(AdaptiveBudget, BadSettingsAreRefused) {
  Geometry g;
  g.layers = 1, g.q_heads = 4, g.kv_heads = kHkv, g.head_dim = kD, g.page_size = 16;
  SelectionPolicy pol;
  pol.dense_layers = {};
  for (double e : {-0.1, 1.0, std::nan("")}) {
    pol.unread_bound_mass = e;
    EXPECT_FALSE(pol.Validate(g).ok()) << e;
  }
  pol.unread_bound_mass = 0.1;
  pol.adaptive_floor = -1;
  EXPECT_FALSE(pol.Validate(g).ok());
  pol.adaptive_floor = 0;
  pol.group_pages = 8;
  EXPECT_FALSE(pol.Validate(g).ok());
  pol.group_pages = 0;
  EXPECT_TRUE(pol.Validate(g).ok());
}

}  // namespace
}  // namespace questkv
