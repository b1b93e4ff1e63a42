// NcclCommunicator: the Communicator of one rank over NCCL, one rank per GPU.
// Built only with -DQUESTKV_NCCL=ON where nccl.h and libnccl are found
// (QUESTKV_HAVE_NCCL is then defined for users of questkv_parallel).
//
// Collectives run on the communicator's own CUDA stream. Buffers may be
// device memory (used in place) or host memory (staged through a device
// buffer of options.staging_bytes fixed at creation); each call returns once
// its results are in recv. NCCL cannot tell that ranks passed different
// sizes: a mismatch hangs or corrupts, so callers send fixed-size messages
// (the parallel decoders do, with a header that catches disagreeing ranks).
// Abort() aborts this rank's NCCL communicator only; other ranks learn of it
// through NCCL's own error reporting, not promptly. NVLink multicast (NVLS)
// is switched off unless NCCL_NVLS_ENABLE is already set.
//
// Thread-compatible: one thread drives a rank at a time.
#pragma once

#include <array>
#include <cstddef>
#include <memory>

#include "parallel/communicator.h"
#include "questkv/status.h"

namespace questkv {

// What every rank of one NCCL group starts from: made once (NewId, usually on
// rank 0) and handed to the other ranks out of band (file, socket, MPI).
struct NcclId {
  std::array<char, 128> bytes{};  // NCCL_UNIQUE_ID_BYTES
};

struct NcclOptions {
  int device = 0;  // CUDA device of this rank
  // Device staging for host buffers: a host send takes `bytes`, a host recv
  // size() * bytes. A host message that does not fit is ResourceExhausted.
  std::size_t staging_bytes = std::size_t(8) << 20;
};

class NcclCommunicator final : public Communicator {
 public:
  // IOError when NCCL cannot make an id (no network interface, ...).
  static Result<NcclId> NewId();
  // Joins the group `id` as rank `rank` of `size`; blocks until every rank
  // has joined. InvalidArgument for rank/size out of range or a device that
  // does not exist; IOError or Internal for CUDA and NCCL failures.
  static Result<std::unique_ptr<NcclCommunicator>> Create(const NcclId& id, int rank, int size,
                                                          const NcclOptions& options = {});
  ~NcclCommunicator() override;

  int rank() const override;
  int size() const override;
  Status AllGather(const void* send, std::size_t bytes, void* recv) override;
  Status AllReduceSum(const float* send, float* recv, std::size_t count) override;
  Status Barrier() override;
  void Abort(const Status& reason) override;

  // The cudaStream_t the collectives run on, for callers that order their
  // own device work after them.
  void* stream() const;

 private:
  struct Impl;
  explicit NcclCommunicator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace questkv
