// Selector: budget arithmetic, sink/local/top-K union, dense fallbacks,
// per-layer budgets and the three GQA modes, each against a brute-force
// reimplementation written here with a full sort.
#include "selector/select.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "kernels/cpu/kernels_cpu.h"
#include "tests/testing/reference.h"

namespace questkv {
namespace {

using Rows = std::vector<std::vector<int>>;

// A summary slab of random boxes (lo <= hi), pages listed in shuffled PageId
// order so logical index and PageId differ.
struct Pages {
  std::vector<float> slab;
  std::vector<uint32_t> ids;
};
Pages RandomPages(const Geometry& g, int n, uint64_t seed) {
  Pages p;
  const int d = g.head_dim;
  p.slab = test::RandomNormal(std::size_t(n + 3) * g.kv_heads * 2 * d, seed);
  for (std::size_t i = 0; i < p.slab.size(); i += 2 * d)
    for (int j = 0; j < d; ++j)
      if (p.slab[i + j] > p.slab[i + d + j]) std::swap(p.slab[i + j], p.slab[i + d + j]);
  p.ids.resize(n + 3);
  std::iota(p.ids.begin(), p.ids.end(), 0u);
  std::shuffle(p.ids.begin(), p.ids.end(), std::mt19937_64(seed));
  p.ids.resize(n);
  return p;
}

Rows RowsOf(const PageSelection& s, int kv_heads) {
  Rows rows;
  for (int h = 0; h < kv_heads; ++h) rows.emplace_back(s.row(h), s.row(h) + s.count(h));
  return rows;
}

// The brute-force policy: same definition as select.h, built from a full sort.
std::vector<int> TopByFullSort(const std::vector<float>& s, const std::set<int>& exclude, int k) {
  std::vector<int> idx;
  for (int i = 0; i < int(s.size()); ++i)
    if (!exclude.count(i)) idx.push_back(i);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return s[a] > s[b]; });
  idx.resize(std::min<std::size_t>(idx.size(), std::max(k, 0)));
  return idx;
}

Rows BruteForce(const Geometry& g, const SelectionPolicy& p, int layer, int n,
                const std::vector<float>& scores) {
  const int64_t budget = p.token_budget_for(layer) / g.page_size;
  Rows rows(g.kv_heads);
  if (p.is_dense(layer) || budget >= n) {
    for (auto& r : rows) {
      r.resize(n);
      std::iota(r.begin(), r.end(), 0);
    }
    return rows;
  }
  std::set<int> fixed;
  for (int i = 0; i < std::min(p.sink_pages, n); ++i) fixed.insert(i);
  for (int i = std::max(0, n - p.local_pages); i < n; ++i) fixed.insert(i);
  const int k = int(budget) - int(fixed.size());
  const int group = g.group();
  for (int h = 0; h < g.kv_heads; ++h) {
    std::set<int> row = fixed;
    auto head = [&](int gi) {
      const float* s = scores.data() + std::size_t(h * group + gi) * n;
      return std::vector<float>(s, s + n);
    };
    if (p.gqa == GqaMode::kUnion) {
      for (int gi = 0; gi < group; ++gi)
        for (int i : TopByFullSort(head(gi), fixed, k)) row.insert(i);
    } else {
      std::vector<float> agg = head(0);
      for (int gi = 1; gi < group; ++gi) {
        const auto s = head(gi);
        for (int i = 0; i < n; ++i)
          agg[i] = p.gqa == GqaMode::kMax ? std::max(agg[i], s[i]) : agg[i] + s[i];
      }
      if (p.gqa == GqaMode::kMean)
        for (float& x : agg) x /= float(group);
      for (int i : TopByFullSort(agg, fixed, k)) row.insert(i);
    }
    rows[h].assign(row.begin(), row.end());
  }
  return rows;
}

Geometry MakeGeometry(int q_heads, int kv_heads, int page_size = 16, int head_dim = 16) {
  Geometry g;
  g.layers = 4;
  g.q_heads = q_heads;
  g.kv_heads = kv_heads;
  g.head_dim = head_dim;
  g.page_size = page_size;
  return g;
}

SelectionPolicy MakePolicy(int64_t token_budget, int sink, int local, GqaMode mode) {
  SelectionPolicy p;
  p.token_budget = token_budget;
  p.sink_pages = sink;
  p.local_pages = local;
  p.gqa = mode;
  p.dense_layers = {0};
  return p;
}

struct Selected {
  Rows rows;
  std::vector<float> scores;
};
Selected Select(const Geometry& g, const SelectionPolicy& p, int layer, int n, uint64_t seed) {
  const Pages pages = RandomPages(g, n, seed);
  const auto q = test::RandomNormal(std::size_t(g.q_heads) * g.head_dim, seed + 1);
  Selector sel(g, p);
  PageSelection out;
  const Status st = sel.Select({q.data(), pages.slab.data(), pages.ids.data(), n, layer}, &out);
  EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(out.indptr.size(), std::size_t(g.kv_heads) + 1);
  return {RowsOf(out, g.kv_heads), sel.scores()};
}

TEST(Select, RejectsBadInput) {
  const Geometry g = MakeGeometry(4, 2);
  Selector sel(g, MakePolicy(256, 1, 2, GqaMode::kMax));
  const Pages pages = RandomPages(g, 8, 1);
  const auto q = test::RandomNormal(4 * 16, 2);
  PageSelection out;
  const SelectInput good{q.data(), pages.slab.data(), pages.ids.data(), 8, 2};
  ASSERT_TRUE(sel.Select(good, &out).ok());
  SelectInput in = good;
  in.q = nullptr;
  EXPECT_EQ(sel.Select(in, &out).code(), Code::kInvalidArgument);
  in = good;
  in.summary_slab = nullptr;
  EXPECT_EQ(sel.Select(in, &out).code(), Code::kInvalidArgument);
  in = good;
  in.page_ids = nullptr;
  EXPECT_EQ(sel.Select(in, &out).code(), Code::kInvalidArgument);
  in = good;
  in.num_pages = 0;
  EXPECT_EQ(sel.Select(in, &out).code(), Code::kInvalidArgument);
  in = good;
  in.layer = 4;
  EXPECT_EQ(sel.Select(in, &out).code(), Code::kInvalidArgument);
  EXPECT_EQ(sel.Select(good, nullptr).code(), Code::kInvalidArgument);
}

// scores() is [Hq][P], query head hq scored against KV head hq / G, in
// logical page order: checked against the formula on the summaries.
TEST(Select, ScoresAreUpperBoundsPerQueryHead) {
  const Geometry g = MakeGeometry(8, 2);
  const int n = 30;
  const Pages pages = RandomPages(g, n, 5);
  const auto q = test::RandomNormal(8 * 16, 6);
  Selector sel(g, MakePolicy(64, 1, 1, GqaMode::kMax));
  PageSelection out;
  ASSERT_TRUE(sel.Select({q.data(), pages.slab.data(), pages.ids.data(), n, 1}, &out).ok());
  ASSERT_EQ(sel.scores().size(), std::size_t(8) * n);
  for (int hq = 0; hq < 8; ++hq)
    for (int i = 0; i < n; ++i) {
      const float* lo = pages.slab.data() + (std::size_t(pages.ids[i]) * 2 + hq / 4) * 2 * 16;
      double u = 0;
      for (int j = 0; j < 16; ++j)
        u += std::max(double(q[hq * 16 + j]) * lo[j], double(q[hq * 16 + j]) * lo[16 + j]);
      ASSERT_NEAR(sel.scores()[hq * n + i], u, 1e-4) << "hq=" << hq << " i=" << i;
    }
}

TEST(Select, BudgetCoveringAllPagesSelectsAllUnscored) {
  const Geometry g = MakeGeometry(4, 2);
  for (int n : {1, 5, 16}) {
    const Selected r = Select(g, MakePolicy(16 * 16 + 15, 1, 2, GqaMode::kMax), 1, n, 10 + n);
    for (const auto& row : r.rows) EXPECT_EQ(int(row.size()), n);
    EXPECT_TRUE(r.scores.empty());
  }
  // One page over the budget: now the selector must rank.
  const Selected r = Select(g, MakePolicy(16 * 16, 1, 2, GqaMode::kMax), 1, 17, 20);
  for (const auto& row : r.rows) EXPECT_EQ(row.size(), 16u);
  EXPECT_EQ(r.scores.size(), 4u * 17);
}

TEST(Select, DenseLayerSelectsAllUnscored) {
  const Geometry g = MakeGeometry(4, 2);
  SelectionPolicy p = MakePolicy(64, 1, 2, GqaMode::kMax);
  p.dense_layers = {0, 3};
  for (int layer : {0, 3}) {
    const Selected r = Select(g, p, layer, 100, 30);
    for (const auto& row : r.rows) EXPECT_EQ(row.size(), 100u);
    EXPECT_TRUE(r.scores.empty());
  }
  const Selected sparse = Select(g, p, 1, 100, 30);
  for (const auto& row : sparse.rows) EXPECT_EQ(row.size(), 4u);
}

// Every row holds the sink and local pages, is ascending without duplicates,
// has exactly the page budget, and equals the brute force, for every mode.
TEST(Select, SinkLocalTopKUnionMatchesBruteForce) {
  uint64_t seed = 100;
  for (GqaMode mode : {GqaMode::kMax, GqaMode::kMean, GqaMode::kUnion})
    for (int sink : {0, 1, 3})
      for (int local : {1, 2, 8})
        for (int n : {1, 2, 5, 12, 40})
          for (int extra : {0, 1, 4}) {
            const Geometry g = MakeGeometry(4, 2);
            const int budget_pages = sink + local + extra;
            const SelectionPolicy p = MakePolicy(budget_pages * 16 + 15, sink, local, mode);
            const Selected r = Select(g, p, 2, n, seed++);
            const Rows expected =
                r.scores.empty() ? BruteForce(g, p, 2, n, {}) : BruteForce(g, p, 2, n, r.scores);
            ASSERT_EQ(r.rows, expected) << GqaModeName(mode) << " sink=" << sink
                                        << " local=" << local << " n=" << n << " extra=" << extra;
            for (const auto& row : r.rows) {
              ASSERT_TRUE(std::is_sorted(row.begin(), row.end()));
              ASSERT_EQ(std::set<int>(row.begin(), row.end()).size(), row.size());
              for (int i = 0; i < std::min(sink, n); ++i)
                ASSERT_TRUE(std::count(row.begin(), row.end(), i));
              for (int i = std::max(0, n - local); i < n; ++i)
                ASSERT_TRUE(std::count(row.begin(), row.end(), i));
              if (mode != GqaMode::kUnion) {
                ASSERT_EQ(int(row.size()), std::min(n, budget_pages));
              }
            }
          }
}

// Each GQA mode against the brute force over group sizes and seeds; kUnion
// may exceed the budget (up to G× the top-K share) and must for some seed.
TEST(Select, GqaModesMatchBruteForce) {
  uint64_t seed = 5000;
  bool union_exceeded_budget = false;
  for (GqaMode mode : {GqaMode::kMax, GqaMode::kMean, GqaMode::kUnion})
    for (int group : {1, 2, 4, 8})
      for (int rep = 0; rep < 10; ++rep) {
        const Geometry g = MakeGeometry(2 * group, 2, 16, 32);
        const SelectionPolicy p = MakePolicy(12 * 16, 1, 3, mode);
        const int n = 60;
        const Selected r = Select(g, p, 3, n, seed++);
        ASSERT_EQ(r.rows, BruteForce(g, p, 3, n, r.scores)) << GqaModeName(mode) << " G=" << group;
        for (const auto& row : r.rows) {
          ASSERT_LE(int(row.size()), 4 + group * 8);
          union_exceeded_budget |= int(row.size()) > 12;
        }
      }
  EXPECT_TRUE(union_exceeded_budget);
}

TEST(Select, PerLayerBudgets) {
  const Geometry g = MakeGeometry(4, 2);
  SelectionPolicy p = MakePolicy(10 * 16, 1, 2, GqaMode::kMax);
  p.layer_token_budgets = {-1, -1, 5 * 16 + 7, 30 * 16};
  const int expected[] = {100, 10, 5, 30};  // layer 0 dense
  for (int layer = 0; layer < 4; ++layer) {
    const Selected r = Select(g, p, layer, 100, 40 + layer);
    for (const auto& row : r.rows) EXPECT_EQ(int(row.size()), expected[layer]) << "layer " << layer;
    if (layer > 0) {
      EXPECT_EQ(r.rows, BruteForce(g, p, layer, 100, r.scores));
    }
  }
}

// Identical summaries tie every score: top-K takes the lowest free indices.
TEST(Select, TiesGoToLowerPageIndex) {
  const Geometry g = MakeGeometry(2, 1, 16, 8);
  std::vector<float> slab;
  for (int p = 0; p < 20; ++p)
    for (int x : {-1, 1})
      for (int j = 0; j < 8; ++j) slab.push_back(float(x));
  std::vector<uint32_t> ids(20);
  std::iota(ids.begin(), ids.end(), 0u);
  const auto q = test::RandomNormal(2 * 8, 3);
  for (GqaMode mode : {GqaMode::kMax, GqaMode::kMean, GqaMode::kUnion}) {
    Selector sel(g, MakePolicy(7 * 16, 2, 2, mode));
    PageSelection out;
    ASSERT_TRUE(sel.Select({q.data(), slab.data(), ids.data(), 20, 1}, &out).ok());
    EXPECT_EQ(RowsOf(out, 1)[0], (std::vector<int>{0, 1, 2, 3, 4, 18, 19})) << GqaModeName(mode);
  }
}

// Seed §1.2's debugging fallback: with a budget covering every page, the
// pipeline append -> select -> attend must equal dense attention (fp32, 1e-5).
TEST(Select, FullBudgetPipelineEqualsDenseAttention) {
  for (int page_size : {1, 7, 16, 17})
    for (int group : {1, 4}) {
      const Geometry g = MakeGeometry(2 * group, 2, page_size, 64);
      const int tokens = 11 * page_size + page_size / 2 + 1, d = 64;
      const int n = (tokens + page_size - 1) / page_size;
      const auto k =
          test::RandomNormal(std::size_t(tokens) * 2 * d, 70 + page_size);  // [T][Hkv][D]
      const auto v = test::RandomNormal(k.size(), 71 + page_size);
      std::vector<float> pages(std::size_t(n) * g.page_elems(), 1e30f),
          slab(std::size_t(n) * g.summary_elems());
      std::vector<uint32_t> ids(n);
      for (int p = 0; p < n; ++p) {
        ids[p] = uint32_t(n - 1 - p);  // PageIds in reverse of logical order
        float* summary = slab.data() + ids[p] * g.summary_elems();
        kernels::ResetSummaryCpu(summary, 2, d);
        const int len = std::min(page_size, tokens - p * page_size);
        const std::size_t at = std::size_t(p) * page_size * 2 * d;
        kernels::AppendTokensCpu(pages.data() + ids[p] * g.page_elems(), summary, 2, page_size, d,
                                 0, k.data() + at, v.data() + at, len);
      }
      const auto q = test::RandomNormal(std::size_t(g.q_heads) * d, 72 + page_size);
      SelectionPolicy p = MakePolicy(int64_t(n) * page_size, 1, 1, GqaMode::kMax);
      Selector sel(g, p);
      PageSelection out;
      ASSERT_TRUE(sel.Select({q.data(), slab.data(), ids.data(), n, 1}, &out).ok());
      for (int h = 0; h < 2; ++h) {
        ASSERT_EQ(out.count(h), n);
        std::vector<kernels::HeadPageRef> refs;
        for (int i = 0; i < out.count(h); ++i) {
          const int lp = out.row(h)[i];
          const float* base = pages.data() + ids[lp] * g.page_elems();
          refs.push_back({base + h * g.head_page_elems(), base + (2 + h) * g.head_page_elems(),
                          std::min(page_size, tokens - lp * page_size)});
        }
        std::vector<float> o(std::size_t(group) * d), m(group), den(group);
        const double scale = 1 / std::sqrt(double(d));
        kernels::AttendPagesCpu(q.data() + std::size_t(h) * group * d, group, d, refs.data(), n,
                                float(scale), o.data(), m.data(), den.data());
        for (int gi = 0; gi < group; ++gi) {
          std::vector<float> dense(d);
          // Token-major input: head h's rows sit at stride Hkv·D.
          kernels::DenseAttentionReference(q.data() + std::size_t(h * group + gi) * d,
                                           k.data() + h * d, v.data() + h * d, tokens, d, 2 * d,
                                           scale, dense.data());
          ASSERT_LE(test::RelL2Error(o.data() + gi * d, dense.data(), d), 1e-5)
              << "S=" << page_size << " G=" << group << " h=" << h;
        }
      }
    }
}

// Seed §1.1's four pages A–D (true max 10, 3, 2, 1; bounds 10, 14, 12, 4) plus
// a tail page E that the local window always takes: with K = 2 Quest picks
// B and C and misses A; K = 3 recalls A.
TEST(Select, SeedFourPageExample) {
  const Geometry g = MakeGeometry(1, 1, 2, 2);
  const std::vector<std::vector<float>> keys = {
      {5, 5}, {7, -4, -4, 7}, {6, -4, -4, 6}, {2, -1, -1, 2}, {0, 0}};
  std::vector<float> slab(keys.size() * 4), page(2 * 2 * 2);
  for (std::size_t p = 0; p < keys.size(); ++p) {
    kernels::ResetSummaryCpu(slab.data() + 4 * p, 1, 2);
    kernels::AppendTokensCpu(page.data(), slab.data() + 4 * p, 1, 2, 2, 0, keys[p].data(),
                             keys[p].data(), int(keys[p].size() / 2));
  }
  const uint32_t ids[] = {0, 1, 2, 3, 4};
  const float q[] = {1, 1};
  for (auto [budget_pages, expected] :
       {std::pair{3, std::vector<int>{1, 2, 4}}, std::pair{4, std::vector<int>{0, 1, 2, 4}}}) {
    Selector sel(g, MakePolicy(budget_pages * 2, 0, 1, GqaMode::kMax));
    PageSelection out;
    ASSERT_TRUE(sel.Select({q, slab.data(), ids, 5, 1}, &out).ok());
    EXPECT_EQ(RowsOf(out, 1)[0], expected);
  }
}

}  // namespace
}  // namespace questkv
