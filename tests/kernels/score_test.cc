// Page scores: the formula of eq. 2–3, the bound of eq. 4, and the seed's
// hand examples (§1.1).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cpu/kernels_cpu.h"
#include "tests/testing/reference.h"

namespace questkv::kernels {
namespace {

// Σ_j max(q_j·lo_j, q_j·hi_j) in double, and the scale of its rounding error.
struct Bound {
  double value, magnitude;
};
Bound BruteBound(const float* q, const float* lo, const float* hi, int d) {
  Bound b{0, 0};
  for (int j = 0; j < d; ++j) {
    const double t = std::max(double(q[j]) * lo[j], double(q[j]) * hi[j]);
    b.value += t;
    b.magnitude += std::abs(t);
  }
  return b;
}

TEST(ScorePages, MatchesFormula) {
  uint64_t seed = 1;
  for (int group : {1, 2, 4, 8})
    for (int d : {1, 7, 64, 128}) {
      const int hkv = 3, slab_pages = 40, n = 25;
      // Boxes with lo <= hi, in a slab larger than the pages scored.
      auto slab = test::RandomNormal(std::size_t(slab_pages) * hkv * 2 * d, seed++);
      for (std::size_t i = 0; i < slab.size(); i += 2 * d)
        for (int j = 0; j < d; ++j)
          if (slab[i + j] > slab[i + d + j]) std::swap(slab[i + j], slab[i + d + j]);
      std::vector<uint32_t> ids(slab_pages);
      std::iota(ids.begin(), ids.end(), 0u);
      std::shuffle(ids.begin(), ids.end(), std::mt19937_64(seed++));
      const auto q = test::RandomNormal(std::size_t(group) * d, seed++);
      for (int h = 0; h < hkv; ++h) {
        std::vector<float> scores(std::size_t(group) * n);
        ScorePagesCpu(q.data(), group, d, slab.data(), hkv, h, ids.data(), n, scores.data());
        for (int g = 0; g < group; ++g)
          for (int i = 0; i < n; ++i) {
            const float* lo = slab.data() + (std::size_t(ids[i]) * hkv + h) * 2 * d;
            const Bound b = BruteBound(q.data() + g * d, lo, lo + d, d);
            ASSERT_NEAR(scores[g * n + i], b.value, 1e-5 * b.magnitude + 1e-30)
                << "G=" << group << " D=" << d << " h=" << h << " g=" << g << " i=" << i;
          }
      }
    }
}

// Eq. 4: U_p(q) >= max_r q·k_r over the valid keys of every page, including
// partial tail pages, and equality for one-token pages (the box is the key).
TEST(ScorePages, UpperBoundsTrueMaxLogit) {
  uint64_t seed = 50;
  for (int s : {1, 3, 7, 16, 17})
    for (int len : {1, s / 2 + 1, s}) {
      const int hkv = 2, d = 32, group = 4, n = 12;
      std::vector<float> page(2 * std::size_t(hkv) * s * d);
      std::vector<float> slab(std::size_t(n) * hkv * 2 * d);
      std::vector<float> keys_all;
      for (int p = 0; p < n; ++p) {
        const auto keys = test::RandomNormal(std::size_t(len) * hkv * d, seed++);
        float* summary = slab.data() + std::size_t(p) * hkv * 2 * d;
        ResetSummaryCpu(summary, hkv, d);
        AppendTokensCpu(page.data(), summary, hkv, s, d, 0, keys.data(), keys.data(), len);
        keys_all.insert(keys_all.end(), keys.begin(), keys.end());
      }
      std::vector<uint32_t> ids(n);
      std::iota(ids.begin(), ids.end(), 0u);
      const auto q = test::RandomNormal(std::size_t(group) * d, seed++);
      for (int h = 0; h < hkv; ++h) {
        std::vector<float> scores(std::size_t(group) * n);
        ScorePagesCpu(q.data(), group, d, slab.data(), hkv, h, ids.data(), n, scores.data());
        for (int g = 0; g < group; ++g)
          for (int p = 0; p < n; ++p) {
            double best = -INFINITY, magnitude = 0;
            for (int r = 0; r < len; ++r) {
              const float* k = keys_all.data() + ((std::size_t(p) * len + r) * hkv + h) * d;
              double dot = 0;
              for (int j = 0; j < d; ++j) {
                dot += double(q[g * d + j]) * k[j];
                magnitude += std::abs(double(q[g * d + j]) * k[j]);
              }
              best = std::max(best, dot);
            }
            const double tol = 1e-5 * magnitude;
            ASSERT_GE(scores[g * n + p], best - tol) << "S=" << s << " len=" << len;
            if (len == 1) {
              ASSERT_NEAR(scores[g * n + p], best, tol);
            }
          }
      }
    }
}

// Builds a one-head slab from pages of 2-D keys.
std::vector<float> SlabOf(const std::vector<std::vector<float>>& pages, int s) {
  std::vector<float> slab(pages.size() * 4), page(2 * std::size_t(s) * 2, 1e30f);
  for (std::size_t p = 0; p < pages.size(); ++p) {
    ResetSummaryCpu(slab.data() + 4 * p, 1, 2);
    const int n = int(pages[p].size() / 2);
    AppendTokensCpu(page.data(), slab.data() + 4 * p, 1, s, 2, 0, pages[p].data(), pages[p].data(),
                    n);
  }
  return slab;
}

// Seed §1.1: the page (1,4), (3,-2), (-1,1) with q = (2,-1) scores 6 + 2 = 8,
// and so does (3,4), (-1,-2) (same box) though its true max is only 2.
// A float with `bits` significant bits: the value of an f16 (11) or bf16 (8).
float RoundToBits(float x, int bits) {
  int e = 0;
  const float m = std::frexp(x, &e);
  return std::ldexp(std::nearbyint(std::ldexp(m, bits)), e - bits);
}

// The premise of the GPU score kernels' fma form (common.cuh, ScoreTerm):
// with 16-bit q and summaries every product is exact in float, so one fma
// rounds acc + q·m as a multiply then an add does, and the fma with the bound
// q's sign picks is acc + max(q·lo, q·hi) (lo <= hi): ScorePagesCpu's term,
// bit for bit.
TEST(ScorePages, FmaTermEqualsMultiplyAddForSixteenBitInputs) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> scale(-12, 12);
  int checked = 0;
  for (int q_bits : {11, 8})
    for (int m_bits : {11, 8})
      for (int i = 0; i < 200000; ++i) {
        const float q = RoundToBits(std::ldexp(normal(rng), scale(rng)), q_bits);
        float lo = RoundToBits(std::ldexp(normal(rng), scale(rng)), m_bits);
        float hi = RoundToBits(lo + std::abs(std::ldexp(normal(rng), scale(rng))), m_bits);
        if (hi < lo) std::swap(lo, hi);
        const float acc = std::ldexp(normal(rng), scale(rng) + 4);  // any float: a running sum
        const float a = q * lo, b = q * hi;
        const float want = acc + (a > b ? a : b);
        const float x = std::fma(q, lo, acc), y = std::fma(q, hi, acc);
        ASSERT_EQ(x, acc + a) << "q " << q << " lo " << lo << " acc " << acc;
        ASSERT_EQ(y, acc + b) << "q " << q << " hi " << hi << " acc " << acc;
        const float got = std::fma(q, q >= 0.f ? hi : lo, acc);
        ASSERT_EQ(std::memcmp(&got, &want, 4), 0) << "q " << q << " lo " << lo << " hi " << hi << " acc " << acc;
        ++checked;
      }
  EXPECT_EQ(checked, 800000);
}

// The term's bound picked by q's sign: max(q·lo, q·hi) is q·hi for q >= 0 and
// q·lo below, bit for bit, whenever lo <= hi (subnormals, huge products and
// zeros included, up to the sign of a zero product, which a sum starting at
// +0 cannot tell; a page's summary always has lo <= hi). With lo > hi the two
// forms differ, so the test can fail.
TEST(ScorePages, SignPicksTheLargerProductForOrderedBounds) {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> scale(-140, 120);
  const float specials[] = {0.f, -0.f, 1e-45f, -1e-45f, 3e38f, -3e38f};
  int checked = 0, differ_unordered = 0;
  for (int i = 0; i < 400000; ++i) {
    auto draw = [&] { return i % 7 == 0 ? specials[rng() % 6] : std::ldexp(normal(rng), scale(rng) / 2); };
    const float q = draw();
    float lo = draw(), hi = draw();
    if (hi < lo) {
      const float a = q * hi, b = q * lo;  // unordered bounds: the forms may differ
      differ_unordered += (a > b ? a : b) != q * (q >= 0.f ? hi : lo);
      std::swap(lo, hi);
    }
    const float a = q * lo, b = q * hi;
    const float want = a > b ? a : b;
    const float got = q * (q >= 0.f ? hi : lo);
    ASSERT_EQ(std::memcmp(&got, &want, 4) == 0 || (got == 0.f && want == 0.f), true)
        << "q " << q << " lo " << lo << " hi " << hi;
    ++checked;
  }
  EXPECT_EQ(checked, 400000);
  EXPECT_GT(differ_unordered, 0);
}

// The order the GPU paths reproduce: partial sum l holds dimensions j ≡ l
// (mod 8) in order, and the 8 partial sums are added pairwise.
TEST(ScorePages, AddsPartialSumsPairwise) {
  constexpr int kD = 32, kPages = 64;
  auto slab = test::RandomNormal(std::size_t(kPages) * 2 * kD, 11, 0.f, 3.f);
  for (int p = 0; p < kPages; ++p)
    for (int j = 0; j < kD; ++j) {
      float& lo = slab[std::size_t(p) * 2 * kD + j];
      float& hi = slab[std::size_t(p) * 2 * kD + kD + j];
      if (hi < lo) std::swap(lo, hi);
    }
  const auto q = test::RandomNormal(kD, 12, 0.f, 3.f);
  std::vector<uint32_t> ids(kPages);
  std::iota(ids.begin(), ids.end(), 0u);
  std::vector<float> got(kPages);
  ScorePagesCpu(q.data(), 1, kD, slab.data(), 1, 0, ids.data(), kPages, got.data());
  for (int p = 0; p < kPages; ++p) {
    const float* lo = slab.data() + std::size_t(p) * 2 * kD;
    const float* hi = lo + kD;
    float acc[8] = {};
    for (int j = 0; j < kD; ++j) {
      const float a = q[j] * lo[j], b = q[j] * hi[j];
      acc[j % 8] += a > b ? a : b;
    }
    const float want = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    EXPECT_EQ(std::memcmp(&got[p], &want, 4), 0) << "page " << p << ": " << got[p] << " vs " << want;
  }
}

// Summaries on the E4M3 grid: a snapped box holds the exact one, so each
// score is at least the exact summary's (terms and sums are monotone), and
// the snapped summary encodes to codes that decode to it exactly.
TEST(ScorePages, E4m3SnappedSummariesScoreAtLeastExactOnes) {
  constexpr int kD = 64, kPages = 50, kHkv = 2;
  auto slab = test::RandomNormal(std::size_t(kPages) * kHkv * 2 * kD, 21, 0.f, 20.f);
  for (std::size_t i = 0; i < slab.size(); i += 2 * kD)
    for (int j = 0; j < kD; ++j)
      if (slab[i + j] > slab[i + kD + j]) std::swap(slab[i + j], slab[i + kD + j]);
  auto snapped = slab;
  for (int p = 0; p < kPages; ++p) {
    float* summary = snapped.data() + std::size_t(p) * kHkv * 2 * kD;
    SnapSummaryE4m3Cpu(summary, kHkv, kD);
    std::vector<uint8_t> codes(kHkv * 2 * kD);
    std::vector<float> back(codes.size());
    EncodeSummaryE4m3Cpu(summary, kHkv, kD, codes.data());
    DecodeSummaryE4m3Cpu(codes.data(), codes.size(), back.data());
    ASSERT_EQ(std::memcmp(back.data(), summary, back.size() * sizeof(float)), 0) << "page " << p;
  }
  std::vector<uint32_t> ids(kPages);
  std::iota(ids.begin(), ids.end(), 0u);
  for (int trial = 0; trial < 20; ++trial) {
    const int group = 1 + trial % 4;
    const auto q = test::RandomNormal(std::size_t(group) * kD, 30 + trial);
    for (int h = 0; h < kHkv; ++h) {
      std::vector<float> exact(std::size_t(group) * kPages), e8(exact.size());
      ScorePagesCpu(q.data(), group, kD, slab.data(), kHkv, h, ids.data(), kPages, exact.data());
      ScorePagesCpu(q.data(), group, kD, snapped.data(), kHkv, h, ids.data(), kPages, e8.data(), true);
      for (std::size_t i = 0; i < exact.size(); ++i) ASSERT_GE(e8[i], exact[i]) << "trial " << trial << " i " << i;
    }
  }
}

// A chosen infinite bound (a key beyond ±448, or the empty box) makes the
// score +inf, also where q_j = 0; an infinite bound the query does not
// choose leaves it finite.
TEST(ScorePages, E4m3InfiniteChosenBoundScoresPlusInfinity) {
  const float inf = INFINITY;
  // One head-page of D = 9 (a tail beyond the 8 lanes too), boxes [-1, 1].
  auto make = [](int j, float lo, float hi) {
    std::vector<float> s(18, 0.f);
    for (int i = 0; i < 9; ++i) s[i] = -1.f, s[9 + i] = 1.f;
    s[j] = lo, s[9 + j] = hi;
    return s;
  };
  const uint32_t id = 0;
  auto score = [&](const std::vector<float>& slab, const std::vector<float>& q) {
    float out;
    ScorePagesCpu(q.data(), 1, 9, slab.data(), 1, 0, &id, 1, &out, true);
    return out;
  };
  std::vector<float> q(9, 0.5f);
  for (int j : {2, 8}) {
    EXPECT_EQ(score(make(j, -1.f, inf), q), inf) << j;  // q_j > 0 chooses the max
    q[j] = 0.f;
    EXPECT_EQ(score(make(j, -1.f, inf), q), inf) << j;  // q_j = 0 chooses it too
    q[j] = -0.5f;
    EXPECT_EQ(score(make(j, -1.f, inf), q), 4.5f) << j;  // the min is chosen: 8 * 0.5 + 0.5
    EXPECT_EQ(score(make(j, -inf, 1.f), q), inf) << j;
    q[j] = 0.5f;
  }
  std::vector<float> empty(18);
  for (int i = 0; i < 9; ++i) empty[i] = inf, empty[9 + i] = -inf;
  EXPECT_EQ(score(empty, q), inf);
  // Without the flag the same slab keeps the exact form's arithmetic.
  float plain;
  const auto slab = make(2, -1.f, inf);
  ScorePagesCpu(q.data(), 1, 9, slab.data(), 1, 0, &id, 1, &plain);
  EXPECT_EQ(plain, inf);
}

TEST(ScorePages, SeedHandExample) {
  const std::vector<float> q = {2, -1};
  const auto slab = SlabOf({{1, 4, 3, -2, -1, 1}, {3, 4, -1, -2}}, 3);
  const uint32_t ids[] = {0, 1};
  float scores[2];
  ScorePagesCpu(q.data(), 1, 2, slab.data(), 1, 0, ids, 2, scores);
  EXPECT_EQ(scores[0], 8.f);
  EXPECT_EQ(scores[1], 8.f);
}

// Seed §1.1's four pages: true max logits A 10, B 3, C 2, D 1 and bounds 14
// for B, 12 for C, 10 for A, 4 for D. K = 2 picks B and C and misses A; K = 3
// recalls A. Realised with q = (1,1) and keys whose box corners do not exist.
TEST(ScorePages, SeedFourPageExampleNeedsK3ForA) {
  const std::vector<float> q = {1, 1};
  const std::vector<std::vector<float>> keys = {
      {5, 5}, {7, -4, -4, 7}, {6, -4, -4, 6}, {2, -1, -1, 2}};
  const auto slab = SlabOf(keys, 2);
  const uint32_t ids[] = {0, 1, 2, 3};
  float scores[4];
  ScorePagesCpu(q.data(), 1, 2, slab.data(), 1, 0, ids, 4, scores);
  EXPECT_EQ(std::vector<float>(scores, scores + 4), (std::vector<float>{10, 14, 12, 4}));
  const float true_max[] = {10, 3, 2, 1};
  for (int p = 0; p < 4; ++p) {
    float best = -INFINITY;
    for (std::size_t r = 0; r < keys[p].size(); r += 2)
      best = std::max(best, q[0] * keys[p][r] + q[1] * keys[p][r + 1]);
    EXPECT_EQ(best, true_max[p]);
  }
  int out[4], scratch[4];
  ASSERT_EQ(TopKCpu(scores, 4, nullptr, 2, out, scratch), 2);
  EXPECT_EQ(std::vector<int>(out, out + 2), (std::vector<int>{1, 2}));
  ASSERT_EQ(TopKCpu(scores, 4, nullptr, 3, out, scratch), 3);
  EXPECT_EQ(std::vector<int>(out, out + 3), (std::vector<int>{0, 1, 2}));
}

}  // namespace
}  // namespace questkv::kernels
