// DecodeBlock (a block of draft tokens per sequence verified in one call)
// against its definition: the same tokens appended one at a time on a twin
// runtime, each position decoded right after its own append. Ragged blocks
// crossing page boundaries, acceptance of a prefix with rollback of the rest
// (the tail summary must be what appending only the accepted tokens gives),
// forks between blocks, and a tiered runtime.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace questkv
