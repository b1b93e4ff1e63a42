// Runtime against a plain model: every sequence's tokens kept in a flat
// vector, summaries and attention recomputed from scratch in the test.
#include "questkv/runtime.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "core/e4m3.h"
#include "tests/testing/reference.h"

namespace questkv {
namespace {

// The plain model of one sequence: token-major K/V per layer.
struct ModelSeq {
  std::vector<std::vector<float>> k, v;  // [layer][T*Hkv*D]
};

class RuntimeTest : public ::testing::Test {
 protected:
  void Make(Geometry g, SelectionPolicy p = {}, uint32_t max_pages = 4096, std::size_t hbm_bytes = 0) {
    cfg_.geometry = g;
    cfg_.policy = p;
    cfg_.max_pages = max_pages;
    cfg_.hbm_bytes = hbm_bytes;
    auto rt = Runtime::Create(cfg_);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    rt_ = std::move(*rt);
  }
  const Geometry& g() const { return cfg_.geometry; }
  std::size_t row() const { return std::size_t(g().kv_heads) * g().head_dim; }

  SeqId NewSeq() {
    auto id = rt_->CreateSequence();
    EXPECT_TRUE(id.ok());
    model_[*id].k.assign(g().layers, {});
    model_[*id].v.assign(g().layers, {});
    return *id;
  }
  // Appends n random tokens to every layer, in chunks of `chunk`.
  void AppendRandom(SeqId id, int64_t n, int64_t chunk = 5) {
    for (int l = 0; l < g().layers; ++l) {
      auto k = test::RandomNormal(n * row(), seed_++);
      auto v = test::RandomNormal(n * row(), seed_++);
      for (int64_t t = 0; t < n; t += chunk) {
        const int64_t m = std::min(chunk, n - t);
        ASSERT_TRUE(rt_->Append(id, l, k.data() + t * row(), v.data() + t * row(), m).ok());
      }
      auto& mk = model_[id].k[l];
      auto& mv = model_[id].v[l];
      mk.insert(mk.end(), k.begin(), k.end());
      mv.insert(mv.end(), v.begin(), v.end());
    }
  }
  int64_t ModelLen(SeqId id, int l) { return int64_t(model_[id].k[l].size() / row()); }

  // Per-head contiguous [T][D] copy of the model's K or V.
  std::vector<float> HeadRows(const std::vector<float>& tok_major, int h) {
    const int64_t T = int64_t(tok_major.size() / row());
    std::vector<float> out(T * g().head_dim);
    for (int64_t t = 0; t < T; ++t)
      std::copy_n(tok_major.data() + t * row() + h * g().head_dim, g().head_dim, out.data() + t * g().head_dim);
    return out;
  }

  // Brute-force summary of logical page p of a layer, compared to the runtime's
  // (with E4M3 summaries, the exact box rounded outward onto the grid).
  void ExpectSummaries(SeqId id, int l) {
    auto pages = rt_->Pages(id, l);
    ASSERT_TRUE(pages.ok());
    const int64_t T = ModelLen(id, l);
    ASSERT_EQ(int64_t(pages->size()), (T + g().page_size - 1) / g().page_size);
    for (std::size_t p = 0; p < pages->size(); ++p) {
      auto s = rt_->Summary((*pages)[p]);
      ASSERT_TRUE(s.ok());
      for (int h = 0; h < g().kv_heads; ++h)
        for (int j = 0; j < g().head_dim; ++j) {
          float lo = INFINITY, hi = -INFINITY;
          for (int64_t t = p * g().page_size; t < std::min<int64_t>(T, (p + 1) * g().page_size); ++t) {
            lo = std::min(lo, model_[id].k[l][t * row() + h * g().head_dim + j]);
            hi = std::max(hi, model_[id].k[l][t * row() + h * g().head_dim + j]);
          }
          if (g().summary_dtype == SummaryDType::kE4M3) lo = e4m3::SnapDown(lo), hi = e4m3::SnapUp(hi);
          ASSERT_EQ((*s)[(h * 2 + 0) * g().head_dim + j], lo) << "page " << p << " head " << h << " dim " << j;
          ASSERT_EQ((*s)[(h * 2 + 1) * g().head_dim + j], hi) << "page " << p << " head " << h << " dim " << j;
        }
    }
  }

  // Output of one sequence at layer l against MaskedAttention over `pages_of(h)`.
  template <typename PagesOf>
  void ExpectOutput(SeqId id, int l, const float* q, const float* out, PagesOf pages_of, double tol) {
    const int T = int(ModelLen(id, l)), D = g().head_dim, G = g().group();
    for (int h = 0; h < g().kv_heads; ++h) {
      auto k = HeadRows(model_[id].k[l], h), v = HeadRows(model_[id].v[l], h);
      for (int gi = 0; gi < G; ++gi) {
        const int qh = h * G + gi;
        auto ref = test::MaskedAttention(q + qh * D, k.data(), v.data(), T, D, g().page_size, pages_of(h),
                                         1.0 / std::sqrt(double(D)));
        std::vector<float> reff(ref.begin(), ref.end());
        EXPECT_LE(test::RelL2Error(out + qh * D, reff.data(), D), tol) << "seq " << id << " layer " << l << " q head " << qh;
      }
    }
  }
  std::vector<int> AllPages(SeqId id, int l) {
    std::vector<int> all((ModelLen(id, l) + g().page_size - 1) / g().page_size);
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = int(i);
    return all;
  }
  // Dense and sparse outputs of one sequence checked against the model.
  void ExpectAttention(SeqId id, int l) {
    auto q = test::RandomNormal(std::size_t(g().q_heads) * g().head_dim, seed_++);
    std::vector<float> out(q.size(), NAN);
    SeqId ids[] = {id};
    ASSERT_TRUE(rt_->DenseAttention(ids, l, q.data(), out.data()).ok());
    ExpectOutput(id, l, q.data(), out.data(), [&](int) { return AllPages(id, l); }, 1e-5);
    std::vector<PageSelection> sel;
    std::fill(out.begin(), out.end(), NAN);
    ASSERT_TRUE(rt_->DecodeAttention(ids, l, q.data(), out.data(), &sel).ok());
    ExpectOutput(id, l, q.data(), out.data(),
                 [&](int h) { return std::vector<int>(sel[0].row(h), sel[0].row(h) + sel[0].count(h)); }, 1e-5);
  }

  Config cfg_;
  std::unique_ptr<Runtime> rt_;
  std::map<SeqId, ModelSeq> model_;
  uint64_t seed_ = 100;
};

Geometry Geo(int S, int hq = 4, int hkv = 2, int D = 16, int layers = 2, SummaryDType sum = SummaryDType::kKv) {
  Geometry g;
  g.layers = layers, g.q_heads = hq, g.kv_heads = hkv, g.head_dim = D, g.page_size = S;
  g.summary_dtype = sum;
  return g;
}
constexpr SummaryDType kSummaryDTypes[] = {SummaryDType::kKv, SummaryDType::kE4M3};
SelectionPolicy Policy(int64_t budget, int sink = 1, int local = 1, std::vector<int> dense = {}) {
  SelectionPolicy p;
  p.token_budget = budget, p.sink_pages = sink, p.local_pages = local, p.dense_layers = std::move(dense);
  return p;
}

TEST_F(RuntimeTest, AppendBuildsExactSummariesAndAttentionForOddSizes) {
  for (SummaryDType sum : kSummaryDTypes)
  for (int S : {1, 3, 7, 16, 17}) {
    SCOPED_TRACE(std::string(SummaryDTypeName(sum)) + " summaries");
    Make(Geo(S, 4, 2, 16, 2, sum), Policy(4 * S, 1, 1, {0}));
    for (int64_t len : {int64_t(1), int64_t(S - 1), int64_t(S), int64_t(S + 1), int64_t(9 * S + 2)}) {
      if (len < 1) continue;
      SCOPED_TRACE("S=" + std::to_string(S) + " len=" + std::to_string(len));
      SeqId id = NewSeq();
      AppendRandom(id, len, 1 + len % 4);
      for (int l = 0; l < g().layers; ++l) {
        EXPECT_EQ(*rt_->Length(id, l), len);
        ExpectSummaries(id, l);
        ExpectAttention(id, l);
      }
      ASSERT_TRUE(rt_->Free(id).ok());
    }
    EXPECT_EQ(rt_->live_pages(), 0u);
  }
}

TEST_F(RuntimeTest, BudgetCoveringAllPagesEqualsDense) {
  Make(Geo(16, 8, 2, 32), Policy(1 << 20, 1, 1));
  SeqId id = NewSeq();
  AppendRandom(id, 16 * 20 + 3, 37);
  auto q = test::RandomNormal(8 * 32, 7);
  std::vector<float> dense(q.size()), sparse(q.size());
  SeqId ids[] = {id};
  ASSERT_TRUE(rt_->DenseAttention(ids, 1, q.data(), dense.data()).ok());
  std::vector<PageSelection> sel;
  ASSERT_TRUE(rt_->DecodeAttention(ids, 1, q.data(), sparse.data(), &sel).ok());
  EXPECT_EQ(sel[0].count(0), 21);
  EXPECT_LE(test::RelL2Error(sparse.data(), dense.data(), q.size()), 1e-5);
}

TEST_F(RuntimeTest, BatchOfMixedLengthsMatchesEachSequenceAlone) {
  for (int G : {1, 2, 4, 8}) {
    Make(Geo(7, 2 * G, 2, 16), Policy(5 * 7, 1, 2));
    std::vector<SeqId> ids;
    for (int64_t len : {1, 6, 7, 8, 60, 200}) {
      ids.push_back(NewSeq());
      AppendRandom(ids.back(), len, 9);
    }
    const std::size_t qs = std::size_t(g().q_heads) * g().head_dim;
    auto q = test::RandomNormal(qs * ids.size(), 11 + G);
    std::vector<float> out(q.size(), NAN), alone(qs);
    std::vector<PageSelection> sel;
    ASSERT_TRUE(rt_->DecodeAttention(ids, 1, q.data(), out.data(), &sel).ok());
    for (std::size_t b = 0; b < ids.size(); ++b) {
      SeqId one[] = {ids[b]};
      std::vector<PageSelection> sel1;
      ASSERT_TRUE(rt_->DecodeAttention(one, 1, q.data() + b * qs, alone.data(), &sel1).ok());
      EXPECT_EQ(sel1[0].pages, sel[b].pages);
      EXPECT_EQ(std::vector<float>(out.begin() + b * qs, out.begin() + (b + 1) * qs), alone) << "G=" << G << " b=" << b;
      ExpectOutput(ids[b], 1, q.data() + b * qs, out.data() + b * qs,
                   [&](int h) { return std::vector<int>(sel[b].row(h), sel[b].row(h) + sel[b].count(h)); }, 1e-5);
    }
  }
}

TEST_F(RuntimeTest, ForkSharesSealedPagesAndCopiesTheTail) {
  for (SummaryDType sum : kSummaryDTypes) {
  SCOPED_TRACE(std::string(SummaryDTypeName(sum)) + " summaries");
  Make(Geo(8, 4, 2, 16, 2, sum), Policy(32, 1, 1));
  SeqId a = NewSeq();
  AppendRandom(a, 8 * 5 + 3);
  const uint32_t before = rt_->live_pages();
  auto b = rt_->Fork(a);
  ASSERT_TRUE(b.ok());
  model_[*b] = model_[a];
  // One new page per layer: the copied tail.
  EXPECT_EQ(rt_->live_pages(), before + g().layers);
  auto pa = *rt_->Pages(a, 0), pb = *rt_->Pages(*b, 0);
  EXPECT_TRUE(std::equal(pa.begin(), pa.end() - 1, pb.begin()));
  EXPECT_NE(pa.back(), pb.back());
  AppendRandom(a, 11);
  AppendRandom(*b, 4);
  for (SeqId id : {a, *b})
    for (int l = 0; l < g().layers; ++l) {
      ExpectSummaries(id, l);
      ExpectAttention(id, l);
    }
  ASSERT_TRUE(rt_->Free(a).ok());
  for (int l = 0; l < g().layers; ++l) ExpectAttention(*b, l);
  ASSERT_TRUE(rt_->Free(*b).ok());
  EXPECT_EQ(rt_->live_pages(), 0u);
  }
}

TEST_F(RuntimeTest, RollbackIntoTailEqualsFreshRebuild) {
  for (SummaryDType sum : kSummaryDTypes) {
  Make(Geo(8, 4, 2, 16, 2, sum), Policy(32, 1, 1));
  for (int64_t drop : {1, 3, 8, 9, 20, 43}) {
    SCOPED_TRACE("drop " + std::to_string(drop) + ", " + std::string(SummaryDTypeName(sum)) + " summaries");
    SeqId id = NewSeq();
    AppendRandom(id, 43);
    ASSERT_TRUE(rt_->Rollback(id, drop).ok());
    // Fresh sequence from the kept tokens only.
    SeqId fresh = NewSeq();
    for (int l = 0; l < g().layers; ++l) {
      auto& m = model_[id];
      m.k[l].resize((43 - drop) * row());
      m.v[l].resize((43 - drop) * row());
      if (43 - drop > 0) {
        ASSERT_TRUE(rt_->Append(fresh, l, m.k[l].data(), m.v[l].data(), 43 - drop).ok());
      }
      model_[fresh].k[l] = m.k[l];
      model_[fresh].v[l] = m.v[l];
      EXPECT_EQ(*rt_->Length(id, l), 43 - drop);
      ExpectSummaries(id, l);
      auto pr = *rt_->Pages(id, l), pf = *rt_->Pages(fresh, l);
      ASSERT_EQ(pr.size(), pf.size());
      for (std::size_t p = 0; p < pr.size(); ++p) EXPECT_EQ(*rt_->Summary(pr[p]), *rt_->Summary(pf[p]));
      if (43 - drop > 0) ExpectAttention(id, l);
    }
    // Appending after the rollback works from the rebuilt tail.
    AppendRandom(id, 5);
    for (int l = 0; l < g().layers; ++l) ExpectSummaries(id, l);
    ASSERT_TRUE(rt_->Free(id).ok());
    ASSERT_TRUE(rt_->Free(fresh).ok());
    EXPECT_EQ(rt_->live_pages(), 0u);
  }
  }
}

TEST_F(RuntimeTest, RollbackIntoASharedSealedPageCopiesIt) {
  Make(Geo(8), Policy(32, 1, 1));
  SeqId a = NewSeq();
  AppendRandom(a, 24);  // three sealed pages per layer
  auto b = rt_->Fork(a);
  ASSERT_TRUE(b.ok());
  model_[*b] = model_[a];
  const auto shared = *rt_->Summary((*rt_->Pages(a, 0))[2]);
  ASSERT_TRUE(rt_->Rollback(a, 5).ok());  // page 2 becomes a partial tail of a
  for (int l = 0; l < g().layers; ++l) {
    model_[a].k[l].resize(19 * row());
    model_[a].v[l].resize(19 * row());
    ExpectSummaries(a, l);
    ExpectSummaries(*b, l);  // b still sees the full page
  }
  EXPECT_EQ(*rt_->Summary((*rt_->Pages(*b, 0))[2]), shared);
  AppendRandom(a, 9);
  for (int l = 0; l < g().layers; ++l) {
    ExpectAttention(a, l);
    ExpectAttention(*b, l);
  }
}

TEST_F(RuntimeTest, ReusedPageIdsCarryNoStaleSummary) {
  for (SummaryDType sum : kSummaryDTypes) {
  SCOPED_TRACE(std::string(SummaryDTypeName(sum)) + " summaries");
  model_.clear();
  Make(Geo(8, 2, 1, 8, 1, sum), Policy(16, 1, 1), 4);
  SeqId a = NewSeq();
  // Extreme keys, then freed.
  std::vector<float> big(8 * 8 * 3, 1e6f), bigv(big.size(), 1.f);
  for (std::size_t i = 0; i < big.size(); i += 2) big[i] = -1e6f;
  ASSERT_TRUE(rt_->Append(a, 0, big.data(), bigv.data(), 24).ok());
  auto old_pages = *rt_->Pages(a, 0);
  ASSERT_TRUE(rt_->Free(a).ok());
  model_.erase(a);
  SeqId b = NewSeq();
  AppendRandom(b, 21);  // a partial tail on a reused id too
  auto new_pages = *rt_->Pages(b, 0);
  std::sort(old_pages.begin(), old_pages.end());
  std::sort(new_pages.begin(), new_pages.end());
  EXPECT_EQ(old_pages, new_pages) << "test premise: the ids are reused";
  ExpectSummaries(b, 0);
  }
}

// E4M3 summaries: every page's score still bounds its best logit, is never
// below the exact summary's score (the box only grows), and a page with a
// key beyond ±448 scores +inf where the query leans on that bound, so a small
// budget still picks it. Two runtimes get the same tokens, one per format.
TEST_F(RuntimeTest, E4m3ScoresBoundEveryPageAndNeverUndercutExactOnes) {
  const int S = 8, D = 16, hq = 4, hkv = 2;
  Config exact_cfg;
  exact_cfg.geometry = Geo(S, hq, hkv, D, 1);
  exact_cfg.policy = Policy(3 * S, 1, 1);
  Make(Geo(S, hq, hkv, D, 1, SummaryDType::kE4M3), Policy(3 * S, 1, 1));
  auto exact = Runtime::Create(exact_cfg);
  ASSERT_TRUE(exact.ok());
  SeqId id = NewSeq();
  auto id_exact = (*exact)->CreateSequence();
  ASSERT_TRUE(id_exact.ok());
  const int T = 20 * S + 5;
  // Keys from 1e-3 to 10 in scale (inside the range), and one key of page 6 beyond it.
  auto k = test::RandomNormal(std::size_t(T) * row(), 5);
  for (int t = 0; t < T; ++t)
    for (std::size_t e = 0; e < row(); ++e) k[t * row() + e] *= std::pow(10.f, float((t + e) % 5) - 3.f);
  k[(6 * S + 3) * row() + 5] = 1000.f;  // head 0, dim 5
  const auto v = test::RandomNormal(k.size(), 6);
  ASSERT_TRUE(rt_->Append(id, 0, k.data(), v.data(), T).ok());
  ASSERT_TRUE((*exact)->Append(*id_exact, 0, k.data(), v.data(), T).ok());
  model_[id].k[0] = k;
  model_[id].v[0] = v;
  ExpectSummaries(id, 0);
  for (int trial = 0; trial < 8; ++trial) {
    auto q = test::RandomNormal(std::size_t(hq) * D, 50 + trial);
    for (int qh = 0; qh < hq; ++qh) q[qh * D + 5] = trial % 2 ? 0.f : 0.5f;  // leans on (or ignores) dim 5
    auto s8 = rt_->Scores(id, 0, q.data());
    auto s32 = (*exact)->Scores(*id_exact, 0, q.data());
    ASSERT_TRUE(s8.ok() && s32.ok());
    const int P = (T + S - 1) / S;
    for (int qh = 0; qh < hq; ++qh) {
      const int h = qh / g().group();
      for (int p = 0; p < P; ++p) {
        double best = -INFINITY;
        for (int t = p * S; t < std::min(T, (p + 1) * S); ++t) {
          double dot = 0;
          for (int j = 0; j < D; ++j) dot += double(q[qh * D + j]) * k[t * row() + h * D + j];
          best = std::max(best, dot);
        }
        const float e8 = (*s8)[std::size_t(qh) * P + p], e32 = (*s32)[std::size_t(qh) * P + p];
        ASSERT_GE(e8, e32) << "q head " << qh << " page " << p;
        ASSERT_GE(double(e8), best - 1e-4 * (1 + std::abs(best))) << "q head " << qh << " page " << p;
        // Dim 5's max is +inf on page 6 (head 0): chosen whenever q_5 >= 0.
        if (p == 6 && h == 0) ASSERT_EQ(e8, INFINITY);
        else ASSERT_TRUE(std::isfinite(e8)) << "q head " << qh << " page " << p;
      }
    }
    std::vector<float> out(q.size());
    std::vector<PageSelection> sel;
    SeqId ids[] = {id};
    ASSERT_TRUE(rt_->DecodeAttention(ids, 0, q.data(), out.data(), &sel).ok());
    const auto row0 = std::vector<int>(sel[0].row(0), sel[0].row(0) + sel[0].count(0));
    EXPECT_NE(std::find(row0.begin(), row0.end(), 6), row0.end()) << "page 6 beyond the range must be selected";
    ExpectOutput(id, 0, q.data(), out.data(),
                 [&](int h) { return std::vector<int>(sel[0].row(h), sel[0].row(h) + sel[0].count(h)); }, 1e-5);
  }
}

TEST_F(RuntimeTest, PrefixSharingSharesSealedPages) {
  Make(Geo(4), Policy(16, 1, 1));
  SeqId a = NewSeq();
  AppendRandom(a, 4 * 6 + 1);
  auto c = rt_->CreateFromPrefix(a, 5);
  ASSERT_TRUE(c.ok());
  model_[*c] = model_[a];
  for (int l = 0; l < g().layers; ++l) {
    model_[*c].k[l].resize(20 * row());
    model_[*c].v[l].resize(20 * row());
    auto pa = *rt_->Pages(a, l), pc = *rt_->Pages(*c, l);
    EXPECT_TRUE(std::equal(pc.begin(), pc.end(), pa.begin()));
  }
  EXPECT_EQ(rt_->CreateFromPrefix(a, 7).status().code(), Code::kOutOfRange);
  AppendRandom(*c, 6);
  ASSERT_TRUE(rt_->Free(a).ok());
  for (int l = 0; l < g().layers; ++l) {
    ExpectSummaries(*c, l);
    ExpectAttention(*c, l);
  }
  ASSERT_TRUE(rt_->Free(*c).ok());
  EXPECT_EQ(rt_->live_pages(), 0u);
}

TEST_F(RuntimeTest, BadInputsGetErrorsAndChangeNothing) {
  Make(Geo(4), Policy(16, 1, 1));
  SeqId a = NewSeq();
  AppendRandom(a, 10);
  std::vector<float> k(row()), q(std::size_t(g().q_heads) * g().head_dim), out(q.size());
  EXPECT_EQ(rt_->Append(999, 0, k.data(), k.data(), 1).code(), Code::kNotFound);
  EXPECT_EQ(rt_->Append(a, 2, k.data(), k.data(), 1).code(), Code::kOutOfRange);
  EXPECT_EQ(rt_->Append(a, -1, k.data(), k.data(), 1).code(), Code::kOutOfRange);
  EXPECT_EQ(rt_->Append(a, 0, k.data(), k.data(), 0).code(), Code::kInvalidArgument);
  EXPECT_EQ(rt_->Append(a, 0, nullptr, k.data(), 1).code(), Code::kInvalidArgument);
  EXPECT_EQ(rt_->Rollback(a, 11).code(), Code::kOutOfRange);
  EXPECT_EQ(rt_->Rollback(a, -1).code(), Code::kInvalidArgument);
  EXPECT_EQ(rt_->Fork(12345).status().code(), Code::kNotFound);
  EXPECT_EQ(rt_->Free(12345).code(), Code::kNotFound);
  SeqId empty = NewSeq();
  SeqId batch[] = {a, empty};
  EXPECT_EQ(rt_->DecodeAttention(batch, 0, q.data(), out.data()).code(), Code::kFailedPrecondition);
  EXPECT_EQ(rt_->DecodeAttention({}, 0, q.data(), out.data()).code(), Code::kInvalidArgument);
  SeqId one[] = {a};
  EXPECT_EQ(rt_->DecodeAttention(one, 0, nullptr, out.data()).code(), Code::kInvalidArgument);
  EXPECT_EQ(rt_->Summary(4000).status().code(), Code::kNotFound);
  for (int l = 0; l < g().layers; ++l) {
    EXPECT_EQ(*rt_->Length(a, l), 10);
    ExpectSummaries(a, l);
    ExpectAttention(a, l);
  }
}

TEST_F(RuntimeTest, InvalidConfigsAreRejected) {
  Config c;
  c.geometry = Geo(16, 6, 4);
  EXPECT_EQ(Runtime::Create(c).status().code(), Code::kInvalidArgument);  // Hq % Hkv
  c.geometry = Geo(16);
  c.policy = Policy(16, 1, 1);  // one page of budget for sink + local = 2
  EXPECT_EQ(Runtime::Create(c).status().code(), Code::kInvalidArgument);
  c.policy = Policy(64, 1, 0);
  EXPECT_EQ(Runtime::Create(c).status().code(), Code::kInvalidArgument);  // no local page
  c.policy = Policy(64, 1, 1, {5});
  EXPECT_EQ(Runtime::Create(c).status().code(), Code::kInvalidArgument);  // dense layer 5 of 2
  c.policy = Policy(64, 1, 1);
  c.geometry.dtype = DType::kF16;
  EXPECT_EQ(Runtime::Create(c).status().code(), Code::kUnimplemented);
  c.geometry = Geo(0);
  EXPECT_EQ(Runtime::Create(c).status().code(), Code::kInvalidArgument);
  c.geometry = Geo(16);
  c.geometry.summary_dtype = SummaryDType(9);
  EXPECT_EQ(Runtime::Create(c).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(ParseSummaryDType("e4m3").value(), SummaryDType::kE4M3);
  EXPECT_EQ(ParseSummaryDType("kv").value(), SummaryDType::kKv);
  EXPECT_EQ(ParseSummaryDType("int4").status().code(), Code::kInvalidArgument);
}

TEST_F(RuntimeTest, RunningOutOfPagesIsAtomic) {
  Make(Geo(4, 4, 2, 16, 1), Policy(16, 1, 1), 6);
  SeqId a = NewSeq();
  AppendRandom(a, 18);  // 5 pages
  std::vector<float> k(9 * row(), 1.f);
  EXPECT_EQ(rt_->Append(a, 0, k.data(), k.data(), 9).code(), Code::kResourceExhausted);  // needs 2 more
  EXPECT_EQ(*rt_->Length(a, 0), 18);
  EXPECT_EQ(rt_->live_pages(), 5u);
  ExpectSummaries(a, 0);
  ExpectAttention(a, 0);
  auto b = rt_->Fork(a);  // tail copy takes the last id
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(rt_->Fork(a).status().code(), Code::kResourceExhausted);
  EXPECT_EQ(rt_->live_pages(), 6u);
  ASSERT_TRUE(rt_->Free(*b).ok());
  ASSERT_TRUE(rt_->Free(a).ok());
  EXPECT_EQ(rt_->live_pages(), 0u);
}

TEST_F(RuntimeTest, HbmBudgetBoundsCacheButNotContext) {
  Geometry geo = Geo(4, 4, 2, 16, 1);
  Make(geo, Policy(16, 1, 1), 100, 3 * geo.page_bytes());
  SeqId a = NewSeq();
  AppendRandom(a, 90);  // 23 pages through an hbm of 3: sealed pages leave for host
  EXPECT_LE(rt_->tier_stats().hbm_peak_bytes, rt_->tier_stats().hbm_capacity_bytes);
  EXPECT_GT(rt_->tier_stats().bytes_hbm_to_host, 0);
  ExpectSummaries(a, 0);
  ExpectAttention(a, 0);
  // Three tails (one per sequence) fill the hbm; a fourth cannot be pinned.
  SeqId b = NewSeq(), c = NewSeq();
  AppendRandom(b, 1);
  AppendRandom(c, 1);
  SeqId d = NewSeq();
  std::vector<float> k(row(), 1.f);
  EXPECT_EQ(rt_->Append(d, 0, k.data(), k.data(), 1).code(), Code::kResourceExhausted);
  EXPECT_EQ(*rt_->Length(d, 0), 0);
  ExpectAttention(a, 0);
}

// Finite keys whose logits pass float32's range are refused with a message,
// never answered with NaN outputs and OK; the sequence stays usable.
TEST_F(RuntimeTest, LogitsPastFloatRangeAreAnErrorNotNaN) {
  Make(Geo(4), Policy(16, 1, 1));
  SeqId a = NewSeq();
  std::vector<float> k(8 * row(), 3e37f), v(8 * row(), 1.f);
  for (int l = 0; l < g().layers; ++l) ASSERT_TRUE(rt_->Append(a, l, k.data(), v.data(), 8).ok());
  std::vector<float> q(std::size_t(g().q_heads) * g().head_dim, 1.f), out(q.size());
  SeqId one[] = {a};
  for (int l = 0; l < g().layers; ++l) {
    Status s = rt_->DecodeAttention(one, l, q.data(), out.data());
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("overflow float32"), std::string::npos) << s.ToString();
    EXPECT_EQ(rt_->DenseAttention(one, l, q.data(), out.data()).code(), Code::kInvalidArgument);
  }
  std::fill(q.begin(), q.end(), 1e-37f);  // small queries bring the logits back in range
  ASSERT_TRUE(rt_->DecodeAttention(one, 0, q.data(), out.data()).ok());
  for (float x : out) EXPECT_NEAR(x, 1.f, 1e-6);
}

}  // namespace
}  // namespace questkv
