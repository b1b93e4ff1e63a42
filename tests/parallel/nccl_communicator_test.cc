// NcclCommunicator, built with -DQUESTKV_NCCL=ON: collectives on host and
// device buffers with one rank per visible GPU (one rank on a one-GPU
// machine), the staging bound, Abort, and ContextParallel over NCCL against
// the single-rank reference. Skipped (GTEST_SKIP) without a GPU; compiled to
// nothing without NCCL.
#ifdef QUESTKV_HAVE_NCCL

#include "parallel/nccl_communicator.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <functional>
#include <thread>
#include <vector>

#include "parallel/context_parallel.h"
#include "tests/parallel/nccl_test_util.h"
#include "tests/parallel/parallel_test_util.h"

namespace questkv {
namespace {

using test::DeviceCount;
using test::RunOnGpus;

class NcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (DeviceCount() < 1) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(NcclTest, AllGatherHostAndDeviceBuffers) {
  const int ranks = DeviceCount();
  const std::vector<Status> st = RunOnGpus(ranks, [&](NcclCommunicator& comm) {
    const std::vector<int> mine = {comm.rank(), 100 + comm.rank()};
    std::vector<int> all(2 * ranks, -1);
    QKV_RETURN_IF_ERROR(AllGather<int>(comm, mine, all));
    for (int r = 0; r < ranks; ++r)
      if (all[2 * r] != r || all[2 * r + 1] != 100 + r) return Status::Internal("host gather wrong");
    int *dsend = nullptr, *drecv = nullptr;
    cudaMalloc(&dsend, 2 * sizeof(int));
    cudaMalloc(&drecv, 2 * ranks * sizeof(int));
    cudaMemcpy(dsend, mine.data(), 2 * sizeof(int), cudaMemcpyHostToDevice);
    Status gathered = comm.AllGather(dsend, 2 * sizeof(int), drecv);
    std::vector<int> back(2 * ranks, -1);
    cudaMemcpy(back.data(), drecv, back.size() * sizeof(int), cudaMemcpyDeviceToHost);
    cudaFree(dsend);
    cudaFree(drecv);
    QKV_RETURN_IF_ERROR(gathered);
    if (back != all) return Status::Internal("device gather differs from host gather");
    float x[2] = {1.f, float(comm.rank())};
    QKV_RETURN_IF_ERROR(comm.AllReduceSum(x, x, 2));
    if (x[0] != float(ranks)) return Status::Internal("all-reduce wrong");
    return comm.Barrier();
  });
  for (const Status& s : st) EXPECT_TRUE(s.ok()) << s.ToString();
}

TEST_F(NcclTest, HostMessageOverStagingAndAbort) {
  const std::vector<Status> st = RunOnGpus(
      1,
      [&](NcclCommunicator& comm) {
        std::vector<char> send(64), recv(64);
        const Status big = comm.AllGather(send.data(), send.size(), recv.data());
        if (big.code() != Code::kResourceExhausted) return Status::Internal("expected ResourceExhausted: " + big.ToString());
        // The failed call closed the communicator.
        if (comm.Barrier().code() != Code::kFailedPrecondition) return Status::Internal("still usable after an error");
        return Status::Ok();
      },
      /*staging_bytes=*/100);
  EXPECT_TRUE(st[0].ok()) << st[0].ToString();
}

TEST_F(NcclTest, ContextParallelMatchesSingleRank) {
  const int ranks = DeviceCount();
  const Geometry g = test::MakeGeometry(2, 4);
  const test::Sequence s = test::MakeSequence(g, 61, 3, 2024);
  const SelectionPolicy p = test::MakePolicy(12, 1, 2, GqaMode::kMax, g.page_size);
  const test::Reference ref = test::SingleRank(s, p, 1);
  std::vector<ParallelDecodeOutput> outs(ranks);
  const std::vector<Status> st = RunOnGpus(ranks, [&](NcclCommunicator& comm) {
    const test::Share share = test::ShareOf(s, ShardLayout::kRoundRobin, ranks, comm.rank());
    ContextParallel cp(g, p, ShardLayout::kRoundRobin);
    return cp.Decode(comm, test::ShardInput(s, share, 1), &outs[comm.rank()]);
  });
  for (int r = 0; r < ranks; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].ToString();
    EXPECT_EQ(test::Rows(outs[r].selection, 0, g.kv_heads), test::Rows(ref.selection, 0, g.kv_heads));
    EXPECT_LE(test::RelL2Error(outs[r].o.data(), ref.o.data(), ref.o.size()), 1e-5);
  }
}

}  // namespace
}  // namespace questkv

#endif  // QUESTKV_HAVE_NCCL
