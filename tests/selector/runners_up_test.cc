// Selector runners-up (the prefetch candidates): the best pages by group-max
// score outside the selection, against a full sort written here.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <set>

#include "kernels/cpu/kernels_cpu.h"
#include "selector/select.h"
#include "tests/testing/reference.h"

namespace questkv {
namespace {

TEST(RunnersUp, AreTheBestUnselectedPagesByGroupMax) {
  for (GqaMode mode : {GqaMode::kMax, GqaMode::kMean, GqaMode::kUnion}) {
    Geometry g;
    g.layers = 1, g.q_heads = 8, g.kv_heads = 2, g.head_dim = 16, g.page_size = 4;
    SelectionPolicy p;
    p.token_budget = 10 * 4, p.sink_pages = 1, p.local_pages = 2, p.gqa = mode, p.dense_layers = {};
    const int n = 300;
    auto slab = test::RandomNormal(std::size_t(n) * g.kv_heads * 2 * g.head_dim, 5);
    for (std::size_t i = 0; i < slab.size(); i += 2 * g.head_dim)
      for (int j = 0; j < g.head_dim; ++j)
        if (slab[i + j] > slab[i + g.head_dim + j]) std::swap(slab[i + j], slab[i + g.head_dim + j]);
    std::vector<uint32_t> ids(n);
    std::iota(ids.begin(), ids.end(), 0u);
    auto q = test::RandomNormal(std::size_t(g.q_heads) * g.head_dim, 6);
    Selector sel(g, p);
    SelectInput in{q.data(), slab.data(), ids.data(), n, 0};
    PageSelection out, next;
    ASSERT_TRUE(sel.Select(in, &out, &next, 5).ok());
    const std::vector<float>& scores = sel.scores();
    for (int h = 0; h < g.kv_heads; ++h) {
      std::set<int> chosen(out.row(h), out.row(h) + out.count(h));
      std::vector<float> gmax(n, -INFINITY);
      for (int gi = 0; gi < g.group(); ++gi)
        for (int i = 0; i < n; ++i) gmax[i] = std::max(gmax[i], scores[(h * g.group() + gi) * n + i]);
      std::vector<int> rest;
      for (int i = 0; i < n; ++i)
        if (!chosen.count(i)) rest.push_back(i);
      std::stable_sort(rest.begin(), rest.end(), [&](int a, int b) { return gmax[a] > gmax[b]; });
      rest.resize(5);
      std::sort(rest.begin(), rest.end());
      EXPECT_EQ(std::vector<int>(next.row(h), next.row(h) + next.count(h)), rest) << "mode " << int(mode);
    }
  }
}

TEST(RunnersUp, EmptyWhenEverythingIsSelected) {
  Geometry g;
  g.layers = 1, g.q_heads = 2, g.kv_heads = 1, g.head_dim = 4, g.page_size = 4;
  SelectionPolicy p;
  p.token_budget = 1000, p.dense_layers = {};
  auto slab = test::RandomNormal(10 * 2 * 4, 1);
  std::vector<uint32_t> ids = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  auto q = test::RandomNormal(8, 2);
  Selector sel(g, p);
  PageSelection out, next;
  ASSERT_TRUE(sel.Select({q.data(), slab.data(), ids.data(), 10, 0}, &out, &next, 3).ok());
  EXPECT_EQ(out.count(0), 10);
  EXPECT_EQ(next.count(0), 0);
}

}  // namespace
}  // namespace questkv
