// InProcessGroup: a communicator group whose ranks are threads of one process,
// meeting at a condition-variable rendezvous. It lets CI run the multi-GPU
// code paths (context and head parallel) with no GPU and no NCCL.
//
// Each collective is one generation: ranks publish their buffers, the last
// rank to arrive checks that all ranks called the same collective with the
// same sizes, copies (or sums, in rank order) for everyone, and wakes the
// rest. A wait longer than the group's timeout, a mismatch, Close() or a
// rank's Abort() closes the group and wakes every waiter with an error, so a
// failed rank never leaves the others hanging.
//
// Thread-safe: the group may be closed from any thread; each rank's
// Communicator is driven by one thread at a time.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "parallel/communicator.h"
#include "questkv/status.h"

namespace questkv {

struct InProcessGroupOptions {
  // Longest a rank waits in one collective for the others.
  std::chrono::milliseconds timeout{30000};
  // Largest message one rank may send in one collective.
  std::size_t max_message_bytes = std::size_t(64) << 20;
};

class InProcessGroup {
 public:
  // InvalidArgument for size < 1 or a non-positive timeout.
  static Result<std::unique_ptr<InProcessGroup>> Create(int size, InProcessGroupOptions options = {});
  ~InProcessGroup();
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;

  int size() const { return size_; }
  // Rank r's communicator, 0 <= r < size() (asserted); owned by the group.
  Communicator& comm(int rank);

  // Closes the group: every collective in progress or to come returns
  // FailedPrecondition naming `reason`. The first reason sticks.
  void Close(const Status& reason);
  // OK while the group is open, else the reason it was closed.
  Status closed_reason() const;

  // Runs body(comm(r)) on size() threads, one per rank, and returns each
  // rank's Status in rank order. A rank whose body returns an error closes
  // the group, so the others do not wait for it.
  std::vector<Status> Run(const std::function<Status(Communicator&)>& body);

 private:
  class Rank;
  enum class Op : uint8_t { kAllGather, kAllReduceSum, kBarrier };
  struct Arrival {
    Op op = Op::kBarrier;
    const void* send = nullptr;
    void* recv = nullptr;
    std::size_t bytes = 0;
    bool here = false;
  };

  InProcessGroup(int size, InProcessGroupOptions options);
  Status Collective(int rank, Arrival arrival);
  Status CheckArrivals() const;
  void Complete();
  std::string MissingRanks() const;
  void CloseLocked(const Status& reason);
  Status ClosedError() const;

  const int size_;
  const InProcessGroupOptions options_;
  std::vector<std::unique_ptr<Rank>> ranks_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Arrival> arrivals_;  // [size] this generation's buffers
  int arrived_ = 0;
  uint64_t generation_ = 0;
  Status result_;                  // of the last completed generation
  Status closed_;                  // OK while open
  std::vector<float> sum_;         // AllReduceSum scratch, <= max_message_bytes
};

}  // namespace questkv
