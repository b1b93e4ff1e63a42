// DiskTier over every backend, and under every fault the fault-injecting
// backend can inject. The invariants checked throughout:
//   - a completion reported OK for a read carries exactly the page's bytes
//     (every good read is compared with the truth; read buffers are poisoned
//     before each read so stale good bytes cannot pass for new ones);
//   - each fault surfaces as the right code (IOError, Corruption) and is
//     counted in stats;
//   - no slot leaks: after dropping every page, slots_used is 0 again;
//   - the tier keeps serving: failed writes succeed on retry, transiently
//     failed reads succeed on retry, pages untouched by faults read fine.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "tests/testing/scratch.h"
#include "tiers/checksum.h"
#include "tiers/disk_probe.h"
#include "tiers/disk_tier.h"

namespace questkv {
namespace {

// Not a multiple of 4096, so slots are rounded up (10000 -> 12288).
constexpr std::size_t kPageBytes = 10000;
constexpr std::size_t kSlotBytes = 12288;
constexpr int kQueueDepth = 8;
constexpr uint32_t kPages = 32;
constexpr unsigned char kReadPoison = 0xee;

using TempDir = test::ScratchDir;


std::unique_ptr<IoBackend> Faulty(const FaultPlan& plan, int queue_depth = kQueueDepth) {
  return MakeFaultInjectingBackend(MakeMemoryBackend(queue_depth), plan);
}

// A tier with a region of one write buffer (holding the truth) and one read
// buffer per page id.
class Harness {
 public:
  explicit Harness(std::unique_ptr<IoBackend> io, uint32_t capacity_slots = 2 * kPages, bool checks_off_thread = false)
      : region_(test::AllocateAligned(2 * kPages * kSlotBytes)) {
    Result<std::unique_ptr<DiskTier>> tier = DiskTier::Open(
        {dir_.path() + "/tier", capacity_slots * kSlotBytes, kPageBytes, 3, checks_off_thread}, std::move(io));
    EXPECT_TRUE(tier.ok()) << tier.status().ToString();
    if (!tier.ok()) return;
    tier_ = std::move(*tier);
    EXPECT_EQ(tier_->slot_bytes(), kSlotBytes);
    EXPECT_TRUE(tier_->RegisterRegion(region_.get(), 2 * kPages * kSlotBytes).ok());
    for (uint32_t id = 0; id < kPages; ++id) SetTruth(id, 1);
  }

  DiskTier& tier() { return *tier_; }
  bool ok() const { return tier_ != nullptr; }
  char* Truth(uint32_t id) { return region_.get() + id * kSlotBytes; }
  char* ReadBuffer(uint32_t id) { return region_.get() + (kPages + id) * kSlotBytes; }
  uint32_t generation(uint32_t id) const { return generation_[id]; }
  uint64_t Seal(uint32_t id) { return PageChecksum(Truth(id), kPageBytes, id, generation_[id]); }

  // New bytes for a page: a function of (id, generation) only.
  void SetTruth(uint32_t id, uint32_t generation) {
    generation_[id] = generation;
    std::mt19937_64 rng(uint64_t(id) << 32 | generation);
    for (std::size_t i = 0; i < kSlotBytes; i += 8) {
      const uint64_t v = rng();
      std::memcpy(Truth(id) + i, &v, 8);
    }
  }

  // Writes each page (current generation), at most queue depth in flight;
  // returns every completion.
  std::vector<DiskCompletion> Write(const std::vector<uint32_t>& ids) {
    return Run(ids, [&](uint32_t id) { return tier_->SubmitWrite(id, generation_[id], Truth(id), Seal(id)); });
  }

  // Reads each page into its read buffer (poisoned first) and checks every
  // good read against the truth.
  std::vector<DiskCompletion> Read(const std::vector<uint32_t>& ids) {
    std::vector<DiskCompletion> done = Run(ids, [&](uint32_t id) {
      std::memset(ReadBuffer(id), kReadPoison, kSlotBytes);
      return tier_->SubmitRead(id, generation_[id], ReadBuffer(id));
    });
    for (const DiskCompletion& d : done) {
      EXPECT_FALSE(d.is_write);
      if (d.status.ok()) {
        EXPECT_EQ(std::memcmp(ReadBuffer(d.page_id), Truth(d.page_id), kPageBytes), 0)
            << "page " << d.page_id << " was reported good with wrong bytes";
      }
    }
    return done;
  }

  // Drops every page and checks that no slot or I/O is left behind.
  void ExpectNoLeaks() {
    EXPECT_EQ(tier_->in_flight(), 0);
    for (uint32_t id = 0; id < kPages; ++id) tier_->Drop(id);
    EXPECT_EQ(tier_->stats().slots_used, 0u);
  }

 private:
  template <typename SubmitFn>
  std::vector<DiskCompletion> Run(const std::vector<uint32_t>& ids, SubmitFn submit) {
    std::vector<DiskCompletion> done;
    for (uint32_t id : ids) {
      while (tier_->in_flight() >= tier_->queue_depth()) EXPECT_TRUE(tier_->Reap(&done, 1).ok());
      Result<uint64_t> ticket = submit(id);
      EXPECT_TRUE(ticket.ok()) << "page " << id << ": " << ticket.status().ToString();
    }
    while (tier_->in_flight() > 0) EXPECT_TRUE(tier_->Reap(&done, 1).ok());
    EXPECT_EQ(done.size(), ids.size());
    return done;
  }

  TempDir dir_;
  test::AlignedBytes region_;
  std::unique_ptr<DiskTier> tier_;
  uint32_t generation_[kPages] = {};
};

std::vector<uint32_t> AllPages() {
  std::vector<uint32_t> ids(kPages);
  for (uint32_t id = 0; id < kPages; ++id) ids[id] = id;
  return ids;
}

std::vector<uint32_t> Failed(const std::vector<DiskCompletion>& done) {
  std::vector<uint32_t> ids;
  for (const DiskCompletion& d : done)
    if (!d.status.ok()) ids.push_back(d.page_id);
  return ids;
}

std::map<Code, int> Codes(const std::vector<DiskCompletion>& done) {
  std::map<Code, int> codes;
  for (const DiskCompletion& d : done) ++codes[d.status.code()];
  return codes;
}

// Writes all pages, retrying the failed ones until every page is held.
// Returns the failed write completions.
std::vector<DiskCompletion> WriteUntilHeld(Harness& h) {
  std::vector<DiskCompletion> failures;
  std::vector<uint32_t> todo = AllPages();
  for (int attempt = 0; attempt < 50 && !todo.empty(); ++attempt) {
    const std::vector<DiskCompletion> done = h.Write(todo);
    for (const DiskCompletion& d : done) {
      EXPECT_TRUE(d.is_write);
      EXPECT_EQ(h.tier().Holds(d.page_id, h.generation(d.page_id)), d.status.ok());
      if (!d.status.ok()) failures.push_back(d);
    }
    todo = Failed(done);
    for (uint32_t id : todo) {  // a failed write leaves no copy to read
      EXPECT_EQ(h.tier().SubmitRead(id, h.generation(id), h.ReadBuffer(id)).status().code(), Code::kNotFound);
    }
  }
  EXPECT_TRUE(todo.empty());
  EXPECT_EQ(h.tier().stats().slots_used, kPages);
  return failures;
}

// Reads all pages, retrying the failed ones (the disk copy stays in place);
// returns the failed read completions.
std::vector<DiskCompletion> ReadUntilGood(Harness& h) {
  std::vector<DiskCompletion> failures;
  std::vector<uint32_t> todo = AllPages();
  for (int attempt = 0; attempt < 50 && !todo.empty(); ++attempt) {
    const std::vector<DiskCompletion> done = h.Read(todo);
    for (const DiskCompletion& d : done)
      if (!d.status.ok()) failures.push_back(d);
    todo = Failed(done);
  }
  EXPECT_TRUE(todo.empty());
  return failures;
}

// ---- every backend ----------------------------------------------------------

// Every backend, with the writes' checks on the owner's thread and on the tier's.
TEST(DiskTier, RoundTripsOnEveryBackend) {
  for (const bool checks_off_thread : {false, true}) {
    std::vector<std::unique_ptr<IoBackend>> backends;
    if (auto uring = MakeUringBackend(kQueueDepth); uring.ok()) backends.push_back(std::move(*uring));
    if (auto sqpoll = MakeUringBackend(kQueueDepth, /*sq_thread=*/true); sqpoll.ok())
      backends.push_back(std::move(*sqpoll));
    backends.push_back(MakePreadPoolBackend(4, kQueueDepth).value());
    backends.push_back(MakeMemoryBackend(kQueueDepth, 3));
    for (auto& io : backends) {
      SCOPED_TRACE(std::string(io->name()) + (checks_off_thread ? ", checks off thread" : ""));
      Harness h(std::move(io), 2 * kPages, checks_off_thread);
      ASSERT_TRUE(h.ok());
      for (const DiskCompletion& d : h.Write(AllPages())) EXPECT_TRUE(d.status.ok()) << d.status.ToString();
      std::vector<uint32_t> ids = AllPages();
      std::shuffle(ids.begin(), ids.end(), std::mt19937_64(1));
      for (const DiskCompletion& d : h.Read(ids)) EXPECT_TRUE(d.status.ok()) << d.status.ToString();
      const DiskStats& s = h.tier().stats();
      EXPECT_EQ(s.writes, kPages);
      EXPECT_EQ(s.reads, kPages);
      EXPECT_EQ(s.bytes_read, int64_t(kPages * kSlotBytes));
      EXPECT_EQ(s.slots_peak, kPages);
      EXPECT_EQ(s.io_errors + s.corruptions, 0);
      h.ExpectNoLeaks();
    }
  }
}

TEST(DiskTier, LeavesNoFilesBehind) {
  TempDir dir;
  const std::string tier_dir = dir.path() + "/made-by-tier";
  {
    auto io = MakePreadPoolBackend(2, 4);
    ASSERT_TRUE(io.ok());
    auto tier = DiskTier::Open({tier_dir, 16 * kSlotBytes, kPageBytes}, std::move(*io));
    ASSERT_TRUE(tier.ok()) << tier.status().ToString();
    EXPECT_TRUE(std::filesystem::is_empty(tier_dir));  // open but unlinked
  }
  EXPECT_FALSE(std::filesystem::exists(tier_dir));  // it made the directory, so it removes it
}

TEST(DiskTier, RejectsBadOptions) {
  auto open = [](DiskTierOptions o) { return DiskTier::Open(o, MakeMemoryBackend(4)).status().code(); };
  TempDir dir;
  EXPECT_EQ(open({dir.path(), kSlotBytes - 1, kPageBytes}), Code::kInvalidArgument);  // 0 slots
  EXPECT_EQ(open({dir.path(), kSlotBytes, 0}), Code::kInvalidArgument);
  EXPECT_EQ(open({dir.path(), kSlotBytes, kPageBytes, 0}), Code::kInvalidArgument);
  EXPECT_EQ(open({"", kSlotBytes, kPageBytes}), Code::kInvalidArgument);
  EXPECT_EQ(DiskTier::Open({dir.path(), kSlotBytes, kPageBytes}, nullptr).status().code(), Code::kInvalidArgument);
}

TEST(DiskTier, RefusesCallsThatDoNotFitTheState) {
  Harness h(MakeMemoryBackend(kQueueDepth));
  ASSERT_TRUE(h.ok());
  DiskTier& t = h.tier();
  EXPECT_EQ(t.SubmitRead(0, 1, h.ReadBuffer(0)).status().code(), Code::kNotFound);
  ASSERT_TRUE(t.SubmitWrite(0, 1, h.Truth(0), h.Seal(0)).ok());
  EXPECT_EQ(t.SubmitWrite(0, 1, h.Truth(0), h.Seal(0)).status().code(), Code::kFailedPrecondition);
  EXPECT_EQ(t.SubmitRead(0, 1, h.ReadBuffer(0)).status().code(), Code::kFailedPrecondition);
  EXPECT_FALSE(t.Holds(0, 1));
  std::vector<DiskCompletion> done;
  ASSERT_TRUE(t.Reap(&done, 1).ok());
  EXPECT_TRUE(t.Holds(0, 1));
  EXPECT_FALSE(t.Holds(0, 2));
  EXPECT_EQ(t.SubmitRead(0, 2, h.ReadBuffer(0)).status().code(), Code::kNotFound);  // stale generation
  char outside[kSlotBytes];
  EXPECT_EQ(t.SubmitRead(0, 1, outside).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(t.SubmitWrite(1, 1, h.Truth(1) + 8).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(t.stats().slots_used, 1u);
  h.ExpectNoLeaks();
}

// ---- budgets and bounds -----------------------------------------------------

TEST(DiskTier, WritesBeyondCapacityAreResourceExhausted) {
  Harness h(MakeMemoryBackend(kQueueDepth), /*capacity_slots=*/4);
  ASSERT_TRUE(h.ok());
  DiskTier& t = h.tier();
  EXPECT_EQ(t.stats().slots_capacity, 4u);
  for (const DiskCompletion& d : h.Write({0, 1, 2, 3})) EXPECT_TRUE(d.status.ok());
  const Result<uint64_t> full = t.SubmitWrite(4, 1, h.Truth(4), h.Seal(4));
  EXPECT_EQ(full.status().code(), Code::kResourceExhausted) << full.status().ToString();
  EXPECT_EQ(t.stats().slots_used, 4u);
  EXPECT_EQ(t.in_flight(), 0);
  t.Drop(2);
  for (const DiskCompletion& d : h.Write({4})) EXPECT_TRUE(d.status.ok());
  for (const DiskCompletion& d : h.Read({0, 1, 3, 4})) EXPECT_TRUE(d.status.ok());
  EXPECT_EQ(t.stats().slots_peak, 4u);
  h.ExpectNoLeaks();
}

TEST(DiskTier, FullQueueIsResourceExhaustedAndTakesNoSlot) {
  Harness h(MakeMemoryBackend(2));
  ASSERT_TRUE(h.ok());
  DiskTier& t = h.tier();
  ASSERT_TRUE(t.SubmitWrite(0, 1, h.Truth(0)).ok());
  ASSERT_TRUE(t.SubmitWrite(1, 1, h.Truth(1)).ok());
  EXPECT_EQ(t.SubmitWrite(2, 1, h.Truth(2)).status().code(), Code::kResourceExhausted);
  EXPECT_EQ(t.stats().slots_used, 2u);
  EXPECT_FALSE(t.Holds(2, 1));
  std::vector<DiskCompletion> done;
  ASSERT_TRUE(t.Reap(&done, 2).ok());
  ASSERT_TRUE(t.SubmitRead(0, 1, h.ReadBuffer(0)).ok());
  ASSERT_TRUE(t.SubmitRead(1, 1, h.ReadBuffer(1)).ok());
  EXPECT_EQ(t.SubmitRead(0, 1, h.ReadBuffer(2)).status().code(), Code::kResourceExhausted);
  EXPECT_EQ(t.Reap(&done, 3).code(), Code::kInvalidArgument);
  ASSERT_TRUE(t.Reap(&done, 2).ok());
  h.ExpectNoLeaks();
}

TEST(DiskTier, DropDuringIoFreesTheSlotWhenItCompletes) {
  Harness h(MakeMemoryBackend(kQueueDepth));
  ASSERT_TRUE(h.ok());
  DiskTier& t = h.tier();
  ASSERT_TRUE(t.SubmitWrite(0, 1, h.Truth(0)).ok());
  t.Drop(0);  // write in flight: the slot must stay taken until it lands
  EXPECT_EQ(t.stats().slots_used, 1u);
  EXPECT_EQ(t.SubmitWrite(0, 1, h.Truth(0)).status().code(), Code::kFailedPrecondition);
  std::vector<DiskCompletion> done;
  ASSERT_TRUE(t.Reap(&done, 1).ok());
  EXPECT_EQ(t.stats().slots_used, 0u);
  EXPECT_FALSE(t.Holds(0, 1));

  for (const DiskCompletion& d : h.Write({1})) EXPECT_TRUE(d.status.ok());
  ASSERT_TRUE(t.SubmitRead(1, 1, h.ReadBuffer(1)).ok());
  t.Drop(1);
  EXPECT_EQ(t.stats().slots_used, 1u);
  EXPECT_EQ(t.SubmitRead(1, 1, h.ReadBuffer(1)).status().code(), Code::kNotFound);
  done.clear();
  ASSERT_TRUE(t.Reap(&done, 1).ok());
  ASSERT_EQ(done.size(), 1u);
  EXPECT_TRUE(done[0].status.ok());  // the slot was not reused under the read
  EXPECT_EQ(std::memcmp(h.ReadBuffer(1), h.Truth(1), kPageBytes), 0);
  EXPECT_EQ(t.stats().slots_used, 0u);
}

TEST(DiskTier, DestructionWaitsForIoInFlight) {
  for (int i = 0; i < 3; ++i) {
    Result<std::unique_ptr<IoBackend>> io = i == 2 ? MakePreadPoolBackend(4, kQueueDepth)
                                                   : MakeUringBackend(kQueueDepth, /*sq_thread=*/i == 1);
    if (!io.ok()) continue;
    Harness h(std::move(*io));
    ASSERT_TRUE(h.ok());
    for (uint32_t id = 0; id < kQueueDepth; ++id) ASSERT_TRUE(h.tier().SubmitWrite(id, 1, h.Truth(id)).ok());
    // ~Harness destroys the tier before its region: the tier must reap first.
  }
}

// ---- the checksum -----------------------------------------------------------

TEST(PageChecksum, KeyedAndSensitiveToEveryBit) {
  std::vector<unsigned char> page(kPageBytes + 3);
  std::mt19937_64 rng(3);
  for (unsigned char& b : page) b = uint8_t(rng());
  const uint64_t sum = PageChecksum(page.data(), kPageBytes, 7, 1);
  EXPECT_EQ(sum, PageChecksum(page.data(), kPageBytes, 7, 1));
  EXPECT_NE(sum, PageChecksum(page.data(), kPageBytes, 7, 2));  // stale generation
  EXPECT_NE(sum, PageChecksum(page.data(), kPageBytes, 8, 1));  // another page's slot
  EXPECT_NE(sum, PageChecksum(page.data(), kPageBytes - 1, 7, 1));
  std::set<uint64_t> sums{sum};
  for (std::size_t i = 0; i < kPageBytes; i += 37) {
    page[i] ^= uint8_t(1u << (i % 8));
    sums.insert(PageChecksum(page.data(), kPageBytes, 7, 1));
    page[i] ^= uint8_t(1u << (i % 8));
  }
  EXPECT_EQ(sums.size(), 1 + (kPageBytes + 36) / 37);  // every flip changed it, no two alike
  for (std::size_t n : {0, 1, 7, 8, 9, 63, 64, 65}) {  // short lengths and every tail
    std::set<uint64_t> by_last_byte;
    for (int v = 0; v < 4 && n > 0; ++v) {
      page[n - 1] = uint8_t(v);
      by_last_byte.insert(PageChecksum(page.data(), n, 1, 1));
    }
    EXPECT_EQ(by_last_byte.size(), n > 0 ? 4u : 0u) << n;
  }
}

// ---- the assert pair --------------------------------------------------------

// What the pre-write check protects against: the page's bytes are damaged in
// host memory after it was sealed (a stray write, a reused slot, a copy still
// landing). Checksumming them afresh at write time would give the damage a
// matching checksum, and the read-side check could never catch it. So
// SubmitWrite checks the checksum taken at sealing against src right before
// submission and refuses. Remove that check and this test fails: the write is
// accepted.
TEST(DiskTier, SealedPageDamagedBeforeWriteIsRefused) {
  Harness h(MakeMemoryBackend(kQueueDepth));
  ASSERT_TRUE(h.ok());
  DiskTier& t = h.tier();
  const uint64_t sealed = h.Seal(5);
  h.Truth(5)[1234] ^= 0x20;
  const Result<uint64_t> w = t.SubmitWrite(5, 1, h.Truth(5), sealed);
  EXPECT_EQ(w.status().code(), Code::kCorruption) << w.status().ToString();
  EXPECT_EQ(t.stats().corruptions, 1);
  EXPECT_EQ(t.stats().slots_used, 0u);
  EXPECT_EQ(t.in_flight(), 0);
  EXPECT_FALSE(t.Holds(5, 1));
  h.Truth(5)[1234] ^= 0x20;  // the intact page writes fine afterwards
  for (const DiskCompletion& d : h.Write({5, 6})) EXPECT_TRUE(d.status.ok());
  for (const DiskCompletion& d : h.Read({5, 6})) EXPECT_TRUE(d.status.ok());
  h.ExpectNoLeaks();
}

// The other half: src changed after SubmitWrite (against the contract) while
// the write is queued — the memory backend transfers at completion, so the
// disk gets the changed bytes. The read-side check refuses them.
TEST(DiskTier, SourceChangedWhileWriteQueuedIsCaughtOnRead) {
  Harness h(MakeMemoryBackend(kQueueDepth));
  ASSERT_TRUE(h.ok());
  DiskTier& t = h.tier();
  ASSERT_TRUE(t.SubmitWrite(3, 1, h.Truth(3), h.Seal(3)).ok());
  h.Truth(3)[0] ^= 1;
  std::vector<DiskCompletion> done;
  ASSERT_TRUE(t.Reap(&done, 1).ok());
  ASSERT_TRUE(done[0].status.ok());
  h.Truth(3)[0] ^= 1;
  const std::vector<DiskCompletion> read = h.Read({3});
  EXPECT_EQ(read[0].status.code(), Code::kCorruption);
  EXPECT_EQ(t.stats().corruptions, 1);
  h.ExpectNoLeaks();
}

// ---- the pre-write check on the tier's own thread ---------------------------

// The damaged page of SealedPageDamagedBeforeWriteIsRefused, checked off the
// owner's thread: SubmitWrite takes a slot and a queue entry, and the write
// completes as a Corruption that frees them; nothing reaches the disk.
TEST(DiskTierChecksOffThread, DamagedPageCompletesAsCorruption) {
  Harness h(MakeMemoryBackend(kQueueDepth), 2 * kPages, /*checks_off_thread=*/true);
  ASSERT_TRUE(h.ok());
  DiskTier& t = h.tier();
  const uint64_t sealed = h.Seal(5);
  h.Truth(5)[1234] ^= 0x20;
  const Result<uint64_t> w = t.SubmitWrite(5, 1, h.Truth(5), sealed);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(t.in_flight(), 1);
  EXPECT_EQ(t.stats().slots_used, 1u);
  EXPECT_EQ(t.SubmitRead(5, 1, h.ReadBuffer(5)).status().code(), Code::kFailedPrecondition);
  std::vector<DiskCompletion> done;
  ASSERT_TRUE(t.Reap(&done, 1).ok());
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].ticket, *w);
  EXPECT_EQ(done[0].page_id, 5u);
  EXPECT_TRUE(done[0].is_write);
  EXPECT_EQ(done[0].status.code(), Code::kCorruption) << done[0].status.ToString();
  EXPECT_EQ(t.stats().corruptions, 1);
  EXPECT_EQ(t.stats().writes, 0);
  EXPECT_EQ(t.stats().slots_used, 0u);
  EXPECT_EQ(t.in_flight(), 0);
  EXPECT_FALSE(t.Holds(5, 1));
  EXPECT_EQ(t.SubmitRead(5, 1, h.ReadBuffer(5)).status().code(), Code::kNotFound);
  h.Truth(5)[1234] ^= 0x20;  // the intact page writes fine afterwards
  for (const DiskCompletion& d : h.Write({5, 6})) EXPECT_TRUE(d.status.ok());
  for (const DiskCompletion& d : h.Read({5, 6})) EXPECT_TRUE(d.status.ok());
  h.ExpectNoLeaks();
}

// Writes being checked hold their queue entries: the queue's bound covers
// them, and Reap may wait for them.
TEST(DiskTierChecksOffThread, WritesBeingCheckedCountAgainstTheQueue) {
  Harness h(MakeMemoryBackend(2), 2 * kPages, /*checks_off_thread=*/true);
  ASSERT_TRUE(h.ok());
  DiskTier& t = h.tier();
  ASSERT_TRUE(t.SubmitWrite(0, 1, h.Truth(0), h.Seal(0)).ok());
  ASSERT_TRUE(t.SubmitWrite(1, 1, h.Truth(1), h.Seal(1)).ok());
  EXPECT_EQ(t.in_flight(), 2);
  EXPECT_EQ(t.SubmitWrite(2, 1, h.Truth(2), h.Seal(2)).status().code(), Code::kResourceExhausted);
  EXPECT_EQ(t.stats().slots_used, 2u);
  std::vector<DiskCompletion> done;
  EXPECT_EQ(t.Reap(&done, 3).code(), Code::kInvalidArgument);
  ASSERT_TRUE(t.Reap(&done, 2).ok());
  ASSERT_EQ(done.size(), 2u);
  for (const DiskCompletion& d : done) EXPECT_TRUE(d.status.ok()) << d.status.ToString();
  EXPECT_TRUE(t.Holds(0, 1));
  EXPECT_TRUE(t.Holds(1, 1));
  h.ExpectNoLeaks();
}

// A page dropped while its write is being checked frees its slot when the
// write completes, good or refused.
TEST(DiskTierChecksOffThread, DropWhileCheckedFreesTheSlot) {
  Harness h(MakeMemoryBackend(kQueueDepth), 2 * kPages, /*checks_off_thread=*/true);
  ASSERT_TRUE(h.ok());
  DiskTier& t = h.tier();
  const uint64_t sealed1 = h.Seal(1);
  h.Truth(1)[9] ^= 1;  // page 1 is refused by its check
  ASSERT_TRUE(t.SubmitWrite(0, 1, h.Truth(0), h.Seal(0)).ok());
  ASSERT_TRUE(t.SubmitWrite(1, 1, h.Truth(1), sealed1).ok());
  t.Drop(0);
  t.Drop(1);
  EXPECT_EQ(t.stats().slots_used, 2u);
  std::vector<DiskCompletion> done;
  ASSERT_TRUE(t.Reap(&done, 2).ok());
  EXPECT_EQ(Codes(done), (std::map<Code, int>{{Code::kOk, 1}, {Code::kCorruption, 1}}));
  EXPECT_EQ(t.stats().slots_used, 0u);
  EXPECT_FALSE(t.Holds(0, 1));
  EXPECT_FALSE(t.Holds(1, 1));
}

// Destroying the tier with writes being checked and in the backend waits for
// both before its buffers can go.
TEST(DiskTierChecksOffThread, DestructionWaitsForChecksAndIo) {
  for (int i = 0; i < 3; ++i) {
    Result<std::unique_ptr<IoBackend>> io =
        i == 0 ? Result<std::unique_ptr<IoBackend>>(MakeMemoryBackend(kQueueDepth))
               : i == 1 ? MakePreadPoolBackend(4, kQueueDepth) : MakeUringBackend(kQueueDepth, /*sq_thread=*/true);
    if (!io.ok()) continue;
    Harness h(std::move(*io), 2 * kPages, /*checks_off_thread=*/true);
    ASSERT_TRUE(h.ok());
    for (uint32_t id = 0; id < kQueueDepth; ++id) ASSERT_TRUE(h.tier().SubmitWrite(id, 1, h.Truth(id), h.Seal(id)).ok());
  }
}

// ---- one test per fault kind ------------------------------------------------

TEST(DiskTierFaults, ReadEioIsIOErrorAndRetrySucceeds) {
  FaultPlan plan;
  plan.seed = 11;
  plan.read_eio = 0.3;
  Harness h(Faulty(plan));
  ASSERT_TRUE(h.ok());
  EXPECT_TRUE(WriteUntilHeld(h).empty());
  const std::vector<DiskCompletion> failed = ReadUntilGood(h);
  EXPECT_FALSE(failed.empty());
  EXPECT_EQ(Codes(failed), (std::map<Code, int>{{Code::kIOError, int(failed.size())}}));
  EXPECT_NE(failed[0].status.message().find("Input/output error"), std::string::npos) << failed[0].status.ToString();
  EXPECT_EQ(h.tier().stats().io_errors, int64_t(failed.size()));
  EXPECT_EQ(h.tier().stats().corruptions, 0);
  h.ExpectNoLeaks();
}

TEST(DiskTierFaults, WriteEioIsIOErrorFreesTheSlotAndRetrySucceeds) {
  FaultPlan plan;
  plan.seed = 12;
  plan.write_eio = 0.3;
  Harness h(Faulty(plan));
  ASSERT_TRUE(h.ok());
  const std::vector<DiskCompletion> failed = WriteUntilHeld(h);
  EXPECT_FALSE(failed.empty());
  EXPECT_EQ(Codes(failed), (std::map<Code, int>{{Code::kIOError, int(failed.size())}}));
  EXPECT_EQ(h.tier().stats().slots_peak, kPages);  // failed writes gave their slots back
  EXPECT_TRUE(ReadUntilGood(h).empty());
  EXPECT_EQ(h.tier().stats().io_errors, int64_t(failed.size()));
  h.ExpectNoLeaks();
}

TEST(DiskTierFaults, ShortReadIsIOErrorAndNeverServed) {
  FaultPlan plan;
  plan.seed = 13;
  plan.short_read = 0.3;
  Harness h(Faulty(plan));
  ASSERT_TRUE(h.ok());
  EXPECT_TRUE(WriteUntilHeld(h).empty());
  const std::vector<DiskCompletion> failed = ReadUntilGood(h);
  EXPECT_FALSE(failed.empty());
  EXPECT_EQ(Codes(failed), (std::map<Code, int>{{Code::kIOError, int(failed.size())}}));
  EXPECT_NE(failed[0].status.message().find("short transfer"), std::string::npos) << failed[0].status.ToString();
  h.ExpectNoLeaks();
}

TEST(DiskTierFaults, ShortWriteIsIOErrorFreesTheSlotAndRetrySucceeds) {
  FaultPlan plan;
  plan.seed = 14;
  plan.short_write = 0.3;
  Harness h(Faulty(plan));
  ASSERT_TRUE(h.ok());
  const std::vector<DiskCompletion> failed = WriteUntilHeld(h);
  EXPECT_FALSE(failed.empty());
  EXPECT_EQ(Codes(failed), (std::map<Code, int>{{Code::kIOError, int(failed.size())}}));
  EXPECT_TRUE(ReadUntilGood(h).empty());
  h.ExpectNoLeaks();
}

TEST(DiskTierFaults, EnospcIsIOErrorAndOtherPagesKeepWriting) {
  FaultPlan plan;
  plan.seed = 15;
  plan.write_enospc = 0.3;
  Harness h(Faulty(plan));
  ASSERT_TRUE(h.ok());
  const std::vector<DiskCompletion> failed = WriteUntilHeld(h);
  EXPECT_FALSE(failed.empty());
  EXPECT_EQ(Codes(failed), (std::map<Code, int>{{Code::kIOError, int(failed.size())}}));
  EXPECT_NE(failed[0].status.message().find("No space"), std::string::npos) << failed[0].status.ToString();
  EXPECT_TRUE(ReadUntilGood(h).empty());
  h.ExpectNoLeaks();
}

TEST(DiskTierFaults, DelayedAndReorderedCompletionsStayCorrect) {
  FaultPlan plan;
  plan.seed = 16;
  plan.delay = 0.5;
  Harness h(Faulty(plan));
  ASSERT_TRUE(h.ok());
  const std::vector<DiskCompletion> writes = h.Write(AllPages());
  const std::vector<DiskCompletion> reads = h.Read(AllPages());
  int out_of_order = 0;
  for (const auto* done : {&writes, &reads}) {
    EXPECT_TRUE(Failed(*done).empty());
    for (std::size_t i = 1; i < done->size(); ++i) out_of_order += (*done)[i].ticket < (*done)[i - 1].ticket;
  }
  EXPECT_GT(out_of_order, 0);
  EXPECT_EQ(h.tier().stats().reads, kPages);
  h.ExpectNoLeaks();
}

// Fails if the read-side check is removed: the flipped byte would be served.
TEST(DiskTierFaults, CorruptedByteIsCorruptionAndNeverServed) {
  FaultPlan plan;
  plan.seed = 17;
  plan.corrupt_read = 0.3;
  Harness h(Faulty(plan));
  ASSERT_TRUE(h.ok());
  EXPECT_TRUE(WriteUntilHeld(h).empty());
  const std::vector<DiskCompletion> failed = ReadUntilGood(h);  // the disk copy is intact: retries succeed
  EXPECT_FALSE(failed.empty());
  EXPECT_EQ(Codes(failed), (std::map<Code, int>{{Code::kCorruption, int(failed.size())}}));
  EXPECT_EQ(h.tier().stats().corruptions, int64_t(failed.size()));
  EXPECT_EQ(h.tier().stats().io_errors, 0);
  h.ExpectNoLeaks();
}

// Every write lands one slot away and says it succeeded, so each slot holds a
// neighbour's complete, well-formed page (or nothing). Fails if the read-side
// check is removed: those neighbours' bytes would be served as good.
TEST(DiskTierFaults, MisdirectedWritesAreCorruptionAndNeverServed) {
  FaultPlan plan;
  plan.seed = 18;
  plan.misdirected_write = 1;
  Harness h(Faulty(plan));
  ASSERT_TRUE(h.ok());
  for (const DiskCompletion& d : h.Write(AllPages())) EXPECT_TRUE(d.status.ok());  // the lie
  const std::vector<DiskCompletion> reads = h.Read(AllPages());
  const std::map<Code, int> codes = Codes(reads);
  EXPECT_EQ(codes.count(Code::kOk), 0u);
  EXPECT_GT(codes.count(Code::kCorruption) ? codes.at(Code::kCorruption) : 0, int(kPages) / 2);
  EXPECT_EQ(h.tier().stats().corruptions, codes.at(Code::kCorruption));
  h.ExpectNoLeaks();
}

// Some writes misdirected: the caller drops what reads back corrupt and
// writes it again; the tier keeps serving the rest throughout.
TEST(DiskTierFaults, AfterMisdirectedWritesRewrittenPagesServeAgain) {
  FaultPlan plan;
  plan.seed = 19;
  plan.misdirected_write = 0.2;
  Harness h(Faulty(plan));
  ASSERT_TRUE(h.ok());
  for (const DiskCompletion& d : h.Write(AllPages())) EXPECT_TRUE(d.status.ok());
  int corrupt = 0, good = 0;
  std::vector<uint32_t> todo = AllPages();
  for (int attempt = 0; attempt < 50 && !todo.empty(); ++attempt) {
    const std::vector<DiskCompletion> reads = h.Read(todo);
    todo = Failed(reads);
    good += int(reads.size() - todo.size());
    corrupt += int(todo.size());
    for (uint32_t id : todo) h.tier().Drop(id);
    h.Write(todo);
  }
  EXPECT_TRUE(todo.empty());
  EXPECT_GT(corrupt, 0);
  EXPECT_GT(good, int(kPages) / 2);
  h.ExpectNoLeaks();
}

// All faults at once, over real files: the invariants still hold, and the
// run reproduces for its seed with the memory backend.
std::vector<std::pair<uint64_t, Code>> MixedFaults(std::unique_ptr<IoBackend> inner, uint64_t seed,
                                                   bool checks_off_thread = false) {
  FaultPlan plan;
  plan.seed = seed;
  plan.read_eio = plan.write_eio = plan.write_enospc = 0.05;
  plan.short_read = plan.short_write = plan.corrupt_read = plan.misdirected_write = 0.05;
  plan.delay = 0.2;
  Harness h(MakeFaultInjectingBackend(std::move(inner), plan), 2 * kPages, checks_off_thread);
  EXPECT_TRUE(h.ok());
  if (!h.ok()) return {};
  std::vector<std::pair<uint64_t, Code>> log;
  for (int round = 0; round < 3; ++round) {
    std::vector<uint32_t> held;
    for (const DiskCompletion& d : h.Write(AllPages())) {
      log.emplace_back(d.ticket, d.status.code());
      if (d.status.ok()) held.push_back(d.page_id);
    }
    for (const DiskCompletion& d : h.Read(held)) log.emplace_back(d.ticket, d.status.code());
    for (uint32_t id = 0; id < kPages; ++id) {
      h.tier().Drop(id);
      h.SetTruth(id, h.generation(id) + 1);
    }
    EXPECT_EQ(h.tier().stats().slots_used, 0u);
  }
  const DiskStats& s = h.tier().stats();
  int errors = 0;
  for (const auto& [ticket, code] : log) errors += code != Code::kOk;
  EXPECT_EQ(s.io_errors + s.corruptions, errors);
  h.ExpectNoLeaks();
  return log;
}

TEST(DiskTierFaults, MixedFaultsOnRealFilesKeepTheInvariants) {
  auto pread = MakePreadPoolBackend(4, kQueueDepth);
  ASSERT_TRUE(pread.ok());
  MixedFaults(std::move(*pread), 21);
  if (auto uring = MakeUringBackend(kQueueDepth); uring.ok()) MixedFaults(std::move(*uring), 22);
  if (auto sqpoll = MakeUringBackend(kQueueDepth, /*sq_thread=*/true); sqpoll.ok()) MixedFaults(std::move(*sqpoll), 24);
}

TEST(DiskTierFaults, MixedFaultsWithChecksOffThreadKeepTheInvariants) {
  MixedFaults(MakeMemoryBackend(kQueueDepth, 5), 25, /*checks_off_thread=*/true);
  auto pread = MakePreadPoolBackend(4, kQueueDepth);
  ASSERT_TRUE(pread.ok());
  MixedFaults(std::move(*pread), 26, /*checks_off_thread=*/true);
  if (auto sqpoll = MakeUringBackend(kQueueDepth, /*sq_thread=*/true); sqpoll.ok())
    MixedFaults(std::move(*sqpoll), 27, /*checks_off_thread=*/true);
}

TEST(DiskTierFaults, AFailingSeedReproduces) {
  const auto a = MixedFaults(MakeMemoryBackend(kQueueDepth), 23);
  const auto b = MixedFaults(MakeMemoryBackend(kQueueDepth), 23);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, MixedFaults(MakeMemoryBackend(kQueueDepth), 24));
}

// ---- the probe --------------------------------------------------------------

TEST(DiskProbe, MeasuresEveryPathAndLeavesNothingBehind) {
  TempDir dir;
  const std::string probe_dir = dir.path() + "/probe";
  EXPECT_EQ(ProbeDiskReads(probe_dir, 1 << 20, 1000, 4, 0.01).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(ProbeDiskReads(probe_dir, 4096, 65536, 4, 0.01).status().code(), Code::kInvalidArgument);
  Result<DiskProbeResult> r = ProbeDiskReads(probe_dir, 4 << 20, 65536, 4, 0.02);
  if (r.status().code() == Code::kUnimplemented) GTEST_SKIP() << r.status().ToString();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_GT(r->raw_uring_gbps, 0);
  EXPECT_GT(r->raw_uring_touched_gbps, 0);
  EXPECT_GT(r->tier_uring_gbps, 0);
  EXPECT_GT(r->tier_pread_gbps, 0);
  EXPECT_GT(r->tier_write_gbps, 0);
  EXPECT_EQ(r->block_bytes, 65536u);
  EXPECT_EQ(r->uring_backend.substr(0, 8), "io_uring");
  EXPECT_FALSE(std::filesystem::exists(probe_dir));
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

}  // namespace
}  // namespace questkv
