// MergeState algebra and sparse paged attention against the brute-force
// page-masked reference of tests/testing (double precision).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <random>
#include <vector>

#include "kernels/attention_state.h"
#include "kernels/cpu/kernels_cpu.h"
#include "tests/testing/reference.h"

namespace questkv::kernels {
namespace {

// ---- MergeState -------------------------------------------------------------

struct State {
  std::vector<float> o;
  float m = kNegInf;
  float d = 0.f;
};

// The state of a token set computed directly in double: logits s, values v [n][dim].
State StateOf(const std::vector<double>& s, const std::vector<float>& v, int dim) {
  State st;
  st.o.assign(dim, 0.f);
  if (s.empty()) return st;
  const double m = *std::max_element(s.begin(), s.end());
  double d = 0;
  std::vector<double> o(dim, 0);
  for (std::size_t t = 0; t < s.size(); ++t) {
    const double w = std::exp(s[t] - m);
    d += w;
    for (int j = 0; j < dim; ++j) o[j] += w * v[t * dim + j];
  }
  for (int j = 0; j < dim; ++j) st.o[j] = float(o[j] / d);
  st.m = float(m);
  st.d = float(d);
  return st;
}

void Merge(State& a, const State& b) {
  MergeState(a.o.data(), a.m, a.d, b.o.data(), b.m, b.d, int(a.o.size()));
}

void ExpectStateNear(const State& a, const State& b, double tol) {
  EXPECT_EQ(a.m, b.m);
  EXPECT_NEAR(a.d, b.d, tol * std::abs(b.d));
  EXPECT_LE(test::RelL2Error(a.o.data(), b.o.data(), a.o.size()), tol);
}

constexpr int kDim = 16;

// Three disjoint random token sets and their states.
struct Triple {
  std::vector<double> s[3];
  std::vector<float> v[3];
  State st[3];
};
Triple RandomTriple(uint64_t seed) {
  Triple t;
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 3; ++i) {
    const int n = 1 + int(rng() % 20);
    const auto logits = test::RandomNormal(n, seed * 10 + i, float(i) * 3.f, 4.f);
    t.s[i].assign(logits.begin(), logits.end());
    t.v[i] = test::RandomNormal(std::size_t(n) * kDim, seed * 10 + i + 5);
    t.st[i] = StateOf(t.s[i], t.v[i], kDim);
  }
  return t;
}

TEST(MergeState, EmptyMergeEmptyIsEmpty) {
  State a = StateOf({}, {}, kDim), b = StateOf({}, {}, kDim);
  Merge(a, b);
  EXPECT_EQ(a.m, kNegInf);
  EXPECT_EQ(a.d, 0.f);
  EXPECT_EQ(a.o, std::vector<float>(kDim, 0.f));
  EXPECT_EQ(StateLse(a.m, a.d), kNegInf);
}

TEST(MergeState, EmptyIsTheIdentity) {
  const Triple t = RandomTriple(1);
  State left = StateOf({}, {}, kDim);
  Merge(left, t.st[0]);
  EXPECT_EQ(left.o, t.st[0].o);
  EXPECT_EQ(left.m, t.st[0].m);
  EXPECT_EQ(left.d, t.st[0].d);
  State right = t.st[0];
  Merge(right, StateOf({}, {}, kDim));
  EXPECT_EQ(right.o, t.st[0].o);
  EXPECT_EQ(right.m, t.st[0].m);
  EXPECT_EQ(right.d, t.st[0].d);
}

TEST(MergeState, AssociativeAndEqualToStateOfUnion) {
  for (uint64_t seed = 1; seed <= 50; ++seed) {
    const Triple t = RandomTriple(seed);
    State ab_c = t.st[0];
    Merge(ab_c, t.st[1]);
    Merge(ab_c, t.st[2]);
    State bc = t.st[1];
    Merge(bc, t.st[2]);
    State a_bc = t.st[0];
    Merge(a_bc, bc);
    ExpectStateNear(ab_c, a_bc, 1e-6);
    std::vector<double> s;
    std::vector<float> v;
    for (int i = 0; i < 3; ++i) {
      s.insert(s.end(), t.s[i].begin(), t.s[i].end());
      v.insert(v.end(), t.v[i].begin(), t.v[i].end());
    }
    ExpectStateNear(ab_c, StateOf(s, v, kDim), 1e-6);
  }
}

// ---- AttendPagesCpu -----------------------------------------------------------

constexpr float kPoison = 1e30f;

// One KV head's sequence: contiguous K/V [T][D] for the reference, and the same
// rows in separate page buffers [S][D] whose unused tail slots are poisoned.
struct Sequence {
  int tokens, page_size, head_dim;
  std::vector<float> k, v;
  std::vector<std::vector<float>> page_k, page_v;

  Sequence(int t, int s, int d, uint64_t seed)
      : tokens(t),
        page_size(s),
        head_dim(d),
        k(test::RandomNormal(std::size_t(t) * d, seed)),
        v(test::RandomNormal(std::size_t(t) * d, seed + 1)) {
    for (int p = 0; p * s < t; ++p) {
      page_k.emplace_back(std::size_t(s) * d, kPoison);
      page_v.emplace_back(std::size_t(s) * d, kPoison);
      const std::size_t first = std::size_t(p) * s * d;
      const std::size_t n = std::size_t(std::min(s, t - p * s)) * d;
      std::copy_n(k.begin() + first, n, page_k.back().begin());
      std::copy_n(v.begin() + first, n, page_v.back().begin());
    }
  }
  int pages() const { return int(page_k.size()); }
  HeadPageRef Ref(int p) const {
    return {page_k[p].data(), page_v[p].data(), std::min(page_size, tokens - p * page_size)};
  }
};

struct Output {
  std::vector<float> o, m, d;
};

Output Attend(const std::vector<float>& q, int group, const Sequence& seq,
              const std::vector<int>& pages, float scale) {
  std::vector<HeadPageRef> refs;
  for (int p : pages) refs.push_back(seq.Ref(p));
  // Garbage in the outputs: the kernel must initialise them.
  Output out{std::vector<float>(std::size_t(group) * seq.head_dim, 7.f),
             std::vector<float>(group, 7.f), std::vector<float>(group, 7.f)};
  AttendPagesCpu(q.data(), group, seq.head_dim, refs.data(), int(refs.size()), scale, out.o.data(),
                 out.m.data(), out.d.data());
  return out;
}

// Every query head's output, max logit and denominator against the reference.
void ExpectMatchesReference(const std::vector<float>& q, int group, const Sequence& seq,
                            const std::vector<int>& pages, const Output& out, double scale) {
  const int d = seq.head_dim;
  for (int g = 0; g < group; ++g) {
    const float* qg = q.data() + std::size_t(g) * d;
    const auto ref = test::MaskedAttention(qg, seq.k.data(), seq.v.data(), seq.tokens, d,
                                           seq.page_size, pages, scale);
    const std::vector<float> ref_f(ref.begin(), ref.end());
    ASSERT_LE(test::RelL2Error(out.o.data() + std::size_t(g) * d, ref_f.data(), d), 1e-5)
        << "T=" << seq.tokens << " S=" << seq.page_size << " G=" << group << " g=" << g;
    double m = -INFINITY;
    std::vector<double> logits;
    for (int p : pages)
      for (int t = p * seq.page_size; t < std::min(seq.tokens, (p + 1) * seq.page_size); ++t) {
        double s = 0;
        for (int j = 0; j < d; ++j) s += double(qg[j]) * seq.k[std::size_t(t) * d + j];
        logits.push_back(scale * s);
        m = std::max(m, scale * s);
      }
    double denom = 0;
    for (double s : logits) denom += std::exp(s - m);
    ASSERT_NEAR(out.m[g], m, 1e-5 * std::max(1.0, std::abs(m)));
    ASSERT_NEAR(out.d[g], denom, 1e-5 * denom);
  }
}

// A random subset of the pages (about half), always with the tail page.
std::vector<int> RandomPages(int pages, std::mt19937_64& rng) {
  std::vector<int> chosen;
  for (int p = 0; p + 1 < pages; ++p)
    if (rng() % 2) chosen.push_back(p);
  chosen.push_back(pages - 1);
  return chosen;
}

TEST(AttendPages, MatchesMaskedReference) {
  std::mt19937_64 rng(3);
  uint64_t seed = 1000;
  for (int s : {1, 3, 7, 16, 17})
    for (int t : {1, s - 1, s, s + 1, 5 * s + 3}) {
      if (t < 1) continue;
      for (int group : {1, 2, 4, 8})
        for (int d : {16, 128}) {
          const Sequence seq(t, s, d, seed++);
          const auto q = test::RandomNormal(std::size_t(group) * d, seed++);
          const double scale = 1.0 / std::sqrt(double(d));
          const auto pages = RandomPages(seq.pages(), rng);
          ExpectMatchesReference(q, group, seq, pages, Attend(q, group, seq, pages, float(scale)),
                                 scale);
        }
    }
}

// Long pages are attended in row blocks and wide groups in head chunks; the
// result must not depend on either split.
TEST(AttendPages, LongPagesAndWideGroups) {
  std::mt19937_64 rng(4);
  for (int s : {127, 128, 129, 300})
    for (int group : {15, 16, 17, 24}) {
      const int d = 32, t = 3 * s - 5;
      const Sequence seq(t, s, d, 77 + s + group);
      const auto q = test::RandomNormal(std::size_t(group) * d, 99 + s + group);
      const double scale = 1.0 / std::sqrt(double(d));
      const auto pages = RandomPages(seq.pages(), rng);
      ExpectMatchesReference(q, group, seq, pages, Attend(q, group, seq, pages, float(scale)),
                             scale);
    }
}

TEST(AttendPages, ShuffledPageOrderGivesSameOutput) {
  std::mt19937_64 rng(5);
  for (int s : {3, 16, 17}) {
    const int group = 4, d = 64;
    const Sequence seq(40 * s + 5, s, d, 500 + s);
    const auto q = test::RandomNormal(std::size_t(group) * d, 600 + s);
    std::vector<int> pages = RandomPages(seq.pages(), rng);
    const Output in_order = Attend(q, group, seq, pages, 0.125f);
    for (int rep = 0; rep < 5; ++rep) {
      std::shuffle(pages.begin(), pages.end(), rng);
      const Output shuffled = Attend(q, group, seq, pages, 0.125f);
      ASSERT_LE(test::RelL2Error(shuffled.o.data(), in_order.o.data(), in_order.o.size()), 1e-6);
      for (int g = 0; g < group; ++g) {
        ASSERT_EQ(shuffled.m[g], in_order.m[g]);
        ASSERT_NEAR(shuffled.d[g], in_order.d[g], 1e-6 * in_order.d[g]);
      }
    }
  }
}

// Budget >= all pages must reproduce dense attention (seed §1.2's fallback).
TEST(AttendPages, AllPagesEqualsDenseReference) {
  for (int s : {1, 7, 16, 17})
    for (int t : {1, s + 1, 100 * s + 3}) {
      const int group = 4, d = 128;
      const Sequence seq(t, s, d, 700 + s + t);
      const auto q = test::RandomNormal(std::size_t(group) * d, 800 + s + t);
      std::vector<int> all(seq.pages());
      for (int p = 0; p < seq.pages(); ++p) all[p] = p;
      const double scale = 1.0 / std::sqrt(double(d));
      const Output out = Attend(q, group, seq, all, float(scale));
      for (int g = 0; g < group; ++g) {
        std::vector<float> dense(d);
        DenseAttentionReference(q.data() + std::size_t(g) * d, seq.k.data(), seq.v.data(), t, d, d,
                                scale, dense.data());
        ASSERT_LE(test::RelL2Error(out.o.data() + std::size_t(g) * d, dense.data(), d), 1e-5)
            << "T=" << t << " S=" << s;
      }
    }
}

// The tail page's unused slots hold 1e30 keys and values: if one entered the
// softmax it would dominate the output.
TEST(AttendPages, PoisonedTailSlotsNeverLeak) {
  const int s = 16, d = 32, group = 2;
  for (int len : {1, 5, 15}) {
    const Sequence seq(2 * s + len, s, d, 900 + len);
    const auto q = test::RandomNormal(std::size_t(group) * d, 950 + len, 1.f, 1.f);
    const Output out = Attend(q, group, seq, {2}, 1.f);
    for (float x : out.o) ASSERT_LT(std::abs(x), 10.f);
    ExpectMatchesReference(q, group, seq, {2}, out, 1.0);
  }
}

TEST(AttendPages, NoPagesGivesEmptyState) {
  const Sequence seq(5, 4, 8, 1);
  const auto q = test::RandomNormal(3 * 8, 2);
  const Output out = Attend(q, 3, seq, {}, 1.f);
  EXPECT_EQ(out.o, std::vector<float>(3 * 8, 0.f));
  EXPECT_EQ(out.m, std::vector<float>(3, kNegInf));
  EXPECT_EQ(out.d, std::vector<float>(3, 0.f));
}

// ---- DenseAttentionReference ------------------------------------------------

TEST(DenseAttentionReference, MatchesBruteForceWithRowStride) {
  for (int t : {1, 2, 33, 500}) {
    const int d = 24, stride = 40;  // rows padded: the padding must be ignored
    auto k = test::RandomNormal(std::size_t(t) * stride, 10 + t);
    auto v = test::RandomNormal(std::size_t(t) * stride, 20 + t);
    std::vector<float> k_dense, v_dense;
    for (int r = 0; r < t; ++r) {
      k_dense.insert(k_dense.end(), k.begin() + r * stride, k.begin() + r * stride + d);
      v_dense.insert(v_dense.end(), v.begin() + r * stride, v.begin() + r * stride + d);
      std::fill(k.begin() + r * stride + d, k.begin() + (r + 1) * stride, kPoison);
      std::fill(v.begin() + r * stride + d, v.begin() + (r + 1) * stride, kPoison);
    }
    const auto q = test::RandomNormal(d, 30 + t);
    const double scale = 0.3;
    std::vector<float> out(d);
    DenseAttentionReference(q.data(), k.data(), v.data(), t, d, stride, scale, out.data());
    // One page of T tokens: the masked reference attends every token.
    const auto ref =
        test::MaskedAttention(q.data(), k_dense.data(), v_dense.data(), t, d, t, {0}, scale);
    const std::vector<float> ref_f(ref.begin(), ref.end());
    ASSERT_LE(test::RelL2Error(out.data(), ref_f.data(), d), 1e-6) << "T=" << t;
    if (t == 1) {
      EXPECT_EQ(out, v_dense);
    }
  }
}

TEST(DenseAttentionReference, NoTokensGivesZeros) {
  std::vector<float> out(4, 7.f);
  const float q[4] = {1, 2, 3, 4};
  DenseAttentionReference(q, nullptr, nullptr, 0, 4, 4, 1.0, out.data());
  EXPECT_EQ(out, std::vector<float>(4, 0.f));
}

}  // namespace
}  // namespace questkv::kernels
