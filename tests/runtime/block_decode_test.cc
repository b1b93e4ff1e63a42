// DecodeBlock (a block of draft tokens per sequence verified in one call)
// against its definition: the same tokens appended one at a time on a twin
// runtime, each position decoded right after its own append. Ragged blocks
// crossing page boundaries, acceptance of a prefix with rollback of the rest
// (the tail summary must be what appending only the accepted tokens gives),
// forks between blocks, and a tiered runtime.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "questkv/runtime.h"
#include "tests/testing/reference.h"
#include "tiers/io_backend.h"

namespace questkv {
namespace {

constexpr int kLayers = 2, kHq = 4, kHkv = 2, kD = 16, kS = 4;
constexpr std::size_t kRow = std::size_t(kHkv) * kD, kQRow = std::size_t(kHq) * kD;

Config Base() {
  Config c;
  c.geometry.layers = kLayers, c.geometry.q_heads = kHq, c.geometry.kv_heads = kHkv, c.geometry.head_dim = kD;
  c.geometry.page_size = kS;
  c.policy.token_budget = 6 * kS;
  c.policy.sink_pages = 1;
  c.policy.local_pages = 2;
  c.policy.dense_layers = {0};
  c.max_pages = 2048;
  return c;
}

std::unique_ptr<Runtime> Make(const Config& c, std::unique_ptr<IoBackend> io = nullptr) {
  auto rt = io ? Runtime::Create(c, std::move(io)) : Runtime::Create(c);
  EXPECT_TRUE(rt.ok()) << rt.status().ToString();
  return std::move(*rt);
}

class BlockDecode : public ::testing::Test {
 protected:
  // Appends `n` tokens (from a seeded stream) to `seq` of `rt` in every layer.
  void AppendAll(Runtime& rt, SeqId seq, int64_t n, uint64_t seed) {
    for (int l = 0; l < kLayers; ++l) {
      auto k = test::RandomNormal(n * kRow, seed + 17 * l), v = test::RandomNormal(n * kRow, seed + 17 * l + 1);
      ASSERT_TRUE(rt.Append(seq, l, k.data(), v.data(), n).ok());
    }
  }

  // One verify step: every sequence gets a block of blocks[b] tokens; `a`
  // takes each layer's blocks in one append and one DecodeBlock, `b` one
  // token at a time with a single-token decode after each. Outputs must be
  // the same bits.
  void VerifyStep(Runtime& a, const std::vector<SeqId>& sa, Runtime& b, const std::vector<SeqId>& sb,
                  const std::vector<int>& blocks, uint64_t seed) {
    int rows = 0;
    for (int n : blocks) rows += n;
    for (int l = 0; l < kLayers; ++l) {
      auto k = test::RandomNormal(std::size_t(rows) * kRow, seed + 100 * l);
      auto v = test::RandomNormal(std::size_t(rows) * kRow, seed + 100 * l + 1);
      auto q = test::RandomNormal(std::size_t(rows) * kQRow, seed + 100 * l + 2);
      std::vector<float> want(q.size()), got(q.size());
      int r = 0;
      for (std::size_t s = 0; s < blocks.size(); ++s) {
        ASSERT_TRUE(a.Append(sa[s], l, k.data() + r * kRow, v.data() + r * kRow, blocks[s]).ok());
        for (int i = 0; i < blocks[s]; ++i, ++r) {
          ASSERT_TRUE(b.Append(sb[s], l, k.data() + r * kRow, v.data() + r * kRow, 1).ok());
          SeqId one[] = {sb[s]};
          Status st = b.DecodeAttention(one, l, q.data() + r * kQRow, want.data() + r * kQRow);
          ASSERT_TRUE(st.ok()) << st.ToString();
        }
      }
      Status st = a.DecodeBlock(sa, blocks, l, q.data(), got.data());
      ASSERT_TRUE(st.ok()) << st.ToString();
      ASSERT_EQ(got, want) << "layer " << l;
    }
  }

  // The summary of the tail page of `seq` in `rt`, layer `l`.
  std::vector<float> TailSummary(Runtime& rt, SeqId seq, int l) {
    auto pages = rt.Pages(seq, l);
    EXPECT_TRUE(pages.ok());
    return *rt.Summary(pages->back());
  }
};

TEST_F(BlockDecode, EqualsOneTokenAtATimeAndRollbackLeavesTheAcceptedState) {
  auto a = Make(Base()), b = Make(Base());
  std::vector<SeqId> sa, sb;
  const std::vector<int64_t> prefill = {37, 50, 9};
  for (std::size_t s = 0; s < prefill.size(); ++s) {
    sa.push_back(*a->CreateSequence());
    sb.push_back(*b->CreateSequence());
    AppendAll(*a, sa[s], prefill[s], 1000 * s);
    AppendAll(*b, sb[s], prefill[s], 1000 * s);
  }
  std::mt19937 rng(7);
  for (int step = 0; step < 12; ++step) {
    std::vector<int> blocks;
    for (std::size_t s = 0; s < sa.size(); ++s) blocks.push_back(1 + int(rng() % 8));  // ragged, across pages
    SCOPED_TRACE("step " + std::to_string(step));
    VerifyStep(*a, sa, *b, sb, blocks, 5000 + 97 * step);
    if (HasFatalFailure()) return;
    // Accept a prefix of each block, roll back the rest, on both.
    for (std::size_t s = 0; s < sa.size(); ++s) {
      const int reject = int(rng() % (blocks[s] + 1));
      ASSERT_TRUE(a->Rollback(sa[s], reject).ok());
      ASSERT_TRUE(b->Rollback(sb[s], reject).ok());
      for (int l = 0; l < kLayers; ++l) {
        ASSERT_EQ(*a->Length(sa[s], l), *b->Length(sb[s], l));
        ASSERT_EQ(TailSummary(*a, sa[s], l), TailSummary(*b, sb[s], l)) << "sequence " << s << " layer " << l;
      }
    }
  }
  // The accepted state is what appending only the accepted tokens gives:
  // every page's K/V and the tail's summary equal a fresh copy's.
  auto fresh = Make(Base());
  for (std::size_t s = 0; s < sa.size(); ++s) {
    const SeqId f = *fresh->CreateSequence();
    for (int l = 0; l < kLayers; ++l) {
      const DenseView view = *a->Gather(sa[s], l);
      std::vector<float> k(std::size_t(view.tokens) * kRow), v(k.size());
      for (int t = 0; t < view.tokens; ++t)
        for (int h = 0; h < kHkv; ++h)
          for (int d = 0; d < kD; ++d) {
            k[(std::size_t(t) * kHkv + h) * kD + d] = view.k[(std::size_t(h) * view.tokens + t) * kD + d];
            v[(std::size_t(t) * kHkv + h) * kD + d] = view.v[(std::size_t(h) * view.tokens + t) * kD + d];
          }
      ASSERT_TRUE(fresh->Append(f, l, k.data(), v.data(), view.tokens).ok());
      EXPECT_EQ(TailSummary(*a, sa[s], l), TailSummary(*fresh, f, l)) << "sequence " << s << " layer " << l;
    }
  }
  for (SeqId s : sa) ASSERT_TRUE(a->Free(s).ok());
  EXPECT_EQ(a->live_pages(), 0u);
}

TEST_F(BlockDecode, ForksBetweenBlocksAndATieredRuntimeGiveTheSameBits) {
  Config tiny = Base();
  tiny.hbm_bytes = 10 * tiny.geometry.page_bytes();
  tiny.host_bytes = 12 * 4096;
  tiny.disk_dir = ::testing::TempDir() + "questkv-block-disk";  // names only for the memory backend
  tiny.disk_bytes = 4096ull * 2048;
  auto a = Make(tiny, MakeMemoryBackend(8, /*reorder_seed=*/5)), b = Make(Base());
  std::vector<SeqId> sa = {*a->CreateSequence()}, sb = {*b->CreateSequence()};
  AppendAll(*a, sa[0], 150, 3);
  AppendAll(*b, sb[0], 150, 3);
  VerifyStep(*a, sa, *b, sb, {6}, 11);
  // A fork keeps the whole block; the parent rejects four of its tokens.
  sa.push_back(*a->Fork(sa[0]));
  sb.push_back(*b->Fork(sb[0]));
  ASSERT_TRUE(a->Rollback(sa[0], 4).ok());
  ASSERT_TRUE(b->Rollback(sb[0], 4).ok());
  for (int step = 0; step < 6; ++step) {
    VerifyStep(*a, sa, *b, sb, {1 + step % 3, 4 - step % 4}, 300 + step);
    if (HasFatalFailure()) return;
  }
  EXPECT_GT(a->tier_stats().bytes_disk_to_host, 0) << "the tiered runtime never read from disk";
}

TEST_F(BlockDecode, BadBlocksAreErrorsAndChangeNothing) {
  auto a = Make(Base());
  const SeqId s = *a->CreateSequence();
  AppendAll(*a, s, 10, 1);
  std::vector<float> q(3 * kQRow), out(q.size());
  const SeqId one[] = {s};
  EXPECT_EQ(a->DecodeBlock(one, std::vector<int>{0}, 1, q.data(), out.data()).code(), Code::kOutOfRange);
  EXPECT_EQ(a->DecodeBlock(one, std::vector<int>{11}, 1, q.data(), out.data()).code(), Code::kOutOfRange);
  EXPECT_EQ(a->DecodeBlock(one, std::vector<int>{1, 1}, 1, q.data(), out.data()).code(), Code::kInvalidArgument);
  EXPECT_EQ(a->DecodeBlock(one, std::vector<int>{3}, 1, nullptr, out.data()).code(), Code::kInvalidArgument);
  EXPECT_EQ(a->DecodeBlock(one, std::vector<int>{3}, 5, q.data(), out.data()).code(), Code::kOutOfRange);
  EXPECT_EQ(*a->Length(s, 1), 10);
  EXPECT_TRUE(a->DecodeBlock(one, std::vector<int>{3}, 1, q.data(), out.data()).ok());
}

// BlockSelection::kShared against a plain model of its definition, built
// from the gathered K/V: each page's key box, scored with every position's
// and group head's query, aggregated (max or mean) per KV head, sink and
// local pages of the whole list plus the top-K (ties to the lower page);
// each position then attends, causally, the selected pages it can see.
std::vector<float> SharedBlockReference(const DenseView& view, int n, const float* q, int page_budget,
                                        const SelectionPolicy& pol, bool dense_layer) {
  const int T = view.tokens, P = (T + kS - 1) / kS, G = kHq / kHkv;
  std::vector<float> out(std::size_t(n) * kQRow);
  for (int h = 0; h < kHkv; ++h) {
    const float* k = view.k.data() + std::size_t(h) * T * kD;
    const float* v = view.v.data() + std::size_t(h) * T * kD;
    std::vector<int> chosen;
    if (dense_layer || page_budget >= P) {
      for (int p = 0; p < P; ++p) chosen.push_back(p);
    } else {
      std::vector<bool> fixed(P, false);
      for (int p = 0; p < std::min(pol.sink_pages, P); ++p) fixed[p] = true;
      for (int p = std::max(0, P - pol.local_pages); p < P; ++p) fixed[p] = true;
      std::vector<std::pair<double, int>> ranked;  // (-score, page)
      for (int p = 0; p < P; ++p) {
        if (fixed[p]) {
          chosen.push_back(p);
          continue;
        }
        double agg = pol.gqa == GqaMode::kMax ? -1e300 : 0;
        for (int pos = 0; pos < n; ++pos)
          for (int g = 0; g < G; ++g) {
            const float* qh = q + (std::size_t(pos) * kHq + h * G + g) * kD;
            double u = 0;
            for (int d = 0; d < kD; ++d) {
              float lo = 1e30f, hi = -1e30f;
              for (int t = p * kS; t < std::min(T, (p + 1) * kS); ++t) {
                lo = std::min(lo, k[std::size_t(t) * kD + d]);
                hi = std::max(hi, k[std::size_t(t) * kD + d]);
              }
              u += std::max(double(qh[d]) * lo, double(qh[d]) * hi);
            }
            agg = pol.gqa == GqaMode::kMax ? std::max(agg, u) : agg + u / (n * G);
          }
        ranked.push_back({-agg, p});
      }
      std::sort(ranked.begin(), ranked.end());
      const int top = page_budget - int(chosen.size());
      for (int i = 0; i < top && i < int(ranked.size()); ++i) chosen.push_back(ranked[i].second);
    }
    for (int pos = 0; pos < n; ++pos) {
      const int tokens = T - n + 1 + pos;
      // The block's pages, and the position's own local window.
      const int pages = (tokens + kS - 1) / kS;
      std::vector<int> mine = chosen;
      for (int p = std::max(0, pages - std::max(pol.local_pages, 1)); p < pages; ++p)
        if (std::find(mine.begin(), mine.end(), p) == mine.end()) mine.push_back(p);
      std::sort(mine.begin(), mine.end());
      for (int g = 0; g < G; ++g) {
        const int qh = h * G + g;
        const auto o = test::MaskedAttention(q + (std::size_t(pos) * kHq + qh) * kD, k, v, tokens, kD, kS, mine,
                                             1.0 / std::sqrt(double(kD)));
        for (int d = 0; d < kD; ++d) out[(std::size_t(pos) * kHq + qh) * kD + d] = float(o[d]);
      }
    }
  }
  return out;
}

TEST_F(BlockDecode, SharedSelectionEqualsItsDefinition) {
  for (const GqaMode gqa : {GqaMode::kMax, GqaMode::kMean}) {
    SCOPED_TRACE(std::string(GqaModeName(gqa)));
    Config c = Base();
    c.policy.block_selection = BlockSelection::kShared;
    c.policy.gqa = gqa;
    auto a = Make(c);
    std::vector<SeqId> seqs;
    const std::vector<int64_t> prefill = {61, 3, 90};
    for (std::size_t s = 0; s < prefill.size(); ++s) {
      seqs.push_back(*a->CreateSequence());
      AppendAll(*a, seqs[s], prefill[s], 70 + s);
    }
    std::mt19937 rng(3);
    for (int step = 0; step < 6; ++step) {
      std::vector<int> blocks;
      int rows = 0;
      for (std::size_t s = 0; s < seqs.size(); ++s) rows += blocks.emplace_back(1 + int(rng() % 7));
      for (std::size_t s = 0; s < seqs.size(); ++s) AppendAll(*a, seqs[s], blocks[s], 900 + 10 * step + s);
      for (int l = 0; l < kLayers; ++l) {
        const auto q = test::RandomNormal(std::size_t(rows) * kQRow, 40 * step + l);
        std::vector<float> got(q.size());
        AttendStats stats;
        ASSERT_TRUE(a->DecodeBlock(seqs, blocks, l, q.data(), got.data(), &stats).ok());
        int r = 0;
        for (std::size_t s = 0; s < seqs.size(); ++s) {
          const DenseView view = *a->Gather(seqs[s], l);
          const auto want = SharedBlockReference(view, blocks[s], q.data() + r * kQRow,
                                                 int(c.policy.token_budget / kS), c.policy, c.policy.is_dense(l));
          EXPECT_LE(test::RelL2Error(got.data() + r * kQRow, want.data(), want.size()), 1e-5)
              << "step " << step << " layer " << l << " sequence " << s << " block " << blocks[s];
          r += blocks[s];
        }
      }
      for (std::size_t s = 0; s < seqs.size(); ++s) ASSERT_TRUE(a->Rollback(seqs[s], int(rng() % (blocks[s] + 1))).ok());
    }
  }
}

// A block of one shares nothing: kShared is then kPerPosition, bit for bit.
TEST_F(BlockDecode, SharedBlocksOfOneEqualPerPosition) {
  Config c = Base();
  c.policy.block_selection = BlockSelection::kShared;
  auto a = Make(c), b = Make(Base());
  const SeqId sa = *a->CreateSequence(), sb = *b->CreateSequence();
  AppendAll(*a, sa, 77, 5);
  AppendAll(*b, sb, 77, 5);
  for (int l = 0; l < kLayers; ++l) {
    const auto q = test::RandomNormal(kQRow, 8 + l);
    std::vector<float> x(kQRow), y(kQRow);
    const SeqId one_a[] = {sa}, one_b[] = {sb};
    ASSERT_TRUE(a->DecodeBlock(one_a, std::vector<int>{1}, l, q.data(), x.data()).ok());
    ASSERT_TRUE(b->DecodeBlock(one_b, std::vector<int>{1}, l, q.data(), y.data()).ok());
    EXPECT_EQ(x, y) << "layer " << l;
  }
}

// Drafts appended with AppendDraft stay in hbm until accepted: a page they
// fill is sealed (host bytes counted) only by Accept, a rejected draft never
// reaches the host or disk, and the accepted state decodes and gathers as a
// twin that appended only the accepted tokens.
TEST_F(BlockDecode, DraftsReachTheTiersOnlyOnceAccepted) {
  Config tiered = Base();
  tiered.hbm_bytes = 64 * tiered.geometry.page_bytes();
  tiered.host_bytes = 12 * 4096;
  tiered.disk_dir = ::testing::TempDir() + "questkv-draft-disk";  // names only for the memory backend
  tiered.disk_bytes = 4096ull * 2048;
  auto a = Make(tiered, MakeMemoryBackend(8, /*reorder_seed=*/9)), b = Make(Base());
  const SeqId sa = *a->CreateSequence(), sb = *b->CreateSequence();
  AppendAll(*a, sa, 150, 21);
  AppendAll(*b, sb, 150, 21);
  const int64_t page_bytes = int64_t(tiered.geometry.page_bytes());
  std::mt19937 rng(11);
  int64_t rejected_full_pages = 0;
  for (int step = 0; step < 10; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const int n = 1 + int(rng() % 9);
    const int64_t before = *a->Length(sa, 0);
    const int64_t sealed_before = a->tier_stats().bytes_hbm_to_host;
    for (int l = 0; l < kLayers; ++l) {
      auto k = test::RandomNormal(std::size_t(n) * kRow, 7000 + 10 * step + l);
      auto v = test::RandomNormal(std::size_t(n) * kRow, 8000 + 10 * step + l);
      ASSERT_TRUE(a->AppendDraft(sa, l, k.data(), v.data(), n).ok());
      ASSERT_TRUE(b->Append(sb, l, k.data(), v.data(), n).ok());
      // No ordinary append onto drafts.
      EXPECT_EQ(a->Append(sa, l, k.data(), v.data(), 1).code(), Code::kFailedPrecondition);
      EXPECT_EQ(*a->Length(sa, l), before + n);
    }
    EXPECT_EQ(a->tier_stats().bytes_hbm_to_host, sealed_before) << "a draft page was sealed before acceptance";
    const SeqId one_a[] = {sa}, one_b[] = {sb};
    for (int l = 0; l < kLayers; ++l) {
      const auto q = test::RandomNormal(std::size_t(n) * kQRow, 9000 + 10 * step + l);
      std::vector<float> x(q.size()), y(q.size());
      ASSERT_TRUE(a->DecodeBlock(one_a, std::vector<int>{n}, l, q.data(), x.data()).ok());
      ASSERT_TRUE(b->DecodeBlock(one_b, std::vector<int>{n}, l, q.data(), y.data()).ok());
      ASSERT_EQ(x, y) << "layer " << l;
    }
    const int reject = int(rng() % (n + 1));
    ASSERT_TRUE(a->Rollback(sa, reject).ok());
    ASSERT_TRUE(b->Rollback(sb, reject).ok());
    EXPECT_EQ(a->tier_stats().bytes_hbm_to_host, sealed_before) << "a rejected draft was sealed";
    rejected_full_pages += (before + n) / kS - (before + n - reject) / kS;
    ASSERT_TRUE(a->Accept(sa).ok());
    const int64_t after = *a->Length(sa, 0);
    EXPECT_EQ(a->tier_stats().bytes_hbm_to_host - sealed_before, (after / kS - before / kS) * kLayers * page_bytes)
        << "accepted " << after - before << " of " << n;
  }
  EXPECT_GT(rejected_full_pages, 0) << "no rejected draft filled a page: the test shows little";
  EXPECT_GT(a->tier_stats().bytes_host_to_disk, 0) << "nothing reached the disk tier";
  for (int l = 0; l < kLayers; ++l) {
    const DenseView x = *a->Gather(sa, l), y = *b->Gather(sb, l);
    EXPECT_EQ(x.tokens, y.tokens);
    EXPECT_EQ(x.k, y.k) << "layer " << l;
    EXPECT_EQ(x.v, y.v) << "layer " << l;
    EXPECT_EQ(TailSummary(*a, sa, l), TailSummary(*b, sb, l)) << "layer " << l;
  }
  ASSERT_TRUE(a->Free(sa).ok());
  EXPECT_EQ(a->live_pages(), 0u);
}

}  // namespace
}  // namespace questkv
