// Allocation failure at the N-th allocation, for N = 1, 2, ... until the
// scenario completes: every failure is a ResourceExhausted error, the failing
// call changes nothing, and freeing everything afterwards leaves every tier
// empty (no slot or page leaked).
#include <gtest/gtest.h>

#include "questkv/runtime.h"
#include "tiers/io_backend.h"
#include "tests/testing/reference.h"
#include "topology/alloc_faults.h"

namespace questkv {
namespace {

Config Tiny() {
  Config c;
  c.geometry.layers = 2;
  c.geometry.q_heads = 4;
  c.geometry.kv_heads = 2;
  c.geometry.head_dim = 8;
  c.geometry.page_size = 4;
  c.policy.token_budget = 12;
  c.policy.sink_pages = 1;
  c.policy.local_pages = 1;
  c.policy.dense_layers = {};
  c.max_pages = 128;
  c.hbm_bytes = 10 * c.geometry.page_bytes();
  c.host_bytes = 4 * 4096;
  c.disk_dir = ::testing::TempDir() + "questkv-allocfaults";
  c.disk_bytes = 4096 * 256;
  return c;
}

struct Snapshot {
  uint32_t pages;
  std::vector<int64_t> lengths;
  bool operator==(const Snapshot&) const = default;
};

Snapshot Take(Runtime& rt, const std::vector<SeqId>& seqs) {
  Snapshot s{rt.live_pages(), {}};
  for (SeqId id : seqs)
    for (int l = 0; l < 2; ++l) s.lengths.push_back(*rt.Length(id, l));
  return s;
}

// One scenario step: exactly one runtime call.
Status Step(Runtime& rt, std::vector<SeqId>& seqs, int step) {
  std::vector<float> kv = test::RandomNormal(30 * 16, 5 + step), q = test::RandomNormal(2 * 32, 9 + step);
  std::vector<float> out(q.size());
  switch (step) {
    case 0:
    case 1: {
      QKV_ASSIGN_OR_RETURN(SeqId id, rt.CreateSequence());
      seqs.push_back(id);
      return Status::Ok();
    }
    case 2:
    case 3:
    case 4:
    case 5:
      return rt.Append(seqs[(step - 2) / 2], step % 2, kv.data(), kv.data(), 30);
    case 6: {
      QKV_ASSIGN_OR_RETURN(SeqId id, rt.Fork(seqs[0]));
      seqs.push_back(id);
      return Status::Ok();
    }
    case 7:
      return rt.Rollback(seqs[1], 7);
    default:
      return rt.DecodeAttention(std::span<const SeqId>(seqs.data(), 2), step % 2, q.data(), out.data());
  }
}

constexpr int kSteps = 12;

TEST(AllocFaults, EveryFailureIsCleanUntilTheScenarioCompletes) {
  int injected = 0;
  for (int64_t n = 1; n < 2000; ++n) {
    SCOPED_TRACE("failing allocation " + std::to_string(n));
    AllocFaults::FailAt(n);
    auto rt = Runtime::Create(Tiny(), MakeMemoryBackend(4));
    if (!rt.ok()) {
      AllocFaults::Clear();
      EXPECT_EQ(rt.status().code(), Code::kResourceExhausted) << rt.status().ToString();
      ++injected;
      continue;
    }
    std::vector<SeqId> seqs;
    bool failed = false;
    bool reached = false;  // the armed allocation happened (maybe absorbed by a retry)
    for (int step = 0; step < kSteps && !failed; ++step) {
      // A decode or seal may allocate through retries; the call must either
      // succeed or change nothing.
      const Snapshot before = Take(**rt, seqs);
      const std::size_t seqs_before = seqs.size();
      Status s = Step(**rt, seqs, step);
      if (!s.ok()) {
        failed = true;
        ++injected;
        EXPECT_EQ(s.code(), Code::kResourceExhausted) << s.ToString();
        seqs.resize(seqs_before);
        EXPECT_TRUE(Take(**rt, seqs) == before) << "a failed step changed the runtime";
      }
    }
    reached = !AllocFaults::Pending();
    AllocFaults::Clear();
    const TierStats t0 = (*rt)->tier_stats();
    EXPECT_LE(t0.hbm_used_bytes, t0.hbm_capacity_bytes);
    for (SeqId id : seqs) ASSERT_TRUE((*rt)->Free(id).ok());
    const TierStats t = (*rt)->tier_stats();
    EXPECT_EQ((*rt)->live_pages(), 0u);
    EXPECT_EQ(t.hbm_used_bytes, 0u);
    EXPECT_EQ(t.host_used_bytes, 0u);
    EXPECT_EQ(t.disk_used_bytes, 0u);
    if (!failed && !reached) break;  // ran through without reaching the N-th allocation
  }
  EXPECT_GT(injected, 20);
}

}  // namespace
}  // namespace questkv
