// InProcessGroup: the collectives over 1-8 threaded ranks, in place and
// typed; errors reach every rank (size and collective mismatches, oversized
// messages); a rank that aborts, fails, closes the group or never comes
// wakes the others with an error instead of hanging them.
#include "parallel/inprocess_group.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace questkv {
namespace {

using std::chrono::milliseconds;

std::unique_ptr<InProcessGroup> MakeGroup(int size, milliseconds timeout = milliseconds(60000)) {
  InProcessGroupOptions options;
  options.timeout = timeout;
  auto group = InProcessGroup::Create(size, options);
  EXPECT_TRUE(group.ok()) << group.status().ToString();
  return std::move(group).value();
}

void ExpectAllOk(const std::vector<Status>& st) {
  for (std::size_t r = 0; r < st.size(); ++r) EXPECT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].ToString();
}

TEST(InProcessGroup, CreateRejectsBadSizes) {
  EXPECT_EQ(InProcessGroup::Create(0).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(InProcessGroup::Create(-2).status().code(), Code::kInvalidArgument);
  InProcessGroupOptions options;
  options.timeout = milliseconds(0);
  EXPECT_EQ(InProcessGroup::Create(2, options).status().code(), Code::kInvalidArgument);
}

TEST(InProcessGroup, AllGatherInRankOrder) {
  for (int size : {1, 2, 3, 4, 8}) {
    auto group = MakeGroup(size);
    std::vector<std::vector<int32_t>> got(size);
    ExpectAllOk(group->Run([&](Communicator& comm) {
      EXPECT_EQ(comm.size(), size);
      // Several rounds in a row, each one generation.
      for (int round = 0; round < 5; ++round) {
        const std::vector<int32_t> mine = {comm.rank() * 10 + round, -comm.rank()};
        got[comm.rank()].assign(2 * size, -99);
        QKV_RETURN_IF_ERROR(AllGather<int32_t>(comm, mine, got[comm.rank()]));
        for (int r = 0; r < size; ++r)
          if (got[comm.rank()][2 * r] != r * 10 + round || got[comm.rank()][2 * r + 1] != -r)
            return Status::Internal("wrong data from rank " + std::to_string(r));
      }
      return Status::Ok();
    }));
  }
}

TEST(InProcessGroup, AllGatherInPlaceAndEmpty) {
  auto group = MakeGroup(4);
  ExpectAllOk(group->Run([&](Communicator& comm) {
    std::vector<double> buf(4 * 3, -1.0);
    for (int j = 0; j < 3; ++j) buf[comm.rank() * 3 + j] = comm.rank() + 0.25 * j;
    QKV_RETURN_IF_ERROR(comm.AllGather(buf.data() + comm.rank() * 3, 3 * sizeof(double), buf.data()));
    for (int r = 0; r < 4; ++r)
      for (int j = 0; j < 3; ++j)
        if (buf[r * 3 + j] != r + 0.25 * j) return Status::Internal("in-place gather wrong");
    return comm.AllGather(nullptr, 0, nullptr);
  }));
}

TEST(InProcessGroup, AllReduceSumSameBitsEverywhere) {
  auto group = MakeGroup(3);
  std::vector<std::vector<float>> got(3);
  ExpectAllOk(group->Run([&](Communicator& comm) {
    std::vector<float> x = {1.f + comm.rank(), 0.1f * float(comm.rank()), -2.f};
    got[comm.rank()].resize(3);
    QKV_RETURN_IF_ERROR(comm.AllReduceSum(x.data(), got[comm.rank()].data(), 3));
    return comm.AllReduceSum(x.data(), x.data(), 3);  // in place
  }));
  EXPECT_EQ(got[0], (std::vector<float>{6.f, (0.f + 0.1f) + 0.2f, -6.f}));
  EXPECT_EQ(got[1], got[0]);
  EXPECT_EQ(got[2], got[0]);
}

TEST(InProcessGroup, BarrierWaitsForEveryRank) {
  auto group = MakeGroup(4);
  std::atomic<int> before{0};
  ExpectAllOk(group->Run([&](Communicator& comm) {
    std::this_thread::sleep_for(milliseconds(5 * comm.rank()));
    before.fetch_add(1);
    QKV_RETURN_IF_ERROR(comm.Barrier());
    return before.load() == 4 ? Status::Ok() : Status::Internal("left the barrier early");
  }));
}

TEST(InProcessGroup, SizeMismatchFailsOnEveryRankAndCloses) {
  auto group = MakeGroup(3);
  const std::vector<Status> st = group->Run([&](Communicator& comm) {
    std::vector<char> send(comm.rank() == 2 ? 16 : 8), recv(3 * 16);
    return comm.AllGather(send.data(), send.size(), recv.data());
  });
  for (const Status& s : st) {
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("size mismatch"), std::string::npos) << s.ToString();
  }
  EXPECT_EQ(group->comm(0).Barrier().code(), Code::kFailedPrecondition);
}

TEST(InProcessGroup, CollectiveMismatchFailsOnEveryRank) {
  auto group = MakeGroup(2);
  const std::vector<Status> st = group->Run([&](Communicator& comm) {
    if (comm.rank() == 0) return comm.Barrier();
    float x = 1.f;
    return comm.AllReduceSum(&x, &x, 1);
  });
  for (const Status& s : st) EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
}

TEST(InProcessGroup, TypedAllGatherChecksRecvLengthAndAborts) {
  auto group = MakeGroup(2);
  const std::vector<Status> st = group->Run([&](Communicator& comm) {
    const std::vector<int> mine(4, comm.rank());
    std::vector<int> recv(comm.rank() == 1 ? 7 : 8);
    return AllGather<int>(comm, mine, recv);
  });
  EXPECT_EQ(st[1].code(), Code::kInvalidArgument) << st[1].ToString();
  EXPECT_NE(st[1].message().find("recv holds 7"), std::string::npos) << st[1].ToString();
  EXPECT_FALSE(st[0].ok());
}

TEST(InProcessGroup, OversizedMessageIsResourceExhausted) {
  InProcessGroupOptions options;
  options.max_message_bytes = 64;
  auto group = InProcessGroup::Create(2, options).value();
  const std::vector<Status> st = group->Run([&](Communicator& comm) {
    std::vector<char> send(65), recv(130);
    return comm.AllGather(send.data(), send.size(), recv.data());
  });
  for (const Status& s : st) EXPECT_EQ(s.code(), Code::kResourceExhausted) << s.ToString();
}

// ---- no rank is left hanging ------------------------------------------------

TEST(InProcessGroup, AbortWakesWaitingRanks) {
  auto group = MakeGroup(4);
  const auto start = std::chrono::steady_clock::now();
  const std::vector<Status> st = group->Run([&](Communicator& comm) {
    if (comm.rank() == 3) {
      std::this_thread::sleep_for(milliseconds(20));  // let the others wait first
      comm.Abort(Status::IOError("disk gone"));
      return Status::Ok();
    }
    return comm.Barrier();
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(st[r].code(), Code::kFailedPrecondition) << st[r].ToString();
    EXPECT_NE(st[r].message().find("rank 3 aborted: disk gone"), std::string::npos) << st[r].ToString();
  }
  EXPECT_EQ(group->closed_reason().code(), Code::kIOError);
}

TEST(InProcessGroup, FailingRankInRunClosesTheGroup) {
  auto group = MakeGroup(3);
  const std::vector<Status> st = group->Run([&](Communicator& comm) {
    if (comm.rank() == 1) return Status::Corruption("bad page");
    std::vector<float> x(2), y(6);
    QKV_RETURN_IF_ERROR(comm.AllGather(x.data(), sizeof(float) * 2, y.data()));
    return Status::Internal("the gather should have failed");
  });
  EXPECT_EQ(st[1].code(), Code::kCorruption);
  for (int r : {0, 2}) EXPECT_EQ(st[r].code(), Code::kFailedPrecondition) << st[r].ToString();
}

TEST(InProcessGroup, CloseFromOutsideWakesRanks) {
  auto group = MakeGroup(3);
  std::thread closer([&] {
    std::this_thread::sleep_for(milliseconds(30));
    group->Close(Status::FailedPrecondition("shutting down"));
  });
  const std::vector<Status> st = group->Run([&](Communicator& comm) {
    if (comm.rank() == 0) return Status::Ok();  // never joins
    return comm.Barrier();
  });
  closer.join();
  for (int r : {1, 2}) {
    EXPECT_EQ(st[r].code(), Code::kFailedPrecondition);
    EXPECT_NE(st[r].message().find("shutting down"), std::string::npos) << st[r].ToString();
  }
  EXPECT_EQ(group->comm(1).Barrier().code(), Code::kFailedPrecondition);
}

TEST(InProcessGroup, MissingRankTimesOut) {
  auto group = MakeGroup(3, milliseconds(100));
  const std::vector<Status> st = group->Run([&](Communicator& comm) {
    if (comm.rank() == 2) return Status::Ok();  // returns without joining, no error
    return comm.Barrier();
  });
  int timed_out = 0;
  for (int r : {0, 1}) {
    EXPECT_FALSE(st[r].ok());
    if (st[r].code() == Code::kResourceExhausted) {
      ++timed_out;
      EXPECT_NE(st[r].message().find("waiting for rank(s) 2"), std::string::npos) << st[r].ToString();
    }
  }
  EXPECT_GE(timed_out, 1);
}

}  // namespace
}  // namespace questkv
