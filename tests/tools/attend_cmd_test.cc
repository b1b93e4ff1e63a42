// `questkv attend` end to end, in-process: small random .npy inputs through
// AttendMain and the real Runtime, outputs checked against attention computed
// here in double; every bad input must give its exit code and a message.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "tools/cli/commands.h"
#include "tools/npy.h"
#include "tests/tools/cli_test_files.h"
#include "tests/testing/reference.h"

namespace questkv {
namespace {

using test::ScratchDir;

using test::Outcome;

Outcome Attend(std::vector<std::string> args) { return test::RunCommand(cli::AttendMain, "attend", std::move(args)); }

// K, V [Hkv][T][D], Q [Hq][D], as the values the command will see.
struct Problem {
  int hq, hkv, d, t;
  std::vector<float> k, v, q;
};

Problem RandomProblem(int hq, int hkv, int d, int t, uint64_t seed) {
  Problem p{hq, hkv, d, t, {}, {}, {}};
  p.k = test::RandomNormal(std::size_t(hkv) * t * d, seed);
  p.v = test::RandomNormal(std::size_t(hkv) * t * d, seed + 1);
  p.q = test::RandomNormal(std::size_t(hq) * d, seed + 2);
  return p;
}

// Softmax attention of query head h over the tokens of `pages` (all when
// empty), in double, straight from the definition.
std::vector<double> BruteForce(const Problem& p, int h, int page_size, const std::set<int>& pages) {
  const int kvh = h / (p.hq / p.hkv);
  const double scale = 1.0 / std::sqrt(double(p.d));
  std::vector<double> logits;
  std::vector<int> tokens;
  for (int t = 0; t < p.t; ++t) {
    if (!pages.empty() && !pages.count(t / page_size)) continue;
    double s = 0;
    for (int j = 0; j < p.d; ++j) s += double(p.q[std::size_t(h) * p.d + j]) * p.k[(std::size_t(kvh) * p.t + t) * p.d + j];
    logits.push_back(s * scale);
    tokens.push_back(t);
  }
  double m = -std::numeric_limits<double>::infinity();
  for (double s : logits) m = std::max(m, s);
  double den = 0;
  std::vector<double> o(std::size_t(p.d), 0.0);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const double w = std::exp(logits[i] - m);
    den += w;
    for (int j = 0; j < p.d; ++j) o[std::size_t(j)] += w * p.v[(std::size_t(kvh) * p.t + tokens[i]) * p.d + j];
  }
  for (double& x : o) x /= den;
  return o;
}

double RelError(const float* got, const std::vector<double>& want) {
  double diff = 0, ref = 0;
  for (std::size_t j = 0; j < want.size(); ++j) {
    diff += (got[j] - want[j]) * (got[j] - want[j]);
    ref += want[j] * want[j];
  }
  return std::sqrt(diff / ref);
}

class AttendTest : public testing::Test {
 protected:
  std::string K() const { return dir_ / "k.npy"; }
  std::string V() const { return dir_ / "v.npy"; }
  std::string Q() const { return dir_ / "q.npy"; }
  std::string O() const { return dir_ / "o.npy"; }
  std::string Sel() const { return dir_ / "sel.npy"; }

  void Write(const Problem& p) {
    const std::vector<int64_t> kv_shape = {p.hkv, p.t, p.d}, q_shape = {p.hq, p.d};
    ASSERT_TRUE(WriteNpyF32(K(), kv_shape, p.k).ok());
    ASSERT_TRUE(WriteNpyF32(V(), kv_shape, p.v).ok());
    ASSERT_TRUE(WriteNpyF32(Q(), q_shape, p.q).ok());
  }

  std::vector<std::string> Args(int page_size, int64_t budget) const {
    return {"--keys", K(), "--values", V(), "--query", Q(), "--page-size", std::to_string(page_size),
            "--token-budget", std::to_string(budget), "--output", O(), "--selected", Sel()};
  }

  static std::vector<std::string> With(std::vector<std::string> args, const std::vector<std::string>& more) {
    args.insert(args.end(), more.begin(), more.end());
    return args;
  }

  // Runs and expects success; returns O [Hq][D] and SEL rows.
  void RunOk(const std::vector<std::string>& args, const Problem& p, std::vector<float>* out,
             std::vector<std::vector<int>>* sel) {
    const Outcome r = Attend(args);
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_TRUE(r.err.empty()) << r.err;
    Result<NpyArray> o = ReadNpy(O());
    ASSERT_TRUE(o.ok()) << o.status().ToString();
    ASSERT_EQ(o->dtype, NpyDType::kF32);
    ASSERT_EQ(o->shape, (std::vector<int64_t>{p.hq, p.d}));
    *out = o->f32;
    Result<NpyArray> s = ReadNpy(Sel());
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_EQ(s->dtype, NpyDType::kI32);
    ASSERT_EQ(s->shape.size(), 2u);
    ASSERT_EQ(s->shape[0], p.hkv);
    sel->assign(std::size_t(p.hkv), {});
    bool some_row_full = false;
    for (int h = 0; h < p.hkv; ++h) {
      bool padding = false;
      for (int64_t i = 0; i < s->shape[1]; ++i) {
        const int32_t page = s->i32[std::size_t(h * s->shape[1] + i)];
        if (page == -1) {
          padding = true;
          continue;
        }
        ASSERT_FALSE(padding) << "page after -1 padding in row " << h;
        ASSERT_TRUE((*sel)[std::size_t(h)].empty() || page > (*sel)[std::size_t(h)].back()) << "row " << h;
        (*sel)[std::size_t(h)].push_back(page);
      }
      some_row_full |= !padding;
    }
    EXPECT_TRUE(some_row_full) << "SEL is wider than its largest row";
  }

  // Expects a failure with `code`, a message containing `needle` on stderr,
  // and no output file.
  void RunFails(const std::vector<std::string>& args, int code, const std::string& needle) {
    std::filesystem::remove(O());
    const Outcome r = Attend(args);
    EXPECT_EQ(r.code, code) << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << "expected '" << needle << "' in: " << r.err;
    EXPECT_FALSE(std::filesystem::exists(O())) << "output written on failure";
  }

  ScratchDir dir_;
};

TEST_F(AttendTest, HelpPrintsUsageAndSucceeds) {
  const Outcome r = Attend({"--help"});
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("usage: questkv attend"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--token-budget"), std::string::npos);
}

struct Shape {
  int hq, hkv, d, t, s;
};

TEST_F(AttendTest, DenseMatchesBruteForceAttention) {
  const Shape shapes[] = {{4, 2, 16, 37, 5}, {3, 3, 8, 1, 4}, {8, 1, 32, 64, 16}, {6, 2, 64, 200, 7}, {2, 1, 5, 9, 9},
                          {4, 4, 128, 50, 1}};
  uint64_t seed = 100;
  for (const Shape& sh : shapes) {
    SCOPED_TRACE(testing::Message() << "Hq " << sh.hq << " Hkv " << sh.hkv << " D " << sh.d << " T " << sh.t << " S "
                                    << sh.s);
    const Problem p = RandomProblem(sh.hq, sh.hkv, sh.d, sh.t, seed += 3);
    Write(p);
    std::vector<float> out;
    std::vector<std::vector<int>> sel;
    // A budget far too small for sparse selection: --dense must ignore it.
    RunOk(With(Args(sh.s, 0), {"--dense"}), p, &out, &sel);
    const int pages = (sh.t + sh.s - 1) / sh.s;
    for (int h = 0; h < sh.hkv; ++h) {
      ASSERT_EQ(int(sel[std::size_t(h)].size()), pages);
      for (int i = 0; i < pages; ++i) EXPECT_EQ(sel[std::size_t(h)][std::size_t(i)], i);
    }
    for (int h = 0; h < sh.hq; ++h)
      EXPECT_LE(RelError(out.data() + std::size_t(h) * sh.d, BruteForce(p, h, sh.s, {})), 1e-5) << "q head " << h;
  }
}

TEST_F(AttendTest, DenseWithoutBudgetFlag) {
  const Problem p = RandomProblem(2, 1, 8, 20, 7);
  Write(p);
  const Outcome r = Attend({"--keys", K(), "--values", V(), "--query", Q(), "--page-size", "4", "--dense", "--output", O()});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(std::filesystem::exists(Sel()));
  Result<NpyArray> o = ReadNpy(O());
  ASSERT_TRUE(o.ok());
  EXPECT_LE(RelError(o->f32.data(), BruteForce(p, 0, 4, {})), 1e-5);
}

TEST_F(AttendTest, HalfInputsAreWidenedExactly) {
  // float16 bit patterns of moderate normal numbers, written by hand.
  const int hq = 4, hkv = 2, d = 16, t = 23, s = 4;
  Problem p{hq, hkv, d, t, {}, {}, {}};
  uint64_t state = 12345;
  const auto half_file = [&](const std::string& path, std::vector<float>* values, std::vector<int64_t> shape) {
    std::size_t n = 1;
    for (int64_t x : shape) n *= std::size_t(x);
    std::vector<uint16_t> bits(n);
    values->resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      const uint16_t sign = uint16_t((state >> 63) << 15);
      const uint16_t exp = uint16_t(12 + (state >> 40) % 5);  // 2^-3 .. 2^1
      bits[i] = uint16_t(sign | exp << 10 | ((state >> 20) & 0x3ff));
      (*values)[i] = float(test::HalfBitsToDoubleByDefinition(bits[i]));
    }
    std::string sh = "(";
    for (int64_t x : shape) sh += std::to_string(x) + ", ";
    test::WriteBytes(path, test::NpyFile("<f2", sh + ")", test::Bytes(bits)));
  };
  half_file(K(), &p.k, {hkv, t, d});
  half_file(V(), &p.v, {hkv, t, d});
  half_file(Q(), &p.q, {hq, d});
  std::vector<float> out;
  std::vector<std::vector<int>> sel;
  RunOk(With(Args(s, 0), {"--dense"}), p, &out, &sel);
  for (int h = 0; h < hq; ++h) EXPECT_LE(RelError(out.data() + std::size_t(h) * d, BruteForce(p, h, s, {})), 1e-5);
}

TEST_F(AttendTest, SparseOutputIsAttentionOverTheSelectedPages) {
  const int hq = 8, hkv = 2, d = 32, t = 300, s = 8;
  const Problem p = RandomProblem(hq, hkv, d, t, 31);
  Write(p);
  const int pages = (t + s - 1) / s;
  for (const char* gqa : {"max", "mean", "union"}) {
    SCOPED_TRACE(gqa);
    std::vector<float> out;
    std::vector<std::vector<int>> sel;
    // 8 pages: sink 1 + local 2 + 5 by score.
    RunOk(With(Args(s, 64 + 7), {"--sink-pages", "1", "--local-pages", "2", "--gqa", gqa}), p, &out, &sel);
    for (int h = 0; h < hkv; ++h) {
      const std::vector<int>& row = sel[std::size_t(h)];
      const std::set<int> set(row.begin(), row.end());
      EXPECT_TRUE(set.count(0) && set.count(pages - 1) && set.count(pages - 2)) << "sink/local missing, KV head " << h;
      if (std::string(gqa) == "union") {
        EXPECT_GE(row.size(), 8u);
        EXPECT_LE(row.size(), 3u + 4u * 5u);
      } else {
        EXPECT_EQ(row.size(), 8u);
      }
      for (int g = 0; g < hq / hkv; ++g) {
        const int qh = h * (hq / hkv) + g;
        EXPECT_LE(RelError(out.data() + std::size_t(qh) * d, BruteForce(p, qh, s, set)), 1e-5) << "q head " << qh;
      }
    }
  }
}

TEST_F(AttendTest, BudgetCoveringEveryPageIsDense) {
  const int hq = 4, hkv = 2, d = 16, t = 45, s = 6;  // 8 pages, the last one partial
  const Problem p = RandomProblem(hq, hkv, d, t, 77);
  Write(p);
  std::vector<float> out;
  std::vector<std::vector<int>> sel;
  RunOk(With(Args(s, 8 * s), {"--sink-pages", "2", "--local-pages", "3"}), p, &out, &sel);
  for (int h = 0; h < hkv; ++h) EXPECT_EQ(sel[std::size_t(h)].size(), 8u);
  for (int h = 0; h < hq; ++h) EXPECT_LE(RelError(out.data() + std::size_t(h) * d, BruteForce(p, h, s, {})), 1e-5);
}

TEST_F(AttendTest, UsageErrorsExitTwo) {
  Write(RandomProblem(4, 2, 8, 40, 5));
  const std::vector<std::string> ok = Args(4, 16);
  RunFails(With(ok, {"--sink-pages", "2", "--local-pages", "3"}), 2, "fewer than --sink-pages 2 + --local-pages 3");
  RunFails(Args(4, 3), 2, "fewer than");  // 0 pages
  RunFails({"--values", V(), "--query", Q(), "--page-size", "4", "--token-budget", "16", "--output", O()}, 2,
           "missing required flag --keys");
  RunFails({"--keys", K(), "--values", V(), "--query", Q(), "--token-budget", "16", "--output", O()}, 2,
           "missing required flag --page-size");
  RunFails({"--keys", K(), "--values", V(), "--query", Q(), "--page-size", "4", "--output", O()}, 2,
           "missing required flag --token-budget");
  RunFails({"--keys", K(), "--values", V(), "--query", Q(), "--page-size", "4", "--token-budget", "16"}, 2,
           "missing required flag --output");
  RunFails(With(ok, {"--sink-pages", "x"}), 2, "not an integer");
  RunFails(With(ok, {"--local-pages", "0"}), 2, "--local-pages");
  RunFails(With(ok, {"--sink-pages", "-1"}), 2, "--sink-pages");
  RunFails(With(ok, {"--gqa", "median"}), 2, "unknown GQA mode 'median'");
  RunFails(With(ok, {"--frobnicate"}), 2, "unknown flag --frobnicate");
  RunFails(With(ok, {"stray"}), 2, "unexpected argument 'stray'");
  RunFails(With(ok, {"--dense=yes"}), 2, "takes no value");
  RunFails(With(ok, {"--gqa"}), 2, "needs a value");
  std::vector<std::string> bad_page = ok;
  bad_page[7] = "0";
  RunFails(bad_page, 2, "--page-size");
  bad_page[7] = "1025";
  RunFails(bad_page, 2, "--page-size");
  bad_page[7] = "4x";
  RunFails(bad_page, 2, "not an integer");
  std::vector<std::string> bad_budget = ok;
  bad_budget[9] = "-16";
  RunFails(bad_budget, 2, "--token-budget");
  bad_budget[9] = "99999999999999999999999";
  RunFails(bad_budget, 2, "--token-budget");
}

TEST_F(AttendTest, BadDataExitsOne) {
  const Problem p = RandomProblem(4, 2, 8, 40, 9);
  Write(p);
  const std::vector<std::string> args = Args(4, 16);
  const auto rewrite = [&](const std::string& path, std::vector<int64_t> shape, std::vector<float> data) {
    ASSERT_TRUE(WriteNpyF32(path, shape, data).ok());
  };

  // Shapes that disagree.
  rewrite(V(), {2, 41, 8}, std::vector<float>(2 * 41 * 8, 0.5f));
  RunFails(args, 1, "must have the same shape");
  rewrite(V(), {2, 40, 8}, p.v);
  rewrite(Q(), {4, 7}, std::vector<float>(28, 0.5f));
  RunFails(args, 1, "head dim 7");
  rewrite(Q(), {3, 8}, std::vector<float>(24, 0.5f));
  RunFails(args, 1, "not a multiple of KV heads");
  rewrite(Q(), {4, 8}, p.q);
  rewrite(K(), {2, 40 * 8}, p.k);
  RunFails(args, 1, "[Hkv, T, D]");
  rewrite(K(), {2, 0, 8}, {});
  rewrite(V(), {2, 0, 8}, {});
  RunFails(args, 1, "every dimension must be in 1..");
  rewrite(K(), {2, 40, 8}, p.k);
  rewrite(V(), {2, 40, 8}, p.v);
  rewrite(Q(), {4, 1, 8}, p.q);
  RunFails(args, 1, "[Hq, D]");
  rewrite(Q(), {4, 8}, p.q);

  // Non-finite values, in each file.
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<float> k = p.k;
  k[(1 * 40 + 3) * 8 + 5] = nan;
  rewrite(K(), {2, 40, 8}, k);
  RunFails(args, 1, "element [1, 3, 5] is NaN");
  rewrite(K(), {2, 40, 8}, p.k);
  std::vector<float> v = p.v;
  v[17] = -inf;
  rewrite(V(), {2, 40, 8}, v);
  RunFails(args, 1, "is infinite");
  rewrite(V(), {2, 40, 8}, p.v);
  std::vector<float> q = p.q;
  q[31] = inf;
  rewrite(Q(), {4, 8}, q);
  RunFails(args, 1, "element [3, 7] is infinite");
  rewrite(Q(), {4, 8}, p.q);
  std::vector<uint16_t> half_inf(2 * 40 * 8, 0x3c00);  // 1.0
  half_inf[100] = 0x7c00;                                // +inf
  test::WriteBytes(K(), test::NpyFile("<f2", "(2, 40, 8)", test::Bytes(half_inf)));
  RunFails(args, 1, "is infinite");

  // Wrong dtypes and unreadable files.
  ASSERT_TRUE(WriteNpyI32(K(), std::vector<int64_t>{2, 40, 8}, std::vector<int32_t>(640, 1)).ok());
  RunFails(args, 1, "must be float32 or float16, not int32");
  test::WriteBytes(K(), test::NpyFile("<f8", "(2, 40, 8)", std::string(640 * 8, '\0')));
  RunFails(args, 1, "unsupported dtype '<f8'");
  test::WriteBytes(K(), "not an npy file at all");
  RunFails(args, 1, "bad magic");
  std::filesystem::remove(K());
  RunFails(args, 1, "cannot open");
  rewrite(K(), {2, 40, 8}, p.k);

  // Valid files the runtime cannot take (head dim above its limit).
  rewrite(K(), {2, 4, 600}, std::vector<float>(2 * 4 * 600, 0.5f));
  rewrite(V(), {2, 4, 600}, std::vector<float>(2 * 4 * 600, 0.5f));
  rewrite(Q(), {4, 600}, std::vector<float>(4 * 600, 0.5f));
  RunFails(args, 1, "head_dim");

  // An output that cannot be written.
  Write(p);
  std::vector<std::string> unwritable = args;
  unwritable[11] = dir_ / "no/such/dir/o.npy";
  const Outcome r = Attend(unwritable);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("no/such/dir/o.npy"), std::string::npos) << r.err;
}

TEST_F(AttendTest, SingleTokenAndOddPageSizes) {
  uint64_t seed = 500;
  for (const Shape& sh : std::initializer_list<Shape>{{2, 2, 8, 1, 3}, {4, 1, 8, 2, 3}, {4, 2, 8, 3, 3}, {4, 2, 8, 4, 3},
                                                      {2, 1, 16, 17, 17}, {2, 1, 16, 18, 17}}) {
    SCOPED_TRACE(testing::Message() << "T " << sh.t << " S " << sh.s);
    const Problem p = RandomProblem(sh.hq, sh.hkv, sh.d, sh.t, seed += 3);
    Write(p);
    std::vector<float> out;
    std::vector<std::vector<int>> sel;
    RunOk(Args(sh.s, sh.s), p, &out, &sel);  // one page: the local window only
    const int last = (sh.t - 1) / sh.s;
    for (int h = 0; h < sh.hkv; ++h) EXPECT_EQ(sel[std::size_t(h)], std::vector<int>{last});
    for (int h = 0; h < sh.hq; ++h)
      EXPECT_LE(RelError(out.data() + std::size_t(h) * sh.d, BruteForce(p, h, sh.s, {last})), 1e-5);
  }
}

// Finite float32 inputs whose sums pass float32's range are refused before
// any work, naming the head and the size reached; inputs just inside the
// bounds still give finite outputs that match attention in double.
TEST_F(AttendTest, InputsThatOverflowFloat32AreRefusedByName) {
  Problem p = RandomProblem(4, 2, 8, 32, 21);
  for (float& x : p.k) x = x < 0 ? -1e38f : 1e38f;  // finite, but |q·k| reaches ~1e39
  Write(p);
  RunFails(Args(4, 16), 1, "logits overflow float32");
  RunFails(Args(4, 16), 1, "scale the queries or keys down");

  // Past float32 only before the 1/sqrt(D) scale: q·k = 64·1e37 overflows in
  // the runtime's float sum though the scaled logit 8e37 would not.
  Problem flat{2, 1, 64, 8, std::vector<float>(64 * 8, 1e37f), std::vector<float>(64 * 8, 1.f),
               std::vector<float>(2 * 64, 1.f)};
  flat.q[64 + 3] = -1.f;
  Write(flat);
  RunFails(Args(4, 8), 1, "for query head 0");

  // One query head out of range names that head.
  Problem one = RandomProblem(4, 2, 8, 32, 23);
  for (float& x : one.k) x = x < 0 ? -1e19f : 1e19f;
  for (float& x : one.q) x = 0.5f;
  for (int j = 0; j < 8; ++j) one.q[std::size_t(2 * 8 + j)] = 1e19f;
  Write(one);
  RunFails(Args(4, 16), 1, "for query head 2");

  Problem v = RandomProblem(4, 2, 8, 32, 25);
  for (float& x : v.v) x = 1e38f;  // 32 tokens x 1e38 > 3.4e38
  Write(v);
  RunFails(Args(4, 16), 1, "values overflow float32");
  RunFails(Args(4, 16), 1, "for KV head 0");
}

TEST_F(AttendTest, LargeInputsInsideFloat32StillMatchBruteForce) {
  Problem p = RandomProblem(4, 2, 8, 32, 27);
  for (float& x : p.k) x *= 1e18f;  // |q·k| up to ~1e19: softmax nearly one-hot
  for (float& x : p.v) x *= 1e36f;  // 32 tokens x ~4e36 stays below 3.4e38
  Write(p);
  std::vector<float> out;
  std::vector<std::vector<int>> sel;
  RunOk(With(Args(4, 0), {"--dense"}), p, &out, &sel);
  for (float x : out) ASSERT_TRUE(std::isfinite(x));
  for (int h = 0; h < p.hq; ++h) EXPECT_LE(RelError(out.data() + std::size_t(h) * p.d, BruteForce(p, h, 4, {})), 1e-5);
}

// Two flags naming one file would lose data silently (the output replaced by
// the selection, or an input overwritten): a usage error, inputs untouched.
TEST_F(AttendTest, OutputsNamingTheSameFileAreUsageErrors) {
  Write(RandomProblem(4, 2, 8, 40, 29));
  const std::string k_before = test::ReadBytes(K());
  const std::vector<std::string> same = {"--keys", K(), "--values", V(), "--query", Q(), "--page-size", "4",
                                         "--token-budget", "16", "--output", O(), "--selected", O()};
  RunFails(same, 2, "name the same file");
  std::vector<std::string> args = Args(4, 16);
  args[13] = dir_ / "./o.npy";  // --selected, spelled differently
  RunFails(args, 2, "name the same file");
  args = Args(4, 16);
  args[11] = K();  // --output over the keys
  RunFails(args, 2, "--output '" + K() + "' and --keys");
  args = Args(4, 16);
  args[13] = Q();  // --selected over the query
  RunFails(args, 2, "and --query");
  std::filesystem::create_symlink(V(), dir_ / "v_link.npy");
  args = Args(4, 16);
  args[11] = dir_ / "v_link.npy";  // the values through a link
  RunFails(args, 2, "and --values");
  EXPECT_EQ(test::ReadBytes(K()), k_before);
  ASSERT_TRUE(ReadNpy(Q()).ok());
  ASSERT_TRUE(ReadNpy(V()).ok());
  EXPECT_EQ(Attend(Args(4, 16)).code, 0);
}

}  // namespace
}  // namespace questkv
