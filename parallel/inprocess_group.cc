#include "parallel/inprocess_group.h"

#include <cassert>
#include <cstring>
#include <string>
#include <thread>

namespace questkv {

namespace {

const char* OpName(int op) {
  static const char* const kNames[] = {"AllGather", "AllReduceSum", "Barrier"};
  return kNames[op];
}

}  // namespace

class InProcessGroup::Rank final : public Communicator {
 public:
  Rank(InProcessGroup* group, int rank) : group_(group), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size_; }

  Status AllGather(const void* send, std::size_t bytes, void* recv) override {
    return group_->Collective(rank_, {Op::kAllGather, send, recv, bytes});
  }
  Status AllReduceSum(const float* send, float* recv, std::size_t count) override {
    return group_->Collective(rank_, {Op::kAllReduceSum, send, recv, count * sizeof(float)});
  }
  Status Barrier() override { return group_->Collective(rank_, {Op::kBarrier, nullptr, nullptr, 0}); }
  void Abort(const Status& reason) override {
    group_->Close(Status(reason.ok() ? Code::kFailedPrecondition : reason.code(),
                         "rank " + std::to_string(rank_) + " aborted: " + reason.message()));
  }

 private:
  InProcessGroup* const group_;
  const int rank_;
};

InProcessGroup::InProcessGroup(int size, InProcessGroupOptions options)
    : size_(size), options_(options), arrivals_(size) {
  for (int r = 0; r < size; ++r) ranks_.push_back(std::make_unique<Rank>(this, r));
}

InProcessGroup::~InProcessGroup() = default;

Result<std::unique_ptr<InProcessGroup>> InProcessGroup::Create(int size, InProcessGroupOptions options) {
  if (size < 1)
    return Status::InvalidArgument("InProcessGroup: size = " + std::to_string(size) + ", must be >= 1");
  if (options.timeout.count() <= 0)
    return Status::InvalidArgument("InProcessGroup: timeout = " + std::to_string(options.timeout.count()) +
                                   " ms, must be > 0");
  return std::unique_ptr<InProcessGroup>(new InProcessGroup(size, options));
}

Communicator& InProcessGroup::comm(int rank) {
  assert(rank >= 0 && rank < size_);
  return *ranks_[rank];
}

void InProcessGroup::Close(const Status& reason) {
  std::lock_guard lock(mu_);
  CloseLocked(reason);
}

Status InProcessGroup::closed_reason() const {
  std::lock_guard lock(mu_);
  return closed_;
}

void InProcessGroup::CloseLocked(const Status& reason) {
  if (!closed_.ok()) return;
  closed_ = reason.ok() ? Status::FailedPrecondition("closed") : reason;
  cv_.notify_all();
}

Status InProcessGroup::ClosedError() const {
  return Status::FailedPrecondition("in-process group closed: " + closed_.ToString());
}

Status InProcessGroup::Collective(int rank, Arrival arrival) {
  std::unique_lock lock(mu_);
  if (!closed_.ok()) return ClosedError();
  if (arrivals_[rank].here) {
    const Status st = Status::Internal("rank " + std::to_string(rank) + " joined one collective twice");
    CloseLocked(st);
    return st;
  }
  arrival.here = true;
  arrivals_[rank] = arrival;
  const uint64_t generation = generation_;
  if (++arrived_ == size_) {
    Complete();
    return result_;
  }
  const bool woke = cv_.wait_for(lock, options_.timeout,
                                 [&] { return generation_ != generation || !closed_.ok(); });
  if (generation_ != generation) return result_;
  if (!woke) {
    const Status st = Status::ResourceExhausted(
        std::string(OpName(int(arrival.op))) + " on rank " + std::to_string(rank) + " timed out after " +
        std::to_string(options_.timeout.count()) + " ms waiting for rank(s) " + MissingRanks());
    CloseLocked(st);
    return st;
  }
  return ClosedError();
}

std::string InProcessGroup::MissingRanks() const {
  std::string out;
  for (int r = 0; r < size_; ++r)
    if (!arrivals_[r].here) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

// All ranks called the same collective with the same sizes, within bounds.
Status InProcessGroup::CheckArrivals() const {
  const Arrival& first = arrivals_[0];
  for (int r = 1; r < size_; ++r) {
    const Arrival& a = arrivals_[r];
    if (a.op != first.op)
      return Status::InvalidArgument("collective mismatch: rank 0 called " + std::string(OpName(int(first.op))) +
                                     ", rank " + std::to_string(r) + " " + OpName(int(a.op)));
    if (a.bytes != first.bytes)
      return Status::InvalidArgument(std::string(OpName(int(a.op))) + " size mismatch: rank 0 sent " +
                                     std::to_string(first.bytes) + " bytes, rank " + std::to_string(r) + " " +
                                     std::to_string(a.bytes));
  }
  if (first.bytes > options_.max_message_bytes)
    return Status::ResourceExhausted(std::string(OpName(int(first.op))) + " of " + std::to_string(first.bytes) +
                                     " bytes per rank exceeds the group's max_message_bytes = " +
                                     std::to_string(options_.max_message_bytes));
  return Status::Ok();
}

// Run by the last rank to arrive, holding mu_: serves every rank's buffers,
// publishes the result and opens the next generation.
void InProcessGroup::Complete() {
  result_ = CheckArrivals();
  const Arrival& first = arrivals_[0];
  if (result_.ok() && first.op == Op::kAllGather && first.bytes > 0) {
    for (const Arrival& to : arrivals_)
      for (int s = 0; s < size_; ++s) {
        char* dst = static_cast<char*>(to.recv) + std::size_t(s) * first.bytes;
        if (dst != arrivals_[s].send) std::memmove(dst, arrivals_[s].send, first.bytes);
      }
  } else if (result_.ok() && first.op == Op::kAllReduceSum && first.bytes > 0) {
    const std::size_t count = first.bytes / sizeof(float);
    const float* base = static_cast<const float*>(first.send);
    sum_.assign(base, base + count);
    for (int s = 1; s < size_; ++s) {
      const float* x = static_cast<const float*>(arrivals_[s].send);
      for (std::size_t i = 0; i < count; ++i) sum_[i] += x[i];
    }
    for (const Arrival& to : arrivals_) std::memcpy(to.recv, sum_.data(), first.bytes);
  }
  if (!result_.ok()) CloseLocked(result_);
  for (Arrival& a : arrivals_) a = Arrival{};
  arrived_ = 0;
  ++generation_;
  cv_.notify_all();
}

std::vector<Status> InProcessGroup::Run(const std::function<Status(Communicator&)>& body) {
  std::vector<Status> statuses(size_);
  std::vector<std::thread> threads;
  threads.reserve(size_);
  for (int r = 0; r < size_; ++r)
    threads.emplace_back([&, r] {
      statuses[r] = body(comm(r));
      if (!statuses[r].ok()) comm(r).Abort(statuses[r]);
    });
  for (std::thread& t : threads) t.join();
  return statuses;
}

}  // namespace questkv
