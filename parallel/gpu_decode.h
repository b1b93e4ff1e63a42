// GpuDecoder: one rank's GPU share of one layer's Quest decode for a batch of
// sequences, the device counterpart of ContextParallel and
// HeadParallel. Each rank owns one CUDA device (rank r: device r % devices,
// unless options name one; several ranks may share a device) and holds its
// shard of the layer's pages there: K/V head-page slots in f16 and f16
// summaries built from them on the device (exact: min and max of f16 keys).
//
//   kContext: the rank holds the pages ShardPages gives it, every KV head.
//     Per step it ranks its own pages with kernels::cuda::LaunchSelect over
//     lists of its candidates (the pages outside sink and local window), sends
//     its best K (score, page) pairs per (sequence, ranking row) through the
//     Communicator, takes the global top-K (parallel/global_topk.h: the
//     Selector's choice, bit for bit), attends its winners with RunAttend
//     and merges every rank's partial (o, lse) in rank order.
//   kHead: the rank holds every page for its contiguous KV head range
//     (SplitHeads); LaunchSelect and RunAttend run on the device with no
//     exchange, and only the outputs are all-gathered.
//
// Exchanges go through host buffers, so any Communicator works: the threaded
// InProcessGroup in tests, NcclCommunicator across GPUs. The shapes are
// fixed at creation (no append): this is the decode step of a loaded layer,
// for tests and benchmarks of the parallel schemes.
//
// Thread-compatible: one thread drives a decoder (it sets its device on
// every call).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "parallel/communicator.h"
#include "parallel/decode_common.h"
#include "parallel/shard.h"
#include "questkv/config.h"
#include "questkv/status.h"

namespace questkv {

enum class GpuParallelMode : uint8_t { kContext, kHead };

struct GpuDecodeOptions {
  GpuParallelMode mode = GpuParallelMode::kContext;
  ShardLayout layout = ShardLayout::kContiguous;  // kContext
  std::vector<int> head_counts;                   // kHead: KV heads per rank; empty: balanced
  int device = -1;                                // -1: rank % device count
  // kHead: copy each step's selection back to the host (out->selection).
  // Off, the selection stays on the device (benchmarks).
  bool selection_to_host = true;
};

// One sequence of the batch, the same on every rank.
struct GpuSequence {
  int num_pages = 0;  // >= 1
  int tail_len = 0;   // valid tokens of the last page, 1..S
};

// Wall-clock microseconds of this rank's last Decode, and the device time
// of its kernels (CUDA events).
struct GpuStepTimes {
  double total_us = 0;
  double exchange_us = 0;    // inside the Communicator's collectives (waiting for other ranks included)
  double select_gpu_us = 0;  // LaunchSelect (+ candidate scores)
  double attend_gpu_us = 0;  // RunAttend
};

class GpuDecoder {
 public:
  // InvalidArgument for sizes the CUDA kernels do not cover (head_dim 64,
  // 128, 256; page_size 8..64; group 1, 2, 4, 8), an empty batch, a bad
  // sequence, rank/ranks out of range or (kHead) more ranks than KV heads;
  // ResourceExhausted when the device memory does not suffice; Internal for
  // other CUDA failures. Geometry and policy must already be validated.
  // Every layer's device plan is made here, so Decode allocates and frees
  // nothing. Create, LoadSequence and FillRandom do: when ranks are threads
  // of one process over NCCL, let every rank finish them before any rank
  // calls a collective (a host-side barrier), as cudaMalloc/cudaFree may wait
  // for a peer GPU whose NCCL kernel waits for this rank.
  static Result<std::unique_ptr<GpuDecoder>> Create(const Geometry& g, const SelectionPolicy& p,
                                                    const GpuDecodeOptions& options, int ranks, int rank,
                                                    std::span<const GpuSequence> batch);
  ~GpuDecoder();
  GpuDecoder(const GpuDecoder&) = delete;
  GpuDecoder& operator=(const GpuDecoder&) = delete;

  int device() const;
  // Bytes of device memory holding this rank's pages and summaries.
  std::size_t resident_bytes() const;

  // Loads sequence b from the whole sequence's pages, pages[num_pages] each
  // [2][Hkv][S][D] f32 in logical order: this rank's share is rounded to f16
  // and uploaded, and its summaries are rebuilt. InvalidArgument for b out
  // of range or a null pointer.
  Status LoadSequence(int b, const float* const* pages);

  // Fills every sequence with deterministic random K/V (a function of the
  // seed, sequence, page, head, token and dimension only, so every split
  // over ranks holds the same values) and rebuilds the summaries.
  Status FillRandom(uint64_t seed);

  // One decode step of every sequence with the other ranks of comm (the
  // same ranks, options and batch on each). q: [batch][Hq][D] f32, the same
  // on every rank. out[b] as ParallelDecodeOutput says: kContext, every KV
  // head's selection and the merged outputs; kHead, this rank's selection
  // rows and every rank's outputs. InvalidArgument for bad arguments or a
  // rank that disagrees on the step; Internal for CUDA errors; errors of
  // the collectives as Communicator's. Any error aborts the group.
  Status Decode(Communicator& comm, const float* q, int layer, float scale, std::vector<ParallelDecodeOutput>* out);

  const GpuStepTimes& last_times() const;

 private:
  struct Impl;
  explicit GpuDecoder(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace questkv
