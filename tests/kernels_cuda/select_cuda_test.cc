// LaunchSelect against the CPU twin: ScorePagesCpu + TopKCpu composed with the
// policy of selector/select.cc (sink + local window + top-K, GQA max / mean /
// union, dense layers). Selections must be equal exactly (same sets, same
// ascending order), ties included, because the device reproduces the CPU's
// float scores bit for bit and breaks ties toward the lower page index. With
// E4M3 summaries the scores themselves are compared too, bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/kernels_cpu.h"
#include "tests/kernels_cuda/cuda_test_util.h"
#include "tests/testing/reference.h"

namespace questkv::kernels::cuda::test {
namespace {

// select.cc's policy for one sequence (all KV heads), from float inputs.
// e4m3: the slab holds summaries on the E4M3 grid (ScorePagesCpu's e4m3
// rule). row_scores, when given: the scores that LaunchSelect's score
// kernels leave at the start of its workspace for this sequence, [H][A][n]
// (A = G per query head for kUnion, else 1, the aggregate), or empty when
// its rows choose every page and are not scored.
std::vector<std::vector<int>> CpuSelect(const SelectShape& s, const float* q, const float* slab,
                                        const uint32_t* ids, int n, bool e4m3 = false,
                                        std::vector<float>* row_scores = nullptr) {
  const int G = s.group, D = s.head_dim, H = s.kv_heads;
  std::vector<std::vector<int>> rows(H);
  if (row_scores) row_scores->clear();
  if (s.dense || s.page_budget >= n) {
    for (auto& r : rows) r.resize(n), std::iota(r.begin(), r.end(), 0);
    return rows;
  }
  std::vector<uint8_t> skip(n, 0);
  const int sink = std::min(s.sink_pages, n), local = std::min(std::max(s.local_pages, 1), n);
  for (int i = 0; i < sink; ++i) skip[i] = 1;
  for (int i = n - local; i < n; ++i) skip[i] = 1;
  const int fixed = int(std::count(skip.begin(), skip.end(), 1));
  const int k = int(std::max<int64_t>(0, s.page_budget - fixed));
  const int A = s.gqa == GqaMode::kUnion ? G : 1;
  const bool scored = k < n - fixed;  // else every page is chosen
  if (row_scores && scored) row_scores->resize(std::size_t(H) * A * n);
  std::vector<float> scores(std::size_t(G) * n), agg(n);
  std::vector<int> chosen(n), scratch(n);
  for (int h = 0; h < H; ++h) {
    ScorePagesCpu(q + std::size_t(h) * G * D, G, D, slab, H, h, ids, n, scores.data(), e4m3);
    std::vector<uint8_t> mark(skip);
    auto mark_top = [&](const float* sc) {
      const int got = TopKCpu(sc, n, skip.data(), k, chosen.data(), scratch.data());
      for (int i = 0; i < got; ++i) mark[chosen[i]] = 1;
    };
    if (s.gqa == GqaMode::kUnion) {
      for (int g = 0; g < G; ++g) mark_top(scores.data() + std::size_t(g) * n);
    } else {
      agg.assign(scores.begin(), scores.begin() + n);
      for (int g = 1; g < G; ++g)
        for (int i = 0; i < n; ++i)
          agg[i] = s.gqa == GqaMode::kMax ? std::max(agg[i], scores[std::size_t(g) * n + i]) : agg[i] + scores[std::size_t(g) * n + i];
      if (s.gqa == GqaMode::kMean)
        for (int i = 0; i < n; ++i) agg[i] /= float(G);
      mark_top(agg.data());
    }
    if (row_scores && scored)
      std::copy_n(s.gqa == GqaMode::kUnion ? scores.data() : agg.data(), std::size_t(A) * n,
                  row_scores->data() + std::size_t(h) * A * n);
    for (int i = 0; i < n; ++i)
      if (mark[i]) rows[h].push_back(i);
  }
  return rows;
}

struct SelectCase {
  int batch, kv_heads, group, head_dim, page_size;
  int64_t page_budget;
  GqaMode gqa;
  DType q_dtype, sum_dtype;
  bool ties;       // summaries of few distinct values: many equal scores
  bool dense = false;
  int big_pages = 0;  // if > 0, sequence 0 has this many pages
  // If > 0, shared block selection: sequence b is scored by a block of
  // 1 + (3b + 1) % positions query rows (SelectParams::q_rows), its CPU
  // twin's group every position's G heads.
  int positions = 0;
};
// Readable test names in ctest.
void PrintTo(const SelectCase& c, std::ostream* os) {
  const char* gqa[] = {"max", "mean", "union"};
  *os << gqa[int(c.gqa)] << "_B" << c.batch << "_H" << c.kv_heads << "_G" << c.group << "_D" << c.head_dim << "_S"
      << c.page_size << "_K" << c.page_budget << "_q" << DTypeName(c.q_dtype) << "_sum" << DTypeName(c.sum_dtype)
      << (c.ties ? "_ties" : "") << (c.dense ? "_dense" : "") << (c.big_pages ? "_P" + std::to_string(c.big_pages) : "")
      << (c.positions ? "_n" + std::to_string(c.positions) : "");
}

// E4M3 summaries from a float slab [..][2][D]: in a few head-pages one
// dimension's bounds scaled past ±448 (codes ±inf: +inf scores for the query
// heads whose signs pick them), a few empty boxes, large finite and
// subnormal values elsewhere; then every bound snapped outward onto the grid.
void MakeE4m3Slab(std::vector<float>& slab, int D, uint64_t seed) {
  std::mt19937 rng{uint32_t(seed * 7 + 5)};
  const int heads = int(slab.size() / (2 * D));
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (int hp = 0; hp < heads; ++hp) {
    float* lo = slab.data() + std::size_t(hp) * 2 * D;
    float* hi = lo + D;
    const uint32_t r = rng();
    if (r % 61 == 0) {
      std::fill(lo, lo + D, kInf);
      std::fill(hi, hi + D, -kInf);
      continue;
    }
    for (int j = 0; j < D; ++j) {
      const uint32_t t = rng() % 64;
      const float scale = t == 0 ? 1e-3f : t == 1 ? 100.f : 1.f;
      lo[j] *= scale, hi[j] *= scale;
    }
    if (r % 16 == 1) {
      const int j = int(rng() % D);
      lo[j] *= 600.f, hi[j] *= 600.f;
    }
  }
  SnapSummaryE4m3Cpu(slab.data(), heads, D);
}

// Tensor-core scores (SelectShape::mma_scores) sum in another order than the
// CPU twin: a score may differ from the twin's by this share of its row's
// largest magnitude, and a selection only where the twin's scores are that
// close to its k-th.
constexpr double kMmaTol = 1e-4;

void RunSelectCase(const SelectCase& c, uint64_t seed, int key_cache = 0, bool split_long_rows = false,
                   bool mma = false) {
  const int B = c.batch, H = c.kv_heads, G = c.group, D = c.head_dim, S = c.page_size;
  const bool e4m3 = c.sum_dtype == DType::kE4M3;
  std::mt19937 rng{uint32_t(seed)};
  // Token lengths 1, S-1, S, S+1, 4099 and random ones.
  const int odd[] = {1, S - 1, S, S + 1, 4099, 3 * S + 5, 700, 40 * S};
  std::vector<int32_t> counts(B), indptr(B + 1, 0);
  for (int b = 0; b < B; ++b) {
    const int tokens = b < 8 ? odd[b] : 1 + int(rng() % 3000);
    counts[b] = (tokens + S - 1) / S;
    if (b == 0 && c.big_pages > 0) counts[b] = c.big_pages;
    indptr[b + 1] = indptr[b] + counts[b];
  }
  const int pages = indptr[B];
  const int id_space = pages + 11;
  std::vector<uint32_t> perm(id_space);
  std::iota(perm.begin(), perm.end(), 0u);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<uint32_t> ids(perm.begin(), perm.begin() + pages);
  std::vector<int32_t> hbm_slot(std::size_t(id_space) * H);
  for (std::size_t i = 0; i < hbm_slot.size(); ++i) hbm_slot[i] = int32_t((i * 7919) % (hbm_slot.size() + 5));

  std::vector<float> slab(std::size_t(id_space) * H * 2 * D);
  {
    std::vector<float> x = questkv::test::RandomNormal(slab.size() / 2, seed + 1);
    std::vector<float> w = questkv::test::RandomUniform(slab.size() / 2, seed + 2, 0.f, 1.f);
    for (std::size_t i = 0; i < x.size(); ++i) {
      if (c.ties) x[i] = std::round(x[i]), w[i] = std::round(w[i]);
      const std::size_t head = i / D, j = i % D;
      slab[head * 2 * D + j] = x[i] - w[i];
      slab[head * 2 * D + D + j] = x[i] + w[i];
    }
  }
  std::vector<int32_t> q_rows(B + 1, 0);
  for (int b = 0; b < B; ++b) q_rows[b + 1] = q_rows[b] + (c.positions > 0 ? 1 + (3 * b + 1) % c.positions : 1);
  std::vector<float> q = questkv::test::RandomNormal(std::size_t(q_rows[B]) * H * G * D, seed + 3);
  if (c.ties)
    for (float& v : q) v = std::round(v);
  std::vector<uint8_t> slab_bytes;
  if (e4m3) {
    MakeE4m3Slab(slab, D, seed);
    slab_bytes.resize(slab.size());
    EncodeSummaryE4m3Cpu(slab.data(), id_space * H, D, slab_bytes.data());
  } else {
    slab = RoundTo(slab, c.sum_dtype);
    slab_bytes = Encode(slab, c.sum_dtype);
  }
  q = RoundTo(q, c.q_dtype);

  SelectShape s;
  s.batch = B;
  s.kv_heads = H;
  s.group = G;
  s.head_dim = D;
  s.page_size = S;
  s.page_budget = c.page_budget;
  s.sink_pages = 1;
  s.local_pages = 4;
  s.gqa = c.gqa;
  s.dense = c.dense;
  s.mma_scores = mma;
  for (int b = 0; b < B && c.positions > 0; ++b) s.positions = std::max(s.positions, q_rows[b + 1] - q_rows[b]);
  SelectPlan plan;
  std::string err;
  ASSERT_TRUE(PlanSelect(s, counts.data(), NumSms(), &plan, &err)) << err;
  // A smaller shared key cache forces the multi-block histogram path (rows
  // longer than the cache) and, when the k-th key's bin overflows it, the
  // top-K block's fallback over global keys.
  if (key_cache > 0) plan.key_cache = std::min(plan.key_cache, key_cache);
  // Rows of more than 16K pages: their top-K in one launch (the grids here
  // are resident at once) or, split, three.
  plan.split_long_rows = split_long_rows;

  DeviceBuffer d_q, d_slab, d_indptr, d_ids, d_slot, d_out_indptr, d_pages, d_slots, d_count, d_ws, d_qrows;
  Upload(d_q, Encode(q, c.q_dtype));
  Upload(d_qrows, q_rows);
  Upload(d_slab, slab_bytes);
  Upload(d_indptr, indptr);
  Upload(d_ids, ids);
  Upload(d_slot, hbm_slot);
  Upload(d_out_indptr, plan.out_indptr);
  const int rows = B * H;
  const int nnz = plan.out_indptr[rows];
  Upload(d_pages, std::vector<int32_t>(nnz, -7));  // poison
  Upload(d_slots, std::vector<int32_t>(nnz, -7));
  Upload(d_count, std::vector<int32_t>(rows, -7));
  d_ws.Resize(std::max<std::size_t>(plan.workspace_bytes, 1));

  SelectParams p;
  p.shape = s;
  p.q_dtype = c.q_dtype;
  p.summary_dtype = c.sum_dtype;
  p.q = d_q.get();
  p.summaries = d_slab.get();
  p.page_indptr = d_indptr.as<int32_t>();
  p.page_ids = d_ids.as<uint32_t>();
  p.hbm_slot = d_slot.as<int32_t>();
  p.out_indptr = d_out_indptr.as<int32_t>();
  p.out_pages = d_pages.as<int32_t>();
  p.out_slots = d_slots.as<int32_t>();
  p.out_count = d_count.as<int32_t>();
  p.workspace = d_ws.get();
  if (c.positions > 0) p.q_rows = d_qrows.as<int32_t>();
  QKV_CUDA_OK(LaunchSelect(plan, p, nullptr));
  QKV_CUDA_OK(cudaDeviceSynchronize());
  const auto got_pages = Download<int32_t>(d_pages, nnz);
  const auto got_slots = Download<int32_t>(d_slots, nnz);
  const auto got_count = Download<int32_t>(d_count, rows);
  // Unless the fused select ran (it scores in shared memory), the score
  // kernels' scores are at the workspace's start (select.cu): sequence b's
  // [H][A][n] from indptr[b] * H * A. The runs with a small key cache take
  // the score kernels, so every E4M3 case compares its scores there.
  const int A = c.gqa == GqaMode::kUnion ? G * s.positions : 1;
  const bool scores_kept = (e4m3 || mma) && !SelectIsFused(plan, p);
  const auto got_scores = scores_kept ? Download<float>(d_ws, std::size_t(pages) * H * A) : std::vector<float>();

  double worst_jaccard = 1.0;
  std::vector<float> want_scores;
  for (int b = 0; b < B; ++b) {
    // The block's queries regrouped [H][n][G][D]: KV head h's group is
    // every position's G query heads, position by position.
    const int n = q_rows[b + 1] - q_rows[b];
    std::vector<float> qb(std::size_t(n) * H * G * D);
    for (int h = 0; h < H; ++h)
      for (int pos = 0; pos < n; ++pos)
        std::copy_n(q.data() + (std::size_t(q_rows[b] + pos) * H + h) * G * D, std::size_t(G) * D,
                    qb.data() + (std::size_t(h) * n + pos) * G * D);
    SelectShape sb = s;
    sb.group = n * G;
    const auto want = CpuSelect(sb, qb.data(), slab.data(), ids.data() + indptr[b], counts[b], e4m3, &want_scores);
    // The largest finite score magnitude of each KV head's rows (mma tolerances).
    const int a_want = c.gqa == GqaMode::kUnion ? n * G : 1;
    std::vector<double> row_scale(H, 1.0);
    for (std::size_t i = 0; i < want_scores.size(); ++i)
      if (std::isfinite(want_scores[i])) {
        double& m = row_scale[i / (std::size_t(a_want) * counts[b])];
        m = std::max(m, double(std::fabs(want_scores[i])));
      }
    if (scores_kept) {
      // [H][A][n] on the device; the CPU's [H][n * G][n] for kUnion (the
      // device's A repeats a short block's last position), else [H][1][n].
      const float* got = got_scores.data() + std::size_t(indptr[b]) * H * A;
      for (std::size_t i = 0; i < want_scores.size(); ++i) {
        const std::size_t h = i / (std::size_t(a_want) * counts[b]), a = i / counts[b] % a_want, j = i % counts[b];
        const float g = got[(h * A + a) * counts[b] + j];
        const float w = want_scores[i];
        bool same = std::memcmp(&g, &w, 4) == 0 || (std::isnan(g) && std::isnan(w));
        if (mma && !same && std::isfinite(w)) same = std::fabs(double(g) - w) <= kMmaTol * row_scale[h];
        ASSERT_TRUE(same) << "sequence " << b << " (" << counts[b] << " pages), score " << i << " of [H][" << a_want
                          << "][n]: " << g << " vs " << w;
      }
    }
    for (int h = 0; h < H; ++h) {
      const int row = b * H + h;
      ASSERT_LE(got_count[row], plan.out_indptr[row + 1] - plan.out_indptr[row]);
      std::vector<int> got(got_pages.begin() + plan.out_indptr[row],
                           got_pages.begin() + plan.out_indptr[row] + std::max(0, got_count[row]));
      worst_jaccard = std::min(worst_jaccard, questkv::test::Jaccard(got, want[h]));
      if (mma && got != want[h] && !want_scores.empty()) {
        // Only pages that some ranking of the twin (the aggregate, or under
        // kUnion a query head's) scores within the tolerance of its k-th may
        // trade places.
        const int sink = std::min(1, counts[b]), local = std::min(4, counts[b]);
        auto fixed = [&](int j) { return j < sink || j >= counts[b] - local; };
        int nfixed = 0;
        for (int j = 0; j < counts[b]; ++j) nfixed += fixed(j);
        const int k = int(std::max<int64_t>(0, c.page_budget - nfixed));
        const double tol = kMmaTol * row_scale[h];
        std::vector<double> kth(a_want, std::numeric_limits<double>::infinity());  // k = 0: nothing near
        for (int a = 0; a < a_want && k > 0; ++a) {
          const float* sc = want_scores.data() + (std::size_t(h) * a_want + a) * counts[b];
          std::vector<float> free;
          for (int j = 0; j < counts[b]; ++j)
            if (!fixed(j)) free.push_back(sc[j]);
          std::nth_element(free.begin(), free.begin() + (k - 1), free.end(), std::greater<float>());
          kth[a] = free[k - 1];
        }
        auto near_kth = [&](int j) {
          for (int a = 0; a < a_want; ++a) {
            const double v = want_scores[(std::size_t(h) * a_want + a) * counts[b] + j];
            if (std::fabs(v - kth[a]) <= tol) return true;
          }
          return false;
        };
        if (c.gqa != GqaMode::kUnion) {
          ASSERT_EQ(got.size(), want[h].size()) << "sequence " << b << ", KV head " << h;
        }
        std::vector<int> diff;
        std::set_symmetric_difference(got.begin(), got.end(), want[h].begin(), want[h].end(), std::back_inserter(diff));
        for (int j : diff)
          ASSERT_TRUE(!fixed(j) && near_kth(j)) << "sequence " << b << " (" << counts[b] << " pages), KV head " << h
                                                << ": page " << j << " differs from the CPU twin's choice";
      } else {
        ASSERT_EQ(got, want[h]) << "sequence " << b << " (" << counts[b] << " pages), KV head " << h;
      }
      for (std::size_t j = 0; j < got.size(); ++j)
        ASSERT_EQ(got_slots[plan.out_indptr[row] + j], hbm_slot[std::size_t(ids[indptr[b] + got[j]]) * H + h]);
      if (c.gqa != GqaMode::kUnion) {
        ASSERT_EQ(got_count[row], plan.out_indptr[row + 1] - plan.out_indptr[row]);
      }
    }
  }
  ::testing::Test::RecordProperty("worst_jaccard", std::to_string(worst_jaccard));
}

class SelectCudaTest : public ::testing::TestWithParam<SelectCase> {};

TEST_P(SelectCudaTest, EqualsCpuTwinExactly) {
  QKV_REQUIRE_GPU();
  for (uint64_t seed : {1u, 2u}) RunSelectCase(GetParam(), 100 * seed + GetParam().batch);
  for (int key_cache : {8, 256}) RunSelectCase(GetParam(), 300 + key_cache + GetParam().batch, key_cache);
  if (GetParam().big_pages > 16384) {
    RunSelectCase(GetParam(), 500 + GetParam().batch, 0, /*split_long_rows=*/true);
    RunSelectCase(GetParam(), 508 + GetParam().batch, 8, /*split_long_rows=*/true);
  }
}

constexpr DType F32 = DType::kF32, F16 = DType::kF16, BF16 = DType::kBF16, E4M3 = DType::kE4M3;

// Tensor-core scores (ScoreKernelMma): within kMmaTol of the CPU twin's, and
// the twin's selections but where its scores are that close to its k-th.
class SelectMmaTest : public ::testing::TestWithParam<SelectCase> {};
TEST_P(SelectMmaTest, WithinRoundingOfCpuTwin) {
  QKV_REQUIRE_GPU();
  for (uint64_t seed : {1u, 2u}) RunSelectCase(GetParam(), 700 * seed + GetParam().batch, 0, false, /*mma=*/true);
  RunSelectCase(GetParam(), 900 + GetParam().batch, 8, false, /*mma=*/true);
  if (GetParam().big_pages > 16384) RunSelectCase(GetParam(), 950 + GetParam().batch, 0, true, /*mma=*/true);
}
INSTANTIATE_TEST_SUITE_P(
    MmaScores, SelectMmaTest,
    ::testing::Values(SelectCase{3, 2, 4, 128, 16, 12, GqaMode::kMax, F16, F16, false},
                      SelectCase{7, 2, 4, 64, 8, 20, GqaMode::kMean, BF16, BF16, false},
                      SelectCase{7, 2, 8, 128, 16, 10, GqaMode::kUnion, F16, F16, false},
                      SelectCase{23, 2, 1, 128, 16, 9, GqaMode::kMax, F16, F16, true},
                      SelectCase{5, 1, 2, 256, 32, 7, GqaMode::kMean, BF16, BF16, false},
                      SelectCase{3, 2, 8, 256, 16, 12, GqaMode::kMax, F16, E4M3, false},
                      SelectCase{7, 2, 4, 128, 16, 10, GqaMode::kUnion, F16, E4M3, true},
                      SelectCase{7, 2, 4, 128, 16, 8, GqaMode::kMax, F16, F16, false, /*dense=*/true},
                      SelectCase{9, 2, 4, 128, 16, 24, GqaMode::kMean, F16, E4M3, false, false, 5000},
                      SelectCase{1, 8, 4, 128, 16, 128, GqaMode::kMax, F16, F16, false, false, 32768},
                      SelectCase{1, 2, 4, 128, 16, 4096, GqaMode::kMax, BF16, BF16, true, false, 70001}));
INSTANTIATE_TEST_SUITE_P(
    Policies, SelectCudaTest,
    ::testing::Values(SelectCase{1, 1, 1, 128, 16, 16, GqaMode::kMax, F32, F32, false},
                      SelectCase{3, 2, 4, 128, 16, 12, GqaMode::kMax, F16, F16, false},
                      SelectCase{7, 2, 4, 64, 8, 20, GqaMode::kMean, F32, F32, false},
                      SelectCase{7, 2, 8, 128, 16, 10, GqaMode::kUnion, BF16, F32, false},
                      SelectCase{23, 2, 4, 128, 16, 9, GqaMode::kMax, F32, F32, true},
                      SelectCase{23, 1, 8, 256, 32, 7, GqaMode::kUnion, F32, F32, true},
                      SelectCase{3, 2, 1, 64, 64, 6, GqaMode::kMean, F16, F32, true},
                      SelectCase{7, 2, 4, 128, 16, 8, GqaMode::kMax, F16, F16, false, /*dense=*/true},
                      SelectCase{3, 2, 4, 128, 16, 5, GqaMode::kMax, F32, F32, false, false},
                      // 4096 winners out of 65536+ pages in sequence 0.
                      SelectCase{1, 2, 4, 128, 16, 4096, GqaMode::kMax, F16, F16, false, false, 70001},
                      SelectCase{3, 1, 4, 128, 16, 4096, GqaMode::kMax, F32, F32, true, false, 65536},
                      SelectCase{1, 1, 4, 64, 16, 1000, GqaMode::kUnion, F32, F32, false, false, 30000},
                      // The fused one-launch path (kMax/kMean, G <= 4, equal dtypes, few rows)
                      // at its 2048-page limit, and a long row with many equal scores.
                      SelectCase{1, 2, 4, 128, 16, 512, GqaMode::kMax, F16, F16, false, false, 2048},
                      SelectCase{2, 1, 2, 64, 16, 300, GqaMode::kMean, BF16, BF16, true, false, 2000},
                      // Short rows in registers (SelectShortRow: 1025..8192 pages): Llama-3-8B at
                      // 128K and one page past (after decode steps: the key cache's RangeKth),
                      // many equal scores with kMean, and a budget above half the row.
                      SelectCase{1, 8, 4, 128, 16, 128, GqaMode::kMax, F16, F16, false, false, 8192},
                      SelectCase{1, 8, 4, 128, 16, 128, GqaMode::kMax, F16, F16, false, false, 8193},
                      SelectCase{1, 2, 2, 64, 16, 9000, GqaMode::kMean, BF16, BF16, true, false, 16384},
                      SelectCase{2, 2, 2, 64, 16, 300, GqaMode::kMean, BF16, BF16, true, false, 5000},
                      SelectCase{3, 1, 1, 128, 16, 2049, GqaMode::kMax, F32, F32, true, false, 4099},
                      // Rows in the key cache past 8192 keys (RangeKth), with ties; G = 4 at
                      // 256K+ head-pages (the staged score kernel).
                      SelectCase{1, 2, 4, 64, 16, 700, GqaMode::kMean, F32, F32, true, false, 20000},
                      SelectCase{1, 8, 4, 128, 16, 128, GqaMode::kMax, F16, F16, false, false, 32768},
                      // The lanes score kernel (G = 4, D = 128) with mixed dtypes over a ragged
                      // batch (units cross rows and end mid-row), and with kUnion's per-head
                      // scores and many equal ones.
                      SelectCase{9, 2, 4, 128, 16, 24, GqaMode::kMean, F16, BF16, false, false, 5000},
                      SelectCase{4, 2, 4, 128, 16, 30, GqaMode::kUnion, F16, F16, true, false, 3000},
                      // Rows of 1025..2048 pages past the fused select's limits (SelectShortRow
                      // too): Llama-3-8B at 32K, and a ragged pair with many equal kMean scores.
                      SelectCase{1, 8, 4, 128, 16, 128, GqaMode::kMax, F16, F16, false, false, 2048},
                      SelectCase{2, 2, 2, 64, 16, 300, GqaMode::kMean, F16, BF16, true, false, 1500},
                      // The staged score kernel's query stage (G * D <= 128) and 16-bit select
                      // masks: Llama-2-7B's G = 1, D = 128 over a ragged batch, and kUnion's
                      // per-head scores at G = 2 with many equal ones.
                      SelectCase{7, 4, 1, 128, 16, 40, GqaMode::kMax, F16, F16, false, false, 6000},
                      SelectCase{3, 2, 2, 64, 16, 50, GqaMode::kUnion, BF16, BF16, true, false, 3000}));

// Shared block selection (SelectParams::q_rows): ragged blocks of up to 4 or
// 8 positions scoring their sequence's pages together, each GQA mode, G up to
// 8 (64 heads a group on the CPU), many equal scores, a dense layer, and a
// long row whose key range the block score kernel folds.
INSTANTIATE_TEST_SUITE_P(
    SharedBlocks, SelectCudaTest,
    ::testing::Values(SelectCase{5, 2, 4, 128, 16, 12, GqaMode::kMax, F16, F16, false, false, 0, 4},
                      SelectCase{6, 2, 4, 64, 16, 10, GqaMode::kMean, F32, F32, true, false, 0, 8},
                      SelectCase{4, 2, 2, 128, 16, 9, GqaMode::kUnion, BF16, F32, false, false, 0, 3},
                      SelectCase{2, 1, 8, 128, 16, 10, GqaMode::kMax, F16, F16, false, false, 0, 8},
                      SelectCase{3, 2, 4, 128, 16, 8, GqaMode::kMax, F16, F16, false, /*dense=*/true, 0, 4},
                      SelectCase{1, 2, 4, 128, 16, 2048, GqaMode::kMax, F16, F16, false, false, 40001, 4},
                      SelectCase{3, 2, 4, 128, 16, 12, GqaMode::kMean, F16, E4M3, false, false, 0, 5},
                      SelectCase{3, 2, 1, 128, 16, 10, GqaMode::kUnion, F32, E4M3, true, false, 0, 3}));

// E4M3 summaries, over every score kernel: staged (G <= 2, D 128 and 256; G = 8 at
// 256K head-pages, with long rows of many +inf scores), direct (G >= 4 and D = 64 at
// any G), lanes (G = 4, D = 128, also with f32 q's separate product and sum), the
// fused short-row select (max/mean, G <= 4, few pages), each GQA mode and q dtype,
// dense, and the top-K's short-row and long-row paths.
INSTANTIATE_TEST_SUITE_P(
    E4m3, SelectCudaTest,
    ::testing::Values(SelectCase{1, 1, 1, 128, 16, 16, GqaMode::kMax, F32, E4M3, false},
                      SelectCase{3, 2, 2, 64, 8, 20, GqaMode::kMean, F16, E4M3, false},
                      SelectCase{1, 2, 1, 64, 16, 30, GqaMode::kMean, F32, E4M3, true},
                      SelectCase{7, 2, 4, 128, 16, 12, GqaMode::kMax, BF16, E4M3, false},
                      SelectCase{7, 2, 4, 64, 16, 10, GqaMode::kUnion, F16, E4M3, true},
                      SelectCase{3, 2, 8, 256, 32, 7, GqaMode::kUnion, F32, E4M3, true},
                      SelectCase{7, 2, 1, 256, 16, 9, GqaMode::kMean, BF16, E4M3, false},
                      SelectCase{3, 1, 8, 128, 16, 8, GqaMode::kMax, F16, E4M3, false},
                      SelectCase{3, 2, 2, 128, 16, 10, GqaMode::kUnion, F32, E4M3, false},
                      SelectCase{7, 2, 4, 128, 16, 8, GqaMode::kMax, F16, E4M3, false, /*dense=*/true},
                      SelectCase{9, 2, 4, 128, 16, 24, GqaMode::kMean, F16, E4M3, false, false, 5000},
                      SelectCase{4, 2, 4, 128, 16, 30, GqaMode::kUnion, F32, E4M3, true, false, 3000},
                      SelectCase{1, 2, 4, 128, 16, 4096, GqaMode::kMean, BF16, E4M3, true, false, 20000},
                      SelectCase{1, 8, 8, 128, 16, 128, GqaMode::kMax, F16, E4M3, false, false, 32768}));

TEST(SelectPlanTest, RejectsUnsupportedSizesWithAMessage) {
  SelectShape s;
  s.batch = 1;
  s.kv_heads = 1;
  s.group = 3;
  s.head_dim = 128;
  s.page_size = 16;
  const int32_t counts[] = {4};
  SelectPlan plan;
  std::string err;
  EXPECT_FALSE(PlanSelect(s, counts, 132, &plan, &err));
  EXPECT_NE(err.find("group = 3"), std::string::npos) << err;
  s.group = 4;
  s.head_dim = 96;
  EXPECT_FALSE(PlanSelect(s, counts, 132, &plan, &err));
  EXPECT_NE(err.find("head_dim = 96"), std::string::npos) << err;
}

// E4M3 is a summary dtype only: queries in it, and summary dtypes that do not
// exist, are refused before any launch (no GPU needed).
TEST(SelectRejectTest, E4m3QueriesAndUnknownSummaryDtypes) {
  SelectShape s;
  s.batch = 1;
  s.kv_heads = 1;
  s.group = 1;
  s.head_dim = 128;
  s.page_size = 16;
  s.page_budget = 2;
  const int32_t counts[] = {40};
  SelectPlan plan;
  std::string err;
  ASSERT_TRUE(PlanSelect(s, counts, 132, &plan, &err)) << err;
  SelectParams p;
  p.shape = s;
  p.q_dtype = DType::kE4M3;
  for (DType sum : {DType::kF16, DType::kE4M3}) {  // both in e4m3: refused by the fused select's dispatch
    p.summary_dtype = sum;
    EXPECT_EQ(LaunchSelect(plan, p, nullptr), cudaErrorInvalidValue);
    EXPECT_NE(LastErrorMessage().find("unsupported dtype = 3 (supported: f32, f16, bf16)"), std::string::npos)
        << LastErrorMessage();
  }
  p.q_dtype = DType::kF16;
  p.summary_dtype = DType(9);
  EXPECT_EQ(LaunchSelect(plan, p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(LastErrorMessage().find("unsupported summary dtype = 9 (supported: f32, f16, bf16, e4m3)"),
            std::string::npos)
      << LastErrorMessage();
}

}  // namespace
}  // namespace questkv::kernels::cuda::test
