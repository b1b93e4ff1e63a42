// Recall diagnostics and the exact top-R branch-and-bound, against brute force
// written here (full sorts, double-precision softmax).
#include "selector/diagnostics.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cpu/kernels_cpu.h"
#include "tests/testing/reference.h"

namespace questkv {
namespace {

Geometry MakeGeometry(int q_heads, int kv_heads, int page_size, int head_dim) {
  Geometry g;
  g.layers = 1;
  g.q_heads = q_heads;
  g.kv_heads = kv_heads;
  g.head_dim = head_dim;
  g.page_size = page_size;
  return g;
}

int NumPages(const Geometry& g, int tokens) { return (tokens + g.page_size - 1) / g.page_size; }

const float* KeyRow(const Geometry& g, const DenseView& kv, int h, int t) {
  return kv.k.data() + (std::size_t(h) * kv.tokens + t) * g.head_dim;
}

// A step's inputs: K/V, queries, and U_p per query head from summaries built
// by the append kernel (so the bounds are the runtime's).
struct Step {
  Geometry g;
  DenseView kv;
  std::vector<float> q, scores;  // [Hq][D], [Hq][P]
};

Step MakeStep(const Geometry& g, int tokens, std::vector<float> k, std::vector<float> v,
              std::vector<float> q) {
  Step s{g, {tokens, std::move(k), std::move(v)}, std::move(q), {}};
  const int pages = NumPages(g, tokens), d = g.head_dim;
  std::vector<float> slab(std::size_t(pages) * g.summary_elems()), page(g.page_elems());
  for (int p = 0; p < pages; ++p) {
    float* summary = slab.data() + std::size_t(p) * g.summary_elems();
    kernels::ResetSummaryCpu(summary, g.kv_heads, d);
    for (int t = p * g.page_size; t < std::min(tokens, (p + 1) * g.page_size); ++t) {
      std::vector<float> row;  // [1][Hkv][D]
      for (int h = 0; h < g.kv_heads; ++h)
        row.insert(row.end(), KeyRow(g, s.kv, h, t), KeyRow(g, s.kv, h, t) + d);
      kernels::AppendTokensCpu(page.data(), summary, g.kv_heads, g.page_size, d,
                               t - p * g.page_size, row.data(), row.data(), 1);
    }
  }
  std::vector<uint32_t> ids(pages);
  std::iota(ids.begin(), ids.end(), 0u);
  s.scores.resize(std::size_t(g.q_heads) * pages);
  for (int h = 0; h < g.kv_heads; ++h)
    kernels::ScorePagesCpu(s.q.data() + std::size_t(h) * g.group() * d, g.group(), d, slab.data(),
                           g.kv_heads, h, ids.data(), pages,
                           s.scores.data() + std::size_t(h) * g.group() * pages);
  return s;
}

Step RandomStep(const Geometry& g, int tokens, uint64_t seed) {
  const std::size_t kv_elems = std::size_t(g.kv_heads) * tokens * g.head_dim;
  return MakeStep(g, tokens, test::RandomNormal(kv_elems, seed),
                  test::RandomNormal(kv_elems, seed + 1),
                  test::RandomNormal(std::size_t(g.q_heads) * g.head_dim, seed + 2, 0.f, 2.f));
}

// Small integers: many exactly equal logits, and exact float arithmetic.
Step TieHeavyStep(const Geometry& g, int tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto ints = [&](std::size_t n) {
    std::vector<float> x(n);
    for (float& e : x) e = float(int(rng() % 5) - 2);
    return x;
  };
  const std::size_t kv_elems = std::size_t(g.kv_heads) * tokens * g.head_dim;
  auto k = ints(kv_elems), v = ints(kv_elems);
  return MakeStep(g, tokens, std::move(k), std::move(v), ints(std::size_t(g.q_heads) * g.head_dim));
}

std::vector<double> Logits(const Step& s, int hq) {
  std::vector<double> out(s.kv.tokens);
  for (int t = 0; t < s.kv.tokens; ++t) {
    const float* k = KeyRow(s.g, s.kv, hq / s.g.group(), t);
    for (int j = 0; j < s.g.head_dim; ++j) out[t] += double(s.q[hq * s.g.head_dim + j]) * k[j];
  }
  return out;
}

// Dense top-R by a full sort: higher logit first, ties toward the lower token.
std::vector<int32_t> BruteTopR(const std::vector<double>& logits, int r) {
  std::vector<int32_t> idx(logits.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  idx.resize(r);
  std::sort(idx.begin(), idx.end());
  return idx;
}

PageSelection SelectionOf(const std::vector<std::vector<int>>& rows) {
  PageSelection sel;
  sel.indptr = {0};
  for (const auto& r : rows) {
    sel.pages.insert(sel.pages.end(), r.begin(), r.end());
    sel.indptr.push_back(int32_t(sel.pages.size()));
  }
  return sel;
}

// The sparse output over the selection, from the brute-force masked reference.
std::vector<float> SparseOut(const Step& s, const std::vector<std::vector<int>>& rows) {
  const int d = s.g.head_dim;
  std::vector<float> out;
  for (int hq = 0; hq < s.g.q_heads; ++hq) {
    const int h = hq / s.g.group();
    const auto o =
        test::MaskedAttention(s.q.data() + hq * d, KeyRow(s.g, s.kv, h, 0),
                              s.kv.v.data() + std::size_t(h) * s.kv.tokens * d, s.kv.tokens, d,
                              s.g.page_size, rows[h], 1 / std::sqrt(double(d)));
    out.insert(out.end(), o.begin(), o.end());
  }
  return out;
}

std::vector<std::vector<int>> AllPages(const Step& s) {
  std::vector<int> all(NumPages(s.g, s.kv.tokens));
  std::iota(all.begin(), all.end(), 0);
  return std::vector<std::vector<int>>(s.g.kv_heads, all);
}

TEST(Diagnose, FullSelectionIsPerfect) {
  for (int page_size : {1, 7, 16}) {
    const Geometry g = MakeGeometry(8, 2, page_size, 32);
    const Step s = RandomStep(g, 5 * page_size + 3, 10 + page_size);
    const auto rows = AllPages(s);
    // The sparse output of the real kernel over all pages.
    std::vector<float> sparse(8 * 32), m(4), d(4);
    for (int h = 0; h < 2; ++h) {
      std::vector<kernels::HeadPageRef> refs;
      for (int p : rows[h]) {
        const std::size_t at = (std::size_t(h) * s.kv.tokens + std::size_t(p) * page_size) * 32;
        refs.push_back({s.kv.k.data() + at, s.kv.v.data() + at,
                        std::min(page_size, s.kv.tokens - p * page_size)});
      }
      kernels::AttendPagesCpu(s.q.data() + h * 4 * 32, 4, 32, refs.data(), int(refs.size()),
                              1 / std::sqrt(32.f), sparse.data() + h * 4 * 32, m.data(), d.data());
    }
    auto r = Diagnose(g, s.q.data(), s.kv, SelectionOf(rows), s.scores.data(), sparse.data(), 5);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->page_recall, 1.0);
    EXPECT_NEAR(r->attention_mass_recall, 1.0, 1e-12);
    EXPECT_LT(r->output_rel_error, 1e-5);
    EXPECT_GE(r->slack_max, r->slack_mean);
  }
}

// Partial selections: recall, mass and error equal the brute force; the
// slack is U_p − true page max for every query head and page.
TEST(Diagnose, PartialSelectionMatchesBruteForce) {
  std::mt19937_64 rng(9);
  uint64_t seed = 200;
  for (bool ties : {false, true})
    for (int page_size : {1, 3, 16, 17})
      for (int group : {1, 4}) {
        const Geometry g = MakeGeometry(2 * group, 2, page_size, 16);
        const int tokens = 9 * page_size + 2;
        const Step s = ties ? TieHeavyStep(g, tokens, seed++) : RandomStep(g, tokens, seed++);
        const int pages = NumPages(g, tokens);
        std::vector<std::vector<int>> rows(2);
        for (auto& row : rows)
          for (int p = 0; p < pages; ++p)
            if (rng() % 3 == 0 || p == pages - 1) row.push_back(p);
        const int top_r = 6;
        const auto sparse = SparseOut(s, rows);
        auto r =
            Diagnose(g, s.q.data(), s.kv, SelectionOf(rows), s.scores.data(), sparse.data(), top_r);
        ASSERT_TRUE(r.ok()) << r.status().ToString();

        double recall = 0, mass = 0, err = 0, ref = 0, slack_max = -INFINITY, slack_sum = 0;
        const auto dense = SparseOut(s, AllPages(s));
        for (int hq = 0; hq < g.q_heads; ++hq) {
          const auto& row = rows[hq / group];
          auto chosen = [&](int t) {
            return std::count(row.begin(), row.end(), t / page_size) > 0;
          };
          const auto logits = Logits(s, hq);
          for (int t : BruteTopR(logits, top_r)) recall += chosen(t) / double(top_r);
          const double mx = *std::max_element(logits.begin(), logits.end());
          double z = 0, kept = 0;
          for (int t = 0; t < tokens; ++t) {
            const double w = std::exp((logits[t] - mx) / 4.0);  // scale 1/sqrt(16)
            z += w;
            kept += chosen(t) ? w : 0;
          }
          mass += kept / z;
          for (int p = 0; p < pages; ++p) {
            double page_max = -INFINITY;
            for (int t = p * page_size; t < std::min(tokens, (p + 1) * page_size); ++t)
              page_max = std::max(page_max, logits[t]);
            const double slack = s.scores[hq * pages + p] - page_max;
            ASSERT_NEAR(r->slack[hq * pages + p], slack, 1e-4);
            ASSERT_GE(slack, -1e-4);
            slack_max = std::max(slack_max, slack);
            slack_sum += slack;
          }
        }
        for (std::size_t i = 0; i < dense.size(); ++i) {
          err += (double(sparse[i]) - dense[i]) * (double(sparse[i]) - dense[i]);
          ref += double(dense[i]) * dense[i];
        }
        EXPECT_NEAR(r->page_recall, recall / g.q_heads, 1e-12);
        EXPECT_NEAR(r->attention_mass_recall, mass / g.q_heads, 1e-9);
        EXPECT_NEAR(r->output_rel_error, std::sqrt(err / ref), 1e-5);
        // The sparse output attends exactly the selection: nothing lost beyond it.
        EXPECT_NEAR(r->selection_rel_error, std::sqrt(err / ref), 1e-5);
        EXPECT_LT(r->attended_rel_error, 1e-5);
        EXPECT_NEAR(r->slack_max, slack_max, 1e-4);
        EXPECT_NEAR(r->slack_mean, slack_sum / (g.q_heads * pages), 1e-4);
      }
}

// A step that attends without some selected pages (deadline's cold misses):
// the selection's own error stays, the loss shows as the attended error
// against exact attention over the whole selection.
TEST(Diagnose, PagesAttendedWithoutShowAsAttendedError) {
  for (int group : {1, 4}) {
    const Geometry g = MakeGeometry(2 * group, 2, 8, 16);
    const int tokens = 12 * 8 + 5;
    const Step s = RandomStep(g, tokens, 31 + group);
    const std::vector<std::vector<int>> rows = {{0, 3, 4, 7, 12}, {1, 2, 5, 9, 12}};
    std::vector<std::vector<int>> attended = rows;
    for (auto& row : attended) row.erase(row.begin() + 1);  // one selected page skipped a head
    const auto full = SparseOut(s, rows), skipped = SparseOut(s, attended);
    auto a = Diagnose(g, s.q.data(), s.kv, SelectionOf(rows), s.scores.data(), full.data(), 4);
    auto b = Diagnose(g, s.q.data(), s.kv, SelectionOf(rows), s.scores.data(), skipped.data(), 4);
    ASSERT_TRUE(a.ok() && b.ok());
    double err = 0, ref = 0;
    for (std::size_t i = 0; i < full.size(); ++i) {
      err += (double(skipped[i]) - full[i]) * (double(skipped[i]) - full[i]);
      ref += double(full[i]) * full[i];
    }
    ASSERT_GT(std::sqrt(err / ref), 1e-3) << "the skipped pages must matter for this test to mean anything";
    EXPECT_EQ(b->selection_rel_error, a->selection_rel_error);
    EXPECT_NEAR(b->attended_rel_error, std::sqrt(err / ref), 1e-5);
    EXPECT_LT(a->attended_rel_error, 1e-5);
    EXPECT_EQ(b->page_recall, a->page_recall);  // recall judges the selection
  }
}

// Query heads spread over threads: every figure equals the one-thread run
// bit for bit (which PartialSelectionMatchesBruteForce checks), for more
// threads than heads too.
TEST(Diagnose, ThreadsDoNotChangeTheResult) {
  const Geometry g = MakeGeometry(8, 2, 7, 24);
  const int tokens = 40 * 7 + 3, pages = NumPages(g, tokens);
  const Step s = RandomStep(g, tokens, 77);
  std::vector<std::vector<int>> rows(2);
  for (int p = 0; p < pages; ++p)
    if (p % 3 != 1 || p == pages - 1) rows[p % 2].push_back(p);
  const auto sparse = SparseOut(s, rows);
  auto one = Diagnose(g, s.q.data(), s.kv, SelectionOf(rows), s.scores.data(), sparse.data(), 9, 1);
  auto exact_one = ExactTopRSearch(g, s.q.data(), s.kv, s.scores.data(), 9, 1);
  ASSERT_TRUE(one.ok() && exact_one.ok());
  ASSERT_LT(one->page_recall, 1.0);  // a selection that misses some of the top tokens
  for (int threads : {0, 2, 3, 8, 100}) {
    auto r = Diagnose(g, s.q.data(), s.kv, SelectionOf(rows), s.scores.data(), sparse.data(), 9, threads);
    auto exact = ExactTopRSearch(g, s.q.data(), s.kv, s.scores.data(), 9, threads);
    ASSERT_TRUE(r.ok() && exact.ok()) << threads;
    EXPECT_EQ(r->page_recall, one->page_recall) << threads;
    EXPECT_EQ(r->attention_mass_recall, one->attention_mass_recall) << threads;
    EXPECT_EQ(r->output_rel_error, one->output_rel_error) << threads;
    EXPECT_EQ(r->selection_rel_error, one->selection_rel_error) << threads;
    EXPECT_EQ(r->attended_rel_error, one->attended_rel_error) << threads;
    EXPECT_EQ(r->slack, one->slack) << threads;
    EXPECT_EQ(exact->tokens, exact_one->tokens) << threads;
    EXPECT_EQ(exact->pages_read, exact_one->pages_read) << threads;
  }
}

// Seed §1.1's four pages, one key each side of the box (see select_test):
// the global top-1 token lives in A, which K = 2 misses and K = 3 recalls.
TEST(Diagnose, SeedFourPageExampleRecall) {
  const Geometry g = MakeGeometry(1, 1, 2, 2);
  const std::vector<float> k = {5, 5, 0, 0, 7, -4, -4, 7, 6, -4, -4, 6, 2, -1, -1, 2};
  const Step s = MakeStep(g, 8, k, test::RandomNormal(16, 3), {1, 1});
  EXPECT_EQ(s.scores, (std::vector<float>{10, 14, 12, 4}));
  for (auto [row, recall] :
       {std::pair{std::vector<int>{1, 2}, 0.0}, std::pair{std::vector<int>{0, 1, 2}, 1.0}}) {
    const auto sparse = SparseOut(s, {row});
    auto r = Diagnose(g, s.q.data(), s.kv, SelectionOf({row}), s.scores.data(), sparse.data(), 1);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->page_recall, recall);
  }
  auto exact = ExactTopRSearch(g, s.q.data(), s.kv, s.scores.data(), 1);
  ASSERT_TRUE(exact.ok());
  EXPECT_EQ(exact->tokens[0], std::vector<int32_t>{0});
  EXPECT_EQ(exact->pages_read[0], 3);  // B (14), C (12), A (10); D's 4 < 10 stops it
}

TEST(Diagnose, RejectsBadInput) {
  const Geometry g = MakeGeometry(4, 2, 4, 8);
  const Step s = RandomStep(g, 10, 1);
  const auto rows = AllPages(s);
  const PageSelection sel = SelectionOf(rows);
  const auto out = SparseOut(s, rows);
  auto code = [&](const Geometry& gg, const float* q, const DenseView& kv, const PageSelection& ps,
                  const float* scores, const float* o,
                  int r) { return Diagnose(gg, q, kv, ps, scores, o, r).status().code(); };
  ASSERT_EQ(code(g, s.q.data(), s.kv, sel, s.scores.data(), out.data(), 3), Code::kOk);
  EXPECT_EQ(code(g, s.q.data(), s.kv, sel, s.scores.data(), out.data(), 0), Code::kInvalidArgument);
  EXPECT_EQ(code(g, s.q.data(), s.kv, sel, s.scores.data(), out.data(), 11),
            Code::kInvalidArgument);
  EXPECT_EQ(code(g, nullptr, s.kv, sel, s.scores.data(), out.data(), 3), Code::kInvalidArgument);
  EXPECT_EQ(code(g, s.q.data(), s.kv, sel, nullptr, out.data(), 3), Code::kInvalidArgument);
  EXPECT_EQ(code(g, s.q.data(), s.kv, sel, s.scores.data(), nullptr, 3), Code::kInvalidArgument);
  Geometry bad_g = g;
  bad_g.q_heads = 3;
  EXPECT_EQ(code(bad_g, s.q.data(), s.kv, sel, s.scores.data(), out.data(), 3),
            Code::kInvalidArgument);
  DenseView short_k = s.kv;
  short_k.k.pop_back();
  EXPECT_EQ(code(g, s.q.data(), short_k, sel, s.scores.data(), out.data(), 3),
            Code::kInvalidArgument);
  DenseView empty = s.kv;
  empty.tokens = 0;
  EXPECT_EQ(code(g, s.q.data(), empty, sel, s.scores.data(), out.data(), 1),
            Code::kInvalidArgument);
  PageSelection one_row = SelectionOf({rows[0]});
  EXPECT_EQ(code(g, s.q.data(), s.kv, one_row, s.scores.data(), out.data(), 3),
            Code::kInvalidArgument);
  PageSelection past_end = SelectionOf({rows[0], {0, 3}});  // 10 tokens / S 4 = pages 0..2
  EXPECT_EQ(code(g, s.q.data(), s.kv, past_end, s.scores.data(), out.data(), 3),
            Code::kInvalidArgument);
  PageSelection bad_indptr = sel;
  bad_indptr.indptr[1] = bad_indptr.indptr[2] + 1;
  EXPECT_EQ(code(g, s.q.data(), s.kv, bad_indptr, s.scores.data(), out.data(), 3),
            Code::kInvalidArgument);
}

// ---- ExactTopRSearch --------------------------------------------------------

void ExpectExactMatchesBruteForce(const Step& s, int top_r) {
  auto r = ExactTopRSearch(s.g, s.q.data(), s.kv, s.scores.data(), top_r);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->tokens.size(), std::size_t(s.g.q_heads));
  for (int hq = 0; hq < s.g.q_heads; ++hq) {
    ASSERT_EQ(r->tokens[hq], BruteTopR(Logits(s, hq), top_r))
        << "hq=" << hq << " T=" << s.kv.tokens << " S=" << s.g.page_size << " R=" << top_r;
    ASSERT_GE(r->pages_read[hq], (top_r + s.g.page_size - 1) / s.g.page_size);
    ASSERT_LE(r->pages_read[hq], NumPages(s.g, s.kv.tokens));
  }
}

TEST(ExactTopRSearch, MatchesBruteForceTopR) {
  std::mt19937_64 rng(11);
  const int page_sizes[] = {1, 3, 7, 16, 17};
  for (uint64_t seed = 1; seed <= 300; ++seed) {
    const int page_size = page_sizes[rng() % 5];
    const int group = 1 << (rng() % 3);
    const int d = int(4 + rng() % 29);
    const int tokens = int(1 + rng() % 300);
    const int top_r = int(1 + rng() % std::min(tokens, 20));
    const Geometry g = MakeGeometry(2 * group, 2, page_size, d);
    const Step s = seed % 2 ? RandomStep(g, tokens, seed * 7) : TieHeavyStep(g, tokens, seed * 7);
    ExpectExactMatchesBruteForce(s, top_r);
  }
}

// A page whose bound equals τ_R can still hold a tie with a lower index, so
// the stop test must be strict. Page 1 (tokens 2, 3) has U = 10 and true max
// 5 at token 2; page 0 has U = 5 and token 0 with logit 5, which wins the tie.
TEST(ExactTopRSearch, BoundEqualToThresholdIsStillRead) {
  const Geometry g = MakeGeometry(1, 1, 2, 2);
  const Step s = MakeStep(g, 4, {2, 3, -1, -1, 5, 0, 0, 5}, std::vector<float>(8, 0.f), {1, 1});
  ASSERT_EQ(s.scores, (std::vector<float>{5, 10}));
  auto r = ExactTopRSearch(g, s.q.data(), s.kv, s.scores.data(), 1);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->tokens[0], std::vector<int32_t>{0});
  EXPECT_EQ(r->pages_read[0], 2);
}

// With one page far above the rest, the search stops after reading it.
TEST(ExactTopRSearch, PrunesPagesBelowThreshold) {
  const Geometry g = MakeGeometry(1, 1, 8, 16);
  const int tokens = 64 * 8;
  std::vector<float> k = test::RandomNormal(std::size_t(tokens) * 16, 5, 0.f, 0.1f);
  const std::vector<float> q = test::RandomNormal(16, 6);
  for (int t = 40 * 8; t < 41 * 8; ++t)
    for (int j = 0; j < 16; ++j) k[t * 16 + j] += 3 * q[j];
  const Step s = MakeStep(g, tokens, k, k, q);
  auto r = ExactTopRSearch(g, s.q.data(), s.kv, s.scores.data(), 8);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->pages_read[0], 1);
  std::vector<int32_t> page40(8);
  std::iota(page40.begin(), page40.end(), 40 * 8);
  EXPECT_EQ(r->tokens[0], page40);
}

TEST(ExactTopRSearch, RejectsBadInput) {
  const Geometry g = MakeGeometry(2, 1, 4, 8);
  const Step s = RandomStep(g, 10, 1);
  EXPECT_TRUE(ExactTopRSearch(g, s.q.data(), s.kv, s.scores.data(), 10).ok());
  EXPECT_EQ(ExactTopRSearch(g, s.q.data(), s.kv, s.scores.data(), 0).status().code(),
            Code::kInvalidArgument);
  EXPECT_EQ(ExactTopRSearch(g, s.q.data(), s.kv, s.scores.data(), 11).status().code(),
            Code::kInvalidArgument);
  EXPECT_EQ(ExactTopRSearch(g, nullptr, s.kv, s.scores.data(), 1).status().code(),
            Code::kInvalidArgument);
  EXPECT_EQ(ExactTopRSearch(g, s.q.data(), s.kv, nullptr, 1).status().code(),
            Code::kInvalidArgument);
  DenseView short_v = s.kv;
  short_v.v.resize(3);
  EXPECT_EQ(ExactTopRSearch(g, s.q.data(), short_v, s.scores.data(), 1).status().code(),
            Code::kInvalidArgument);
}

}  // namespace
}  // namespace questkv
