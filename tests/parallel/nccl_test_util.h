// Shared by the NCCL suites (tests/parallel, tests/parallel_cuda): the
// visible GPUs, and one NCCL rank per GPU on threads of this process. Only
// for builds with -DQUESTKV_NCCL=ON (QUESTKV_HAVE_NCCL).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <functional>
#include <thread>
#include <vector>

#include "parallel/nccl_communicator.h"
#include "questkv/status.h"

namespace questkv::test {

inline int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

// Runs body(comm) on one thread per GPU (rank r on device r) and returns the
// ranks' statuses.
inline std::vector<Status> RunOnGpus(int ranks, const std::function<Status(NcclCommunicator&)>& body,
                                     std::size_t staging_bytes = std::size_t(8) << 20) {
  const NcclId id = NcclCommunicator::NewId().value();
  std::vector<Status> statuses(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      NcclOptions options;
      options.device = r;
      options.staging_bytes = staging_bytes;
      auto comm = NcclCommunicator::Create(id, r, ranks, options);
      statuses[r] = comm.ok() ? body(**comm) : comm.status();
    });
  for (auto& t : threads) t.join();
  return statuses;
}

}  // namespace questkv::test
