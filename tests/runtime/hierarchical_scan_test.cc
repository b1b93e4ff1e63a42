// SelectionPolicy::group_pages end to end on the CPU backend: a runtime with
// the hierarchical scan against one with the flat scan, through appends that
// grow tails, forks, rollbacks, frees (page ids reused) and a tiered run.
// Outputs and selections must be identical at every step; where keys are
// local and the query seeks them, the summary bytes read must fall.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "questkv/runtime.h"
#include "tests/testing/reference.h"

namespace questkv {
namespace {

constexpr int kHq = 8, kHkv = 2, kD = 16, kS = 4;

Config Base(int group_pages) {
  Config c;
  c.geometry.layers = 2, c.geometry.q_heads = kHq, c.geometry.kv_heads = kHkv, c.geometry.head_dim = kD;
  c.geometry.page_size = kS;
  c.policy.token_budget = 10 * kS;
  c.policy.sink_pages = 1;
  c.policy.local_pages = 2;
  c.policy.dense_layers = {0};
  c.policy.group_pages = group_pages;
  c.max_pages = 4096;
  return c;
}

// n tokens of K/V [n][Hkv][D]: noise, plus `lift` along u for tokens in
// [hot0, hot1).
std::vector<float> Keys(int64_t n, uint64_t seed, const std::vector<float>& u, double lift, int64_t hot0,
                        int64_t hot1) {
  auto k = test::RandomNormal(std::size_t(n) * kHkv * kD, seed);
  for (int64_t t = hot0; t < std::min(hot1, n); ++t)
    for (int i = 0; i < kHkv * kD; ++i) k[std::size_t(t) * kHkv * kD + i] += float(lift) * u[i % kD];
  return k;
}

struct Twins {
  std::unique_ptr<Runtime> flat, grouped;
  explicit Twins(int group_pages, Config base = Base(0)) {
    auto a = Runtime::Create(base);
    base.policy.group_pages = group_pages;
    auto b = Runtime::Create(base);
    EXPECT_TRUE(a.ok() && b.ok());
    flat = std::move(*a), grouped = std::move(*b);
  }
  std::pair<SeqId, SeqId> New() { return {*flat->CreateSequence(), *grouped->CreateSequence()}; }
  void Append(std::pair<SeqId, SeqId> s, const std::vector<float>& k, const std::vector<float>& v, int64_t n) {
    for (int l = 0; l < 2; ++l) {
      ASSERT_TRUE(flat->Append(s.first, l, k.data(), v.data(), n).ok());
      ASSERT_TRUE(grouped->Append(s.second, l, k.data(), v.data(), n).ok());
    }
  }
  // One decode of the batch at the sparse layer: equal outputs and selections.
  void Decode(const std::vector<std::pair<SeqId, SeqId>>& batch, const std::vector<float>& q, AttendStats* fs,
              AttendStats* gs) {
    std::vector<SeqId> a, b;
    for (auto [x, y] : batch) a.push_back(x), b.push_back(y);
    std::vector<float> o1(q.size()), o2(q.size());
    std::vector<PageSelection> s1, s2;
    ASSERT_TRUE(flat->DecodeAttention(a, 1, q.data(), o1.data(), &s1, fs).ok());
    const Status st = grouped->DecodeAttention(b, 1, q.data(), o2.data(), &s2, gs);
    ASSERT_TRUE(st.ok()) << st.ToString();
    ASSERT_EQ(s1.size(), s2.size());
    for (std::size_t i = 0; i < s1.size(); ++i) {
      ASSERT_EQ(s1[i].indptr, s2[i].indptr) << "sequence " << i;
      ASSERT_EQ(s1[i].pages, s2[i].pages) << "sequence " << i;
    }
    ASSERT_EQ(o1, o2);
  }
};

std::vector<float> Queries(int batch, uint64_t seed, const std::vector<float>& u, double along) {
  auto q = test::RandomNormal(std::size_t(batch) * kHq * kD, seed);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = float(along) * u[i % kD] + q[i];
  return q;
}

TEST(HierarchicalScan, RuntimeOutputsEqualTheFlatScanThroughForksRollbacksAndReuse) {
  for (int B : {2, 5, 16}) {
    Twins tw(B);
    const auto u = test::RandomNormal(kD, 7);
    std::vector<std::pair<SeqId, SeqId>> seqs;
    for (int i = 0; i < 3; ++i) {
      seqs.push_back(tw.New());
      const int64_t n = 150 + 61 * i;
      tw.Append(seqs.back(), Keys(n, 10 + i, u, 3.0, 40, 60), test::RandomNormal(n * kHkv * kD, 20 + i), n);
    }
    uint64_t seed = 100;
    for (int step = 0; step < 40; ++step) {
      // Appends grow tails and seal pages inside cached groups.
      for (auto& s : seqs) {
        const uint64_t key_seed = seed++, value_seed = seed++;  // in this order, whatever the compiler's
        tw.Append(s, Keys(1, key_seed, u, step % 7 == 0 ? 3.0 : 0.0, 0, 1), test::RandomNormal(kHkv * kD, value_seed), 1);
      }
      if (step == 10) {  // a fork shares every page and copies the tail
        auto f = std::make_pair(*tw.flat->Fork(seqs[0].first), *tw.grouped->Fork(seqs[0].second));
        seqs.push_back(f);
      }
      if (step == 15 || step == 25) {  // rollbacks inside and across groups
        for (int64_t r : {3, 9})
          ASSERT_TRUE(tw.flat->Rollback(seqs[1].first, r).ok() && tw.grouped->Rollback(seqs[1].second, r).ok());
      }
      if (step == 20) {  // freed ids come back under other sequences
        ASSERT_TRUE(tw.flat->Free(seqs[2].first).ok() && tw.grouped->Free(seqs[2].second).ok());
        seqs[2] = tw.New();
        tw.Append(seqs[2], Keys(97, 77, u, 3.0, 0, 20), test::RandomNormal(97 * kHkv * kD, 78), 97);
      }
      tw.Decode(seqs, Queries(int(seqs.size()), seed++, u, step % 2 ? 1.0 : 0.0), nullptr, nullptr);
      if (HasFatalFailure()) return;
    }
  }
}

TEST(HierarchicalScan, TieredStrictRunEqualsTheFlatScan) {
  Config c = Base(0);
  const std::size_t page = c.geometry.page_bytes();
  c.hbm_bytes = 12 * page;
  c.host_bytes = 16 * 4096;
  c.disk_dir = ::testing::TempDir() + "questkv-hier-disk";
  c.disk_bytes = 4096ull * 1024;
  c.cold_miss = ColdMissPolicy::kStrict;
  Twins tw(4, c);
  const auto u = test::RandomNormal(kD, 8);
  std::vector<std::pair<SeqId, SeqId>> seqs{tw.New(), tw.New()};
  tw.Append(seqs[0], Keys(300, 1, u, 3.0, 100, 130), test::RandomNormal(300 * kHkv * kD, 2), 300);
  tw.Append(seqs[1], Keys(170, 3, u, 3.0, 10, 30), test::RandomNormal(170 * kHkv * kD, 4), 170);
  for (int step = 0; step < 20; ++step) {
    for (auto& s : seqs) tw.Append(s, test::RandomNormal(kHkv * kD, 500 + step), test::RandomNormal(kHkv * kD, 600 + step), 1);
    tw.Decode(seqs, Queries(2, 700 + step, u, 1.0), nullptr, nullptr);
    if (HasFatalFailure()) return;
  }
  EXPECT_GT(tw.grouped->tier_stats().bytes_disk_to_host, 0);
}

// Keys with a hot run, queries that seek it: after the first step (which
// builds every group's box) the scan reads a fraction of the flat scan's
// summary bytes.
TEST(HierarchicalScan, ReadsFewerSummaryBytesWhereKeysAreLocal) {
  Config c = Base(0);
  c.max_pages = 1 << 14;
  Twins tw(16, c);
  const auto u = test::RandomNormal(kD, 9);
  auto s = tw.New();
  const int64_t n = 16 * 1024;
  tw.Append(s, Keys(n, 1, u, 4.0, 5000, 5040), test::RandomNormal(n * kHkv * kD, 2), n);
  AttendStats warm_f, warm_g, f, g;
  tw.Decode({s}, Queries(1, 3, u, 2.0), &warm_f, &warm_g);
  for (int step = 0; step < 8; ++step) {
    tw.Append(s, test::RandomNormal(kHkv * kD, 10 + step), test::RandomNormal(kHkv * kD, 20 + step), 1);
    tw.Decode({s}, Queries(1, 30 + step, u, 2.0), &f, &g);
    if (HasFatalFailure()) return;
  }
  EXPECT_GT(f.summary_bytes_read, 0);
  EXPECT_LT(g.summary_bytes_read, f.summary_bytes_read / 4) << g.summary_bytes_read << " of " << f.summary_bytes_read;
  // The first step reads every page's box once to build the groups.
  EXPECT_GE(warm_g.summary_bytes_read, warm_f.summary_bytes_read);
  // The dense layer reads no summary, right after a sparse one did.
  std::vector<float> q = Queries(1, 50, u, 1.0), o(q.size());
  const SeqId one[] = {s.second};
  AttendStats dense;
  ASSERT_TRUE(tw.grouped->DecodeAttention(one, 0, q.data(), o.data(), nullptr, &dense).ok());
  EXPECT_EQ(dense.summary_bytes_read, 0);
}

TEST(HierarchicalScan, BadGroupSizesAreRefused) {
  for (int B : {-1, 1, (1 << 16) + 1}) {
    auto r = Runtime::Create(Base(B));
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << B;
  }
}

}  // namespace
}  // namespace questkv
