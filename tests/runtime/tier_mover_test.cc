// TierMover without an hbm cache, as the CUDA backend drives it: two-phase
// seals, the home listener (the device's host_addr mirror), EnsureHost and
// HostHome across demotion and promotion, and demotion order. Plain model:
// a map of what each page's home should hold and whether it is readable.
#include "prefetch/tier_mover.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <thread>
#include <vector>

#include "tests/testing/reference.h"
#include "tiers/checksum.h"

namespace questkv {
namespace {

class TierMoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    g_ = Geometry{1, 2, 1, 8, 4, DType::kF16};  // page: 2 * 1 * 4 * 8 * 2 B = 128 B
    auto host = SlotArena::Create(1024, kHostSlots, "host");
    ASSERT_TRUE(host.ok());
    host_ = std::move(*host);
    dir_ = std::filesystem::temp_directory_path() / ("questkv_mover_" + std::to_string(::getpid()));
    OpenMover(dir_.string(), 1 << 20);
  }
  void TearDown() override {
    mover_.reset();
    disk_.reset();
    std::filesystem::remove_all(dir_);
    std::filesystem::remove_all(dir_.string() + "-small");
    std::filesystem::remove_all(dir_.string() + "-deep");
  }
  // A fresh mover (by default high water 6, low water 4 of the 8 host
  // slots) over a disk tier of `bytes` in `dir` whose queue holds `depth` I/Os.
  void OpenMover(const std::string& dir, std::size_t bytes, int depth = 4, double high = 0.75, double low = 0.5,
                 bool checks_off_thread = false) {
    mover_.reset();
    disk_.reset();
    DiskTierOptions options{dir, bytes, g_.page_bytes()};
    options.check_writes_off_thread = checks_off_thread;
    auto disk = DiskTier::Open(options, MakeMemoryBackend(depth));
    ASSERT_TRUE(disk.ok()) << disk.status().ToString();
    disk_ = std::move(*disk);
    ASSERT_TRUE(disk_->RegisterRegion(host_->base(), host_->bytes()).ok());
    mover_ = std::make_unique<TierMover>(g_, high, low, kPages, host_.get(), disk_.get());
    mover_->SetHomeListener([this](uint32_t page, const void* home) { published_[page] = home; });
  }
  // SetUp's mover over a disk tier of `bytes`.
  void UseSmallDisk(std::size_t bytes) { OpenMover(dir_.string() + "-small", bytes); }
  // Seals `page` with bytes derived from `seed` through SealBegin/SealEnd.
  void SealPage(uint32_t page, uint8_t seed, int64_t step) {
    auto home = mover_->SealBegin(page, /*generation=*/1, step);
    ASSERT_TRUE(home.ok()) << home.status().ToString();
    EXPECT_EQ(mover_->HostHome(page), nullptr) << "readable before SealEnd";
    std::vector<uint8_t> bytes(g_.page_bytes());
    for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = uint8_t(seed + i);
    std::memcpy(*home, bytes.data(), bytes.size());
    truth_[page] = bytes;
    mover_->SealEnd(page);
    EXPECT_EQ(mover_->HostHome(page), *home);
    EXPECT_EQ(published_[page], *home);
  }
  // A mover with high water 4 and low water 2 of the 8 host slots
  // (the disk queue holds 4 I/Os); pages 0..4 sealed with bytes from
  // `seed` * page, page p last selected at step p + 2; two pumps put the
  // three coldest (0, 1, 2) on disk.
  void DeadlineWithThreeOnDisk(uint8_t seed) {
    mover_ = std::make_unique<TierMover>(g_, 0.5, 0.25, kPages, host_.get(), disk_.get());
    mover_->SetHomeListener([this](uint32_t page, const void* home) { published_[page] = home; });
    for (uint32_t p = 0; p < 5; ++p) SealPage(p, uint8_t(seed * p), 1);
    for (uint32_t p = 0; p < 5; ++p) mover_->NoteSelected(p, p + 2);
    ASSERT_TRUE(mover_->Pump(20).ok());
    ASSERT_TRUE(mover_->Pump(21).ok());
    for (uint32_t p : {0u, 1u, 2u}) ASSERT_EQ(mover_->HostHome(p), nullptr) << "page " << p;
  }
  // The fixture's mover (high water 6, low water 4 of 8 slots):
  // pages 0..6 sealed with bytes from `seed` * page, page p last selected at
  // step p + 2; two pumps put the three coldest (0, 1, 2) on disk.
  void StrictWithThreeOnDisk(uint8_t seed) {
    for (uint32_t p = 0; p < 7; ++p) SealPage(p, uint8_t(seed * p), 1);
    for (uint32_t p = 0; p < 7; ++p) mover_->NoteSelected(p, p + 2);
    ASSERT_TRUE(mover_->Pump(20).ok());
    ASSERT_TRUE(mover_->Pump(21).ok());
    for (uint32_t p : {0u, 1u, 2u}) ASSERT_EQ(mover_->HostHome(p), nullptr) << "page " << p;
  }
  // Every page's home, where readable, holds its bytes, and the listener's
  // view equals HostHome.
  void CheckHomes() {
    for (const auto& [page, bytes] : truth_) {
      const void* home = mover_->HostHome(page);
      EXPECT_EQ(published_[page], home) << "page " << page;
      if (home) {
        EXPECT_EQ(std::memcmp(home, bytes.data(), bytes.size()), 0) << "page " << page;
      }
    }
  }

  static constexpr uint32_t kHostSlots = 8, kPages = 64;
  Geometry g_;
  std::unique_ptr<SlotArena> host_;
  std::unique_ptr<DiskTier> disk_;
  std::unique_ptr<TierMover> mover_;
  std::filesystem::path dir_;
  std::map<uint32_t, const void*> published_;
  std::map<uint32_t, std::vector<uint8_t>> truth_;
};

TEST_F(TierMoverTest, SealsDemotesAndPromotesWithTheListenerInStep) {
  int64_t step = 1;
  for (uint32_t p = 0; p < 20; ++p) {  // more pages than host slots: seals demote to make room
    SealPage(p, uint8_t(3 * p), step);
    CheckHomes();
  }
  EXPECT_GT(mover_->stats().demotions + int64_t(disk_->in_flight()), 0);
  EXPECT_LE(host_->used(), kHostSlots);
  // Every page can be made readable again, with its bytes.
  for (uint32_t p = 0; p < 20; ++p) {
    ++step;
    ASSERT_TRUE(mover_->EnsureHost(p, 1, step).ok()) << "page " << p;
    ASSERT_NE(mover_->HostHome(p), nullptr);
    CheckHomes();
  }
  EXPECT_GT(mover_->stats().promotions, 0);
  EXPECT_EQ(mover_->stats().prefetches, 0);  // promotions of missed pages are not prefetches
  // A drop unpublishes.
  mover_->Drop(7);
  EXPECT_EQ(published_[7], nullptr);
  EXPECT_EQ(mover_->HostHome(7), nullptr);
}

// A host copy damaged after its seal is never written to disk, and once its
// demotion's check finds it, never served again: on the decoding thread
// (refused by SubmitWrite) or on the disk tier's own (the write's completion).
class TierMoverChecks : public TierMoverTest, public ::testing::WithParamInterface<bool> {};

TEST_P(TierMoverChecks, AHostCopyDamagedAfterItsSealIsNeverWrittenNorServed) {
  ASSERT_NO_FATAL_FAILURE(OpenMover(dir_.string(), 1 << 20, 4, 0.75, 0.5, /*checks_off_thread=*/GetParam()));
  for (uint32_t p = 0; p < 7; ++p) SealPage(p, uint8_t(5 * p), 1);
  for (uint32_t p = 0; p < 7; ++p) mover_->NoteSelected(p, p + 2);
  static_cast<uint8_t*>(const_cast<void*>(mover_->HostHome(0)))[7] ^= 0x40;  // page 0, the coldest
  ASSERT_TRUE(mover_->Pump(20).ok());
  for (int i = 0; i < 5000 && disk_->in_flight() > 0; ++i) {  // the checks run beside the pumps
    ASSERT_TRUE(mover_->Pump(21).ok());
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  ASSERT_EQ(disk_->in_flight(), 0);
  EXPECT_EQ(mover_->stats().corruptions, 1);
  EXPECT_EQ(disk_->stats().corruptions, 1);
  EXPECT_EQ(mover_->stats().write_errors, 0) << "the disk is not at fault";
  EXPECT_EQ(mover_->stats().demotions, 2);  // pages 1 and 2, down to the low-water mark
  EXPECT_FALSE(disk_->Holds(0, 1));
  EXPECT_EQ(mover_->HostHome(0), nullptr);
  EXPECT_EQ(published_[0], nullptr);
  EXPECT_EQ(mover_->EnsureHost(0, 1, 22).code(), Code::kCorruption);
  for (uint32_t p : {1u, 2u}) {
    ASSERT_EQ(mover_->HostHome(p), nullptr) << "page " << p;
    ASSERT_TRUE(mover_->EnsureHost(p, 1, 22).ok()) << "page " << p;
  }
  truth_.erase(0);
  CheckHomes();
}

INSTANTIATE_TEST_SUITE_P(CheckThreads, TierMoverChecks, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("OffThread") : std::string("Inline");
                         });

TEST_F(TierMoverTest, DemotionTakesTheColdestAndSparesPagesSelectedSince) {
  // Pages 0..6 fill 7 of 8 host slots (high water 6), page p last selected at step p + 2.
  for (uint32_t p = 0; p < 7; ++p) SealPage(p, uint8_t(p), 1);
  for (uint32_t p = 0; p < 7; ++p) mover_->NoteSelected(p, p + 2);
  ASSERT_TRUE(mover_->Pump(20).ok());  // down to low water (4): the three coldest go
  ASSERT_TRUE(mover_->Pump(21).ok());  // their writes complete
  for (uint32_t p : {0u, 1u, 2u}) EXPECT_EQ(mover_->HostHome(p), nullptr) << "page " << p;
  for (uint32_t p : {3u, 4u, 5u, 6u}) EXPECT_NE(mover_->HostHome(p), nullptr) << "page " << p;
  // Refill, and select page 3 — the next coldest by the order made at step 20.
  for (uint32_t p = 7; p < 10; ++p) SealPage(p, uint8_t(p), 21);
  mover_->NoteSelected(3, 21);
  ASSERT_TRUE(mover_->Pump(22).ok());
  ASSERT_TRUE(mover_->Pump(23).ok());
  EXPECT_NE(mover_->HostHome(3), nullptr) << "a page selected since the order was made was demoted";
  for (uint32_t p : {4u, 5u, 6u}) EXPECT_EQ(mover_->HostHome(p), nullptr) << "page " << p;
  EXPECT_LE(host_->used(), 6u);
  CheckHomes();
}

// A report's pages noted together are as recent as pages noted one by one
// (a page listed twice among them included): the others are demoted first.
TEST_F(TierMoverTest, PagesNotedTogetherCountAsNotedOneByOne) {
  for (uint32_t p = 0; p < 7; ++p) SealPage(p, uint8_t(p), 1);
  for (uint32_t p : {4u, 5u, 6u}) mover_->NoteSelected(p, 5);
  const std::vector<uint32_t> report = {2, 0, 3, 2, 1};
  mover_->NoteSelected(std::span<const uint32_t>(report), 10);
  ASSERT_TRUE(mover_->Pump(20).ok());  // down to low water (4): the three coldest go
  ASSERT_TRUE(mover_->Pump(21).ok());
  for (uint32_t p : {4u, 5u, 6u}) EXPECT_EQ(mover_->HostHome(p), nullptr) << "page " << p;
  for (uint32_t p : {0u, 1u, 2u, 3u}) EXPECT_NE(mover_->HostHome(p), nullptr) << "page " << p;
  CheckHomes();
}

// An order lives 64 model steps — 64 * 2 * layers runtime steps, the
// runtime's step advancing twice a decode call — unless it runs out: at 1M
// tokens building one scans every host page (~45 ms).
TEST_F(TierMoverTest, ADemotionOrderLastsSixtyFourModelSteps) {
  Geometry g32 = g_;
  g32.layers = 32;
  const int64_t age = 64 * 2 * 32;
  mover_ = std::make_unique<TierMover>(g32, 0.75, 0.5, kPages, host_.get(), disk_.get());
  mover_->SetHomeListener([this](uint32_t page, const void* home) { published_[page] = home; });
  // Pages 0..6 fill 7 of 8 host slots (high water 6); the order made at
  // step 20 holds them all, the coldest three go.
  for (uint32_t p = 0; p < 7; ++p) SealPage(p, uint8_t(p), 1);
  for (uint32_t p = 0; p < 7; ++p) mover_->NoteSelected(p, p + 2);
  ASSERT_TRUE(mover_->Pump(20).ok());
  ASSERT_TRUE(mover_->Pump(21).ok());
  EXPECT_EQ(mover_->stats().demotion_orders, 1);
  // Refilled and pumped an age later: the same order serves (3 goes next).
  for (uint32_t p = 7; p < 10; ++p) SealPage(p, uint8_t(p), 21);
  ASSERT_TRUE(mover_->Pump(20 + age).ok());
  ASSERT_TRUE(mover_->Pump(21 + age).ok());
  EXPECT_EQ(mover_->stats().demotion_orders, 1) << "an order younger than 64 model steps was rebuilt";
  EXPECT_EQ(mover_->HostHome(3), nullptr);
  // Past that age it is rebuilt.
  for (uint32_t p = 10; p < 13; ++p) SealPage(p, uint8_t(p), 22 + age);
  ASSERT_TRUE(mover_->Pump(21 + age + age).ok());
  EXPECT_EQ(mover_->stats().demotion_orders, 2);
  ASSERT_TRUE(mover_->Pump(22 + age + age).ok());  // the writes complete
  EXPECT_LE(host_->used(), 6u);
  CheckHomes();
}

// A promotion that waits for room takes it from a promoted page (its disk
// copy exists: no write) before writing any, once a model step (two runtime
// steps at one layer) has passed since that page landed and since it was
// last selected.
TEST_F(TierMoverTest, AWaitForRoomDropsAPromotedPageBeforeWriting) {
  StrictWithThreeOnDisk(13);  // 0, 1, 2 on disk; 3..6 (last selected at 5..8) on the host
  if (HasFatalFailure()) return;
  ASSERT_TRUE(mover_->EnsureHost(0, 1, 30).ok());  // lands at step 30
  mover_->NoteSelected(0, 28);
  for (uint32_t p = 7; p < 10; ++p) SealPage(p, uint8_t(7 * p), 30);
  ASSERT_EQ(host_->used(), kHostSlots);
  // One runtime step after page 0 landed: too young to leave, so page 1's
  // promotion waits for writes (the coldest, down to the low-water mark).
  int64_t writes = mover_->stats().demotions;
  ASSERT_TRUE(mover_->EnsureHost(1, 1, 31).ok());
  ASSERT_TRUE(mover_->Pump(31).ok());  // the rest of the writes complete
  EXPECT_EQ(mover_->stats().demotions - writes, 4);
  EXPECT_EQ(mover_->stats().clean_drops, 0);
  ASSERT_NE(mover_->HostHome(0), nullptr) << "a page promoted a runtime step ago left";

  // A model step after it landed, page 0 makes room for page 2 at no write.
  for (uint32_t p = 10; p < 13; ++p) SealPage(p, uint8_t(7 * p), 32);
  ASSERT_EQ(host_->used(), kHostSlots);
  writes = mover_->stats().demotions;
  ASSERT_TRUE(mover_->EnsureHost(2, 1, 32).ok());
  EXPECT_EQ(mover_->HostHome(0), nullptr) << "pages were written while a promoted page could leave";
  EXPECT_EQ(mover_->stats().clean_drops, 1);
  EXPECT_EQ(mover_->stats().demotions, writes);
  EXPECT_EQ(disk_->in_flight(), 0);

  // Page 1, promoted before page 2 but selected a runtime step ago, stays;
  // page 2 leaves to make room for page 0, which reads back from disk.
  mover_->NoteSelected(1, 40);
  ASSERT_EQ(host_->used(), kHostSlots);
  ASSERT_TRUE(mover_->EnsureHost(0, 1, 41).ok());
  EXPECT_NE(mover_->HostHome(1), nullptr) << "a promoted page selected a runtime step ago left";
  EXPECT_EQ(mover_->HostHome(2), nullptr);
  EXPECT_EQ(mover_->stats().clean_drops, 2);
  EXPECT_EQ(mover_->stats().demotions, writes);
  CheckHomes();
}

TEST_F(TierMoverTest, MissedPagesPromoteAboveHighWaterSpeculativeReadsDoNot) {
  // Pages 0..6 take 7 of 8 slots (high water 6); the three coldest (0, 1, 2) go to disk.
  StrictWithThreeOnDisk(5);
  if (HasFatalFailure()) return;
  SealPage(7, 70, 21);
  SealPage(8, 80, 21);
  ASSERT_EQ(host_->used(), 6u);  // at the high-water mark
  ASSERT_TRUE(mover_->Prefetch(0, /*ahead=*/true).ok());
  EXPECT_EQ(host_->used(), 6u) << "a speculative read went past the high-water mark";
  ASSERT_TRUE(mover_->Prefetch(0, /*ahead=*/false).ok());
  EXPECT_EQ(host_->used(), 7u) << "a missed page was not promoted above the high-water mark";
  ASSERT_TRUE(mover_->Prefetch(1, /*ahead=*/false).ok());
  EXPECT_EQ(host_->used(), 8u);
  ASSERT_TRUE(mover_->Prefetch(2, /*ahead=*/false).ok());  // host full: nothing started, no error
  EXPECT_EQ(host_->used(), 8u);
  for (uint32_t p : {0u, 1u}) {
    ASSERT_TRUE(mover_->EnsureHost(p, 1, 22).ok());
    EXPECT_NE(mover_->HostHome(p), nullptr);
  }
  EXPECT_EQ(mover_->stats().promotions, 2);
  EXPECT_EQ(mover_->stats().prefetches, 0);
  CheckHomes();
}

// Under strict a step's cold misses are queued together (Prefetch), then
// waited for one by one (EnsureHost): the first wait starts the others' reads
// in the room its demotions made, instead of each waiting for its own.
TEST_F(TierMoverTest, WaitingForOneMissStartsTheQueuedOnes) {
  StrictWithThreeOnDisk(11);
  if (HasFatalFailure()) return;
  for (uint32_t p = 7; p < 11; ++p) SealPage(p, uint8_t(11 * p), 21);
  ASSERT_EQ(host_->used(), kHostSlots);
  for (uint32_t p : {0u, 1u, 2u}) {
    mover_->NoteSelected(p, 22);
    ASSERT_TRUE(mover_->Prefetch(p, /*ahead=*/false).ok());
  }
  ASSERT_EQ(mover_->pending_promotions(), 3u) << "the host was full: every read should wait for room";
  ASSERT_TRUE(mover_->EnsureHost(0, 1, 22).ok());
  EXPECT_EQ(mover_->pending_promotions(), 0u);
  for (uint32_t p : {0u, 1u, 2u}) EXPECT_NE(mover_->HostHome(p), nullptr) << "page " << p << " was not promoted";
  EXPECT_EQ(mover_->stats().promotions, 3);
  for (uint32_t p : {1u, 2u}) ASSERT_TRUE(mover_->EnsureHost(p, 1, 22).ok());
  EXPECT_EQ(mover_->stats().promotions, 3);
  CheckHomes();
}

TEST_F(TierMoverTest, BackgroundDemotionLeavesQueueRoomForPromotions) {
  DeadlineWithThreeOnDisk(7);
  if (HasFatalFailure()) return;
  for (uint32_t p = 5; p < 9; ++p) SealPage(p, uint8_t(7 * p), 21);
  ASSERT_EQ(host_->used(), 6u);
  ASSERT_TRUE(mover_->Pump(22).ok());  // wants 4 writes; 3 go, one queue slot stays free
  EXPECT_EQ(disk_->in_flight(), 3);
  ASSERT_TRUE(mover_->Prefetch(0, /*ahead=*/false).ok());
  EXPECT_EQ(host_->used(), 7u) << "the missed page found no room in the I/O queue";
  ASSERT_TRUE(mover_->EnsureHost(0, 1, 23).ok());
  EXPECT_NE(mover_->HostHome(0), nullptr);
  ASSERT_TRUE(mover_->Pump(24).ok());
  CheckHomes();
}

// Under deadline a missed page's promotion queues behind a full host; the
// next Pump gives it the room of a clean home (a promoted page, its disk copy
// kept) not selected for a model step, instead of waiting for writes that a
// full disk would refuse.
TEST_F(TierMoverTest, QueuedMissesTakeTheRoomOfCleanHomesAModelStepOld) {
  DeadlineWithThreeOnDisk(15);  // 0, 1, 2 on disk; 3, 4 on the host
  if (HasFatalFailure()) return;
  mover_->NoteSelected(0, 22);
  ASSERT_TRUE(mover_->EnsureHost(0, 1, 22).ok());  // promoted: host and disk copies
  for (uint32_t p = 5; p < 10; ++p) SealPage(p, uint8_t(15 * p), 22);
  ASSERT_EQ(host_->used(), kHostSlots);
  mover_->NoteSelected(1, 30);
  ASSERT_TRUE(mover_->Prefetch(1, /*ahead=*/false).ok());
  ASSERT_EQ(mover_->pending_promotions(), 1u) << "the host was full: the read should wait for room";
  ASSERT_TRUE(mover_->Pump(30).ok());
  EXPECT_EQ(mover_->pending_promotions(), 0u) << "the missed page still waits for room";
  EXPECT_EQ(mover_->stats().clean_drops, 1);
  EXPECT_EQ(mover_->HostHome(0), nullptr) << "the clean home a model step old stayed";
  ASSERT_TRUE(mover_->EnsureHost(1, 1, 30).ok());
  EXPECT_NE(mover_->HostHome(1), nullptr);
  EXPECT_EQ(mover_->stats().promotions, 2);
  CheckHomes();
}

// The room goes only to reads that can start, less the slots already on
// their way back: with six missed pages queued and an I/O queue of four, four
// clean homes leave, and none more while the device still reads theirs.
TEST_F(TierMoverTest, QueuedMissesTakeOnlyTheRoomTheirReadsCanUse) {
  mover_ = std::make_unique<TierMover>(g_, 0.5, 0.25, kPages, host_.get(), disk_.get());
  mover_->SetHomeListener([this](uint32_t page, const void* home) { published_[page] = home; });
  uint64_t queued = 0, done = 0;
  mover_->SetDeviceReads({[&] { return queued; }, [&](bool wait) -> Result<uint64_t> {
                            if (wait) done = queued;
                            return done;
                          }});
  auto settle = [&](int64_t step) {  // demotions down to the low-water mark, their writes done
    for (int i = 0; i < 20 && (host_->used() > 2 || disk_->in_flight() > 0); ++i) ASSERT_TRUE(mover_->Pump(step).ok());
    ASSERT_EQ(host_->used(), 2u);
  };
  for (uint32_t p = 0; p < 8; ++p) SealPage(p, uint8_t(5 * p), 1);
  ASSERT_NO_FATAL_FAILURE(settle(2));
  for (uint32_t p = 8; p < 14; ++p) SealPage(p, uint8_t(5 * p), 3);
  ASSERT_NO_FATAL_FAILURE(settle(4));
  std::vector<uint32_t> on_disk;
  for (uint32_t p = 0; p < 14; ++p)
    if (!mover_->HostHome(p)) on_disk.push_back(p);
  ASSERT_EQ(on_disk.size(), 12u);
  for (int i = 0; i < 6; ++i) {  // six promoted: clean homes, selected at step 10
    mover_->NoteSelected(on_disk[i], 10);
    ASSERT_TRUE(mover_->EnsureHost(on_disk[i], 1, 10).ok());
  }
  ASSERT_EQ(host_->used(), kHostSlots);
  for (int i = 6; i < 12; ++i) {
    mover_->NoteSelected(on_disk[i], 20);
    ASSERT_TRUE(mover_->Prefetch(on_disk[i], /*ahead=*/false).ok());
  }
  ASSERT_EQ(mover_->pending_promotions(), 6u);
  ASSERT_EQ(disk_->in_flight(), 0);
  const std::size_t depth = std::size_t(disk_->queue_depth());
  queued = 1;  // a call that may read every readable home, not yet done
  ASSERT_TRUE(mover_->Pump(20).ok());
  EXPECT_EQ(std::size_t(mover_->stats().clean_drops), depth) << "dropped more homes than reads could start";
  EXPECT_EQ(mover_->retired_slots(), depth);
  ASSERT_TRUE(mover_->Pump(21).ok());
  EXPECT_EQ(std::size_t(mover_->stats().clean_drops), depth) << "dropped again for room already on its way";
  EXPECT_EQ(mover_->pending_promotions(), 6u);
  done = 1;  // the call is done: the room comes back and the reads start
  ASSERT_TRUE(mover_->Pump(22).ok());
  EXPECT_EQ(mover_->pending_promotions(), 6u - depth);
  for (int step = 23; step < 60 && mover_->pending_promotions() > 0; ++step) {
    done = queued;
    ASSERT_TRUE(mover_->Pump(step).ok());
  }
  EXPECT_EQ(mover_->pending_promotions(), 0u);
  for (int i = 6; i < 12; ++i) ASSERT_TRUE(mover_->EnsureHost(on_disk[i], 1, 60).ok());
  CheckHomes();
}

// Missed pages waiting for host room add their count to a Pump's demotion
// writes: with four queued behind a full host, one Pump writes eight (down
// to the low-water mark), not kPumpWrites (four).
TEST_F(TierMoverTest, QueuedMissesRaiseAPumpsWrites) {
  OpenMover(dir_.string() + "-deep", 1 << 20, /*depth=*/16, /*high=*/0.5, /*low=*/0.0);  // low water: empty
  if (HasFatalFailure()) return;
  for (uint32_t p = 0; p < 8; ++p) SealPage(p, uint8_t(9 * p), 1);
  for (int i = 0; i < 20 && (host_->used() > 4 || disk_->in_flight() > 0); ++i) ASSERT_TRUE(mover_->Pump(2).ok());
  ASSERT_EQ(host_->used(), 4u);  // at the high-water mark
  std::vector<uint32_t> on_disk;
  for (uint32_t p = 0; p < 8; ++p)
    if (!mover_->HostHome(p)) on_disk.push_back(p);
  ASSERT_EQ(on_disk.size(), 4u);
  for (uint32_t p = 8; p < 12; ++p) SealPage(p, uint8_t(9 * p), 3);  // the host full of pages never written
  for (uint32_t p : on_disk) {
    mover_->NoteSelected(p, 5);
    ASSERT_TRUE(mover_->Prefetch(p, /*ahead=*/false).ok());
  }
  ASSERT_EQ(mover_->pending_promotions(), 4u);
  ASSERT_EQ(disk_->in_flight(), 0);
  ASSERT_TRUE(mover_->Pump(5).ok());
  EXPECT_EQ(disk_->in_flight(), 8) << "a Pump's writes ignored the misses waiting for room";
  for (int step = 6; step < 30 && mover_->pending_promotions() > 0; ++step) ASSERT_TRUE(mover_->Pump(step).ok());
  EXPECT_EQ(mover_->pending_promotions(), 0u);
  for (uint32_t p : on_disk) ASSERT_TRUE(mover_->EnsureHost(p, 1, 30).ok());
  CheckHomes();
}

TEST_F(TierMoverTest, MissedPagesThatFindTheQueueFullStartAtTheNextPump) {
  DeadlineWithThreeOnDisk(9);
  if (HasFatalFailure()) return;
  for (uint32_t p = 5; p < 9; ++p) {
    SealPage(p, uint8_t(9 * p), 21);
    mover_->NoteSelected(p, 30);
  }
  ASSERT_TRUE(mover_->Pump(22).ok());  // 3 and 4 written (5..8 are selected since): two queue slots free
  ASSERT_EQ(disk_->in_flight(), 2);
  // Step 22 misses 0, 1 and 2: 0 and 1 take the free queue slots, 2 waits.
  for (uint32_t p : {0u, 1u, 2u}) {
    mover_->NoteSelected(p, 40);  // the hottest pages: host pressure demotes 5..8 first
    ASSERT_TRUE(mover_->Prefetch(p, /*ahead=*/false).ok());
  }
  EXPECT_EQ(disk_->in_flight(), 4);
  EXPECT_EQ(mover_->pending_promotions(), 1u);
  // The next decode call's Pump starts it, without its being missed again.
  ASSERT_TRUE(mover_->Pump(23).ok());
  EXPECT_EQ(mover_->pending_promotions(), 0u);
  ASSERT_TRUE(mover_->Pump(24).ok());
  for (uint32_t p : {0u, 1u, 2u}) EXPECT_NE(mover_->HostHome(p), nullptr) << "page " << p << " was not promoted";
  EXPECT_EQ(mover_->stats().promotions, 3);
  for (uint32_t p : {3u, 4u}) EXPECT_EQ(mover_->HostHome(p), nullptr) << "page " << p;
  CheckHomes();
  // A queued page dropped before its turn is passed over.
  mover_->NoteSelected(3, 40);
  ASSERT_TRUE(mover_->Prefetch(3, /*ahead=*/false).ok());
  ASSERT_TRUE(mover_->Prefetch(4, /*ahead=*/false).ok());
  ASSERT_EQ(mover_->pending_promotions(), 1u);  // 3 started, 4 waits
  mover_->Drop(4);
  truth_.erase(4);
  ASSERT_TRUE(mover_->Pump(25).ok());
  ASSERT_TRUE(mover_->Pump(26).ok());
  EXPECT_EQ(mover_->pending_promotions(), 0u);
  EXPECT_EQ(mover_->HostHome(4), nullptr);
  CheckHomes();
}

TEST_F(TierMoverTest, SealFailsCleanlyWhenHostAndDiskAreFull) {
  // No disk room: a tiny disk tier.
  ASSERT_NO_FATAL_FAILURE(UseSmallDisk(4096));
  Status last;
  uint32_t p = 0;
  for (; p < 40 && last.ok(); ++p) {
    auto home = mover_->SealBegin(p, 1, 1);
    last = home.status();
    if (home.ok()) {
      std::memset(*home, int(p), g_.page_bytes());
      truth_[p] = std::vector<uint8_t>(g_.page_bytes(), uint8_t(p));
      mover_->SealEnd(p);
    }
  }
  EXPECT_EQ(last.code(), Code::kResourceExhausted) << last.ToString();
  EXPECT_EQ(published_.count(p - 1), 0u) << "the refused page was published";
  CheckHomes();
}

// Host and disk hold every page with two slots to spare; the pages on the
// host were never selected, four on disk are hot. A promotion keeps its disk
// copy, so after two the disk is full and the cold host pages, having no disk
// copy, cannot leave. The hot pages give up their disk copies and the cold
// pages are written there: the reads succeed, and the hot pages stay on the
// host (dropping them instead would read them again at the next step).
TEST_F(TierMoverTest, WithTheDiskFullHotPagesGiveTheirDiskSlotsToTheColdest) {
  ASSERT_NO_FATAL_FAILURE(UseSmallDisk(24 * 4096));
  const uint32_t pages = kHostSlots + disk_->stats().slots_capacity - 2;
  ASSERT_LE(pages, kPages) << disk_->stats().slots_capacity << " disk slots";
  for (uint32_t p = 0; p < pages; ++p) SealPage(p, uint8_t(3 * p), 1);
  ASSERT_TRUE(mover_->Pump(2).ok());
  std::vector<uint32_t> hot;
  for (uint32_t p = 0; p < pages && hot.size() < 4; ++p)
    if (!mover_->HostHome(p)) hot.push_back(p);
  ASSERT_EQ(hot.size(), 4u);
  mover_->NoteSelected(hot, 10);
  const int64_t writes = mover_->stats().demotions;
  std::vector<uint8_t> bytes(g_.page_bytes());
  for (int64_t step : {10, 11}) {
    for (uint32_t p : hot) {
      const Status s = mover_->ReadPage(p, 1, bytes.data(), step);
      ASSERT_TRUE(s.ok()) << "step " << step << " page " << p << ": " << s.ToString();
      EXPECT_EQ(bytes, truth_[p]) << "page " << p;
    }
  }
  EXPECT_EQ(mover_->stats().promotions, 4) << "a hot page left the host and was read again";
  EXPECT_GE(mover_->stats().demotions - writes, 2) << "no cold page took a hot page's disk slot";
  EXPECT_EQ(mover_->stats().io_errors, 0);
  for (uint32_t p : hot) EXPECT_NE(mover_->HostHome(p), nullptr) << "page " << p;
  CheckHomes();
}

// A device reads host homes in place (the CUDA backend's zero-copy misses)
// for calls that return before it is done: a home that stops being readable
// while such a call may read it is reused only once that call is done —
// after the next Pump that finds it done, or at once when a seal needs the
// room and waits for the device.
TEST_F(TierMoverTest, HomesTheDeviceMayReadAreReusedOnlyAfterItsCalls) {
  uint64_t queued = 0, done = 0;
  int waits = 0;
  mover_->SetDeviceReads({[&] { return queued; }, [&](bool wait) -> Result<uint64_t> {
                            if (wait) {
                              ++waits;
                              done = queued;
                            }
                            return done;
                          }});
  for (uint32_t p = 0; p < 7; ++p) SealPage(p, uint8_t(5 * p), 1);
  for (uint32_t p = 0; p < 7; ++p) mover_->NoteSelected(p, p + 2);
  std::vector<const void*> old_homes;
  for (uint32_t p : {0u, 1u, 2u}) old_homes.push_back(mover_->HostHome(p));
  queued = 1;  // a call that may read every readable home, not yet done
  ASSERT_TRUE(mover_->Pump(20).ok());
  ASSERT_TRUE(mover_->Pump(21).ok());
  for (uint32_t p : {0u, 1u, 2u}) {
    EXPECT_EQ(mover_->HostHome(p), nullptr) << "page " << p;
    EXPECT_EQ(published_[p], nullptr) << "page " << p;
  }
  EXPECT_EQ(mover_->retired_slots(), 3u);
  EXPECT_EQ(host_->used(), 7u) << "retired slots count as used";
  EXPECT_EQ(waits, 0);
  // The one free slot, then a seal that needs the device to be done.
  SealPage(7, 70, 22);
  EXPECT_EQ(std::count(old_homes.begin(), old_homes.end(), mover_->HostHome(7)), 0)
      << "a home still read by the device was reused";
  EXPECT_EQ(waits, 0);
  SealPage(8, 80, 22);
  EXPECT_EQ(waits, 1) << "the seal did not wait for the device";
  EXPECT_EQ(mover_->retired_slots(), 0u);
  CheckHomes();
  // A dropped page's home: retired while a call is queued, back at the next
  // Pump once that call is done, without waiting.
  queued = 2;
  const void* home3 = mover_->HostHome(3);
  ASSERT_NE(home3, nullptr);
  const uint32_t used = host_->used();
  mover_->Drop(3);
  EXPECT_EQ(published_[3], nullptr);
  EXPECT_EQ(host_->used(), used);
  ASSERT_TRUE(mover_->Pump(23).ok());
  EXPECT_EQ(mover_->retired_slots(), 1u);
  done = 2;
  ASSERT_TRUE(mover_->Pump(24).ok());
  EXPECT_EQ(mover_->retired_slots(), 0u);
  EXPECT_EQ(host_->used(), used - 1);
  EXPECT_EQ(waits, 1);
  truth_.erase(3);
  CheckHomes();
}

}  // namespace
}  // namespace questkv
