#include "tools/workload.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <set>
#include <vector>

namespace questkv {
namespace {

Geometry SmallGeometry() {
  Geometry g;
  g.layers = 2;
  g.q_heads = 8;
  g.kv_heads = 2;
  g.head_dim = 64;
  g.page_size = 16;
  return g;
}

Workload MakeWorkload(WorkloadKind kind, uint64_t seed = 7, int64_t context_tokens = 4096, int64_t decode_steps = 64,
                      const Geometry& g = SmallGeometry()) {
  Result<Workload> w = Workload::Create(g, WorkloadSpec{kind, seed, context_tokens, decode_steps});
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  return std::move(w).value();
}

// K and V of every token of one layer, [total][Hkv][D] each.
struct LayerKv {
  std::vector<float> k, v;
};

LayerKv AllTokens(const Workload& w, int layer) {
  const Geometry& g = w.geometry();
  const std::size_t elems = std::size_t(w.total_tokens()) * g.kv_heads * g.head_dim;
  LayerKv kv{std::vector<float>(elems), std::vector<float>(elems)};
  w.Tokens(layer, 0, w.total_tokens(), kv.k.data(), kv.v.data());
  return kv;
}

std::vector<float> QueryOf(const Workload& w, int layer, int64_t step) {
  std::vector<float> q(std::size_t(w.geometry().q_heads) * w.geometry().head_dim);
  w.Query(layer, step, q.data());
  return q;
}

// Logits q.k/sqrt(D) of one query head over the tokens its step attends.
std::vector<float> Logits(const Workload& w, const LayerKv& kv, const std::vector<float>& q, int q_head,
                          int64_t step) {
  const Geometry& g = w.geometry();
  const int dim = g.head_dim;
  const int head = q_head / g.group();
  const int64_t n = w.spec().context_tokens + step + 1;
  const float* qh = &q[std::size_t(q_head) * dim];
  std::vector<float> logits(n);
  for (int64_t p = 0; p < n; ++p) {
    const float* k = &kv.k[(std::size_t(p) * g.kv_heads + head) * dim];
    double dot = 0;
    for (int i = 0; i < dim; ++i) dot += double(qh[i]) * k[i];
    logits[p] = float(dot / std::sqrt(double(dim)));
  }
  return logits;
}

std::vector<float> PageMaxLogits(const std::vector<float>& logits, int page_size) {
  std::vector<float> page_max((logits.size() + page_size - 1) / page_size, -INFINITY);
  for (std::size_t p = 0; p < logits.size(); ++p) page_max[p / page_size] = std::max(page_max[p / page_size], logits[p]);
  return page_max;
}

// Best page max logit over the pages holding tokens [begin, end).
float RangeBest(const std::vector<float>& page_max, int page_size, int64_t begin, int64_t end) {
  float best = -INFINITY;
  for (int64_t p = begin; p < end; ++p) best = std::max(best, page_max[p / page_size]);
  return best;
}

// Pages whose true max logit beats the best page of [begin, end): 0 is top.
int RangeRank(const std::vector<float>& page_max, int page_size, int64_t begin, int64_t end) {
  const float best = RangeBest(page_max, page_size, begin, end);
  return int(std::count_if(page_max.begin(), page_max.end(), [&](float m) { return m > best; }));
}

std::vector<int64_t> StepsOf(const Workload& w, QueryKind kind) {
  std::vector<int64_t> steps;
  for (int64_t s = 0; s < w.spec().decode_steps; ++s)
    if (w.Target(s).kind == kind) steps.push_back(s);
  return steps;
}

TEST(WorkloadKindTest, ParsesAndNames) {
  for (WorkloadKind kind : {WorkloadKind::kStructured, WorkloadKind::kGaussian}) {
    Result<WorkloadKind> parsed = ParseWorkloadKind(WorkloadKindName(kind));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, kind);
  }
  Result<WorkloadKind> bad = ParseWorkloadKind("uniform");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("structured"), std::string::npos);
}

TEST(WorkloadTest, CreateRejectsBadSpecs) {
  const Geometry g = SmallGeometry();
  const auto code = [](const Geometry& geometry, WorkloadSpec spec) {
    return Workload::Create(geometry, spec).status().code();
  };
  EXPECT_EQ(code(g, {WorkloadKind::kStructured, 1, 0, 8}), Code::kInvalidArgument);
  EXPECT_EQ(code(g, {WorkloadKind::kStructured, 1, 64, -1}), Code::kInvalidArgument);
  EXPECT_EQ(code(g, {WorkloadKind::kGaussian, 1, Workload::kMaxTokens, 1}), Code::kInvalidArgument);
  Geometry bad_heads = g;
  bad_heads.q_heads = 3;
  EXPECT_EQ(code(bad_heads, {WorkloadKind::kGaussian, 1, 64, 8}), Code::kInvalidArgument);
  Geometry narrow = g;
  narrow.head_dim = 8;
  EXPECT_EQ(code(narrow, {WorkloadKind::kStructured, 1, 64, 8}), Code::kInvalidArgument);
  EXPECT_EQ(code(narrow, {WorkloadKind::kGaussian, 1, 64, 8}), Code::kOk);
  EXPECT_EQ(code(g, {WorkloadKind::kStructured, 1, 1, 0}), Code::kOk);
}

class WorkloadKindParamTest : public ::testing::TestWithParam<WorkloadKind> {};

// Chunk sizes straddle spans, special runs, drift knots and the prefill/decode
// boundary; odd sizes shift every chunk's alignment.
TEST_P(WorkloadKindParamTest, ChunkedGenerationIsBitIdentical) {
  const Workload w = MakeWorkload(GetParam(), 11, 4096, 64);
  const Geometry& g = w.geometry();
  const std::size_t per_token = std::size_t(g.kv_heads) * g.head_dim;
  for (int layer = 0; layer < g.layers; ++layer) {
    const LayerKv whole = AllTokens(w, layer);
    std::vector<float> k(whole.k.size()), v(whole.v.size());
    const int64_t chunks[] = {1, 7, 333, 15, 2048, 1};
    int64_t at = 0;
    for (int i = 0; at < w.total_tokens(); ++i) {
      const int64_t n = std::min(chunks[i % 6], w.total_tokens() - at);
      w.Tokens(layer, at, n, &k[at * per_token], &v[at * per_token]);
      at += n;
    }
    EXPECT_EQ(std::memcmp(k.data(), whole.k.data(), k.size() * sizeof(float)), 0) << "layer " << layer;
    EXPECT_EQ(std::memcmp(v.data(), whole.v.data(), v.size() * sizeof(float)), 0) << "layer " << layer;
  }
}

// Layers generated in reverse by a second, independently created workload match.
TEST_P(WorkloadKindParamTest, LayerOrderDoesNotMatter) {
  const Workload forward = MakeWorkload(GetParam(), 5);
  const Workload backward = MakeWorkload(GetParam(), 5);
  const int layers = forward.geometry().layers;
  std::vector<LayerKv> reversed(layers);
  std::vector<std::vector<float>> reversed_q(layers);
  for (int layer = layers - 1; layer >= 0; --layer) {
    reversed[layer] = AllTokens(backward, layer);
    reversed_q[layer] = QueryOf(backward, layer, 17);
  }
  for (int layer = 0; layer < layers; ++layer) {
    const LayerKv kv = AllTokens(forward, layer);
    EXPECT_EQ(kv.k, reversed[layer].k);
    EXPECT_EQ(kv.v, reversed[layer].v);
    EXPECT_EQ(QueryOf(forward, layer, 17), reversed_q[layer]);
  }
}

TEST_P(WorkloadKindParamTest, SeedsLayersAndHeadsDiffer) {
  const Workload a = MakeWorkload(GetParam(), 1);
  const Workload b = MakeWorkload(GetParam(), 2);
  const LayerKv a0 = AllTokens(a, 0);
  const LayerKv b0 = AllTokens(b, 0);
  const LayerKv a1 = AllTokens(a, 1);
  EXPECT_NE(a0.k, b0.k);
  EXPECT_NE(a0.v, b0.v);
  EXPECT_NE(a0.k, a1.k);
  EXPECT_NE(QueryOf(a, 0, 3), QueryOf(b, 0, 3));
  EXPECT_NE(QueryOf(a, 0, 3), QueryOf(a, 0, 4));
  const int dim = a.geometry().head_dim;
  EXPECT_FALSE(std::equal(a0.k.begin(), a0.k.begin() + dim, a0.k.begin() + dim)) << "KV heads 0 and 1 equal";
}

TEST_P(WorkloadKindParamTest, ValuesAreFinite) {
  Geometry odd = SmallGeometry();
  odd.head_dim = 17;  // the last Box-Muller pair is half used
  odd.page_size = 7;
  for (const Geometry& g : {SmallGeometry(), odd}) {
    const Workload w = MakeWorkload(GetParam(), 3, 2048, 40, g);
    for (int layer = 0; layer < g.layers; ++layer) {
      const LayerKv kv = AllTokens(w, layer);
      for (float x : kv.k) ASSERT_TRUE(std::isfinite(x));
      for (float x : kv.v) ASSERT_TRUE(std::isfinite(x));
      for (int64_t s = 0; s < w.spec().decode_steps; ++s)
        for (float x : QueryOf(w, layer, s)) ASSERT_TRUE(std::isfinite(x));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(BothKinds, WorkloadKindParamTest,
                         ::testing::Values(WorkloadKind::kStructured, WorkloadKind::kGaussian),
                         [](const auto& info) { return std::string(WorkloadKindName(info.param)); });

struct Moments {
  double mean = 0, var = 0, kurtosis = 0, pair_corr = 0;
};

// Moments of a sample, and the correlation of elements 2j and 2j+1 (the two
// halves of one Box-Muller draw).
Moments MomentsOf(const std::vector<float>& x) {
  Moments m;
  const double n = double(x.size());
  for (float v : x) m.mean += v;
  m.mean /= n;
  double m4 = 0, cross = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double d = x[i] - m.mean;
    m.var += d * d;
    m4 += d * d * d * d;
    if (i % 2 == 0) cross += d * (x[i + 1] - m.mean);
  }
  m.var /= n;
  m.kurtosis = m4 / n / (m.var * m.var);
  m.pair_corr = cross / (n / 2) / m.var;
  return m;
}

// 2^19 samples each: standard errors ~0.0014 (mean), 0.002 (variance),
// 0.014 (kurtosis); tolerances are about 6 of them.
TEST(GaussianWorkloadTest, MomentsAreStandardNormal) {
  const Workload w = MakeWorkload(WorkloadKind::kGaussian, 9, 4096, 512);
  std::vector<float> q;
  for (int64_t s = 0; s < w.spec().decode_steps; ++s) {
    const std::vector<float> qs = QueryOf(w, 1, s);
    q.insert(q.end(), qs.begin(), qs.end());
  }
  const LayerKv kv = AllTokens(w, 1);
  for (const std::vector<float>* sample : {&kv.k, &kv.v, static_cast<const std::vector<float>*>(&q)}) {
    const Moments m = MomentsOf(*sample);
    EXPECT_NEAR(m.mean, 0.0, 0.01);
    EXPECT_NEAR(m.var, 1.0, 0.015);
    EXPECT_NEAR(m.kurtosis, 3.0, 0.1);
    EXPECT_NEAR(m.pair_corr, 0.0, 0.015);
  }
  EXPECT_EQ(w.sink_tokens(), 0);
  EXPECT_EQ(w.Target(0).kind, QueryKind::kRandom);
}

TEST(StructuredWorkloadTest, ScheduleHasEveryKindWithValidTargets) {
  const Workload w = MakeWorkload(WorkloadKind::kStructured, 7, 4096, 128);
  std::set<QueryKind> kinds;
  std::vector<QueryTarget> needles;
  for (int64_t s = 0; s < w.spec().decode_steps; ++s) {
    const QueryTarget t = w.Target(s);
    kinds.insert(t.kind);
    EXPECT_LT(t.begin, t.end) << "step " << s;
    EXPECT_GE(t.begin, w.sink_tokens());
    EXPECT_LE(t.end, w.spec().context_tokens + s + 1);
    if (t.kind == QueryKind::kNeedle) needles.push_back(t);
  }
  EXPECT_EQ(kinds, (std::set<QueryKind>{QueryKind::kRecent, QueryKind::kTopic, QueryKind::kEntity,
                                        QueryKind::kReversal, QueryKind::kNeedle}));
  EXPECT_EQ(StepsOf(w, QueryKind::kRecent).size(), 80u) << "recent queries are 10 of every 16 steps";
  // The needles sit at a page start and across a page boundary, among others.
  const int page = w.geometry().page_size;
  ASSERT_EQ(needles.size(), 4u);
  EXPECT_TRUE(std::any_of(needles.begin(), needles.end(), [&](auto& t) { return t.begin % page == 0; }));
  EXPECT_TRUE(std::any_of(needles.begin(), needles.end(),
                          [&](auto& t) { return t.begin / page != (t.end - 1) / page; }));
}

TEST(StructuredWorkloadTest, ShortContextOnlyAimsAtRecentTopics) {
  const Workload w = MakeWorkload(WorkloadKind::kStructured, 7, 300, 40);
  for (int64_t s = 0; s < w.spec().decode_steps; ++s) EXPECT_EQ(w.Target(s).kind, QueryKind::kRecent);
  EXPECT_EQ(w.sink_tokens(), 4);
}

// Brute force over a small context: a needle or the reversed entity B holds
// one of the top pages by true max logit (only the sink page may beat it).
TEST(StructuredWorkloadTest, NeedleAndReversalTargetsHoldTopPages) {
  for (uint64_t seed : {1, 2, 3}) {
    const Workload w = MakeWorkload(WorkloadKind::kStructured, seed, 4096, 64);
    const Geometry& g = w.geometry();
    for (int layer = 0; layer < g.layers; ++layer) {
      const LayerKv kv = AllTokens(w, layer);
      for (QueryKind kind : {QueryKind::kNeedle, QueryKind::kReversal}) {
        const std::vector<int64_t> steps = StepsOf(w, kind);
        ASSERT_FALSE(steps.empty());
        for (int64_t s : steps) {
          const QueryTarget t = w.Target(s);
          const std::vector<float> q = QueryOf(w, layer, s);
          for (int qh = 0; qh < g.q_heads; ++qh) {
            const std::vector<float> page_max = PageMaxLogits(Logits(w, kv, q, qh, s), g.page_size);
            EXPECT_LE(RangeRank(page_max, g.page_size, t.begin, t.end), 2)
                << QueryKindName(kind) << " seed " << seed << " layer " << layer << " step " << s << " head " << qh;
          }
        }
      }
    }
  }
}

// Relevance reversal (seed §2.2): A-queries prefer A's pages over B's; the
// reversal query prefers B's page over A's introduction and every mention.
TEST(StructuredWorkloadTest, ReversalPrefersBOverTheOftenMentionedA) {
  const Workload w = MakeWorkload(WorkloadKind::kStructured, 4, 4096, 64);
  const Geometry& g = w.geometry();
  const QueryTarget a = w.Target(StepsOf(w, QueryKind::kEntity).front());
  const QueryTarget b = w.Target(StepsOf(w, QueryKind::kReversal).front());
  const LayerKv kv = AllTokens(w, 1);
  for (int64_t s : {StepsOf(w, QueryKind::kEntity).front(), StepsOf(w, QueryKind::kReversal).front()}) {
    const std::vector<float> q = QueryOf(w, 1, s);
    for (int qh = 0; qh < g.q_heads; ++qh) {
      const std::vector<float> logits = Logits(w, kv, q, qh, s);
      const std::vector<float> page_max = PageMaxLogits(logits, g.page_size);
      const float b_best = RangeBest(page_max, g.page_size, b.begin, b.end);
      const float a_intro = RangeBest(page_max, g.page_size, a.begin, a.end);
      if (w.Target(s).kind == QueryKind::kEntity) {
        EXPECT_GT(a_intro, b_best + 1.0f) << "head " << qh;
        continue;
      }
      // Every page other than B's and the sink page scores below B's.
      std::vector<float> others = page_max;
      others[0] = -INFINITY;
      for (int64_t p = b.begin; p < b.end; ++p) others[p / g.page_size] = -INFINITY;
      EXPECT_GT(b_best, *std::max_element(others.begin(), others.end())) << "head " << qh;
      EXPECT_GT(b_best, a_intro + 1.0f) << "head " << qh;
    }
  }
}

// An older span that becomes relevant again ranks near the top on average.
TEST(StructuredWorkloadTest, TopicQueriesReachBackToTheirSpan) {
  const Workload w = MakeWorkload(WorkloadKind::kStructured, 8, 4096, 64);
  const Geometry& g = w.geometry();
  double rank_sum = 0;
  int count = 0;
  for (int layer = 0; layer < g.layers; ++layer) {
    const LayerKv kv = AllTokens(w, layer);
    for (int64_t s : StepsOf(w, QueryKind::kTopic)) {
      const QueryTarget t = w.Target(s);
      EXPECT_LE(t.end, w.spec().context_tokens + s + 1 - 2048) << "a topic step aims at an old span";
      const std::vector<float> q = QueryOf(w, layer, s);
      for (int qh = 0; qh < g.q_heads; ++qh) {
        rank_sum += RangeRank(PageMaxLogits(Logits(w, kv, q, qh, s), g.page_size), g.page_size, t.begin, t.end);
        ++count;
      }
    }
  }
  ASSERT_GT(count, 0);
  EXPECT_LE(rank_sum / count, 3.0);
}

// Temporal locality: the best non-sink tokens of a recent-topic query lie in
// the last 2048 positions, where the topic's centroid has barely drifted.
TEST(StructuredWorkloadTest, RecentQueriesFindRecentTokens) {
  const Workload w = MakeWorkload(WorkloadKind::kStructured, 6, 4096, 64);
  const Geometry& g = w.geometry();
  constexpr int kTop = 16;
  double recent = 0, total = 0;
  for (int layer = 0; layer < g.layers; ++layer) {
    const LayerKv kv = AllTokens(w, layer);
    for (int64_t s : StepsOf(w, QueryKind::kRecent)) {
      const std::vector<float> q = QueryOf(w, layer, s);
      for (int qh = 0; qh < g.q_heads; ++qh) {
        const std::vector<float> logits = Logits(w, kv, q, qh, s);
        std::vector<int64_t> order(logits.size() - w.sink_tokens());
        std::iota(order.begin(), order.end(), w.sink_tokens());
        std::partial_sort(order.begin(), order.begin() + kTop, order.end(),
                          [&](int64_t x, int64_t y) { return logits[x] > logits[y]; });
        const int64_t window_begin = int64_t(logits.size()) - 2048;
        recent += double(std::count_if(order.begin(), order.begin() + kTop, [&](int64_t p) { return p >= window_begin; }));
        total += kTop;
      }
    }
  }
  EXPECT_GE(recent / total, 0.9);
}

// Sinks draw a large share of attention on average, and logits are spread
// like a trained model's: the top sits well above the typical token, not
// saturated and not flat.
TEST(StructuredWorkloadTest, SinksDrawAttentionAndLogitsHaveRealisticSpread) {
  const Workload w = MakeWorkload(WorkloadKind::kStructured, 5, 4096, 64);
  const Geometry& g = w.geometry();
  double sink_mass = 0, spread = 0;
  int queries = 0;
  for (int layer = 0; layer < g.layers; ++layer) {
    const LayerKv kv = AllTokens(w, layer);
    for (int64_t s = 0; s < w.spec().decode_steps; ++s) {
      const std::vector<float> q = QueryOf(w, layer, s);
      for (int qh = 0; qh < g.q_heads; ++qh) {
        std::vector<float> logits = Logits(w, kv, q, qh, s);
        const float top = *std::max_element(logits.begin(), logits.end());
        double z = 0, z_sink = 0;
        for (std::size_t p = 0; p < logits.size(); ++p) {
          const double e = std::exp(double(logits[p] - top));
          z += e;
          if (int64_t(p) < w.sink_tokens()) z_sink += e;
        }
        sink_mass += z_sink / z;
        std::nth_element(logits.begin(), logits.begin() + logits.size() / 2, logits.end());
        spread += top - logits[logits.size() / 2];
        ++queries;
      }
    }
  }
  EXPECT_GE(sink_mass / queries, 0.1) << "4 sinks of 4K tokens";
  EXPECT_GE(spread / queries, 6.0);
  EXPECT_LE(spread / queries, 16.0);
}

}  // namespace
}  // namespace questkv
