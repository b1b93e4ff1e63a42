// The CUDA backend end to end (runtime/cuda/) against the CPU
// backend on the same inputs: selections equal, outputs within the dtype's
// rounding; all-in-HBM against mostly-on-host (and on disk) bit for bit;
// fork, rollback and prefix sharing; the device-pointer API; bad input.
// K/V and queries are rounded to the model dtype first, so the CPU backend
// (f32) sees exactly the values the GPU stores.
// Skips, saying why, without a usable GPU (or when built without CUDA).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "questkv/runtime.h"
#include "tests/testing/reference.h"

namespace questkv {
namespace {

struct Case {
  DType dtype;
  GqaMode gqa;
  int q_heads, kv_heads;
  double tol;  // relative L2 of outputs against the CPU backend
  SummaryDType summary = SummaryDType::kKv;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << DTypeName(c.dtype) << "_" << GqaModeName(c.gqa) << "_Hq" << c.q_heads << "_Hkv" << c.kv_heads;
  if (c.summary != SummaryDType::kKv) *os << "_" << SummaryDTypeName(c.summary);
}

Config MakeConfig(Backend b, const Case& c) {
  Config cfg;
  cfg.backend = b;
  cfg.geometry = Geometry{3, c.q_heads, c.kv_heads, 64, 16, b == Backend::kCuda ? c.dtype : DType::kF32, c.summary};
  cfg.policy.token_budget = 128;  // 8 pages
  cfg.policy.sink_pages = 1;
  cfg.policy.local_pages = 2;
  cfg.policy.gqa = c.gqa;
  cfg.policy.dense_layers = {0};
  cfg.max_pages = 4096;
  return cfg;
}

// Skips the test when the CUDA backend cannot run here.
#define QKV_CREATE_CUDA(var, cfg)                                                         \
  auto var##_r = Runtime::Create(cfg);                                                    \
  if (!var##_r.ok() && (var##_r.status().code() == Code::kFailedPrecondition ||           \
                        var##_r.status().code() == Code::kUnimplemented))                 \
    GTEST_SKIP() << var##_r.status().ToString();                                          \
  ASSERT_TRUE(var##_r.ok()) << var##_r.status().ToString();                               \
  std::unique_ptr<Runtime> var = std::move(*var##_r)

float RoundTo(float x, DType t) {
  if (t == DType::kF16) return __half2float(__float2half_rn(x));
  if (t == DType::kBF16) return __bfloat162float(__float2bfloat16_rn(x));
  return x;
}
std::vector<float> Rounded(std::vector<float> x, DType t) {
  for (float& v : x) v = RoundTo(v, t);
  return x;
}

// Drives any number of runtimes through the same calls and compares them.
class Twins {
 public:
  Twins(std::vector<Runtime*> rts, const Geometry& g, DType dtype) : rts_(std::move(rts)), g_(g), dtype_(dtype) {}

  std::vector<SeqId> NewSeq() {
    std::vector<SeqId> ids;
    for (Runtime* rt : rts_) {
      auto id = rt->CreateSequence();
      EXPECT_TRUE(id.ok()) << id.status().ToString();
      ids.push_back(*id);
    }
    return ids;
  }
  // Random K/V (rounded to the dtype) appended to every layer in chunks.
  void Append(const std::vector<SeqId>& ids, int64_t n, int64_t chunk) {
    const std::size_t row = std::size_t(g_.kv_heads) * g_.head_dim;
    for (int l = 0; l < g_.layers; ++l) {
      const auto k = Rounded(test::RandomNormal(n * row, seed_++), dtype_);
      const auto v = Rounded(test::RandomNormal(n * row, seed_++), dtype_);
      for (int64_t t = 0; t < n; t += chunk) {
        const int64_t m = std::min(chunk, n - t);
        for (std::size_t i = 0; i < rts_.size(); ++i) {
          const Status s = rts_[i]->Append(ids[i], l, k.data() + t * row, v.data() + t * row, m);
          ASSERT_TRUE(s.ok()) << s.ToString();
        }
      }
    }
  }
  // One decode call at `layer` over batch[b][runtime]: selections equal,
  // outputs of runtime i>0 against runtime 0 within `tol` (0: bit for bit).
  void Decode(const std::vector<std::vector<SeqId>>& batch, int layer, double tol, bool dense = false) {
    const std::size_t qn = batch.size() * g_.q_heads * g_.head_dim;
    const auto q = Rounded(test::RandomNormal(qn, seed_++), dtype_);
    std::vector<std::vector<float>> outs(rts_.size(), std::vector<float>(qn, -1.f));
    std::vector<std::vector<PageSelection>> sels(rts_.size());
    for (std::size_t i = 0; i < rts_.size(); ++i) {
      std::vector<SeqId> ids;
      for (const auto& b : batch) ids.push_back(b[i]);
      const Status s = dense ? rts_[i]->DenseAttention(ids, layer, q.data(), outs[i].data())
                             : rts_[i]->DecodeAttention(ids, layer, q.data(), outs[i].data(), &sels[i]);
      ASSERT_TRUE(s.ok()) << "runtime " << i << ": " << s.ToString();
    }
    for (std::size_t i = 1; i < rts_.size(); ++i) {
      if (!dense) {
        ASSERT_EQ(sels[i].size(), sels[0].size());
        for (std::size_t b = 0; b < sels[0].size(); ++b) {
          EXPECT_EQ(sels[i][b].indptr, sels[0][b].indptr) << "runtime " << i << " batch entry " << b;
          EXPECT_EQ(sels[i][b].pages, sels[0][b].pages) << "runtime " << i << " batch entry " << b;
        }
      }
      if (tol == 0) {
        EXPECT_EQ(std::memcmp(outs[i].data(), outs[0].data(), qn * sizeof(float)), 0)
            << "runtime " << i << " layer " << layer << ": outputs differ";
      } else {
        EXPECT_LE(test::RelL2Error(outs[i].data(), outs[0].data(), qn), tol) << "runtime " << i << " layer " << layer;
      }
    }
    ++decodes_;
  }
  int decodes() const { return decodes_; }

 private:
  std::vector<Runtime*> rts_;
  Geometry g_;
  DType dtype_;
  uint64_t seed_ = 1;
  int decodes_ = 0;
};

// Sequences of 1, S-1, S, S+1 and 4099 tokens, a few decode steps (append one
// token per sequence and layer, then a batch decode), on `rts`.
void RunScenario(Twins& tw, const Geometry& g, double tol, int steps) {
  std::vector<std::vector<SeqId>> seqs;
  const int64_t lens[] = {1, 15, 16, 17, 4099};
  const int64_t chunks[] = {1, 4, 16, 5, 1000};
  for (int i = 0; i < 5; ++i) {
    seqs.push_back(tw.NewSeq());
    tw.Append(seqs.back(), lens[i], chunks[i]);
  }
  for (int step = 0; step < steps; ++step) {
    for (const auto& s : seqs) tw.Append(s, 1, 1);
    for (int l = 0; l < g.layers; ++l) tw.Decode(seqs, l, tol);
    // A smaller batch too (other partitions untouched).
    tw.Decode({seqs[4], seqs[1]}, 1, tol);
  }
}

class CudaVsCpu : public ::testing::TestWithParam<Case> {};

TEST_P(CudaVsCpu, SameSelectionsAndOutputs) {
  const Case c = GetParam();
  QKV_CREATE_CUDA(gpu, MakeConfig(Backend::kCuda, c));
  auto cpu = Runtime::Create(MakeConfig(Backend::kCpu, c));
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  Twins tw({cpu->get(), gpu.get()}, gpu->config().geometry, c.dtype);
  RunScenario(tw, gpu->config().geometry, c.tol, 4);
  // Summaries and gathered K/V agree exactly (the CPU saw the rounded values).
  auto cs = (*cpu)->Pages(5, 2);
  auto gs = gpu->Pages(5, 2);
  ASSERT_TRUE(cs.ok() && gs.ok());
  for (std::size_t p = 0; p < cs->size(); p += 37) {
    auto a = (*cpu)->Summary((*cs)[p]);
    auto b = gpu->Summary((*gs)[p]);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(*a, *b) << "page " << p;
  }
  auto va = (*cpu)->Gather(5, 2);
  auto vb = gpu->Gather(5, 2);
  ASSERT_TRUE(va.ok() && vb.ok()) << vb.status().ToString();
  EXPECT_EQ(va->k, vb->k);
  EXPECT_EQ(va->v, vb->v);
  // Dense attention on the GPU against the CPU backend's.
  tw.Decode({{5, 5}}, 2, c.tol, /*dense=*/true);
}

INSTANTIATE_TEST_SUITE_P(Backends, CudaVsCpu,
                         ::testing::Values(Case{DType::kF32, GqaMode::kMax, 8, 2, 1e-5},
                                           Case{DType::kF16, GqaMode::kMax, 8, 2, 2e-3},
                                           Case{DType::kF16, GqaMode::kMean, 8, 2, 2e-3},
                                           Case{DType::kBF16, GqaMode::kUnion, 8, 2, 1e-2},
                                           Case{DType::kF16, GqaMode::kMax, 2, 2, 2e-3},
                                           Case{DType::kF16, GqaMode::kUnion, 16, 2, 2e-3},
                                           // E4M3 summaries: the device's codes decode to the CPU
                                           // backend's snapped bounds, so selections stay equal.
                                           Case{DType::kF32, GqaMode::kMax, 8, 2, 1e-5, SummaryDType::kE4M3},
                                           Case{DType::kF16, GqaMode::kMax, 8, 2, 2e-3, SummaryDType::kE4M3},
                                           Case{DType::kBF16, GqaMode::kMean, 8, 2, 1e-2, SummaryDType::kE4M3},
                                           Case{DType::kF16, GqaMode::kUnion, 16, 2, 2e-3, SummaryDType::kE4M3},
                                           Case{DType::kF16, GqaMode::kMax, 2, 2, 2e-3, SummaryDType::kE4M3},
                                           // Groups of 3, 5, 6, 7 run padded to 4 or 8 heads.
                                           Case{DType::kF16, GqaMode::kMax, 6, 2, 2e-3},
                                           Case{DType::kBF16, GqaMode::kMean, 6, 2, 1e-2},
                                           Case{DType::kF16, GqaMode::kUnion, 6, 2, 2e-3},
                                           Case{DType::kF32, GqaMode::kMax, 10, 2, 1e-5},
                                           Case{DType::kF16, GqaMode::kMean, 12, 2, 2e-3},
                                           Case{DType::kF16, GqaMode::kUnion, 14, 2, 2e-3, SummaryDType::kE4M3}));

// The two-stage re-rank (SelectionPolicy::rerank) on the GPU: candidates by
// the bound, kept by their exact scores from HBM slots or, with a small HBM,
// from pinned host homes; the CPU backend's selections and outputs, and the
// same key bytes counted.
TEST(CudaSelection, RerankMatchesCpu) {
  for (const Case& c : {Case{DType::kF16, GqaMode::kMax, 8, 2, 2e-3}, Case{DType::kF32, GqaMode::kMean, 8, 2, 1e-5},
                        Case{DType::kBF16, GqaMode::kMax, 16, 2, 1e-2, SummaryDType::kE4M3},
                        Case{DType::kF16, GqaMode::kMean, 2, 2, 2e-3, SummaryDType::kE4M3},
                        Case{DType::kF16, GqaMode::kMax, 6, 2, 2e-3}, Case{DType::kBF16, GqaMode::kMean, 6, 2, 1e-2}}) {
    std::ostringstream name;
    PrintTo(c, &name);
    SCOPED_TRACE(name.str());
    Config all = MakeConfig(Backend::kCuda, c);
    all.policy.rerank = 2.5;
    Config small = all;
    small.hbm_bytes = 1100 * std::size_t(2 * 16 * 64) * DTypeBytes(c.dtype);
    Config on_cpu = MakeConfig(Backend::kCpu, c);
    on_cpu.policy.rerank = 2.5;
    QKV_CREATE_CUDA(gpu, all);
    QKV_CREATE_CUDA(tight, small);
    auto cpu = Runtime::Create(on_cpu);
    ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
    Twins tw({cpu->get(), gpu.get(), tight.get()}, all.geometry, c.dtype);
    RunScenario(tw, all.geometry, c.tol, 3);
    EXPECT_GT(tight->tier_stats().hbm_misses, 0) << "every candidate stayed in HBM: the host reads are untested";
    // The same selections and key bytes as plain Quest with the candidates' budget would not give:
    // the re-rank must change some selection (else the test shows little).
    Config plain = all;
    plain.policy.rerank = 0;
    QKV_CREATE_CUDA(quest, plain);
    Twins differ({gpu.get(), quest.get()}, all.geometry, c.dtype);
    const auto a = differ.NewSeq();
    differ.Append(a, 4099, 1000);
    std::vector<PageSelection> sa, sb;
    const auto q = Rounded(test::RandomNormal(std::size_t(c.q_heads) * 64, 99), c.dtype);
    std::vector<float> oa(q.size()), ob(q.size());
    AttendStats ra, rb;
    ASSERT_TRUE(gpu->DecodeAttention(std::span<const SeqId>(&a[0], 1), 1, q.data(), oa.data(), &sa, &ra).ok());
    ASSERT_TRUE(quest->DecodeAttention(std::span<const SeqId>(&a[1], 1), 1, q.data(), ob.data(), &sb, &rb).ok());
    EXPECT_NE(sa[0].pages, sb[0].pages) << "the re-rank kept plain Quest's pages";
    EXPECT_GT(ra.rerank_key_bytes, 0);
    EXPECT_EQ(rb.rerank_key_bytes, 0);
  }
}

// Adaptive budgets (SelectionPolicy::unread_bound_mass) on the GPU: each
// row's page count from its bound masses, between the floor and the budget;
// the CPU backend's selections, outputs and counts. A loose share must
// stop some rows short of the budget (else the test shows little): at 0.6
// and 0.8 every ranking of the last call took the budget on both backends.
TEST(CudaSelection, AdaptiveBudgetsMatchCpu) {
  for (const Case& c : {Case{DType::kF16, GqaMode::kMax, 8, 2, 2e-3}, Case{DType::kF32, GqaMode::kMean, 8, 2, 1e-5},
                        Case{DType::kBF16, GqaMode::kMax, 16, 2, 1e-2, SummaryDType::kE4M3},
                        Case{DType::kF16, GqaMode::kMean, 6, 2, 2e-3}}) {
    for (const double share : {0.95, 0.05}) {
      std::ostringstream name;
      PrintTo(c, &name);
      SCOPED_TRACE(name.str() + " unread share " + std::to_string(share));
      Config on_gpu = MakeConfig(Backend::kCuda, c);
      Config on_cpu = MakeConfig(Backend::kCpu, c);
      for (Config* cfg : {&on_gpu, &on_cpu}) {
        cfg->policy.token_budget = 256;  // 16 pages: 13 beside sink and local
        cfg->policy.unread_bound_mass = share;
        cfg->policy.adaptive_floor = 80;  // 5 pages: 2 beside sink and local
      }
      QKV_CREATE_CUDA(gpu, on_gpu);
      auto cpu = Runtime::Create(on_cpu);
      ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
      Twins tw({cpu->get(), gpu.get()}, on_gpu.geometry, c.dtype);
      RunScenario(tw, on_gpu.geometry, c.tol, 3);
      // One more call on the longest sequence (id 5), its counts on both.
      const auto q = Rounded(test::RandomNormal(std::size_t(c.q_heads) * 64, 7), c.dtype);
      std::vector<float> oa(q.size()), ob(q.size());
      AttendStats sa, sb;
      const SeqId seq = 5;
      ASSERT_TRUE((*cpu)->DecodeAttention(std::span<const SeqId>(&seq, 1), 1, q.data(), oa.data(), nullptr, &sa).ok());
      ASSERT_TRUE(gpu->DecodeAttention(std::span<const SeqId>(&seq, 1), 1, q.data(), ob.data(), nullptr, &sb).ok());
      EXPECT_EQ(sb.adaptive_rankings, sa.adaptive_rankings);
      EXPECT_EQ(sb.adaptive_pages, sa.adaptive_pages);
      EXPECT_EQ(sb.adaptive_pages_max, sa.adaptive_pages_max);
      EXPECT_EQ(sb.adaptive_cap_hits, sa.adaptive_cap_hits);
      EXPECT_EQ(std::vector<int64_t>(std::begin(sb.adaptive_hist), std::end(sb.adaptive_hist)),
                std::vector<int64_t>(std::begin(sa.adaptive_hist), std::end(sa.adaptive_hist)));
      EXPECT_EQ(sa.adaptive_rankings, 2) << "one ranking a KV head";
      EXPECT_EQ(sb.head_pages_selected, sa.head_pages_selected);
      EXPECT_LE(test::RelL2Error(ob.data(), oa.data(), q.size()), c.tol);
      if (share > 0.5) {
        EXPECT_LT(sa.adaptive_cap_hits, sa.adaptive_rankings) << "every ranking took the budget";
      }
    }
  }
}

// With gqa union, the re-rank or shared blocks, adaptive budgets need the
// CPU backend: refused at creation, with a message that says so.
TEST(CudaSelection, AdaptiveBudgetsRefuseWhatTheyDoNotRun) {
  const Case c{DType::kF16, GqaMode::kUnion, 8, 2, 2e-3};
  Config cfg = MakeConfig(Backend::kCuda, c);
  cfg.policy.unread_bound_mass = 0.2;
  auto r = Runtime::Create(cfg);
  if (!r.ok() && r.status().code() == Code::kFailedPrecondition) GTEST_SKIP() << r.status().ToString();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kUnimplemented);
  EXPECT_NE(r.status().message().find("adaptive"), std::string::npos) << r.status().ToString();
}

// Every page in HBM against an HBM that holds a fraction: the misses are
// gathered from pinned host memory and the outputs are the same bits.
TEST(CudaTiers, MostlyOnHostIsBitIdenticalToAllInHbm) {
  const Case c{DType::kF16, GqaMode::kMax, 8, 2, 0};
  Config all = MakeConfig(Backend::kCuda, c);
  Config small = all;
  const std::size_t slot = 2 * 16 * 64 * 2;
  small.hbm_bytes = 1100 * slot;  // staging 128 + tails 30 + dense layer ~530 + sparse lists
  QKV_CREATE_CUDA(a, all);
  QKV_CREATE_CUDA(b, small);
  Twins tw({a.get(), b.get()}, all.geometry, c.dtype);
  RunScenario(tw, all.geometry, 0, 6);
  const TierStats s = b->tier_stats();
  EXPECT_GT(s.hbm_misses, 0);
  EXPECT_GT(s.bytes_host_to_hbm, 0);
  EXPECT_GT(s.hbm_evictions, 0);
  EXPECT_LE(s.hbm_peak_bytes, s.hbm_capacity_bytes);
  EXPECT_EQ(s.bytes_host_to_hbm, (s.hbm_misses) * int64_t(slot));
}

// Layers prefilled first keep the pages that fit in HBM; the layers decoded
// after them must still get their share of the pool to cache in, not exactly
// one step's selection. Two queries alternate at every layer, so each layer
// selects two fixed sets (8 pages a row each): once both are in, a layer
// whose list holds more than one step's need misses nothing. Counted from
// step 4: layer 0 hits everything at step 0, so its list keeps prefill order
// (an all-hit step does not reorder, kernels/cuda/resolve.cu), gives its
// first slots to layer 2 and evicts by that order at step 1: a few of its
// pages come back once more at step 2 (5, measured on the H200).
TEST(CudaTiers, PrefillResidentListsShareThePoolWithLaterLayers) {
  const Case c{DType::kF16, GqaMode::kMax, 8, 2, 0};
  Config cfg = MakeConfig(Backend::kCuda, c);
  cfg.policy.dense_layers = {};
  const Geometry& g = cfg.geometry;
  // Staging 128 + tails 6 + 200: layer 0 keeps its 128 head-pages from
  // prefill, layer 1 the 72 left, layer 2 none. A list needs 16 per step.
  cfg.hbm_bytes = (128 + 6 + 200) * std::size_t(2 * 16 * 64 * 2);
  QKV_CREATE_CUDA(rt, cfg);
  auto id = rt->CreateSequence();
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  const int64_t n = 64 * 16;
  const std::size_t row = std::size_t(g.kv_heads) * g.head_dim;
  for (int l = 0; l < g.layers; ++l) {
    const auto k = Rounded(test::RandomNormal(n * row, 10 + l), c.dtype);
    const auto v = Rounded(test::RandomNormal(n * row, 20 + l), c.dtype);
    ASSERT_TRUE(rt->Append(*id, l, k.data(), v.data(), n).ok());
  }
  const std::size_t qn = std::size_t(g.q_heads) * g.head_dim;
  std::vector<std::vector<float>> q;
  for (int i = 0; i < 2 * g.layers; ++i) q.push_back(Rounded(test::RandomNormal(qn, 30 + i), c.dtype));
  std::vector<float> out(qn);
  int64_t misses_after_warmup = 0;
  for (int step = 0; step < 14; ++step) {
    if (step == 4) misses_after_warmup = rt->tier_stats().hbm_misses;
    for (int l = 0; l < g.layers; ++l) {
      const SeqId ids[] = {*id};
      const Status s = rt->DecodeAttention(ids, l, q[2 * l + step % 2].data(), out.data());
      ASSERT_TRUE(s.ok()) << "step " << step << " layer " << l << ": " << s.ToString();
    }
  }
  EXPECT_GT(misses_after_warmup, 0);  // layers 1 and 2 started without their pages
  EXPECT_EQ(rt->tier_stats().hbm_misses, misses_after_warmup) << "a layer re-fetched pages it had two steps ago";
  EXPECT_GE(rt->tier_stats().hbm_evictions, 1);  // the pool was full
}

// HBM holds the staging slots, the tails and every sealed head-page of three
// dense layers, not one slot more. A dense row selects its tail too, which
// stays in its pinned tail slots, never in the list: a list that counted it
// would take a slot from the next layer's list a step, and that layer would
// miss and take from the next.
TEST(CudaTiers, DenseLayersThatFitExactlyNeverMiss) {
  const Case c{DType::kF16, GqaMode::kMax, 8, 2, 0};
  Config all = MakeConfig(Backend::kCuda, c);
  all.policy.dense_layers = {0, 1, 2};
  Config exact = all;
  exact.hbm_bytes = (128 + 6 + 3 * 64 * 2) * std::size_t(2 * 16 * 64 * 2);  // staging + tails + pages
  QKV_CREATE_CUDA(a, all);
  QKV_CREATE_CUDA(b, exact);
  Twins tw({a.get(), b.get()}, all.geometry, c.dtype);
  const auto seq = tw.NewSeq();
  tw.Append(seq, 64 * 16 + 5, 256);  // 64 sealed pages and a tail, at every layer
  for (int step = 0; step < 6; ++step) {
    tw.Append(seq, 1, 1);  // the tail grows; no page seals
    for (int l = 0; l < all.geometry.layers; ++l) tw.Decode({seq}, l, 0);
  }
  const TierStats s = b->tier_stats();
  EXPECT_EQ(s.hbm_misses, 0);
  EXPECT_EQ(s.hbm_evictions, 0);
  EXPECT_EQ(s.hbm_bypasses, 0);
  EXPECT_LE(s.hbm_peak_bytes, s.hbm_capacity_bytes);
}

// A tail that fills during decode stays resident while the pool has free
// slots: the local window selects it at the next step, and with every page
// cached it never misses. Outputs equal a small HBM's (misses read from
// host homes), bit for bit.
TEST(CudaTiers, FilledTailsStayResidentWhileThePoolHasRoom) {
  const Case c{DType::kF16, GqaMode::kMax, 8, 2, 0};
  Config all = MakeConfig(Backend::kCuda, c);  // every page of max_pages: free slots throughout
  Config small = all;
  small.hbm_bytes = 400 * 2 * 16 * 64 * 2;  // staging 256, tails 6, lists 138 of the 264 head-pages
  QKV_CREATE_CUDA(a, all);
  QKV_CREATE_CUDA(b, small);
  Twins tw({a.get(), b.get()}, all.geometry, c.dtype);
  const auto seq = tw.NewSeq();
  tw.Append(seq, 40 * 16 + 13, 256);  // the tail fills at the 3rd, 19th and 35th decode tokens
  for (int step = 0; step < 40; ++step) {
    tw.Append(seq, 1, 1);
    for (int l = 0; l < all.geometry.layers; ++l) tw.Decode({seq}, l, 0);
  }
  const TierStats s = a->tier_stats();
  EXPECT_EQ(s.hbm_misses, 0) << "a filled tail lost its slots";
  EXPECT_EQ(s.hbm_evictions, 0);
  EXPECT_GT(b->tier_stats().hbm_misses, 0);
}

// Decode steps replayed from captured CUDA graphs give the bits of direct
// launches, over the scenario's shape changes (page counts, list growth,
// batches of 5 and 2) and with misses (a small HBM).
TEST(CudaGraphs, ReplayedStepsEqualDirectLaunches) {
  const Case c{DType::kF16, GqaMode::kMax, 8, 2, 0};
  Config graphs = MakeConfig(Backend::kCuda, c);
  graphs.hbm_bytes = 1100 * 2 * 16 * 64 * 2;
  Config direct = graphs;
  direct.cuda_graphs = false;
  QKV_CREATE_CUDA(a, direct);
  QKV_CREATE_CUDA(b, graphs);
  Twins tw({a.get(), b.get()}, graphs.geometry, c.dtype);
  RunScenario(tw, graphs.geometry, 0, 8);
  const TierStats sa = a->tier_stats(), sb = b->tier_stats();
  EXPECT_GT(sb.hbm_misses, 0);
  EXPECT_EQ(sa.hbm_hits, sb.hbm_hits);
  EXPECT_EQ(sa.hbm_misses, sb.hbm_misses);
  EXPECT_EQ(sa.hbm_evictions, sb.hbm_evictions);
  EXPECT_EQ(sa.bytes_host_to_hbm, sb.bytes_host_to_hbm);
}

// `mem` (the scenario's in-memory config) with 1100 head-pages of hbm, a
// host tier for 200 of its ~800 pages and the rest on disk in `dir`.
Config WithDiskTier(const Config& mem, const std::filesystem::path& dir, ColdMissPolicy policy) {
  Config c = mem;
  c.hbm_bytes = 1100 * 2 * 16 * 64 * 2;
  c.host_bytes = 200 * 4096;
  c.disk_dir = dir.string();
  c.disk_bytes = 64 << 20;
  c.io_backend = IoBackendKind::kPread;
  c.cold_miss = policy;
  return c;
}

// Host tier smaller than the cache, the rest on disk: under `strict` the
// outputs are the in-memory ones, bit for bit; under `deadline` the run
// completes and counts what it skipped.
TEST(CudaTiers, DiskTierStrictIsBitIdenticalAndDeadlineCompletes) {
  const Case c{DType::kF16, GqaMode::kMax, 8, 2, 0};
  const auto dir = std::filesystem::temp_directory_path() / ("questkv_cuda_disk_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  Config mem = MakeConfig(Backend::kCuda, c);
  Config strict = WithDiskTier(mem, dir, ColdMissPolicy::kStrict);
  Config deadline = strict;
  deadline.cold_miss = ColdMissPolicy::kDeadline;
  deadline.disk_dir = (dir / "d").string();
  std::filesystem::create_directories(deadline.disk_dir);
  {
    QKV_CREATE_CUDA(a, mem);
    QKV_CREATE_CUDA(b, strict);
    Twins tw({a.get(), b.get()}, mem.geometry, c.dtype);
    RunScenario(tw, mem.geometry, 0, 3);
    const TierStats s = b->tier_stats();
    EXPECT_GT(s.bytes_host_to_disk, 0);
    EXPECT_GT(s.bytes_disk_to_host, 0);
    EXPECT_GT(s.cold_stalls, 0);
    EXPECT_EQ(s.cold_stalls, s.cold_misses);
    EXPECT_EQ(s.pages_skipped, 0);
  }
  {
    QKV_CREATE_CUDA(d, deadline);
    Twins tw({d.get()}, mem.geometry, c.dtype);
    RunScenario(tw, mem.geometry, 0, 3);
    const TierStats s = d->tier_stats();
    EXPECT_EQ(s.cold_stalls, 0);
    EXPECT_EQ(s.pages_skipped, s.cold_misses);
    for (SeqId id = 1; id <= 5; ++id) ASSERT_TRUE(d->Free(id).ok());
    EXPECT_EQ(d->live_pages(), 0u);
  }
  std::filesystem::remove_all(dir);
}

// `deadline` with a skip limit: limit 0 waits for every cold miss and
// computes the in-memory outputs bit for bit; a limit between skips and
// waits, each cold miss counted once as one or the other.
TEST(CudaTiers, DeadlineSkipLimitWaitsPastItAndZeroIsStrict) {
  const Case c{DType::kF16, GqaMode::kMax, 8, 2, 0};
  const auto dir = std::filesystem::temp_directory_path() / ("questkv_cuda_limit_" + std::to_string(::getpid()));
  Config mem = MakeConfig(Backend::kCuda, c);
  for (const double limit : {0.0, 0.3}) {
    SCOPED_TRACE("limit " + std::to_string(limit));
    std::filesystem::create_directories(dir);
    Config tiers = WithDiskTier(mem, dir, ColdMissPolicy::kDeadline);
    tiers.deadline_skip_limit = limit;
    {
      QKV_CREATE_CUDA(a, mem);
      QKV_CREATE_CUDA(b, tiers);
      if (limit == 0) {
        Twins tw({a.get(), b.get()}, mem.geometry, c.dtype);
        RunScenario(tw, mem.geometry, 0, 3);
      } else {
        Twins tw({b.get()}, mem.geometry, c.dtype);
        RunScenario(tw, mem.geometry, 0, 3);
      }
      const TierStats s = b->tier_stats();
      EXPECT_GT(s.cold_misses, 0);
      EXPECT_EQ(s.cold_stalls + s.pages_skipped, s.cold_misses);
      EXPECT_GT(s.deadline_waits, 0);
      if (limit == 0) {
        EXPECT_EQ(s.pages_skipped, 0);
      }
    }
    std::filesystem::remove_all(dir);
  }
}

// Fork (copy of a partial tail), rollback (in place and from a sealed page),
// prefix sharing, and freeing, against the CPU backend.
TEST(CudaSequences, ForkRollbackPrefixMatchCpu) {
  for (const SummaryDType sum : {SummaryDType::kKv, SummaryDType::kE4M3}) {
  SCOPED_TRACE(std::string(SummaryDTypeName(sum)) + " summaries");
  const Case c{DType::kF32, GqaMode::kMax, 8, 2, 1e-5, sum};
  QKV_CREATE_CUDA(gpu, MakeConfig(Backend::kCuda, c));
  auto cpu = Runtime::Create(MakeConfig(Backend::kCpu, c));
  ASSERT_TRUE(cpu.ok());
  Runtime* rts[2] = {cpu->get(), gpu.get()};
  Twins tw({rts[0], rts[1]}, gpu->config().geometry, c.dtype);
  const auto a = tw.NewSeq();
  tw.Append(a, 300, 64);  // 18 full pages and a tail of 12
  std::vector<SeqId> f, p;
  for (int i = 0; i < 2; ++i) {
    auto id = rts[i]->Fork(a[i]);  // the partial tail is copied
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    f.push_back(*id);
    auto pre = rts[i]->CreateFromPrefix(a[i], 10);
    ASSERT_TRUE(pre.ok()) << pre.status().ToString();
    p.push_back(*pre);
  }
  for (int l = 0; l < 3; ++l) tw.Decode({a, f, p}, l, c.tol);
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(rts[i]->Rollback(f[i], 3).ok());   // 297: the private tail, in place
    ASSERT_TRUE(rts[i]->Rollback(a[i], 20).ok());  // 280: sealed page 17 becomes a tail (a copy)
  }
  tw.Append(f, 5, 5);
  tw.Append(p, 7, 3);
  for (int l = 0; l < 3; ++l) tw.Decode({a, f, p}, l, c.tol);
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(rts[i]->Rollback(f[i], 22).ok());  // 302 -> 280: shared page 17, copied
  tw.Append(f, 40, 7);
  for (int l = 0; l < 3; ++l) tw.Decode({f, a}, l, c.tol);
  for (int l = 0; l < 3; ++l) {
    auto ga = rts[0]->Gather(f[0], l);
    auto gb = rts[1]->Gather(f[1], l);
    ASSERT_TRUE(ga.ok() && gb.ok()) << gb.status().ToString();
    EXPECT_EQ(ga->k, gb->k);
    EXPECT_EQ(ga->v, gb->v);
  }
  for (int i = 0; i < 2; ++i) {
    for (SeqId id : {a[i], f[i], p[i]}) ASSERT_TRUE(rts[i]->Free(id).ok());
    EXPECT_EQ(rts[i]->live_pages(), 0u);
  }
  }
}

// Speculative decoding on the GPU: blocks of drafts (AppendDraft) verified
// by one DecodeBlock call, a random prefix accepted and the rest rolled
// back, against the CPU backend doing the same. Blocks are ragged across the
// batch and cross page boundaries; some fill whole pages that are then
// rejected (their slots go free), some rollbacks end inside a held page. A
// draft page reaches the host only once accepted. Then both runtimes hold
// the same tokens, decode alike one token at a time, and one HBM small
// enough to evict (too small for a block's union: its blocks go in parts)
// gives the same bits as one holding everything for single tokens. Under
// shared block selection each block selects once for all its positions
// (each GQA mode), and each position attends its share.
TEST(CudaSequences, DraftBlocksMatchCpu) {
  struct Mode {
    SummaryDType sum;
    BlockSelection blocks;
    GqaMode gqa;
    int q_heads = 8;
  };
  for (const Mode m : {Mode{SummaryDType::kKv, BlockSelection::kPerPosition, GqaMode::kMax},
                       Mode{SummaryDType::kKv, BlockSelection::kPerPosition, GqaMode::kMean, 6},  // padded groups
                       Mode{SummaryDType::kKv, BlockSelection::kShared, GqaMode::kMax, 6},
                       Mode{SummaryDType::kE4M3, BlockSelection::kPerPosition, GqaMode::kMax},
                       Mode{SummaryDType::kKv, BlockSelection::kShared, GqaMode::kMax},
                       Mode{SummaryDType::kKv, BlockSelection::kShared, GqaMode::kMean},
                       Mode{SummaryDType::kE4M3, BlockSelection::kShared, GqaMode::kUnion}}) {
    SCOPED_TRACE(std::string(SummaryDTypeName(m.sum)) + " summaries, " + std::string(BlockSelectionName(m.blocks)) +
                 " " + std::string(GqaModeName(m.gqa)) + ", Hq " + std::to_string(m.q_heads));
    const Case c{DType::kF32, m.gqa, m.q_heads, 2, 1e-5, m.sum};
    Config all = MakeConfig(Backend::kCuda, c);
    all.policy.block_selection = m.blocks;
    Config small = all;
    small.hbm_bytes = 480 * std::size_t(2 * 16 * 64 * 4);  // staging 128, tails 18, held <= 54, lists: evicts
    // A shared block never goes in parts, and a shared union's bound (sink +
    // local + n * G * K pages a head) fills a list here: no small HBM for it.
    const bool tight = !(m.blocks == BlockSelection::kShared && m.gqa == GqaMode::kUnion);
    if (!tight) small.hbm_bytes = 0;
    QKV_CREATE_CUDA(gpu, all);
    QKV_CREATE_CUDA(second, small);
    Config host = MakeConfig(Backend::kCpu, c);
    host.policy.block_selection = m.blocks;
    auto cpu = Runtime::Create(host);
    ASSERT_TRUE(cpu.ok());
    Runtime* rts[3] = {cpu->get(), gpu.get(), second.get()};
    const Geometry& g = all.geometry;
    Twins tw({rts[0], rts[1], rts[2]}, g, c.dtype);
    const std::vector<std::vector<SeqId>> seqs = {tw.NewSeq(), tw.NewSeq(), tw.NewSeq()};
    tw.Append(seqs[0], 1000, 64);
    tw.Append(seqs[1], 40, 40);
    tw.Append(seqs[2], 1, 1);
    const std::size_t row = std::size_t(g.kv_heads) * g.head_dim, qrow = std::size_t(g.q_heads) * g.head_dim;
    const int64_t page_bytes = int64_t(g.page_bytes());
    std::mt19937 rng(5);
    int64_t rejected_full_pages = 0;
    for (int step = 0; step < 8; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      std::vector<int> blocks;
      int rows = 0;
      for (std::size_t b = 0; b < seqs.size(); ++b) blocks.push_back(step == 2 ? 33 : 1 + int(rng() % 20)), rows += blocks.back();
      std::vector<int64_t> before(seqs.size()), sealed_before(3);
      for (std::size_t b = 0; b < seqs.size(); ++b) before[b] = *rts[0]->Length(seqs[b][0], 0);
      // Bytes sealed so far: a seal counts once its copy has landed (after a wait).
      auto sealed = [&](int i) {
        EXPECT_TRUE(rts[i]->Synchronize().ok());
        return rts[i]->tier_stats().bytes_hbm_to_host;
      };
      for (int i = 0; i < 3; ++i) sealed_before[i] = sealed(i);
      for (int l = 0; l < g.layers; ++l) {
        const auto k = test::RandomNormal(std::size_t(rows) * row, 1000 * step + 10 * l);
        const auto v = test::RandomNormal(std::size_t(rows) * row, 1000 * step + 10 * l + 1);
        const auto q = test::RandomNormal(std::size_t(rows) * qrow, 1000 * step + 10 * l + 2);
        std::vector<std::vector<float>> outs(3, std::vector<float>(q.size(), -1.f));
        for (int i = 0; i < 3; ++i) {
          std::vector<SeqId> ids;
          int r = 0;
          for (std::size_t b = 0; b < seqs.size(); ++b) {
            ids.push_back(seqs[b][i]);
            const Status st = rts[i]->AppendDraft(seqs[b][i], l, k.data() + r * row, v.data() + r * row, blocks[b]);
            ASSERT_TRUE(st.ok()) << "runtime " << i << ": " << st.ToString();
            r += blocks[b];
          }
          const Status st = rts[i]->DecodeBlock(ids, blocks, l, q.data(), outs[i].data());
          ASSERT_TRUE(st.ok()) << "runtime " << i << ": " << st.ToString();
        }
        EXPECT_LE(test::RelL2Error(outs[1].data(), outs[0].data(), q.size()), c.tol) << "layer " << l;
        // The small HBM cannot hold a block's union: it verifies in several
        // launches, whose attention splits its rows differently (float order).
        EXPECT_LE(test::RelL2Error(outs[2].data(), outs[0].data(), q.size()), c.tol) << "layer " << l;
      }
      for (int i = 0; i < 3; ++i)
        EXPECT_EQ(sealed(i), sealed_before[i]) << "runtime " << i << " sealed a draft";
      std::vector<int64_t> after(seqs.size());
      for (std::size_t b = 0; b < seqs.size(); ++b) {
        const int reject = step == 2 ? 17 + int(b) : int(rng() % (blocks[b] + 1));
        const int64_t end = before[b] + blocks[b];
        rejected_full_pages += end / g.page_size - (end - reject) / g.page_size;
        for (int i = 0; i < 3; ++i) {
          ASSERT_TRUE(rts[i]->Rollback(seqs[b][i], reject).ok());
          ASSERT_TRUE(rts[i]->Accept(seqs[b][i]).ok());
        }
        after[b] = end - reject;
      }
      int64_t accepted_pages = 0;
      for (std::size_t b = 0; b < seqs.size(); ++b) accepted_pages += after[b] / g.page_size - before[b] / g.page_size;
      for (int i = 0; i < 3; ++i)
        EXPECT_EQ(sealed(i) - sealed_before[i], accepted_pages * g.layers * page_bytes)
            << "runtime " << i;
      for (int l = 0; l < g.layers; ++l) tw.Decode(seqs, l, c.tol);
    }
    EXPECT_GT(rejected_full_pages, 0) << "no rejected draft filled a page: the test shows little";
    if (tight) {
      EXPECT_GT(rts[2]->tier_stats().hbm_evictions, 0) << "the small HBM never evicted: the test shows little";
    }
    for (std::size_t b = 0; b < seqs.size(); ++b)
      for (int l = 0; l < g.layers; ++l) {
        const auto x = rts[0]->Gather(seqs[b][0], l), y = rts[1]->Gather(seqs[b][1], l), z = rts[2]->Gather(seqs[b][2], l);
        ASSERT_TRUE(x.ok() && y.ok() && z.ok());
        EXPECT_EQ(x->k, y->k);
        EXPECT_EQ(x->v, y->v);
        EXPECT_EQ(y->k, z->k);
        EXPECT_EQ(y->v, z->v);
      }
    for (int i = 0; i < 3; ++i) {
      for (const auto& s : seqs) ASSERT_TRUE(rts[i]->Free(s[i]).ok());
      EXPECT_EQ(rts[i]->live_pages(), 0u);
    }
  }
}

// The attention keeps per-row counters before its splits' partials: a batch
// of more rows than the call before it finds its extra counters where that
// call's partials were, and must still match the CPU backend.
TEST(CudaApi, ALargerBatchAfterASmallerOneMatchesCpu) {
  const Case c{DType::kF32, GqaMode::kMax, 8, 2, 1e-5};
  const Config cfg = MakeConfig(Backend::kCuda, c);
  QKV_CREATE_CUDA(gpu, cfg);
  auto cpu = Runtime::Create(MakeConfig(Backend::kCpu, c));
  ASSERT_TRUE(cpu.ok());
  Twins tw({cpu->get(), gpu.get()}, cfg.geometry, c.dtype);
  std::vector<std::vector<SeqId>> seqs;
  for (int i = 0; i < 40; ++i) {  // 80 rows: counters past the first 64 rows' 256 bytes
    seqs.push_back(tw.NewSeq());
    tw.Append(seqs.back(), 90 + 7 * i, 64);
  }
  for (int l = 0; l < cfg.geometry.layers; ++l) {
    tw.Decode(seqs, l, c.tol);
    tw.Decode({seqs[39]}, l, c.tol);
    tw.Decode(seqs, l, c.tol);
  }
}

// Device pointers in the model dtype give the same bits as the host API.
TEST(CudaApi, DevicePointersMatchHostApi) {
  const Case c{DType::kF16, GqaMode::kMax, 8, 2, 0};
  QKV_CREATE_CUDA(rt, MakeConfig(Backend::kCuda, c));
  const Geometry& g = rt->config().geometry;
  const std::size_t row = std::size_t(g.kv_heads) * g.head_dim, qn = std::size_t(g.q_heads) * g.head_dim;
  const int64_t n = 333;
  auto k = Rounded(test::RandomNormal(n * row, 7), c.dtype);
  auto v = Rounded(test::RandomNormal(n * row, 8), c.dtype);
  auto q = Rounded(test::RandomNormal(qn, 9), c.dtype);
  std::vector<__half> kh(k.size()), vh(v.size()), qh(q.size()), oh(qn);
  for (std::size_t i = 0; i < k.size(); ++i) kh[i] = __float2half_rn(k[i]), vh[i] = __float2half_rn(v[i]);
  for (std::size_t i = 0; i < q.size(); ++i) qh[i] = __float2half_rn(q[i]);
  void *dk, *dv, *dq, *dout;
  ASSERT_EQ(cudaMalloc(&dk, kh.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dv, vh.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dq, qh.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dout, qn * 2), cudaSuccess);
  cudaMemcpy(dk, kh.data(), kh.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dv, vh.data(), vh.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dq, qh.data(), qh.size() * 2, cudaMemcpyHostToDevice);
  auto s1 = rt->CreateSequence(), s2 = rt->CreateSequence();
  for (int l = 0; l < g.layers; ++l) {
    ASSERT_TRUE(rt->Append(*s1, l, k.data(), v.data(), n).ok());
    ASSERT_TRUE(rt->AppendDevice(*s2, l, dk, dv, n).ok());
  }
  for (int l = 0; l < g.layers; ++l) {
    std::vector<float> out(qn);
    ASSERT_TRUE(rt->DecodeAttention(std::vector<SeqId>{*s1}, l, q.data(), out.data()).ok());
    ASSERT_TRUE(rt->DecodeAttentionDevice(std::vector<SeqId>{*s2}, l, dq, dout).ok());
    ASSERT_TRUE(rt->Synchronize().ok());  // the call may return before its work is done
    cudaMemcpy(oh.data(), dout, qn * 2, cudaMemcpyDeviceToHost);
    for (std::size_t i = 0; i < qn; ++i) ASSERT_EQ(__half2float(oh[i]), out[i]) << "layer " << l << " elem " << i;
  }
  cudaFree(dk), cudaFree(dv), cudaFree(dq), cudaFree(dout);
  auto cpu = Runtime::Create(MakeConfig(Backend::kCpu, c));
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ((*cpu)->AppendDevice(1, 0, nullptr, nullptr, 1).code(), Code::kFailedPrecondition);
}

// Draft blocks through the device-pointer calls (AppendDraftDevice,
// DecodeBlockDevice, enqueued without waiting) give the host calls' outputs
// bit for bit, block after block with rollbacks between them, in two
// sequences whose blocks differ in length.
TEST(CudaApi, DeviceBlocksMatchHostBlocks) {
  const Case c{DType::kF16, GqaMode::kMax, 8, 2, 0};
  QKV_CREATE_CUDA(host, MakeConfig(Backend::kCuda, c));
  QKV_CREATE_CUDA(dev, MakeConfig(Backend::kCuda, c));
  const Geometry& g = host->config().geometry;
  const std::size_t row = std::size_t(g.kv_heads) * g.head_dim, qrow = std::size_t(g.q_heads) * g.head_dim;
  const int64_t lens[2] = {1000, 37};
  std::vector<SeqId> hs, ds;
  for (int b = 0; b < 2; ++b) {
    hs.push_back(*host->CreateSequence());
    ds.push_back(*dev->CreateSequence());
    for (int l = 0; l < g.layers; ++l) {
      const auto k = Rounded(test::RandomNormal(lens[b] * row, 10 * b + l), c.dtype);
      const auto v = Rounded(test::RandomNormal(lens[b] * row, 10 * b + l + 100), c.dtype);
      ASSERT_TRUE(host->Append(hs[b], l, k.data(), v.data(), lens[b]).ok());
      ASSERT_TRUE(dev->Append(ds[b], l, k.data(), v.data(), lens[b]).ok());
    }
  }
  const auto stream = static_cast<cudaStream_t>(dev->cuda_stream());
  const int kMaxRows = 2 * 17;
  void *dk, *dv, *dq, *dout;
  ASSERT_EQ(cudaMalloc(&dk, kMaxRows * row * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dv, kMaxRows * row * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dq, kMaxRows * qrow * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dout, std::size_t(g.layers) * kMaxRows * qrow * 2), cudaSuccess);
  auto up = [&](void* dst, const std::vector<float>& x) {
    std::vector<__half> h(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) h[i] = __float2half_rn(x[i]);
    ASSERT_EQ(cudaMemcpyAsync(dst, h.data(), h.size() * 2, cudaMemcpyHostToDevice, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);  // (h leaves scope)
  };
  std::mt19937 rng(11);
  for (int step = 0; step < 6; ++step) {
    SCOPED_TRACE("block " + std::to_string(step));
    const std::vector<int> blocks = {1 + int(rng() % 17), 1 + int(rng() % 5)};
    const int rows = blocks[0] + blocks[1];
    std::vector<std::vector<float>> want(g.layers);
    for (int l = 0; l < g.layers; ++l) {
      const auto k = Rounded(test::RandomNormal(std::size_t(rows) * row, 500 + 10 * step + l), c.dtype);
      const auto v = Rounded(test::RandomNormal(std::size_t(rows) * row, 700 + 10 * step + l), c.dtype);
      const auto q = Rounded(test::RandomNormal(std::size_t(rows) * qrow, 900 + 10 * step + l), c.dtype);
      want[l].resize(q.size());
      up(dk, k);
      up(dv, v);
      up(dq, q);
      for (int b = 0, r = 0; b < 2; r += blocks[b], ++b) {
        ASSERT_TRUE(host->AppendDraft(hs[b], l, k.data() + r * row, v.data() + r * row, blocks[b]).ok());
        ASSERT_TRUE(dev->AppendDraftDevice(ds[b], l, static_cast<__half*>(dk) + r * row,
                                           static_cast<__half*>(dv) + r * row, blocks[b])
                        .ok());
      }
      ASSERT_TRUE(host->DecodeBlock(hs, blocks, l, q.data(), want[l].data()).ok());
      const Status st = dev->DecodeBlockDevice(ds, blocks, l, dq, static_cast<__half*>(dout) + l * kMaxRows * qrow);
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
    ASSERT_TRUE(dev->Synchronize().ok());
    std::vector<__half> got(std::size_t(g.layers) * kMaxRows * qrow);
    ASSERT_EQ(cudaMemcpy(got.data(), dout, got.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int l = 0; l < g.layers; ++l)
      for (std::size_t i = 0; i < want[l].size(); ++i)
        ASSERT_EQ(__half2float(got[l * kMaxRows * qrow + i]), want[l][i]) << "layer " << l << " elem " << i;
    for (int b = 0; b < 2; ++b) {  // keep a random prefix of each block
      const int rejected = int(rng() % blocks[b]);
      ASSERT_TRUE(host->Rollback(hs[b], rejected).ok());
      ASSERT_TRUE(dev->Rollback(ds[b], rejected).ok());
      ASSERT_TRUE(host->Accept(hs[b]).ok());
      ASSERT_TRUE(dev->Accept(ds[b]).ok());
    }
  }
  cudaFree(dk), cudaFree(dv), cudaFree(dq), cudaFree(dout);
  const int one = 1;
  EXPECT_EQ(dev->DecodeBlockDevice(ds, std::vector<int>{one}, 0, dq, dout).code(), Code::kInvalidArgument);
  auto cpu = Runtime::Create(MakeConfig(Backend::kCpu, c));
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ((*cpu)->AppendDraftDevice(1, 0, nullptr, nullptr, 1).code(), Code::kFailedPrecondition);
}

// Device-pointer decode calls enqueued back to back — each layer's inputs
// uploaded on the runtime's stream into the same buffers the previous layer
// read, no wait until the step's end — give the host calls' outputs bit for
// bit, with a small HBM (misses, evictions) and CUDA graphs on.
TEST(CudaApi, EnqueuedStepsMatchHostCalls) {
  const Case c{DType::kF16, GqaMode::kMax, 8, 2, 0};
  Config cfg = MakeConfig(Backend::kCuda, c);
  cfg.hbm_bytes = 1100 * 2 * 16 * 64 * 2;
  QKV_CREATE_CUDA(host, cfg);
  QKV_CREATE_CUDA(dev, cfg);
  const Geometry& g = cfg.geometry;
  const auto stream = static_cast<cudaStream_t>(dev->cuda_stream());
  ASSERT_NE(stream, nullptr);
  const int B = 3;
  const std::size_t row = std::size_t(g.kv_heads) * g.head_dim, qn = std::size_t(B) * g.q_heads * g.head_dim;
  const int64_t lens[B] = {4099, 17, 700};
  std::vector<SeqId> hs, ds;
  for (int b = 0; b < B; ++b) {
    hs.push_back(*host->CreateSequence());
    ds.push_back(*dev->CreateSequence());
    for (int l = 0; l < g.layers; ++l) {
      const auto k = Rounded(test::RandomNormal(lens[b] * row, 100 + 10 * b + l), c.dtype);
      const auto v = Rounded(test::RandomNormal(lens[b] * row, 200 + 10 * b + l), c.dtype);
      ASSERT_TRUE(host->Append(hs[b], l, k.data(), v.data(), lens[b]).ok());
      ASSERT_TRUE(dev->Append(ds[b], l, k.data(), v.data(), lens[b]).ok());
    }
  }
  // Pinned inputs for every call of a step, one device buffer each for k, v and q.
  const int steps = 20, calls = g.layers;
  __half *hk, *hv, *hq, *dk, *dv, *dq, *dout;
  ASSERT_EQ(cudaMallocHost(&hk, calls * B * row * 2), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(&hv, calls * B * row * 2), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(&hq, calls * qn * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dk, B * row * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dv, B * row * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dq, qn * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dout, calls * qn * 2), cudaSuccess);
  std::vector<__half> got(calls * qn);
  uint64_t seed = 1000;
  for (int step = 0; step < steps; ++step) {
    std::vector<std::vector<float>> want(calls, std::vector<float>(qn));
    for (int l = 0; l < calls; ++l) {
      const auto k = Rounded(test::RandomNormal(B * row, seed++), c.dtype);
      const auto v = Rounded(test::RandomNormal(B * row, seed++), c.dtype);
      const auto q = Rounded(test::RandomNormal(qn, seed++), c.dtype);
      for (int b = 0; b < B; ++b)
        ASSERT_TRUE(host->Append(hs[b], l, k.data() + b * row, v.data() + b * row, 1).ok());
      ASSERT_TRUE(host->DecodeAttention(hs, l, q.data(), want[l].data()).ok());
      for (std::size_t i = 0; i < B * row; ++i)
        hk[l * B * row + i] = __float2half_rn(k[i]), hv[l * B * row + i] = __float2half_rn(v[i]);
      for (std::size_t i = 0; i < qn; ++i) hq[l * qn + i] = __float2half_rn(q[i]);
    }
    for (int l = 0; l < calls; ++l) {
      ASSERT_EQ(cudaMemcpyAsync(dk, hk + l * B * row, B * row * 2, cudaMemcpyHostToDevice, stream), cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(dv, hv + l * B * row, B * row * 2, cudaMemcpyHostToDevice, stream), cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(dq, hq + l * qn, qn * 2, cudaMemcpyHostToDevice, stream), cudaSuccess);
      for (int b = 0; b < B; ++b) ASSERT_TRUE(dev->AppendDevice(ds[b], l, dk + b * row, dv + b * row, 1).ok());
      ASSERT_TRUE(dev->DecodeAttentionDevice(ds, l, dq, dout + l * qn).ok());
    }
    ASSERT_TRUE(dev->Synchronize().ok());
    ASSERT_EQ(cudaMemcpy(got.data(), dout, got.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int l = 0; l < calls; ++l)
      for (std::size_t i = 0; i < qn; ++i)
        ASSERT_EQ(__half2float(got[l * qn + i]), want[l][i]) << "step " << step << " layer " << l << " elem " << i;
  }
  const TierStats a = host->tier_stats(), b = dev->tier_stats();
  EXPECT_GT(b.hbm_misses, 0);
  EXPECT_EQ(a.hbm_hits, b.hbm_hits);
  EXPECT_EQ(a.hbm_misses, b.hbm_misses);
  EXPECT_EQ(a.bytes_host_to_hbm, b.bytes_host_to_hbm);
  cudaFreeHost(hk), cudaFreeHost(hv), cudaFreeHost(hq);
  cudaFree(dk), cudaFree(dv), cudaFree(dq), cudaFree(dout);
}

// With a disk tier under `deadline`, device-pointer calls still return once
// enqueued: the mover learns their selections and cold misses one call later,
// and a host home a queued kernel may read is not reused (demotions,
// promotions and seals run meanwhile). Each layer's query is the same every
// step, so selections settle and most steps skip nothing; such a step's
// outputs equal an in-memory runtime's bit for bit.
TEST(CudaApi, EnqueuedStepsWithADiskTier) {
  const Case c{DType::kF16, GqaMode::kMax, 8, 2, 0};
  const auto dir = std::filesystem::temp_directory_path() / ("questkv_cuda_async_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  Config mem = MakeConfig(Backend::kCuda, c);
  Config tiered = WithDiskTier(mem, dir, ColdMissPolicy::kDeadline);
  tiered.host_bytes = 400 * 4096;
  {
    QKV_CREATE_CUDA(ref, mem);
    QKV_CREATE_CUDA(dev, tiered);
    const Geometry& g = mem.geometry;
    const auto stream = static_cast<cudaStream_t>(dev->cuda_stream());
    const int B = 3;
    const std::size_t row = std::size_t(g.kv_heads) * g.head_dim, qn = std::size_t(B) * g.q_heads * g.head_dim;
    const int64_t lens[B] = {4099, 17, 700};
    std::vector<SeqId> rs, ds;
    for (int b = 0; b < B; ++b) {
      rs.push_back(*ref->CreateSequence());
      ds.push_back(*dev->CreateSequence());
      for (int l = 0; l < g.layers; ++l) {
        const auto k = Rounded(test::RandomNormal(lens[b] * row, 300 + 10 * b + l), c.dtype);
        const auto v = Rounded(test::RandomNormal(lens[b] * row, 400 + 10 * b + l), c.dtype);
        ASSERT_TRUE(ref->Append(rs[b], l, k.data(), v.data(), lens[b]).ok());
        ASSERT_TRUE(dev->Append(ds[b], l, k.data(), v.data(), lens[b]).ok());
      }
    }
    const int steps = 40, calls = g.layers;
    std::vector<std::vector<float>> q(calls);
    __half *hk, *hv, *hq, *dk, *dv, *dq, *dout;
    ASSERT_EQ(cudaMallocHost(&hk, calls * B * row * 2), cudaSuccess);
    ASSERT_EQ(cudaMallocHost(&hv, calls * B * row * 2), cudaSuccess);
    ASSERT_EQ(cudaMallocHost(&hq, calls * qn * 2), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dk, B * row * 2), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dv, B * row * 2), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dq, qn * 2), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dout, calls * qn * 2), cudaSuccess);
    for (int l = 0; l < calls; ++l) {
      q[l] = Rounded(test::RandomNormal(qn, 500 + l), c.dtype);
      for (std::size_t i = 0; i < qn; ++i) hq[l * qn + i] = __float2half_rn(q[l][i]);
    }
    std::vector<__half> got(calls * qn);
    uint64_t seed = 2000;
    int compared = 0;
    int64_t skipped_before = 0;
    for (int step = 0; step < steps; ++step) {
      std::vector<std::vector<float>> want(calls, std::vector<float>(qn));
      for (int l = 0; l < calls; ++l) {
        const auto k = Rounded(test::RandomNormal(B * row, seed++), c.dtype);
        const auto v = Rounded(test::RandomNormal(B * row, seed++), c.dtype);
        for (int b = 0; b < B; ++b)
          ASSERT_TRUE(ref->Append(rs[b], l, k.data() + b * row, v.data() + b * row, 1).ok());
        ASSERT_TRUE(ref->DecodeAttention(rs, l, q[l].data(), want[l].data()).ok());
        for (std::size_t i = 0; i < B * row; ++i)
          hk[l * B * row + i] = __float2half_rn(k[i]), hv[l * B * row + i] = __float2half_rn(v[i]);
      }
      for (int l = 0; l < calls; ++l) {
        ASSERT_EQ(cudaMemcpyAsync(dk, hk + l * B * row, B * row * 2, cudaMemcpyHostToDevice, stream), cudaSuccess);
        ASSERT_EQ(cudaMemcpyAsync(dv, hv + l * B * row, B * row * 2, cudaMemcpyHostToDevice, stream), cudaSuccess);
        ASSERT_EQ(cudaMemcpyAsync(dq, hq + l * qn, qn * 2, cudaMemcpyHostToDevice, stream), cudaSuccess);
        for (int b = 0; b < B; ++b) ASSERT_TRUE(dev->AppendDevice(ds[b], l, dk + b * row, dv + b * row, 1).ok());
        const Status st = dev->DecodeAttentionDevice(ds, l, dq, dout + l * qn);
        ASSERT_TRUE(st.ok()) << "step " << step << " layer " << l << ": " << st.ToString();
      }
      ASSERT_TRUE(dev->Synchronize().ok());
      const int64_t skipped = dev->tier_stats().pages_skipped;
      if (skipped != skipped_before) {  // attended without a page: not comparable
        skipped_before = skipped;
        continue;
      }
      ++compared;
      ASSERT_EQ(cudaMemcpy(got.data(), dout, got.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
      for (int l = 0; l < calls; ++l)
        for (std::size_t i = 0; i < qn; ++i)
          ASSERT_EQ(__half2float(got[l * qn + i]), want[l][i]) << "step " << step << " layer " << l << " elem " << i;
    }
    const TierStats t = dev->tier_stats();
    std::printf("steps compared %d of %d; skipped %lld of %lld cold misses; host->hbm %lld B, host->disk %lld B, "
                "disk->host %lld B\n",
                compared, steps, (long long)t.pages_skipped, (long long)t.cold_misses, (long long)t.bytes_host_to_hbm,
                (long long)t.bytes_host_to_disk, (long long)t.bytes_disk_to_host);
    EXPECT_GE(compared, steps / 2);
    EXPECT_GT(t.bytes_host_to_hbm, 0) << "no host home was read";
    EXPECT_GT(t.bytes_host_to_disk, 0) << "nothing was demoted";
    cudaFreeHost(hk), cudaFreeHost(hv), cudaFreeHost(hq);
    cudaFree(dk), cudaFree(dv), cudaFree(dq), cudaFree(dout);
  }
  std::filesystem::remove_all(dir);
}

// A prefill sealing more pages than the host holds runs in pieces; with no
// disk to demote to, one refused part-way is cut back whole (the old partial
// tail too), and the sequence decodes as an all-in-HBM twin that never saw it.
TEST(CudaApi, ALongAppendRefusedPartWayLeavesTheSequenceAsItWas) {
  const Case c{DType::kF16, GqaMode::kMax, 8, 2, 0};
  Config mem = MakeConfig(Backend::kCuda, c);
  Config small = mem;
  small.host_bytes = 40 * 8192;  // 40 homes of [2][Hkv][S][D] f16: pieces of 20 pages
  QKV_CREATE_CUDA(ref, mem);
  QKV_CREATE_CUDA(rt, small);
  const Geometry& g = mem.geometry;
  const std::size_t row = std::size_t(g.kv_heads) * g.head_dim;
  const SeqId s = *rt->CreateSequence(), r = *ref->CreateSequence();
  const auto k0 = Rounded(test::RandomNormal(37 * row, 1), c.dtype), v0 = Rounded(test::RandomNormal(37 * row, 2), c.dtype);
  ASSERT_TRUE(rt->Append(s, 1, k0.data(), v0.data(), 37).ok());
  ASSERT_TRUE(ref->Append(r, 1, k0.data(), v0.data(), 37).ok());
  const TierStats before = rt->tier_stats();
  const auto k = Rounded(test::RandomNormal(1000 * row, 3), c.dtype), v = Rounded(test::RandomNormal(1000 * row, 4), c.dtype);
  const Status refused = rt->Append(s, 1, k.data(), v.data(), 1000);  // 62 pages to seal
  ASSERT_EQ(refused.code(), Code::kResourceExhausted) << refused.ToString();
  EXPECT_GT(rt->tier_stats().bytes_hbm_to_host, before.bytes_hbm_to_host) << "no piece ran before the refusal";
  EXPECT_EQ(*rt->Length(s, 1), 37);
  EXPECT_EQ(rt->live_pages(), 3u);
  EXPECT_EQ(rt->tier_stats().host_used_bytes, before.host_used_bytes);
  ASSERT_TRUE(rt->Append(s, 1, k.data(), v.data(), 300).ok());  // 20 pages sealed: fits
  ASSERT_TRUE(ref->Append(r, 1, k.data(), v.data(), 300).ok());
  std::vector<float> q(std::size_t(g.q_heads) * g.head_dim), o1(q.size()), o2(q.size());
  const SeqId ss[] = {s}, rs[] = {r};
  for (int step = 0; step < 3; ++step) {
    q = Rounded(test::RandomNormal(q.size(), 70 + step), c.dtype);
    ASSERT_TRUE(ref->DecodeAttention(rs, 1, q.data(), o1.data()).ok());
    ASSERT_TRUE(rt->DecodeAttention(ss, 1, q.data(), o2.data()).ok());
    ASSERT_EQ(o1, o2) << "step " << step;
  }
  ASSERT_TRUE(rt->Free(s).ok());
  EXPECT_EQ(rt->live_pages(), 0u);
  EXPECT_EQ(rt->tier_stats().host_used_bytes, 0u);
}

// Appends that fill pages return before their seal copies land. Sequences
// freed right after such appends, their homes taken at once by the next
// sequence's seals (40 host homes, no disk, each round sealing 36 pages):
// the next sequence's pages, read right after their appends (Gather), hold
// their own bytes, none lost to a home reused too soon.
TEST(CudaTiers, HomesFreedWhileTheirSealsLandServeTheNextSequence) {
  const Case c{DType::kF16, GqaMode::kMax, 8, 2, 0};
  Config cfg = MakeConfig(Backend::kCuda, c);
  cfg.host_bytes = 40 * 8192;  // homes of [2][Hkv][S][D] f16
  QKV_CREATE_CUDA(rt, cfg);
  const Geometry& g = cfg.geometry;
  const std::size_t row = std::size_t(g.kv_heads) * g.head_dim;
  const int64_t n = 12 * 16 + 5;  // 12 full pages a layer
  auto heads_major = [&](const std::vector<float>& x) {  // [T][Hkv][D] -> [Hkv][T][D]
    std::vector<float> y(x.size());
    for (int64_t t = 0; t < n; ++t)
      for (int h = 0; h < g.kv_heads; ++h)
        std::copy_n(x.data() + (t * g.kv_heads + h) * g.head_dim, g.head_dim,
                    y.data() + (h * n + t) * g.head_dim);
    return y;
  };
  for (int round = 0; round < 6; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const SeqId s = *rt->CreateSequence();
    std::vector<std::vector<float>> ks, vs;
    for (int l = 0; l < g.layers; ++l) {
      ks.push_back(Rounded(test::RandomNormal(n * row, 700 + 10 * round + l), c.dtype));
      vs.push_back(Rounded(test::RandomNormal(n * row, 800 + 10 * round + l), c.dtype));
      for (int64_t t = 0; t < n; t += 7) {
        const int64_t m = std::min<int64_t>(7, n - t);
        const Status st = rt->Append(s, l, ks[l].data() + t * row, vs[l].data() + t * row, m);
        ASSERT_TRUE(st.ok()) << "layer " << l << " token " << t << ": " << st.ToString();
      }
    }
    for (int l = 0; l < g.layers && round % 2 == 0; ++l) {  // odd rounds: freed at once
      auto got = rt->Gather(s, l);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      EXPECT_EQ(got->k, heads_major(ks[l])) << "layer " << l;
      EXPECT_EQ(got->v, heads_major(vs[l])) << "layer " << l;
    }
    ASSERT_TRUE(rt->Free(s).ok());
  }
  EXPECT_EQ(rt->live_pages(), 0u);
  ASSERT_TRUE(rt->Synchronize().ok());
  EXPECT_EQ(rt->tier_stats().host_used_bytes, 0u);
  EXPECT_EQ(rt->tier_stats().bytes_hbm_to_host, 6 * 36 * 8192);
}

// Bad input: clear errors, and the runtime keeps serving.
TEST(CudaErrors, BadInputLeavesTheRuntimeConsistent) {
  Case c{DType::kF16, GqaMode::kMax, 8, 2, 0};
  Config bad = MakeConfig(Backend::kCuda, c);
  bad.geometry.head_dim = 96;
  auto r = Runtime::Create(bad);
  if (r.status().code() == Code::kFailedPrecondition || r.status().code() == Code::kUnimplemented)
    GTEST_SKIP() << r.status().ToString();
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << r.status().ToString();

  Config small = MakeConfig(Backend::kCuda, c);
  small.hbm_bytes = 400 * 2 * 16 * 64 * 2;  // room for the staging, tails and sparse lists, not a long dense layer
  QKV_CREATE_CUDA(rt, small);
  Twins tw({rt.get()}, small.geometry, c.dtype);
  const auto longer = tw.NewSeq();
  const auto shorter = tw.NewSeq();
  tw.Append(longer, 16 * 300, 1000);
  tw.Append(shorter, 100, 100);
  std::vector<float> q(2 * 8 * 64, 0.5f), out(q.size());
  // A sequence twice in a batch: its two rows, each as a call of its own gives.
  {
    const SeqId dup[2] = {shorter[0], shorter[0]};
    const auto q2 = test::RandomNormal(q.size(), 77);
    std::vector<float> both(q.size()), alone(q.size() / 2);
    ASSERT_TRUE(rt->DecodeAttention(dup, 1, q2.data(), both.data()).ok());
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(rt->DecodeAttention(std::span<const SeqId>(dup, 1), 1, q2.data() + r * alone.size(), alone.data()).ok());
      EXPECT_EQ(std::memcmp(alone.data(), both.data() + r * alone.size(), alone.size() * sizeof(float)), 0) << "row " << r;
    }
  }
  const SeqId one[1] = {longer[0]};
  EXPECT_EQ(rt->DecodeAttention(one, 0, q.data(), out.data()).code(), Code::kResourceExhausted);  // dense layer
  const SeqId unknown[1] = {999};
  EXPECT_EQ(rt->DecodeAttention(unknown, 1, q.data(), out.data()).code(), Code::kNotFound);
  // Still serving: sparse layers of both, the dense layer of the short one.
  tw.Decode({longer, shorter}, 1, 0);
  tw.Decode({shorter}, 0, 0);
  ASSERT_TRUE(rt->Free(longer[0]).ok());
  ASSERT_TRUE(rt->Free(shorter[0]).ok());
  EXPECT_EQ(rt->live_pages(), 0u);
  EXPECT_EQ(rt->tier_stats().hbm_used_bytes, uint64_t(128) * 2 * 16 * 64 * 2);  // the staging slots only
}

}  // namespace
}  // namespace questkv
