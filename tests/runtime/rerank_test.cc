// SelectionPolicy::rerank against a plain model of its definition, built
// from the gathered K/V: page boxes give the bound U_p (summed in double),
// aggregated over the group; the top ceil(rerank * K) candidates are ranked
// again by their exact maximum logit (aggregated the same way) and the best
// K kept, beside the sink and local pages. A factor past the page count is
// the exact-page-max oracle. Also: the key bytes it reports, and bad factors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "questkv/runtime.h"
#include "tests/testing/reference.h"

namespace questkv {
namespace {

constexpr int kHq = 4, kHkv = 2, kD = 16, kS = 4;

Config Base(double rerank, GqaMode gqa) {
  Config c;
  c.geometry.layers = 1, c.geometry.q_heads = kHq, c.geometry.kv_heads = kHkv, c.geometry.head_dim = kD;
  c.geometry.page_size = kS;
  c.policy.token_budget = 8 * kS;
  c.policy.sink_pages = 1;
  c.policy.local_pages = 2;
  c.policy.dense_layers = {};
  c.policy.gqa = gqa;
  c.policy.rerank = rerank;
  c.max_pages = 4096;
  return c;
}

// The selected pages of each KV head under the definition above.
std::vector<std::vector<int32_t>> Reference(const DenseView& kv, const float* q, const SelectionPolicy& pol) {
  const int T = kv.tokens, P = (T + kS - 1) / kS, G = kHq / kHkv;
  const int budget = int(pol.token_budget / kS);
  std::vector<std::vector<int32_t>> rows(kHkv);
  for (int h = 0; h < kHkv; ++h) {
    const float* k = kv.k.data() + std::size_t(h) * T * kD;
    std::vector<bool> fixed(P, false);
    for (int p = 0; p < std::min(pol.sink_pages, P); ++p) fixed[p] = true;
    for (int p = std::max(0, P - pol.local_pages); p < P; ++p) fixed[p] = true;
    const int nfixed = int(std::count(fixed.begin(), fixed.end(), true));
    const int top = std::max(0, budget - nfixed);
    auto aggregate = [&](auto per_head) {
      double a = pol.gqa == GqaMode::kMax ? -std::numeric_limits<double>::infinity() : 0;
      for (int g = 0; g < G; ++g) {
        const double x = per_head(q + std::size_t(h * G + g) * kD);
        a = pol.gqa == GqaMode::kMax ? std::max(a, x) : a + x / G;
      }
      return a;
    };
    std::vector<std::pair<double, int>> bound, exact;  // (-score, page)
    for (int p = 0; p < P; ++p) {
      if (fixed[p]) continue;
      const int t0 = p * kS, t1 = std::min(T, t0 + kS);
      bound.push_back({-aggregate([&](const float* qh) {
                         double u = 0;
                         for (int d = 0; d < kD; ++d) {
                           float lo = k[std::size_t(t0) * kD + d], hi = lo;
                           for (int t = t0; t < t1; ++t) {
                             lo = std::min(lo, k[std::size_t(t) * kD + d]);
                             hi = std::max(hi, k[std::size_t(t) * kD + d]);
                           }
                           u += std::max(double(qh[d]) * lo, double(qh[d]) * hi);
                         }
                         return u;
                       }),
                       p});
    }
    std::sort(bound.begin(), bound.end());
    const int c = int(std::min<double>(std::ceil(pol.rerank * top), double(bound.size())));
    for (int i = 0; i < c; ++i) {
      const int p = bound[i].second, t0 = p * kS, t1 = std::min(T, t0 + kS);
      exact.push_back({-aggregate([&](const float* qh) {
                         double best = -std::numeric_limits<double>::infinity();
                         for (int t = t0; t < t1; ++t) {
                           double dot = 0;
                           for (int d = 0; d < kD; ++d) dot += double(qh[d]) * k[std::size_t(t) * kD + d];
                           best = std::max(best, dot);
                         }
                         return best;
                       }),
                       p});
    }
    std::sort(exact.begin(), exact.end());
    for (int p = 0; p < P; ++p)
      if (fixed[p]) rows[h].push_back(p);
    for (int i = 0; i < std::min(top, int(exact.size())); ++i) rows[h].push_back(exact[i].second);
    std::sort(rows[h].begin(), rows[h].end());
  }
  return rows;
}

class Rerank : public ::testing::TestWithParam<std::tuple<double, GqaMode>> {};

TEST_P(Rerank, SelectsAsItsDefinition) {
  const auto [factor, gqa] = GetParam();
  const Config c = Base(factor, gqa);
  auto rt = Runtime::Create(c);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  const SeqId s = *(*rt)->CreateSequence();
  const std::size_t row = std::size_t(kHkv) * kD;
  int differs_from_quest = 0;
  for (int64_t len : {10, 37, 130, 257}) {
    const int64_t have = *(*rt)->Length(s, 0);
    const auto k = test::RandomNormal((len - have) * row, 11 + len), v = test::RandomNormal((len - have) * row, 12 + len);
    ASSERT_TRUE((*rt)->Append(s, 0, k.data(), v.data(), len - have).ok());
    const DenseView kv = *(*rt)->Gather(s, 0);
    for (int trial = 0; trial < 4; ++trial) {
      const auto q = test::RandomNormal(std::size_t(kHq) * kD, 100 * len + trial);
      std::vector<float> out(q.size());
      std::vector<PageSelection> sel;
      AttendStats stats;
      const SeqId one[] = {s};
      ASSERT_TRUE((*rt)->DecodeAttention(one, 0, q.data(), out.data(), &sel, &stats).ok());
      const auto want = Reference(kv, q.data(), c.policy);
      for (int h = 0; h < kHkv; ++h) {
        const std::vector<int32_t> got(sel[0].row(h), sel[0].row(h) + sel[0].count(h));
        EXPECT_EQ(got, want[h]) << "tokens " << len << " trial " << trial << " head " << h;
      }
      // Quest's own selection, to see that the re-rank changes something.
      SelectionPolicy plain = c.policy;
      plain.rerank = 1;
      const auto quest = Reference(kv, q.data(), plain);
      for (int h = 0; h < kHkv; ++h) differs_from_quest += quest[h] != want[h];
      // Key bytes: the candidates' keys, every KV head.
      const int P = int((len + kS - 1) / kS), budget = int(c.policy.token_budget / kS);
      if (P > budget) {
        const int fixed = 1 + 2, top = budget - fixed;
        const int64_t cands = std::min<int64_t>(int64_t(std::ceil(factor * top)), P - fixed);
        EXPECT_EQ(stats.rerank_key_bytes, kHkv * cands * kS * kD * 4);
      } else {
        EXPECT_EQ(stats.rerank_key_bytes, 0);
      }
    }
  }
  if (factor > 1) {
    EXPECT_GT(differs_from_quest, 0) << "the re-rank never changed Quest's selection here";
  }
}

INSTANTIATE_TEST_SUITE_P(Factors, Rerank,
                         ::testing::Combine(::testing::Values(1.0, 1.5, 3.0, 1e6),
                                            ::testing::Values(GqaMode::kMax, GqaMode::kMean)));

TEST(RerankConfig, BadFactorsAreRefused) {
  for (double bad : {0.5, -1.0, std::nan(""), 2e6}) {
    auto rt = Runtime::Create(Base(bad, GqaMode::kMax));
    EXPECT_EQ(rt.status().code(), Code::kInvalidArgument) << bad;
  }
  auto rt = Runtime::Create(Base(2, GqaMode::kUnion));
  EXPECT_EQ(rt.status().code(), Code::kInvalidArgument);
  EXPECT_NE(rt.status().message().find("union"), std::string::npos) << rt.status().ToString();
}

}  // namespace
}  // namespace questkv
