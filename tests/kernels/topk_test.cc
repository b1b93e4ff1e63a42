// Top-K against a full sort, as exact index lists: the order is total (score
// desc, index asc, NaN last), so even with ties there is one right answer.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cpu/kernels_cpu.h"

namespace questkv::kernels {
namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<int> SortedTopK(const std::vector<float>& s, const std::vector<uint8_t>& skip, int k) {
  std::vector<int> idx;
  for (int i = 0; i < int(s.size()); ++i)
    if (skip.empty() || !skip[i]) idx.push_back(i);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) {
    if (std::isnan(s[a]) || std::isnan(s[b])) return !std::isnan(s[a]) && std::isnan(s[b]);
    return s[a] > s[b];
  });
  idx.resize(std::min<std::size_t>(idx.size(), std::max(k, 0)));
  std::sort(idx.begin(), idx.end());
  return idx;
}

std::vector<int> RunTopK(const std::vector<float>& s, const std::vector<uint8_t>& skip, int k) {
  const int n = int(s.size());
  std::vector<int> out(std::max(n, 1), -1), scratch(std::max(n, 1));
  const int got =
      TopKCpu(s.data(), n, skip.empty() ? nullptr : skip.data(), k, out.data(), scratch.data());
  out.resize(got);
  return out;
}

// Scores drawn from a handful of values (many ties), with NaN and ±inf mixed in.
std::vector<float> TieHeavyScores(int n, std::mt19937_64& rng) {
  const float values[] = {-INFINITY, -1.f, 0.f, -0.f, 2.f, 2.f, 3.5f, INFINITY, kNaN};
  std::uniform_int_distribution<int> pick(0, 8);
  std::vector<float> s(n);
  for (float& x : s) x = values[pick(rng)];
  return s;
}

TEST(TopK, MatchesFullSortWithTiesAndNaN) {
  std::mt19937_64 rng(7);
  for (int n : {1, 2, 3, 5, 16, 64, 1000})
    for (bool use_skip : {false, true})
      for (int rep = 0; rep < 5; ++rep) {
        const auto s = TieHeavyScores(n, rng);
        std::vector<uint8_t> skip;
        if (use_skip)
          for (int i = 0; i < n; ++i) skip.push_back(rng() % 4 == 0);
        for (int k : {0, 1, 2, n / 2, n - 1, n, n + 3})
          ASSERT_EQ(RunTopK(s, skip, k), SortedTopK(s, skip, k))
              << "n=" << n << " k=" << k << " skip=" << use_skip;
      }
}

TEST(TopK, MatchesFullSortOnDistinctScores) {
  std::mt19937_64 rng(8);
  std::normal_distribution<float> normal;
  for (int n : {2048, 65536}) {
    std::vector<float> s(n);
    for (float& x : s) x = normal(rng);
    for (int k : {64, 256}) ASSERT_EQ(RunTopK(s, {}, k), SortedTopK(s, {}, k));
  }
}

// Floats a few ulps apart share every key digit but the last, and denormals,
// ±0, the extremes and NaN sit at the ends of the key range: radix select must
// order them all exactly like comparisons do.
TEST(TopK, MatchesFullSortOnNearbyAndExtremeFloats) {
  std::mt19937_64 rng(9);
  const float specials[] = {0.f,
                            -0.f,
                            1e-45f,
                            -1e-45f,
                            1e-40f,
                            std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::lowest(),
                            INFINITY,
                            -INFINITY,
                            kNaN};
  for (int rep = 0; rep < 20; ++rep) {
    const int n = 1 + int(rng() % 3000);
    std::vector<float> s(n);
    for (float& x : s) {
      const float base = rng() % 2 ? 1.f : -1.f;
      float v = base;
      for (int step = int(rng() % 40); step > 0; --step) v = std::nextafter(v, 2.f);
      x = rng() % 10 == 0 ? specials[rng() % 10] : v;
    }
    for (int k : {1, 7, n / 3, n - 1})
      ASSERT_EQ(RunTopK(s, {}, k), SortedTopK(s, {}, k)) << "n=" << n;
  }
}

TEST(TopK, EqualScoresGoToLowerIndices) {
  const std::vector<float> s(10, 1.f);
  EXPECT_EQ(RunTopK(s, {}, 3), (std::vector<int>{0, 1, 2}));
  const std::vector<uint8_t> skip = {1, 0, 1, 0, 0, 0, 0, 0, 0, 0};
  EXPECT_EQ(RunTopK(s, skip, 3), (std::vector<int>{1, 3, 4}));
}

TEST(TopK, NaNRanksBelowEveryNumber) {
  const std::vector<float> s = {kNaN, -INFINITY, kNaN, -1e30f};
  EXPECT_EQ(RunTopK(s, {}, 2), (std::vector<int>{1, 3}));
  EXPECT_EQ(RunTopK(s, {}, 3), (std::vector<int>{0, 1, 3}));
}

TEST(TopK, AllSkippedChoosesNothing) {
  const std::vector<float> s = {1, 2, 3};
  EXPECT_TRUE(RunTopK(s, {1, 1, 1}, 2).empty());
  EXPECT_TRUE(RunTopK({}, {}, 2).empty());
}

}  // namespace
}  // namespace questkv::kernels
