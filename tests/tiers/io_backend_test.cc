// IoBackend implementations: every backend round-trips random pages at random
// offsets with several requests in flight, keeps its queue bounded, rejects bad
// requests, and reports short transfers as they are; the memory backend's
// reordering and the fault backend's faults reproduce for a seed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "tests/testing/scratch.h"
#include "tiers/io_backend.h"

namespace questkv {
namespace {

constexpr uint32_t kPageBytes = 16384;

using TempDir = test::ScratchDir;

void FillRandom(char* p, std::size_t bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (std::size_t i = 0; i < bytes; i += 8) {
    const uint64_t v = rng();
    std::memcpy(p + i, &v, std::min<std::size_t>(8, bytes - i));
  }
}

enum class Kind { kUring, kUringSqpoll, kPread, kMemory, kMemoryReordered };

std::string KindName(const testing::TestParamInfo<Kind>& info) {
  switch (info.param) {
    case Kind::kUring: return "Uring";
    case Kind::kUringSqpoll: return "UringSqpoll";
    case Kind::kPread: return "Pread";
    case Kind::kMemory: return "Memory";
    case Kind::kMemoryReordered: return "MemoryReordered";
  }
  return "Unknown";
}

Result<std::unique_ptr<IoBackend>> Make(Kind kind, int queue_depth) {
  switch (kind) {
    case Kind::kUring: return MakeUringBackend(queue_depth);
    case Kind::kUringSqpoll: return MakeUringBackend(queue_depth, /*sq_thread=*/true);
    case Kind::kPread: return MakePreadPoolBackend(4, queue_depth);
    case Kind::kMemory: return MakeMemoryBackend(queue_depth);
    case Kind::kMemoryReordered: return MakeMemoryBackend(queue_depth, 42);
  }
  return Status::Internal("unknown kind");
}

// A backend with two files open and a region of `pages` page buffers.
class BackendTest : public testing::TestWithParam<Kind> {
 protected:
  static constexpr int kQueueDepth = 8;
  static constexpr int kPages = 64;

  void SetUp() override {
    Result<std::unique_ptr<IoBackend>> io = Make(GetParam(), kQueueDepth);
    if (io.status().code() == Code::kUnimplemented) GTEST_SKIP() << io.status().ToString();
    ASSERT_TRUE(io.ok()) << io.status().ToString();
    io_ = std::move(*io);
    ASSERT_FALSE(dir_.path().empty());
    paths_ = {dir_.path() + "/a", dir_.path() + "/b"};
    ASSERT_TRUE(io_->OpenFiles(paths_).ok());
    region_ = test::AllocateAligned(2 * kPages * std::size_t(kPageBytes));
    ASSERT_TRUE(io_->RegisterRegion(region_.get(), 2 * kPages * std::size_t(kPageBytes)).ok());
  }

  char* Buffer(int i) { return region_.get() + std::size_t(i) * kPageBytes; }

  // Submits every request, keeping at most queue_depth() in flight; returns
  // the result of each by tag.
  std::map<uint64_t, int64_t> RunAll(const std::vector<IoRequest>& requests) {
    std::map<uint64_t, int64_t> results;
    std::vector<IoCompletion> done;
    auto reap = [&](int min) {
      done.clear();
      EXPECT_TRUE(io_->Reap(&done, min).ok());
      for (const IoCompletion& c : done) results[c.tag] = c.result;
    };
    for (const IoRequest& r : requests) {
      if (io_->in_flight() == io_->queue_depth()) reap(1);
      EXPECT_TRUE(io_->Submit(r).ok());
    }
    while (io_->in_flight() > 0) reap(1);
    return results;
  }

  TempDir dir_;
  std::vector<std::string> paths_;
  std::unique_ptr<IoBackend> io_;
  test::AlignedBytes region_;
};

TEST_P(BackendTest, RoundTripsRandomPagesAtRandomSlots) {
  std::mt19937_64 rng(7);
  std::vector<int> slots(256);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<IoRequest> writes, reads;
  for (int i = 0; i < kPages; ++i) {
    FillRandom(Buffer(i), kPageBytes, 100 + i);
    const int file = slots[i] % 2;
    const uint64_t offset = uint64_t(slots[i] / 2) * kPageBytes;
    writes.push_back({IoRequest::Op::kWrite, file, offset, Buffer(i), kPageBytes, uint64_t(i)});
    reads.push_back({IoRequest::Op::kRead, file, offset, Buffer(kPages + i), kPageBytes, uint64_t(1000 + i)});
  }
  for (const auto& [tag, result] : RunAll(writes)) EXPECT_EQ(result, kPageBytes) << "write " << tag;
  std::shuffle(reads.begin(), reads.end(), rng);
  const std::map<uint64_t, int64_t> results = RunAll(reads);
  ASSERT_EQ(results.size(), std::size_t(kPages));
  for (int i = 0; i < kPages; ++i) {
    EXPECT_EQ(results.at(1000 + i), kPageBytes);
    EXPECT_EQ(std::memcmp(Buffer(i), Buffer(kPages + i), kPageBytes), 0) << "page " << i;
  }
}

TEST_P(BackendTest, QueueIsBoundedByItsDepth) {
  for (int i = 0; i < kQueueDepth; ++i)
    ASSERT_TRUE(io_->Submit({IoRequest::Op::kWrite, 0, uint64_t(i) * kPageBytes, Buffer(i), kPageBytes, 0}).ok());
  EXPECT_EQ(io_->in_flight(), kQueueDepth);
  const Status full = io_->Submit({IoRequest::Op::kWrite, 0, 0, Buffer(0), kPageBytes, 0});
  EXPECT_EQ(full.code(), Code::kResourceExhausted) << full.ToString();
  std::vector<IoCompletion> done;
  EXPECT_EQ(io_->Reap(&done, kQueueDepth + 1).code(), Code::kInvalidArgument);
  ASSERT_TRUE(io_->Reap(&done, kQueueDepth).ok());
  EXPECT_GE(done.size(), std::size_t(kQueueDepth));
  EXPECT_EQ(io_->in_flight(), 0);
  EXPECT_TRUE(io_->Submit({IoRequest::Op::kRead, 0, 0, Buffer(0), kPageBytes, 0}).ok());
  ASSERT_TRUE(io_->Reap(&done, 1).ok());
}

TEST_P(BackendTest, RejectsBadRequests) {
  auto code = [&](IoRequest r) { return io_->Submit(r).code(); };
  const IoRequest good{IoRequest::Op::kRead, 1, 0, Buffer(0), kPageBytes, 0};
  IoRequest r = good;
  r.file = 2;
  EXPECT_EQ(code(r), Code::kInvalidArgument);
  r.file = -1;
  EXPECT_EQ(code(r), Code::kInvalidArgument);
  r = good;
  r.len = 0;
  EXPECT_EQ(code(r), Code::kInvalidArgument);
  r = good;
  r.buf = Buffer(2 * kPages - 1) + 4096;  // runs past the region's end
  EXPECT_EQ(code(r), Code::kInvalidArgument);
  char outside[64];
  r.buf = outside;
  r.len = sizeof outside;
  EXPECT_EQ(code(r), Code::kInvalidArgument);
  EXPECT_EQ(io_->in_flight(), 0);
  EXPECT_EQ(io_->OpenFiles(paths_).code(), Code::kFailedPrecondition);
  EXPECT_EQ(io_->RegisterRegion(region_.get(), 4096).code(), Code::kFailedPrecondition);
  std::vector<IoCompletion> done;
  EXPECT_EQ(io_->Reap(&done, 1).code(), Code::kInvalidArgument);
  EXPECT_TRUE(io_->Reap(&done, 0).ok());
  EXPECT_TRUE(done.empty());
}

TEST_P(BackendTest, ShortTransferIsReportedAsItIs) {
  FillRandom(Buffer(0), kPageBytes, 1);
  const auto written = RunAll({{IoRequest::Op::kWrite, 0, 0, Buffer(0), kPageBytes, 1}});
  EXPECT_EQ(written.at(1), kPageBytes);
  // Two pages asked of a one-page file: one page comes back, and no error.
  const auto read = RunAll({{IoRequest::Op::kRead, 0, 0, Buffer(1), 2 * kPageBytes, 2},
                            {IoRequest::Op::kRead, 0, 8 * kPageBytes, Buffer(3), kPageBytes, 3}});
  EXPECT_EQ(read.at(2), kPageBytes);
  EXPECT_EQ(read.at(3), 0);
  EXPECT_EQ(std::memcmp(Buffer(0), Buffer(1), kPageBytes), 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, BackendTest,
                         testing::Values(Kind::kUring, Kind::kUringSqpoll, Kind::kPread, Kind::kMemory,
                                         Kind::kMemoryReordered),
                         KindName);

TEST(DirectBackends, RejectUnalignedRequests) {
  TempDir dir;
  auto region = test::AllocateAligned(4 * kPageBytes);
  for (Kind kind : {Kind::kUring, Kind::kUringSqpoll, Kind::kPread}) {
    Result<std::unique_ptr<IoBackend>> io = Make(kind, 4);
    if (!io.ok()) continue;  // io_uring unavailable: covered by the skip above
    const std::vector<std::string> paths = {dir.path() + "/f" + std::to_string(int(kind))};
    ASSERT_TRUE((*io)->OpenFiles(paths).ok());
    ASSERT_TRUE((*io)->RegisterRegion(region.get(), 4 * kPageBytes).ok());
    EXPECT_EQ((*io)->Submit({IoRequest::Op::kRead, 0, 512, region.get(), 4096, 0}).code(), Code::kInvalidArgument);
    EXPECT_EQ((*io)->Submit({IoRequest::Op::kRead, 0, 0, region.get(), 1000, 0}).code(), Code::kInvalidArgument);
    EXPECT_EQ((*io)->Submit({IoRequest::Op::kRead, 0, 0, region.get() + 8, 4096, 0}).code(), Code::kInvalidArgument);
  }
}

TEST(DirectBackends, SubmitBeforeSetUpIsAnError) {
  auto io = MakeMemoryBackend(4);
  char buf[4096];
  EXPECT_EQ(io->Submit({IoRequest::Op::kRead, 0, 0, buf, 4096, 0}).code(), Code::kFailedPrecondition);
  Result<std::unique_ptr<IoBackend>> pread = MakePreadPoolBackend(2, 4);
  ASSERT_TRUE(pread.ok());
  EXPECT_EQ((*pread)->Submit({IoRequest::Op::kRead, 0, 0, buf, 4096, 0}).code(), Code::kFailedPrecondition);
  EXPECT_EQ(MakePreadPoolBackend(0, 4).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(MakePreadPoolBackend(2, 0).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(MakeUringBackend(0).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(MakeUringBackend(0, /*sq_thread=*/true).status().code(), Code::kInvalidArgument);
}

TEST(DefaultBackend, PicksAWorkingBackend) {
  Result<std::unique_ptr<IoBackend>> io = MakeDefaultBackend(16);
  ASSERT_TRUE(io.ok()) << io.status().ToString();
  const bool uring = MakeUringBackend(16).ok();
  EXPECT_EQ((*io)->name().substr(0, uring ? 8 : 10), uring ? "io_uring" : "pread-pool");
  EXPECT_EQ((*io)->queue_depth(), 16);
}

// The tags of the completions of `count` one-page reads, in the order a
// backend reports them, reaping with min_complete 1.
std::vector<uint64_t> CompletionOrder(IoBackend* io, char* region, int count) {
  EXPECT_TRUE(io->OpenFiles(std::vector<std::string>{"x"}).ok());
  EXPECT_TRUE(io->RegisterRegion(region, std::size_t(count) * 4096).ok());
  for (int i = 0; i < count; ++i)
    EXPECT_TRUE(io->Submit({IoRequest::Op::kWrite, 0, uint64_t(i) * 4096, region + i * 4096, 4096, uint64_t(i)}).ok());
  std::vector<uint64_t> order;
  std::vector<IoCompletion> done;
  while (io->in_flight() > 0) {
    done.clear();
    EXPECT_TRUE(io->Reap(&done, 1).ok());
    EXPECT_FALSE(done.empty());
    for (const IoCompletion& c : done) order.push_back(c.tag);
  }
  return order;
}

TEST(MemoryBackend, ReordersDeterministicallyForASeed) {
  constexpr int kCount = 16;
  auto region = test::AllocateAligned(kCount * 4096);
  std::vector<uint64_t> fifo(kCount);
  std::iota(fifo.begin(), fifo.end(), 0);
  EXPECT_EQ(CompletionOrder(MakeMemoryBackend(kCount).get(), region.get(), kCount), fifo);
  const std::vector<uint64_t> a = CompletionOrder(MakeMemoryBackend(kCount, 5).get(), region.get(), kCount);
  const std::vector<uint64_t> b = CompletionOrder(MakeMemoryBackend(kCount, 5).get(), region.get(), kCount);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, fifo);
  std::vector<uint64_t> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, fifo);  // every request completes exactly once
}

// Results by tag of reads and writes through a fault backend over memory.
std::vector<IoCompletion> FaultRun(const FaultPlan& plan, char* region) {
  auto io = MakeFaultInjectingBackend(MakeMemoryBackend(8), plan);
  EXPECT_TRUE(io->OpenFiles(std::vector<std::string>{"x"}).ok());
  EXPECT_TRUE(io->RegisterRegion(region, 64 * 4096).ok());
  std::vector<IoCompletion> all;
  for (int i = 0; i < 64; ++i) {
    const auto op = i % 2 ? IoRequest::Op::kRead : IoRequest::Op::kWrite;
    if (io->in_flight() == io->queue_depth()) {
      EXPECT_TRUE(io->Reap(&all, 1).ok());
    }
    EXPECT_TRUE(io->Submit({op, 0, uint64_t(i / 2) * 4096, region + i * 4096, 4096, uint64_t(i)}).ok());
  }
  while (io->in_flight() > 0) EXPECT_TRUE(io->Reap(&all, 1).ok());
  return all;
}

TEST(FaultBackend, ReproducesForASeedAndInjectsEveryKind) {
  FaultPlan plan;
  plan.seed = 9;
  plan.read_eio = plan.write_eio = plan.write_enospc = 0.1;
  plan.short_read = plan.short_write = plan.corrupt_read = plan.misdirected_write = 0.1;
  plan.delay = 0.3;
  auto region = test::AllocateAligned(64 * 4096);
  const std::vector<IoCompletion> a = FaultRun(plan, region.get());
  const std::vector<IoCompletion> b = FaultRun(plan, region.get());
  ASSERT_EQ(a.size(), 64u);
  ASSERT_EQ(a.size(), b.size());
  int eio = 0, enospc = 0, shortened = 0, reordered = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].tag, b[i].tag);
    EXPECT_EQ(a[i].result, b[i].result);
    eio += a[i].result == -EIO;
    enospc += a[i].result == -ENOSPC;
    shortened += a[i].result >= 0 && a[i].result < 4096;
    reordered += i > 0 && a[i].tag < a[i - 1].tag;
  }
  EXPECT_GT(eio, 0);
  EXPECT_GT(enospc, 0);
  EXPECT_GT(shortened, 0);
  EXPECT_GT(reordered, 0);
}

TEST(FaultBackend, FailedReadsLeavePoisonNotData) {
  FaultPlan plan;
  plan.read_eio = 1;
  auto io = MakeFaultInjectingBackend(MakeMemoryBackend(4), plan);
  auto region = test::AllocateAligned(2 * 4096);
  ASSERT_TRUE(io->OpenFiles(std::vector<std::string>{"x"}).ok());
  ASSERT_TRUE(io->RegisterRegion(region.get(), 2 * 4096).ok());
  std::memset(region.get(), 0x11, 4096);
  std::memset(region.get() + 4096, 0x11, 4096);
  std::vector<IoCompletion> done;
  ASSERT_TRUE(io->Submit({IoRequest::Op::kWrite, 0, 0, region.get(), 4096, 1}).ok());
  ASSERT_TRUE(io->Submit({IoRequest::Op::kRead, 0, 0, region.get() + 4096, 4096, 2}).ok());
  ASSERT_TRUE(io->Reap(&done, 2).ok());
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(done[1].result, -EIO);
  EXPECT_NE(std::memcmp(region.get(), region.get() + 4096, 4096), 0);
}

}  // namespace
}  // namespace questkv
