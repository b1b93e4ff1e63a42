// The tiered runtime (tiny hbm and host budgets, a disk tier on an in-memory
// or real backend) against the same operations on an all-in-memory runtime:
// under `strict` every output must be bit-identical.
#include <gtest/gtest.h>

#include <sys/resource.h>

#include <csignal>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <utility>

#include "questkv/runtime.h"
#include "tiers/io_backend.h"
#include "tests/testing/reference.h"
#include "tests/testing/scratch.h"

namespace questkv {
namespace {

Geometry Geo() {
  Geometry g;
  g.layers = 2, g.q_heads = 4, g.kv_heads = 2, g.head_dim = 16, g.page_size = 4;
  return g;
}

Config Base() {
  Config c;
  c.geometry = Geo();
  c.policy.token_budget = 6 * 4;
  c.policy.sink_pages = 1;
  c.policy.local_pages = 2;
  c.policy.dense_layers = {0};
  c.max_pages = 1024;
  return c;
}

// hbm: 10 pages' worth of head-pages; host: 12 pages; disk: plenty.
Config Tiny(ColdMissPolicy policy) {
  Config c = Base();
  const std::size_t page = c.geometry.page_bytes();
  c.hbm_bytes = 10 * page;
  c.host_bytes = 12 * 4096;  // host slots are 4096-aligned pages
  c.disk_dir = ::testing::TempDir() + "questkv-memory-disk";  // names only for the memory backend
  c.disk_bytes = 4096ull * 2048;
  c.cold_miss = policy;
  return c;
}

struct Pair {
  std::unique_ptr<Runtime> ref, tiered;
};

// An all-in-memory runtime beside one with `tiered_config`'s tiers on `io`
// (a runtime that fails to be created is null).
Pair MakePair(const Config& tiered_config, std::unique_ptr<IoBackend> io) {
  Pair p;
  auto ref = Runtime::Create(Base());
  EXPECT_TRUE(ref.ok()) << ref.status().ToString();
  auto tiered = Runtime::Create(tiered_config, std::move(io));
  EXPECT_TRUE(tiered.ok()) << tiered.status().ToString();
  if (ref.ok()) p.ref = std::move(*ref);
  if (tiered.ok()) p.tiered = std::move(*tiered);
  return p;
}

void AppendBoth(Pair& p, SeqId a, SeqId b, int64_t n, uint64_t seed) {
  const std::size_t row = 2 * 16;
  for (int l = 0; l < 2; ++l) {
    auto k = test::RandomNormal(n * row, seed + l), v = test::RandomNormal(n * row, seed + 100 + l);
    ASSERT_TRUE(p.ref->Append(a, l, k.data(), v.data(), n).ok());
    Status s = p.tiered->Append(b, l, k.data(), v.data(), n);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
}

TEST(Tiered, StrictOutputsAreBitIdenticalToAllInMemory) {
  Pair p = MakePair(Tiny(ColdMissPolicy::kStrict), MakeMemoryBackend(8, /*reorder_seed=*/3));
  std::vector<SeqId> ra, ta;
  for (int i = 0; i < 3; ++i) {
    ra.push_back(*p.ref->CreateSequence());
    ta.push_back(*p.tiered->CreateSequence());
    AppendBoth(p, ra[i], ta[i], 150 + 37 * i, 10 * i);
  }
  std::vector<float> q(3 * 4 * 16), o1(q.size()), o2(q.size());
  for (int step = 0; step < 30; ++step) {
    for (int i = 0; i < 3; ++i) AppendBoth(p, ra[i], ta[i], 1, 1000 + step * 7 + i);
    for (int l = 0; l < 2; ++l) {
      test::FillNormal(q.data(), q.size(), 5000 + step * 2 + l);
      ASSERT_TRUE(p.ref->DecodeAttention(ra, l, q.data(), o1.data()).ok());
      auto s = p.tiered->DecodeAttention(ta, l, q.data(), o2.data());
      ASSERT_TRUE(s.ok()) << s.ToString();
      ASSERT_EQ(o1, o2) << "step " << step << " layer " << l;
    }
  }
  const TierStats t = p.tiered->tier_stats();
  EXPECT_GT(t.bytes_host_to_hbm, 0);
  EXPECT_GT(t.bytes_hbm_to_host, 0);
  EXPECT_GT(t.bytes_host_to_disk, 0);
  EXPECT_GT(t.bytes_disk_to_host, 0);
  EXPECT_GT(t.cold_stalls, 0);
  EXPECT_EQ(t.pages_skipped, 0);
  EXPECT_LE(t.hbm_peak_bytes, t.hbm_capacity_bytes);
  EXPECT_LE(t.host_peak_bytes, t.host_capacity_bytes);
  for (SeqId s : ta) ASSERT_TRUE(p.tiered->Free(s).ok());
  const TierStats after = p.tiered->tier_stats();
  EXPECT_EQ(p.tiered->live_pages(), 0u);
  EXPECT_EQ(after.hbm_used_bytes, 0u);
  EXPECT_EQ(after.host_used_bytes, 0u);
  EXPECT_EQ(after.disk_used_bytes, 0u);
}

TEST(Tiered, RunnersUpArePromotedAheadOfNeedWhereTheHostHasRoom) {
  Config c = Tiny(ColdMissPolicy::kStrict);
  c.host_bytes = 60 * 4096;
  Pair p = MakePair(c, MakeMemoryBackend(8));
  ASSERT_TRUE(p.ref && p.tiered);
  SeqId r = *p.ref->CreateSequence(), t = *p.tiered->CreateSequence();
  AppendBoth(p, r, t, 600, 21);  // 150 pages per layer, host for 60
  std::vector<float> q(4 * 16), o1(q.size()), o2(q.size());
  SeqId rs[] = {r}, ts[] = {t};
  for (int step = 0; step < 20; ++step) {
    test::FillNormal(q.data(), q.size(), 40 + step);
    ASSERT_TRUE(p.ref->DecodeAttention(rs, 1, q.data(), o1.data()).ok());
    ASSERT_TRUE(p.tiered->DecodeAttention(ts, 1, q.data(), o2.data()).ok());
    ASSERT_EQ(o1, o2);
  }
  EXPECT_GT(p.tiered->tier_stats().prefetches, 0);
}

TEST(Tiered, DeadlineSkipsColdPagesAndLetsThemLand) {
  Pair p = MakePair(Tiny(ColdMissPolicy::kDeadline), MakeMemoryBackend(8));
  SeqId r = *p.ref->CreateSequence(), t = *p.tiered->CreateSequence();
  AppendBoth(p, r, t, 400, 1);
  std::vector<float> q(4 * 16), o(q.size());
  SeqId ts[] = {t};
  for (int step = 0; step < 20; ++step) {
    test::FillNormal(q.data(), q.size(), 77 + step);
    ASSERT_TRUE(p.tiered->DecodeAttention(ts, 1, q.data(), o.data()).ok());
    for (float x : o) ASSERT_TRUE(std::isfinite(x));
  }
  const TierStats s = p.tiered->tier_stats();
  EXPECT_GT(s.pages_skipped, 0);
  EXPECT_EQ(s.cold_stalls, 0);
  EXPECT_GT(s.promotions, 0);  // background promotions completed
}

// Under deadline with a skip limit, each call (one sequence, so the tier
// counters read around it are its own) skips at most the limit's share of
// what it selected and waits for the rest of its cold misses; a call that
// skipped nothing matches the all-in-memory run bit for bit. Limit 0 computes
// what strict does; limit 1 never waits.
TEST(Tiered, DeadlineWaitsForACallWhoseSkipsWouldPassItsLimit) {
  int64_t waited = 0, skipped_calls = 0;
  for (const double limit : {0.0, 0.2, 0.5, 1.0}) {
    SCOPED_TRACE("limit " + std::to_string(limit));
    Config c = Tiny(ColdMissPolicy::kDeadline);
    c.deadline_skip_limit = limit;
    Pair p = MakePair(c, MakeMemoryBackend(8));
    ASSERT_TRUE(p.ref && p.tiered);
    SeqId r = *p.ref->CreateSequence(), t = *p.tiered->CreateSequence();
    AppendBoth(p, r, t, 400, 3);
    std::vector<float> q(4 * 16), o1(q.size()), o2(q.size());
    SeqId rs[] = {r}, ts[] = {t};
    std::vector<PageSelection> sel;
    int64_t limit_waits = 0, limit_skips = 0;
    for (int step = 0; step < 24; ++step) {
      AppendBoth(p, r, t, 1, 900 + step);
      for (int l = 0; l < 2; ++l) {
        test::FillNormal(q.data(), q.size(), 300 + 2 * step + l);
        ASSERT_TRUE(p.ref->DecodeAttention(rs, l, q.data(), o1.data()).ok());
        const TierStats before = p.tiered->tier_stats();
        auto s = p.tiered->DecodeAttention(ts, l, q.data(), o2.data(), &sel);
        ASSERT_TRUE(s.ok()) << s.ToString();
        const TierStats after = p.tiered->tier_stats();
        const int64_t waits = after.deadline_waits - before.deadline_waits;
        const int64_t stalls = after.cold_stalls - before.cold_stalls;
        const int64_t skipped = after.pages_skipped - before.pages_skipped;
        const int64_t selected = int64_t(sel[0].pages.size());
        SCOPED_TRACE("step " + std::to_string(step) + " layer " + std::to_string(l));
        ASSERT_EQ(waits, stalls > 0 ? 1 : 0);
        ASSERT_LE(double(skipped), limit * double(selected));
        // Past its limit a call waits for all its cold misses, not only
        // for those beyond the limit (here nothing leaves the host mid-call).
        if (waits) {
          ASSERT_EQ(skipped, 0);
        }
        if (skipped == 0) {
          ASSERT_EQ(o1, o2);
        } else {
          ASSERT_NE(o1, o2);
        }
        limit_waits += waits;
        limit_skips += skipped > 0;
      }
    }
    if (limit == 0) {
      EXPECT_EQ(limit_skips, 0);
      EXPECT_GT(limit_waits, 0);
    }
    if (limit == 1) {
      EXPECT_EQ(limit_waits, 0);
      EXPECT_GT(limit_skips, 0);
    }
    waited += limit_waits, skipped_calls += limit_skips;
    EXPECT_EQ(p.tiered->tier_stats().deadline_waits, limit_waits);
  }
  EXPECT_GT(waited, 0);
  EXPECT_GT(skipped_calls, 0);
}

TEST(Tiered, ASkipLimitOutsideZeroToOneIsRefused) {
  for (const double limit : {-0.1, 1.5, std::nan("")}) {
    Config c = Tiny(ColdMissPolicy::kDeadline);
    c.deadline_skip_limit = limit;
    auto rt = Runtime::Create(c, MakeMemoryBackend(8));
    ASSERT_FALSE(rt.ok());
    EXPECT_EQ(rt.status().code(), Code::kInvalidArgument);
    EXPECT_NE(rt.status().message().find("deadline_skip_limit"), std::string::npos) << rt.status().ToString();
  }
}

// Every I/O backend over real files, with the writes' checks on the decoding
// thread or the disk tier's, serves the all-in-memory outputs.
TEST(Tiered, RealDiskThroughEveryBackend) {
  const std::pair<IoBackendKind, bool> cases[] = {{IoBackendKind::kAuto, false},
                                                  {IoBackendKind::kUring, false},
                                                  {IoBackendKind::kUringSqpoll, true},
                                                  {IoBackendKind::kPread, true}};
  for (const auto& [kind, checks_off_thread] : cases) {
    SCOPED_TRACE(std::string(IoBackendKindName(kind)) + (checks_off_thread ? ", checks off thread" : ""));
    test::ScratchDir dir;
    Config c = Tiny(ColdMissPolicy::kStrict);
    c.disk_dir = dir.path();
    c.io_backend = kind;
    c.io_checks_off_thread = checks_off_thread;
    auto rt = Runtime::Create(c);
    if (rt.status().code() == Code::kUnimplemented) continue;  // io_uring unavailable here
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    auto ref = Runtime::Create(Base());
    ASSERT_TRUE(ref.ok());
    Pair p{std::move(*ref), std::move(*rt)};
    SeqId r = *p.ref->CreateSequence(), t = *p.tiered->CreateSequence();
    AppendBoth(p, r, t, 300, 9);
    std::vector<float> q(4 * 16), o1(q.size()), o2(q.size());
    SeqId rs[] = {r}, ts[] = {t};
    for (int step = 0; step < 10; ++step) {
      test::FillNormal(q.data(), q.size(), 900 + step);
      ASSERT_TRUE(p.ref->DecodeAttention(rs, 1, q.data(), o1.data()).ok());
      ASSERT_TRUE(p.tiered->DecodeAttention(ts, 1, q.data(), o2.data()).ok());
      ASSERT_EQ(o1, o2);
    }
    EXPECT_GT(p.tiered->tier_stats().bytes_disk_to_host, 0);
    p.tiered.reset();  // closes the page files before the directory goes
  }
}

struct FaultCase {
  const char* name;
  double FaultPlan::*field;
  double rate;
};

class TieredFaults : public ::testing::TestWithParam<FaultCase> {};

// Under each disk fault: a step either serves exactly the all-in-memory output
// or fails with the fault's error; nothing leaks; other sequences keep serving.
TEST_P(TieredFaults, NoWrongKvErrorsSurfaceNothingLeaks) {
  FaultPlan plan;
  plan.seed = 11;
  plan.*(GetParam().field) = GetParam().rate;
  Pair p = MakePair(Tiny(ColdMissPolicy::kStrict), MakeFaultInjectingBackend(MakeMemoryBackend(8, 5), plan));
  SeqId r = *p.ref->CreateSequence(), t = *p.tiered->CreateSequence();
  AppendBoth(p, r, t, 300, 4);
  std::vector<float> q(4 * 16), o1(q.size()), o2(q.size());
  SeqId rs[] = {r}, ts[] = {t};
  int failures = 0;
  for (int step = 0; step < 40; ++step) {
    test::FillNormal(q.data(), q.size(), 300 + step);
    ASSERT_TRUE(p.ref->DecodeAttention(rs, 1, q.data(), o1.data()).ok());
    Status s = p.tiered->DecodeAttention(ts, 1, q.data(), o2.data());
    if (s.ok()) {
      ASSERT_EQ(o1, o2) << "a successful step served wrong K/V at step " << step;
    } else {
      ++failures;
      EXPECT_TRUE(s.code() == Code::kCorruption || s.code() == Code::kIOError ||
                  s.code() == Code::kResourceExhausted)
          << s.ToString();
    }
  }
  const TierStats st = p.tiered->tier_stats();
  EXPECT_GT(st.io_errors + st.corruptions, 0) << "the fault never fired";
  // A sequence whose pages never went to disk keeps working.
  SeqId t2 = *p.tiered->CreateSequence(), r2 = *p.ref->CreateSequence();
  AppendBoth(p, r2, t2, 5, 99);
  SeqId rs2[] = {r2}, ts2[] = {t2};
  ASSERT_TRUE(p.ref->DecodeAttention(rs2, 1, q.data(), o1.data()).ok());
  ASSERT_TRUE(p.tiered->DecodeAttention(ts2, 1, q.data(), o2.data()).ok());
  EXPECT_EQ(o1, o2);
  ASSERT_TRUE(p.tiered->Free(t).ok());
  ASSERT_TRUE(p.tiered->Free(t2).ok());
  const TierStats end = p.tiered->tier_stats();
  EXPECT_EQ(p.tiered->live_pages(), 0u);
  EXPECT_EQ(end.hbm_used_bytes, 0u);
  EXPECT_EQ(end.host_used_bytes, 0u);
  EXPECT_EQ(end.disk_used_bytes, 0u);
  (void)failures;
}

INSTANTIATE_TEST_SUITE_P(
    EveryFault, TieredFaults,
    ::testing::Values(FaultCase{"read_eio", &FaultPlan::read_eio, 0.3},
                      FaultCase{"write_eio", &FaultPlan::write_eio, 0.3},
                      FaultCase{"write_enospc", &FaultPlan::write_enospc, 0.3},
                      FaultCase{"short_read", &FaultPlan::short_read, 0.3},
                      FaultCase{"short_write", &FaultPlan::short_write, 0.3},
                      FaultCase{"corrupt_read", &FaultPlan::corrupt_read, 0.3},
                      FaultCase{"misdirected_write", &FaultPlan::misdirected_write, 0.3}),
    [](const ::testing::TestParamInfo<FaultCase>& info) { return std::string(info.param.name); });

TEST(Tiered, DelayedAndReorderedCompletionsChangeNothing) {
  FaultPlan plan;
  plan.seed = 3;
  plan.delay = 0.5;
  Pair p = MakePair(Tiny(ColdMissPolicy::kStrict), MakeFaultInjectingBackend(MakeMemoryBackend(8, 9), plan));
  SeqId r = *p.ref->CreateSequence(), t = *p.tiered->CreateSequence();
  AppendBoth(p, r, t, 300, 4);
  std::vector<float> q(4 * 16), o1(q.size()), o2(q.size());
  SeqId rs[] = {r}, ts[] = {t};
  for (int step = 0; step < 30; ++step) {
    test::FillNormal(q.data(), q.size(), 700 + step);
    ASSERT_TRUE(p.ref->DecodeAttention(rs, 1, q.data(), o1.data()).ok());
    Status s = p.tiered->DecodeAttention(ts, 1, q.data(), o2.data());
    ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_EQ(o1, o2);
  }
  EXPECT_GT(p.tiered->tier_stats().bytes_disk_to_host, 0);
}

TEST(Tiered, HostFullWithoutDiskIsAClearErrorAndNothingIsLost) {
  Config c = Base();
  c.host_bytes = 3 * 4096;
  auto rt = Runtime::Create(c);
  ASSERT_TRUE(rt.ok());
  SeqId s = *(*rt)->CreateSequence();
  std::vector<float> k(2 * 16 * 40, 0.5f);
  // 40 tokens = 10 pages; only 3 host homes: the rest stay pinned in hbm,
  // retried later; nothing is lost and attention still sees every token.
  ASSERT_TRUE((*rt)->Append(s, 1, k.data(), k.data(), 40).ok());
  EXPECT_GT((*rt)->tier_stats().deferred_seals, 0);
  EXPECT_EQ(*(*rt)->Length(s, 1), 40);
  std::vector<float> q(4 * 16, 0.1f), o(q.size());
  SeqId ss[] = {s};
  ASSERT_TRUE((*rt)->DenseAttention(ss, 1, q.data(), o.data()).ok());
  for (float x : o) EXPECT_NEAR(x, 0.5f, 1e-6);
}

// An append that seals more pages than half the host holds runs in pieces;
// one refused part-way (hbm full of pages waiting for a host home) is cut
// back whole, the old partial tail included, and the sequence serves and
// takes appends as before.
TEST(Tiered, ALongAppendRefusedPartWayLeavesTheSequenceAsItWas) {
  Config c = Base();
  c.hbm_bytes = 10 * c.geometry.page_bytes();
  c.host_bytes = 6 * 4096;  // pieces of 3 pages
  auto made = Runtime::Create(c), ref_made = Runtime::Create(Base());
  ASSERT_TRUE(made.ok() && ref_made.ok());
  Runtime &rt = **made, &ref = **ref_made;
  const SeqId s = *rt.CreateSequence(), r = *ref.CreateSequence();
  const std::size_t row = 2 * 16;
  auto k0 = test::RandomNormal(6 * row, 1), v0 = test::RandomNormal(6 * row, 2);
  ASSERT_TRUE(rt.Append(s, 1, k0.data(), v0.data(), 6).ok());
  ASSERT_TRUE(ref.Append(r, 1, k0.data(), v0.data(), 6).ok());
  const TierStats before = rt.tier_stats();
  auto k = test::RandomNormal(200 * row, 3), v = test::RandomNormal(200 * row, 4);
  const Status refused = rt.Append(s, 1, k.data(), v.data(), 200);
  ASSERT_EQ(refused.code(), Code::kResourceExhausted) << refused.ToString();
  EXPECT_GT(rt.tier_stats().bytes_hbm_to_host, before.bytes_hbm_to_host) << "no piece was appended before the refusal";
  EXPECT_EQ(*rt.Length(s, 1), 6);
  EXPECT_EQ(rt.live_pages(), 2u);  // 6 tokens: a full page and a copy of the old tail
  EXPECT_EQ(rt.tier_stats().host_used_bytes, before.host_used_bytes);
  // 40 more tokens fit: both runtimes hold the same 46, and decode alike.
  ASSERT_TRUE(rt.Append(s, 1, k.data(), v.data(), 40).ok());
  ASSERT_TRUE(ref.Append(r, 1, k.data(), v.data(), 40).ok());
  std::vector<float> q(4 * 16), o1(q.size()), o2(q.size());
  const SeqId ss[] = {s}, rs[] = {r};
  for (int step = 0; step < 3; ++step) {
    test::FillNormal(q.data(), q.size(), 70 + step);
    ASSERT_TRUE(ref.DecodeAttention(rs, 1, q.data(), o1.data()).ok());
    ASSERT_TRUE(rt.DecodeAttention(ss, 1, q.data(), o2.data()).ok());
    ASSERT_EQ(o1, o2) << "step " << step;
  }
  ASSERT_TRUE(rt.Free(s).ok());
  EXPECT_EQ(rt.live_pages(), 0u);
  EXPECT_EQ(rt.tier_stats().hbm_used_bytes, 0u);
  EXPECT_EQ(rt.tier_stats().host_used_bytes, 0u);
}

// Appends to both runtimes in chunks until the tiered one refuses one: the
// refused chunk reaches neither, and the error is `want` naming `reason`.
// Returns the tokens both hold.
int64_t AppendUntilRefused(Pair& p, SeqId r, SeqId t, Code want, const std::string& reason) {
  const std::size_t row = 2 * 16;
  int64_t held = 0;
  for (int chunk = 0; chunk < 200; ++chunk) {
    auto k = test::RandomNormal(12 * row, 50 + chunk), v = test::RandomNormal(12 * row, 90 + chunk);
    Status s = p.tiered->Append(t, 1, k.data(), v.data(), 12);
    if (!s.ok()) {
      EXPECT_EQ(s.code(), want) << s.ToString();
      EXPECT_NE(s.message().find(reason), std::string::npos) << s.ToString();
      EXPECT_NE(s.message().find("page"), std::string::npos) << s.ToString();
      EXPECT_EQ(*p.tiered->Length(t, 1), held) << "a refused append changed the sequence";
      return held;
    }
    EXPECT_TRUE(p.ref->Append(r, 1, k.data(), v.data(), 12).ok());
    held += 12;
  }
  ADD_FAILURE() << "every append succeeded on a disk that fails every write";
  return held;
}

// What the refused runtime still holds decodes exactly as the all-in-memory
// one, and freeing it returns every slot.
void ExpectServesAndFrees(Pair& p, SeqId r, SeqId t) {
  std::vector<float> q(4 * 16), o1(q.size()), o2(q.size());
  SeqId rs[] = {r}, ts[] = {t};
  for (int step = 0; step < 5; ++step) {
    test::FillNormal(q.data(), q.size(), 600 + step);
    ASSERT_TRUE(p.ref->DenseAttention(rs, 1, q.data(), o1.data()).ok());
    Status s = p.tiered->DenseAttention(ts, 1, q.data(), o2.data());
    ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_EQ(o1, o2);
  }
  ASSERT_TRUE(p.tiered->Free(t).ok());
  const TierStats end = p.tiered->tier_stats();
  EXPECT_EQ(p.tiered->live_pages(), 0u);
  EXPECT_EQ(end.hbm_used_bytes, 0u);
  EXPECT_EQ(end.host_used_bytes, 0u);
  EXPECT_EQ(end.disk_used_bytes, 0u);
}

// A disk that refuses every write (full, or failing): demotion gives up after
// a bounded number of writes, the page keeps its host home, and an append
// that needs room gets the disk's error instead of spinning.
TEST(Tiered, ADiskThatRefusesEveryWriteEndsInAnErrorNotAHang) {
  for (double FaultPlan::*fault : {&FaultPlan::write_enospc, &FaultPlan::write_eio}) {
    FaultPlan plan;
    plan.*fault = 1.0;
    Pair p = MakePair(Tiny(ColdMissPolicy::kStrict), MakeFaultInjectingBackend(MakeMemoryBackend(8), plan));
    SeqId r = *p.ref->CreateSequence(), t = *p.tiered->CreateSequence();
    const std::string reason = fault == &FaultPlan::write_enospc ? "No space left on device" : "Input/output error";
    const int64_t held = AppendUntilRefused(p, r, t, Code::kIOError, reason);
    EXPECT_GT(held, 0);
    const TierStats st = p.tiered->tier_stats();
    EXPECT_GT(st.io_errors, 0);
    // Each seal that needed room tried at most TierMover::kIoAttempts writes.
    EXPECT_LE(st.io_errors, 3 * (held / 4 + 2) + 8) << "demotion kept retrying";
    EXPECT_EQ(st.bytes_host_to_disk, 0);
    ExpectServesAndFrees(p, r, t);
  }
}

// The same through the OS: the process's file-size limit drops after the
// tier opened, so every write past it fails with EFBIG.
TEST(Tiered, AFileSizeLimitReachedAfterOpeningIsAnIOError) {
  test::ScratchDir dir;
  Config c = Tiny(ColdMissPolicy::kStrict);
  c.disk_dir = dir.path();
  c.io_backend = IoBackendKind::kPread;
  auto rt = Runtime::Create(c);
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  auto ref = Runtime::Create(Base());
  Pair p{std::move(*ref), std::move(*rt)};
  struct rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit low = old;
  low.rlim_cur = 0;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &low), 0);
  SeqId r = *p.ref->CreateSequence(), t = *p.tiered->CreateSequence();
  AppendUntilRefused(p, r, t, Code::kIOError, "File too large");
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &old), 0);
  std::signal(SIGXFSZ, old_handler);
  ExpectServesAndFrees(p, r, t);
  p.tiered.reset();
}

TEST(Tiered, ADiskBudgetPastTheFileSizeLimitIsRefusedAtCreation) {
  test::ScratchDir dir;
  Config c = Tiny(ColdMissPolicy::kStrict);
  c.disk_dir = dir.path();
  struct rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  struct rlimit low = old;
  low.rlim_cur = 64 * 1024;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &low), 0);
  auto rt = Runtime::Create(c);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &old), 0);
  ASSERT_FALSE(rt.ok());
  EXPECT_EQ(rt.status().code(), Code::kResourceExhausted);
  EXPECT_NE(rt.status().message().find("file-size limit"), std::string::npos) << rt.status().ToString();
  c.disk_bytes = 4096ull * 0xfffffff0u;  // 16 TiB: more than any test machine has free
  rt = Runtime::Create(c);
  ASSERT_FALSE(rt.ok());
  EXPECT_NE(rt.status().message().find("free"), std::string::npos) << rt.status().ToString();
}

// A page whose disk copy cannot be read is an error for the step that
// selects it, under `deadline` too, after a bounded number of attempts:
// never skipped forever in silence.
TEST(Tiered, DeadlineSurfacesAPageThatCannotBeRead) {
  FaultPlan plan;
  plan.read_eio = 1.0;
  Pair p = MakePair(Tiny(ColdMissPolicy::kDeadline), MakeFaultInjectingBackend(MakeMemoryBackend(8), plan));
  SeqId r = *p.ref->CreateSequence(), t = *p.tiered->CreateSequence();
  AppendBoth(p, r, t, 400, 1);
  std::vector<float> q(4 * 16), o(q.size());
  SeqId ts[] = {t};
  Status failed;
  for (int step = 0; step < 40 && failed.ok(); ++step) {
    test::FillNormal(q.data(), q.size(), 77 + step);
    failed = p.tiered->DecodeAttention(ts, 1, q.data(), o.data());
  }
  ASSERT_FALSE(failed.ok()) << "unreadable pages were skipped without an error";
  EXPECT_EQ(failed.code(), Code::kIOError) << failed.ToString();
  EXPECT_NE(failed.message().find("read of page"), std::string::npos) << failed.ToString();
  EXPECT_GT(p.tiered->tier_stats().io_errors, 0);
  p.tiered->Free(t).ok();
  EXPECT_EQ(p.tiered->live_pages(), 0u);
}

}  // namespace
}  // namespace questkv
