// Head-parallel Quest decode of one layer for one sequence (seed
// §2.1 on tensor parallelism by head): the KV heads are split into contiguous
// ranges, one per rank, and each rank holds every page of the sequence for
// its heads only (K/V and summaries). Selection needs no exchange — a KV
// head's pages depend on its own query heads alone — so each rank runs the
// Selector and the attention for its heads, and only the outputs are
// all-gathered. The outputs equal the single-rank run bit for bit.
//
// Thread-compatible: a decoder holds scratch, one per rank's thread.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/cpu/kernels_cpu.h"
#include "parallel/communicator.h"
#include "parallel/decode_common.h"
#include "parallel/shard.h"
#include "questkv/config.h"
#include "questkv/status.h"
#include "selector/select.h"

namespace questkv {

// One rank's heads of one sequence at one layer; `count` below is the
// number of KV heads this rank owns (HeadParallel::HeadsOf).
struct HeadShard {
  const float* q = nullptr;             // [count * G][D] the query heads of this rank's KV heads
  const float* summary_slab = nullptr;  // [PageId][count][2][D] this rank's heads' summaries
  const uint32_t* page_ids = nullptr;   // [num_pages] logical order
  const float* const* pages = nullptr;  // [num_pages] this rank's heads' K/V, [2][count][S][D] each
  int num_pages = 0;                    // >= 1, the same on every rank
  int tail_len = 0;                     // valid tokens of logical page num_pages - 1, 1..S
  int layer = 0;
  float scale = 0.f;                    // multiplies q·k; 1/sqrt(D) for the model
};

class HeadParallel {
 public:
  // Geometry and policy must already be validated. head_counts: the KV heads
  // of each rank, in rank order (see SplitHeads); empty for a balanced split.
  HeadParallel(const Geometry& g, const SelectionPolicy& p, std::vector<int> head_counts = {});

  // The KV heads rank `rank` of `ranks` owns. InvalidArgument as SplitHeads
  // (notably more ranks than KV heads).
  Result<HeadRange> HeadsOf(int ranks, int rank) const;

  // Selects and attends this rank's KV heads and gathers every rank's
  // outputs. out->selection holds this rank's rows (first_kv_head = its first
  // head); out->o and out->lse every query head's, identical on every rank.
  // InvalidArgument for bad input or a rank that disagrees on the step;
  // errors of the collectives as Communicator's. Any error aborts the group.
  Status Decode(Communicator& comm, const HeadShard& in, ParallelDecodeOutput* out);

 private:
  Status Validate(const Communicator& comm, const HeadShard& in, const ParallelDecodeOutput* out);
  Status DecodeValid(Communicator& comm, const HeadShard& in, ParallelDecodeOutput* out);
  void AttendOwn(const HeadShard& in, const PageSelection& sel, int max_heads);
  void Unpack(int ranks, int max_heads, ParallelDecodeOutput* out) const;

  Geometry g_;
  SelectionPolicy p_;
  std::vector<int> head_counts_;
  std::vector<HeadRange> ranges_;       // of the last Decode's group
  Geometry local_;                      // g_ narrowed to this rank's heads
  std::unique_ptr<Selector> selector_;  // for local_
  StepExchange exchange_;
  std::vector<kernels::HeadPageRef> refs_;
  std::vector<int32_t> idx_;
  std::vector<float> m_, d_;            // [count * G]
  std::vector<float> mine_;             // [o: max_heads * G][D] [lse: max_heads * G], zero-padded
  std::vector<float> all_;              // [R][as mine_]
};

}  // namespace questkv
