// Communicator: the collectives that multi-GPU Quest needs, behind
// one interface so the same context-parallel and head-parallel code runs over
// NCCL on GPUs and over threads in CI (InProcessGroup).
//
// A group has size() ranks, 0..size()-1; each rank holds its own
// Communicator. Collectives are blocking and all-or-nothing: every rank calls
// the same collective with the same sizes, in the same order. A collective
// that fails on one rank (bad sizes, a closed group, a timeout) fails on every
// rank that takes part, and a rank that gives up before joining one calls
// Abort so that the others wake with an error instead of waiting for it.
// After any error the group is closed: later calls return FailedPrecondition.
//
// Thread-compatible: one thread drives a rank's Communicator at a time.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <type_traits>

#include "questkv/status.h"

namespace questkv {

class Communicator {
 public:
  Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // recv [size()][bytes] := every rank's send [bytes], in rank order. recv may
  // hold send at offset rank()*bytes (in place). InvalidArgument when the
  // ranks pass different byte counts (where the implementation can tell);
  // FailedPrecondition when the group is closed.
  virtual Status AllGather(const void* send, std::size_t bytes, void* recv) = 0;

  // recv [count] := Σ over ranks of send [count], in an order the
  // implementation fixes, so every rank gets the same bits (InProcessGroup:
  // rank order). recv may equal send. Errors as AllGather.
  virtual Status AllReduceSum(const float* send, float* recv, std::size_t count) = 0;

  // Returns when every rank has called Barrier. Errors as AllGather.
  virtual Status Barrier() = 0;

  // Closes the group on behalf of this rank: collectives in progress or to
  // come, on every rank, return FailedPrecondition naming `reason`.
  virtual void Abort(const Status& reason) = 0;
};

// Returns st; a non-OK st first aborts comm's group. For errors a rank finds
// on its own before a collective, so the other ranks do not wait for it.
inline Status AbortIfError(Communicator& comm, Status st) {
  if (!st.ok()) comm.Abort(st);
  return st;
}

// Typed all-gather: recv [size()][send.size()] of a trivially copyable T.
// A recv of the wrong length is InvalidArgument on this rank, which aborts the
// group so the other ranks do not wait for it.
template <typename T>
Status AllGather(Communicator& comm, std::span<const T> send, std::span<T> recv) {
  static_assert(std::is_trivially_copyable_v<T>, "AllGather copies bytes");
  if (recv.size() != send.size() * std::size_t(comm.size()))
    return AbortIfError(comm, Status::InvalidArgument(
                                  "AllGather on rank " + std::to_string(comm.rank()) + ": recv holds " +
                                  std::to_string(recv.size()) + " elements, " + std::to_string(comm.size()) +
                                  " ranks x " + std::to_string(send.size()) + " sent need " +
                                  std::to_string(send.size() * std::size_t(comm.size()))));
  return comm.AllGather(send.data(), send.size_bytes(), recv.data());
}

}  // namespace questkv
