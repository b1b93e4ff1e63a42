// LaunchAdaptive against the definition of adaptive budgets
// (test::AdaptiveDefinition): rows of given scores and the select's rows
// for them (sink, the top-k by score, local) narrowed in place; the counts
// summed on the device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cpu/kernels_cpu.h"
#include "tests/kernels_cuda/cuda_test_util.h"
#include "tests/testing/reference.h"

namespace questkv::kernels::cuda::test {
namespace {

struct AdaptiveCase {
  std::vector<int> pages;  // a sequence's page count each
  int64_t budget;          // pages
  double share;
  int64_t floor_tokens;
  // kMean over 3 query heads padded to 4: the kernel is given the select's
  // sums / 4 and the definition the model's means, fl(sum / 3).
  bool padded_mean = false;
};

void RunAdaptiveCase(const AdaptiveCase& c, uint64_t seed) {
  const int B = int(c.pages.size()), H = 2, D = 128, S = 16;
  SelectShape s;
  s.batch = B;
  s.kv_heads = H;
  s.group = 4;
  s.head_dim = D;
  s.page_size = S;
  s.page_budget = c.budget;
  s.sink_pages = 1;
  s.local_pages = 4;
  s.keep_scores = true;
  if (c.padded_mean) s.gqa = GqaMode::kMean;
  std::mt19937 rng{uint32_t(seed)};
  std::vector<int32_t> page_indptr(B + 1, 0);
  for (int b = 0; b < B; ++b) page_indptr[b + 1] = page_indptr[b] + c.pages[b];
  // Scores [b][h][n] as the select leaves them: peaked rows (a few pages
  // far above the rest), flat ones with ties, one with -inf scores and one
  // whose best is +inf (an E4M3 bound past 448).
  const std::size_t head_pages = std::size_t(page_indptr[B]) * H;
  std::vector<float> scores(head_pages);
  std::vector<int32_t> out_indptr(1, 0), out_pages, out_count;
  std::vector<std::vector<int>> want;
  std::vector<int> want_k;
  std::vector<int> caps, floors;  // per row; floors of ranked rows only read
  for (int b = 0; b < B; ++b) {
    const int n = c.pages[b];
    for (int h = 0; h < H; ++h) {
      const int row = b * H + h;
      float* sc = scores.data() + std::size_t(page_indptr[b]) * H + std::size_t(h) * n;
      const std::vector<float> x = questkv::test::RandomNormal(n, seed * 131 + row);
      const int kind = row % 4;
      for (int i = 0; i < n; ++i) {
        sc[i] = kind == 0 ? 40.f * x[i] : kind == 1 ? std::round(x[i]) : 8.f * x[i];
        if (kind == 2 && i % 5 == 0) sc[i] = -INFINITY;
      }
      if (kind == 3 && n > 6) sc[n / 2] = INFINITY;
      // What the definition ranks: the model's scores (sc itself unless padded).
      std::vector<float> model(sc, sc + n);
      if (c.padded_mean)
        for (int i = 0; i < n; ++i) model[i] = sc[i] / 3.f, sc[i] = sc[i] / 4.f;  // sc[i] is the group's sum
      // The select's row: sink ∪ local ∪ top-k (ties toward the lower page).
      const int sink = std::min(1, n), local = std::min(4, n);
      std::vector<uint8_t> skip(n, 0);
      std::vector<int> fixed;
      for (int i = 0; i < n; ++i)
        if (i < sink || i >= n - local) skip[i] = 1, fixed.push_back(i);
      const int cap = int(std::max<int64_t>(0, c.budget - int64_t(fixed.size())));
      caps.push_back(cap);
      std::vector<int> row_pages(fixed);
      if (c.budget < n) {
        std::vector<int> chosen(n), scratch(n);
        const int got = TopKCpu(model.data(), n, skip.data(), cap, chosen.data(), scratch.data());
        row_pages.insert(row_pages.end(), chosen.begin(), chosen.begin() + got);
      } else {
        row_pages.resize(n);
        std::iota(row_pages.begin(), row_pages.end(), 0);
      }
      std::sort(row_pages.begin(), row_pages.end());
      out_pages.insert(out_pages.end(), row_pages.begin(), row_pages.end());
      out_pages.resize(out_pages.size() + 3, -7);  // capacity past the count: never read
      out_indptr.push_back(int32_t(out_pages.size()));
      out_count.push_back(int32_t(row_pages.size()));
      if (c.budget >= n) {  // every page: no ranking
        want.push_back(row_pages);
        want_k.push_back(-1);
        floors.push_back(0);
        continue;
      }
      const int floor_k = int(std::clamp<int64_t>(c.floor_tokens / S - int64_t(fixed.size()), 0, cap));
      int k = 0;
      want.push_back(questkv::test::AdaptiveDefinition(model, fixed, c.share, floor_k, cap,
                                                       D, &k));
      want_k.push_back(k);
      floors.push_back(floor_k);
    }
  }
  DeviceBuffer d_scores, d_indptr, d_out_indptr, d_pages, d_count, d_counters;
  Upload(d_scores, scores);
  Upload(d_indptr, page_indptr);
  Upload(d_out_indptr, out_indptr);
  Upload(d_pages, out_pages);
  Upload(d_count, out_count);
  Upload(d_counters, std::vector<uint8_t>(sizeof(AdaptiveCounters), 0));
  AdaptiveParams p;
  p.shape = s;
  p.unread_bound_mass = c.share;
  p.floor_tokens = c.floor_tokens;
  p.scores = d_scores.as<float>();
  p.page_indptr = d_indptr.as<int32_t>();
  p.out_indptr = d_out_indptr.as<int32_t>();
  p.out_pages = d_pages.as<int32_t>();
  p.out_count = d_count.as<int32_t>();
  p.counters = d_counters.as<AdaptiveCounters>();
  if (c.padded_mean) p.mean_heads = 3;
  QKV_CUDA_OK(LaunchAdaptive(p, nullptr));
  QKV_CUDA_OK(cudaDeviceSynchronize());
  const auto got_pages = Download<int32_t>(d_pages, out_pages.size());
  const auto got_count = Download<int32_t>(d_count, out_count.size());
  AdaptiveCounters got_c;
  std::memcpy(&got_c, Download<uint8_t>(d_counters, sizeof(AdaptiveCounters)).data(), sizeof(got_c));
  AdaptiveCounters want_c{};
  int below_cap = 0, floor_below_cap = 0;  // rows that stopped short; rows whose floor let them
  for (int row = 0; row < B * H; ++row) {
    const std::vector<int> got(got_pages.begin() + out_indptr[row], got_pages.begin() + out_indptr[row] + got_count[row]);
    ASSERT_EQ(got, want[row]) << "row " << row << " of " << c.pages[row / H] << " pages";
    for (int j = out_indptr[row] + got_count[row]; j < out_indptr[row + 1]; ++j)
      if (j >= out_indptr[row] + out_count[row]) {
        ASSERT_EQ(got_pages[j], -7) << "row " << row << " wrote past its capacity";
      }
    const int k = want_k[row];
    if (k < 0) continue;
    ++want_c.rankings;
    want_c.pages += k;
    want_c.pages_max = std::max<unsigned long long>(want_c.pages_max, k);
    want_c.cap_hits += k == caps[row];
    ++want_c.hist[std::min(k, kAdaptiveHistPages)];
    below_cap += k < caps[row];
    floor_below_cap += floors[row] < caps[row];
  }
  EXPECT_EQ(got_c.rankings, want_c.rankings);
  EXPECT_EQ(got_c.pages, want_c.pages);
  EXPECT_EQ(got_c.pages_max, want_c.pages_max);
  EXPECT_EQ(got_c.cap_hits, want_c.cap_hits);
  for (int i = 0; i <= kAdaptiveHistPages; ++i) EXPECT_EQ(got_c.hist[i], want_c.hist[i]) << "pages " << i;
  // A floor at or past a row's cap fixes its count; elsewhere some row must stop short.
  if (floor_below_cap > 0) {
    EXPECT_GT(below_cap, 0) << "no row stopped below its budget: the test shows little";
  } else {
    EXPECT_EQ(got_c.cap_hits, got_c.rankings);
  }
}

TEST(AdaptiveCudaTest, EqualsTheDefinition) {
  QKV_REQUIRE_GPU();
  // Short rows (all pages, or all fixed), rows of a few hundred pages, a long
  // one (20K pages) with the largest budget; floors below, at and above the
  // winners' count.
  const std::vector<int> pages = {1, 5, 6, 40, 257, 700, 3001, 20000};
  for (double share : {0.5, 0.1, 0.01})
    for (int64_t floor_tokens : {int64_t(0), int64_t(16 * 12), int64_t(16 * 5000)}) {
      SCOPED_TRACE("share " + std::to_string(share) + " floor " + std::to_string(floor_tokens));
      RunAdaptiveCase({pages, 64, share, floor_tokens}, 7);
      RunAdaptiveCase({pages, kAdaptiveMaxPages, share, floor_tokens}, 11);
    }
}

// A group of 3 query heads padded to 4 under kMean (the runtime's PadQ adds a
// zero head): the kept scores are 3/4 of the model's means, which would
// flatten every bound mass; the kernel weighs the model's means.
TEST(AdaptiveCudaTest, PaddedMeanGroupsWeighTheModelsMeans) {
  QKV_REQUIRE_GPU();
  const std::vector<int> pages = {6, 40, 257, 700, 3001};
  for (double share : {0.95, 0.5}) {  // (at 0.1 every row of these takes its 59 pages)
    SCOPED_TRACE("share " + std::to_string(share));
    RunAdaptiveCase({pages, 64, share, 0, /*padded_mean=*/true}, 13);
  }
}

// Refused before any launch (no GPU needed): a share outside (0, 1), gqa
// union, a budget past kAdaptiveMaxPages, scores not kept, mean_heads
// outside a kMean group.
TEST(AdaptiveCudaTest, RefusesWhatItDoesNotRun) {
  AdaptiveParams p;
  p.shape.batch = 1;
  p.shape.kv_heads = 1;
  p.shape.page_budget = 64;
  p.shape.keep_scores = true;
  float f = 0;
  int32_t i = 0;
  AdaptiveCounters counters{};
  p.scores = &f;
  p.page_indptr = p.out_indptr = &i;
  p.out_pages = p.out_count = &i;
  p.counters = &counters;
  for (double share : {0.0, 1.0, -0.5}) {
    p.unread_bound_mass = share;
    EXPECT_EQ(LaunchAdaptive(p, nullptr), cudaErrorInvalidValue) << share;
  }
  p.unread_bound_mass = 0.2;
  AdaptiveParams q = p;
  q.shape.gqa = GqaMode::kUnion;
  EXPECT_EQ(LaunchAdaptive(q, nullptr), cudaErrorInvalidValue);
  q = p;
  q.shape.keep_scores = false;
  EXPECT_EQ(LaunchAdaptive(q, nullptr), cudaErrorInvalidValue);
  q = p;
  q.shape.page_budget = kAdaptiveMaxPages + 1;
  EXPECT_EQ(LaunchAdaptive(q, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(LastErrorMessage().find("adaptive page budget"), std::string::npos) << LastErrorMessage();
  q = p;
  q.scores = nullptr;
  EXPECT_EQ(LaunchAdaptive(q, nullptr), cudaErrorInvalidValue);
  q = p;  // a padded group's mean under kMax, or more model heads than the group
  q.shape.group = 4;
  q.mean_heads = 3;
  EXPECT_EQ(LaunchAdaptive(q, nullptr), cudaErrorInvalidValue);
  q.shape.gqa = GqaMode::kMean;
  q.mean_heads = 5;
  EXPECT_EQ(LaunchAdaptive(q, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace questkv::kernels::cuda::test
