// A host-side meeting of the rank threads of one process. Ranks that drive
// NCCL finish their set-up (device allocations, uploads, frees of staging
// memory) here before any launches its first collective: cudaMalloc,
// cudaFree and cudaMallocHost may wait for every GPU the device has peer
// access to, so one made while a peer's NCCL kernel waits for this rank
// would hang both, and a collective cannot serve as this meeting.
#pragma once

#include <atomic>
#include <barrier>

namespace questkv {

class HostRendezvous {
 public:
  explicit HostRendezvous(int ranks) : barrier_(ranks) {}
  // Waits for every rank; true when every rank arrived with ok.
  bool AllOk(bool ok) {
    if (!ok) failed_.fetch_add(1);
    barrier_.arrive_and_wait();
    return failed_.load() == 0;
  }

 private:
  std::barrier<> barrier_;
  std::atomic<int> failed_{0};
};

}  // namespace questkv
