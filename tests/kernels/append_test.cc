// Append + summary: page contents, min/max of exactly the valid keys, reset,
// rebuild (eq. 8/14, seed §1.2 and §3 on tail length and slot reuse).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <vector>

#include "kernels/cpu/kernels_cpu.h"
#include "tests/testing/reference.h"

namespace questkv::kernels {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kPoison = 1e30f;

// One page [2][Hkv][S][D] with its summary [Hkv][2][D]; every slot starts
// poisoned so a read of an unwritten slot shows up as a huge value.
struct Page {
  int kv_heads, page_size, head_dim;
  std::vector<float> bytes, summary;
  Page(int hkv, int s, int d)
      : kv_heads(hkv),
        page_size(s),
        head_dim(d),
        bytes(2 * std::size_t(hkv) * s * d, kPoison),
        summary(2 * std::size_t(hkv) * d) {
    ResetSummaryCpu(summary.data(), hkv, d);
  }
  float K(int h, int r, int j) const {
    return bytes[(std::size_t(h) * page_size + r) * head_dim + j];
  }
  float V(int h, int r, int j) const {
    return bytes[((std::size_t(kv_heads) + h) * page_size + r) * head_dim + j];
  }
  float Min(int h, int j) const { return summary[std::size_t(h) * 2 * head_dim + j]; }
  float Max(int h, int j) const { return summary[(std::size_t(h) * 2 + 1) * head_dim + j]; }
};

// Token-major input [n][Hkv][D], as engines produce it.
float At(const std::vector<float>& x, int hkv, int d, int t, int h, int j) {
  return x[(std::size_t(t) * hkv + h) * d + j];
}

// Summary must equal brute-force min/max of tokens [0, len) of `keys`.
void ExpectSummaryOf(const Page& p, const std::vector<float>& keys, int len) {
  for (int h = 0; h < p.kv_heads; ++h)
    for (int j = 0; j < p.head_dim; ++j) {
      float lo = kInf, hi = -kInf;
      for (int t = 0; t < len; ++t) {
        lo = std::min(lo, At(keys, p.kv_heads, p.head_dim, t, h, j));
        hi = std::max(hi, At(keys, p.kv_heads, p.head_dim, t, h, j));
      }
      ASSERT_EQ(p.Min(h, j), lo) << "h=" << h << " j=" << j << " len=" << len;
      ASSERT_EQ(p.Max(h, j), hi) << "h=" << h << " j=" << j << " len=" << len;
    }
}

TEST(AppendTokens, SummaryIsMinMaxOfAppendedKeys) {
  uint64_t seed = 1;
  for (int s : {1, 3, 7, 16, 17})
    for (int hkv : {1, 3})
      for (int d : {1, 5, 64}) {
        const auto keys = test::RandomNormal(std::size_t(s) * hkv * d, seed++);
        const auto vals = test::RandomNormal(keys.size(), seed++);
        Page p(hkv, s, d);
        // Chunks of 1, 2, 3, ... tokens: prefill pieces and single decode tokens.
        for (int off = 0, n = 1; off < s; off += n, ++n) {
          n = std::min(n, s - off);
          const std::size_t at = std::size_t(off) * hkv * d;
          AppendTokensCpu(p.bytes.data(), p.summary.data(), hkv, s, d, off, keys.data() + at,
                          vals.data() + at, n);
          ExpectSummaryOf(p, keys, off + n);
        }
        for (int t = 0; t < s; ++t)
          for (int h = 0; h < hkv; ++h)
            for (int j = 0; j < d; ++j) {
              ASSERT_EQ(p.K(h, t, j), At(keys, hkv, d, t, h, j));
              ASSERT_EQ(p.V(h, t, j), At(vals, hkv, d, t, h, j));
            }
      }
}

TEST(AppendTokens, TailSummaryUsesOnlyValidSlots) {
  const int s = 16, hkv = 2, d = 8;
  for (int len : {1, 5, 15}) {
    const auto keys = test::RandomNormal(std::size_t(len) * hkv * d, 40 + len);
    Page p(hkv, s, d);
    AppendTokensCpu(p.bytes.data(), p.summary.data(), hkv, s, d, 0, keys.data(), keys.data(), len);
    ExpectSummaryOf(p, keys, len);
    // The unused slots are untouched (still poisoned), so nothing wrote past len.
    for (int h = 0; h < hkv; ++h)
      for (int r = len; r < s; ++r) ASSERT_EQ(p.K(h, r, 0), kPoison);
    // And a rebuild over len valid rows ignores the poisoned slots too.
    RebuildSummaryCpu(p.bytes.data(), p.summary.data(), hkv, s, d, len);
    ExpectSummaryOf(p, keys, len);
  }
}

TEST(ResetSummary, GivesEmptyBoxForEveryHead) {
  Page p(3, 4, 5);
  test::FillNormal(p.summary.data(), p.summary.size(), 7);
  ResetSummaryCpu(p.summary.data(), 3, 5);
  for (int h = 0; h < 3; ++h)
    for (int j = 0; j < 5; ++j) {
      EXPECT_EQ(p.Min(h, j), kInf);
      EXPECT_EQ(p.Max(h, j), -kInf);
    }
}

// A slot that was filled, freed and re-initialised must summarise exactly like
// a never-used slot: stale extremes would make the new page score high forever.
TEST(ResetSummary, ReusedSlotCarriesNoStaleValues) {
  const int s = 7, hkv = 2, d = 6;
  const auto old_keys = test::RandomNormal(std::size_t(s) * hkv * d, 11, 0.f, 1000.f);
  const auto new_keys = test::RandomNormal(std::size_t(3) * hkv * d, 12);
  Page reused(hkv, s, d);
  AppendTokensCpu(reused.bytes.data(), reused.summary.data(), hkv, s, d, 0, old_keys.data(),
                  old_keys.data(), s);
  ResetSummaryCpu(reused.summary.data(), hkv, d);
  AppendTokensCpu(reused.bytes.data(), reused.summary.data(), hkv, s, d, 0, new_keys.data(),
                  new_keys.data(), 3);
  Page fresh(hkv, s, d);
  AppendTokensCpu(fresh.bytes.data(), fresh.summary.data(), hkv, s, d, 0, new_keys.data(),
                  new_keys.data(), 3);
  EXPECT_EQ(reused.summary, fresh.summary);
  ExpectSummaryOf(reused, new_keys, 3);
}

TEST(RebuildSummary, EqualsFreshBuildForEveryLength) {
  uint64_t seed = 100;
  for (int s : {1, 3, 7, 16, 17}) {
    const int hkv = 2, d = 9;
    const auto keys = test::RandomNormal(std::size_t(s) * hkv * d, seed++);
    Page full(hkv, s, d);
    AppendTokensCpu(full.bytes.data(), full.summary.data(), hkv, s, d, 0, keys.data(), keys.data(),
                    s);
    for (int len = 0; len <= s; ++len) {
      Page fresh(hkv, s, d);
      if (len > 0)
        AppendTokensCpu(fresh.bytes.data(), fresh.summary.data(), hkv, s, d, 0, keys.data(),
                        keys.data(), len);
      // Start from the full page's summary: a rebuild that forgot to reset
      // would keep the extremes of the rolled-back rows.
      std::vector<float> rebuilt = full.summary;
      RebuildSummaryCpu(full.bytes.data(), rebuilt.data(), hkv, s, d, len);
      ASSERT_EQ(rebuilt, fresh.summary) << "S=" << s << " len=" << len;
    }
  }
}

// Seed §1.1: keys (1,4), (3,-2), (-1,1) give m = (-1,-2), M = (3,4).
TEST(AppendTokens, SeedHandExampleSummary) {
  const std::vector<float> keys = {1, 4, 3, -2, -1, 1};
  Page p(1, 3, 2);
  AppendTokensCpu(p.bytes.data(), p.summary.data(), 1, 3, 2, 0, keys.data(), keys.data(), 3);
  EXPECT_EQ(p.summary, (std::vector<float>{-1, -2, 3, 4}));
}

}  // namespace
}  // namespace questkv::kernels
