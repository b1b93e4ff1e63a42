// Deterministic simulation: one seed drives random sequence operations
// (create, append, fork, rollback, free, decode) against two runtimes — one
// with tiny tier budgets over a fake disk whose completions arrive in a
// seeded order, one with everything in memory — and checks after every
// operation that outputs are bit-identical (strict policy), every live page
// reads back the same K/V, and no budget is exceeded; at the end, that no
// slot of any tier leaked. There is no wall clock in the CPU backend's tier
// logic: the fake disk's seeded completion order is the only timing.
//
// A failure names its seed; QUESTKV_SIM_SEED=N reruns that one seed.
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>

#include "questkv/runtime.h"
#include "tiers/io_backend.h"
#include "tests/testing/reference.h"

namespace questkv {
namespace {

constexpr int kSeeds = 5000;
constexpr int kOps = 40;

Config Reference() {
  Config c;
  c.geometry.layers = 2;
  c.geometry.q_heads = 4;
  c.geometry.kv_heads = 2;
  c.geometry.head_dim = 8;
  c.geometry.page_size = 3;
  c.policy.token_budget = 4 * 3;
  c.policy.sink_pages = 1;
  c.policy.local_pages = 1;
  c.policy.dense_layers = {0};
  c.max_pages = 512;
  return c;
}

Config Tiny(uint64_t seed) {
  Config c = Reference();
  // Room for every tail (at most 6 sequences x 2 layers), the two a rollback
  // or fork copies at once, and a cache of 1-5 pages.
  c.hbm_bytes = (12 + 2 + 1 + seed % 5) * c.geometry.page_bytes();
  c.host_bytes = (4 + seed % 4) * 4096;
  c.disk_dir = ::testing::TempDir() + "questkv-sim";
  c.disk_bytes = 4096ull * 400;
  c.io_queue_depth = 1 + int(seed % 6);
  return c;
}

struct Sim {
  std::mt19937_64 rng;
  std::unique_ptr<Runtime> ref, tiny;
  std::vector<std::pair<SeqId, SeqId>> seqs;  // (reference id, tiered id)
  uint64_t data_seed;

  explicit Sim(uint64_t seed) : rng(seed), data_seed(seed * 1000003) {
    auto r = Runtime::Create(Reference());
    ref = std::move(*r);
    auto t = Runtime::Create(Tiny(seed), MakeMemoryBackend(Tiny(seed).io_queue_depth, seed + 1));
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    tiny = std::move(*t);
  }
  int Pick() { return int(rng() % seqs.size()); }

  void Create() {
    seqs.emplace_back(*ref->CreateSequence(), *tiny->CreateSequence());
  }
  void Append(int i, int64_t n) {
    for (int l = 0; l < 2; ++l) {
      auto k = test::RandomNormal(n * 16, data_seed++), v = test::RandomNormal(n * 16, data_seed++);
      Status a = ref->Append(seqs[i].first, l, k.data(), v.data(), n);
      Status b = tiny->Append(seqs[i].second, l, k.data(), v.data(), n);
      ASSERT_EQ(a.code(), b.code()) << a.ToString() << " vs " << b.ToString() << " with " << seqs.size()
                                     << " sequences, " << tiny->tier_stats().deferred_seals << " deferred seals";
    }
  }
  void Fork(int i) {
    auto a = ref->Fork(seqs[i].first);
    auto b = tiny->Fork(seqs[i].second);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status().ToString() << " / " << b.status().ToString();
    seqs.emplace_back(*a, *b);
  }
  void Rollback(int i, int64_t n) {
    Status a = ref->Rollback(seqs[i].first, n), b = tiny->Rollback(seqs[i].second, n);
    ASSERT_EQ(a.code(), b.code()) << a.ToString() << " vs " << b.ToString();
  }
  void Free(int i) {
    ASSERT_TRUE(ref->Free(seqs[i].first).ok());
    ASSERT_TRUE(tiny->Free(seqs[i].second).ok());
    seqs.erase(seqs.begin() + i);
  }
  void Decode() {
    std::vector<SeqId> a, b;
    for (auto [r, t] : seqs)
      if (*ref->Length(r, 1) > 0 && rng() % 2) a.push_back(r), b.push_back(t);
    if (a.empty()) return;
    const int layer = int(rng() % 2);
    std::vector<float> q(a.size() * 4 * 8), o1(q.size()), o2(q.size());
    test::FillNormal(q.data(), q.size(), data_seed++);
    ASSERT_TRUE(ref->DecodeAttention(a, layer, q.data(), o1.data()).ok());
    Status s = tiny->DecodeAttention(b, layer, q.data(), o2.data());
    ASSERT_TRUE(s.ok()) << s.ToString();
    if (o1 != o2 && std::getenv("QUESTKV_SIM_TRACE")) {
      for (std::size_t i = 0; i < a.size(); ++i) {
        const bool same = std::equal(o1.begin() + i * 32, o1.begin() + (i + 1) * 32, o2.begin() + i * 32);
        auto ga = ref->Gather(a[i], layer), gb = tiny->Gather(b[i], layer);
        std::fprintf(stderr, "batch %zu seq %llu layer %d len %lld out %s gather %s\n", i, (unsigned long long)b[i], layer,
                     (long long)*ref->Length(a[i], layer), same ? "same" : "DIFF", ga->k == gb->k && ga->v == gb->v ? "same" : "DIFF");
      }
    }
    ASSERT_EQ(o1, o2);
  }
  void CheckInvariants() {
    const TierStats t = tiny->tier_stats();
    ASSERT_LE(t.hbm_used_bytes, t.hbm_capacity_bytes);
    ASSERT_LE(t.host_used_bytes, t.host_capacity_bytes);
    ASSERT_LE(t.disk_used_bytes, t.disk_capacity_bytes);
    ASSERT_EQ(ref->live_pages(), tiny->live_pages());
    if (seqs.empty()) return;
    // Every live page of one sequence reads back what the reference holds
    // (this also pulls its pages through the tiers, shuffling placement).
    {
      const auto [r, s] = seqs[Pick()];
      for (int l = 0; l < 2; ++l) {
        auto a = ref->Gather(r, l), b = tiny->Gather(s, l);
        ASSERT_TRUE(a.ok() && b.ok());
        ASSERT_EQ(a->k, b->k) << "sequence " << s << " layer " << l;
        ASSERT_EQ(a->v, b->v) << "sequence " << s << " layer " << l;
      }
    }
  }

  void Run() {
    const bool trace = std::getenv("QUESTKV_SIM_TRACE") != nullptr;
    Create();
    for (int op = 0; op < kOps; ++op) {
      const int kind = int(rng() % 10);
      if (trace) {
        std::string lens;
        for (auto [r, t] : seqs) lens += " " + std::to_string(*ref->Length(r, 0));
        std::fprintf(stderr, "op %d kind %d lens%s\n", op, kind, lens.c_str());
      }
      if (seqs.empty() || kind == 0) {
        if (seqs.size() < 5) Create();
      } else if (kind <= 3) {
        Append(Pick(), 1 + int64_t(rng() % (rng() % 3 ? 4 : 25)));
      } else if (kind == 4 && seqs.size() < 6) {
        Fork(Pick());
      } else if (kind == 5) {
        const int i = Pick();
        const int64_t len = *ref->Length(seqs[i].first, 0);
        Rollback(i, len ? int64_t(rng() % (len + 1)) : 0);
      } else if (kind == 6 && seqs.size() > 1) {
        Free(Pick());
      } else {
        Decode();
      }
      if (::testing::Test::HasFatalFailure()) return;
      CheckInvariants();
      if (::testing::Test::HasFatalFailure()) return;
    }
    while (!seqs.empty()) Free(0);
    const TierStats t = tiny->tier_stats();
    ASSERT_EQ(tiny->live_pages(), 0u);
    ASSERT_EQ(t.hbm_used_bytes, 0u);
    ASSERT_EQ(t.host_used_bytes, 0u);
    ASSERT_EQ(t.disk_used_bytes, 0u);
  }
};

TEST(Simulation, TinyTiersMatchAllInMemoryForManySeeds) {
  uint64_t first = 1, last = kSeeds;
  if (const char* one = std::getenv("QUESTKV_SIM_SEED")) first = last = std::strtoull(one, nullptr, 10);
  int64_t disk_reads = 0;
  for (uint64_t seed = first; seed <= last; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun: QUESTKV_SIM_SEED=" + std::to_string(seed) + ")");
    Sim sim(seed);
    sim.Run();
    if (HasFatalFailure()) return;
    disk_reads += sim.tiny->tier_stats().bytes_disk_to_host;
  }
  // The budgets are small enough that the disk path is exercised.
  EXPECT_GT(disk_reads, 0);
}

}  // namespace
}  // namespace questkv
