// GpuDecoder over NcclCommunicator (-DQUESTKV_NCCL=ON): one rank per GPU,
// context and head parallel, against the single-rank CPU reference. One rank
// runs on any GPU machine; two ranks need two GPUs and skip, saying so, with
// fewer. Without NCCL in the build the suite skips, saying so.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "tests/parallel_cuda/gpu_decode_test_util.h"

#ifdef QUESTKV_HAVE_NCCL
#include "tests/parallel/nccl_test_util.h"
#endif

namespace questkv {
namespace {

#ifdef QUESTKV_HAVE_NCCL

// At static initialisation, before this binary's first CUDA call: every
// kernel loaded when a device's context starts. Lazy loading (the default)
// loads a kernel at its first launch, which can wait on the device while the
// peer rank's NCCL kernel waits for this rank (threads-per-GPU NCCL hangs).
[[maybe_unused]] const bool kEagerModules = [] { return setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0) == 0; }();

void RunOverNccl(int ranks) {
  const Geometry g = test::MakeGeometry(8, 4, 16, 128);
  const test::GpuBatch batch = test::MakeGpuBatch(g, {{1, 5}, {61, 3}, {517, 16}}, 2024);
  for (GqaMode mode : {GqaMode::kMax, GqaMode::kUnion})
    for (GpuParallelMode scheme : {GpuParallelMode::kContext, GpuParallelMode::kHead}) {
      const SelectionPolicy p = test::MakePolicy(32, 1, 4, mode, g.page_size);
      GpuDecodeOptions o;
      o.mode = scheme;
      o.layout = ShardLayout::kRoundRobin;
      const std::string what = std::string(scheme == GpuParallelMode::kContext ? "context" : "head") +
                               " parallel, mode " + std::to_string(int(mode)) + ", " + std::to_string(ranks) +
                               " NCCL ranks";
      for (int layer : {0, 1}) {
        test::GpuRun run;
        run.outs.resize(ranks);
        HostRendezvous ready(ranks);
        run.statuses = test::RunOnGpus(ranks, [&](NcclCommunicator& comm) {
          return test::DecodeOnRank(comm, batch, p, o, layer, &run.outs[comm.rank()], &ready);
        });
        test::ExpectMatches(batch, test::References(batch, p, layer), run, what + " layer " + std::to_string(layer));
      }
    }
}

TEST(GpuDecoderNccl, OneRank) {
  QKV_REQUIRE_GPU();
  RunOverNccl(1);
}

TEST(GpuDecoderNccl, TwoGpus) {
  QKV_REQUIRE_GPU();
  const int devices = test::DeviceCount();
  if (devices < 2) GTEST_SKIP() << "needs 2 GPUs for 2 NCCL ranks; this machine has " << devices;
  RunOverNccl(2);
}

#else

TEST(GpuDecoderNccl, NeedsNccl) { GTEST_SKIP() << "built without NCCL: configure with -DQUESTKV_NCCL=ON"; }

#endif

}  // namespace
}  // namespace questkv
