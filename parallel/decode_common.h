// Pieces shared by the context-parallel and head-parallel decoders: their
// output, the header-checked exchange every step's messages go through, and
// the attention of one KV head over the pages a rank holds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/cpu/kernels_cpu.h"
#include "parallel/communicator.h"
#include "questkv/config.h"
#include "questkv/status.h"
#include "selector/select.h"

namespace questkv {

// One layer's decode step for one sequence, as seen by one rank.
struct ParallelDecodeOutput {
  // Rows of `selection` are KV heads first_kv_head, first_kv_head + 1, ...
  // Context parallel: every KV head (first 0), the same on every rank.
  // Head parallel: this rank's KV heads.
  int first_kv_head = 0;
  PageSelection selection;  // ascending global logical page indices per row
  std::vector<float> o;     // [Hq][D] every query head's output, the same on every rank
  std::vector<float> lse;   // [Hq] log-sum-exp of the scaled logits attended (-inf: none)
};

// What every rank must agree on for a step. Sent in front of each message so
// a rank that disagrees (another page count, budget or phase) is reported
// instead of its bytes being misread.
struct StepHeader {
  int32_t tag = 0;  // which message of the step
  int32_t num_pages = 0;
  int32_t layer = 0;
  int32_t tail_len = 0;
  int32_t q_heads = 0;
  int32_t kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 0;
  int32_t top_k = 0;
  int32_t gqa = 0;
};

// An all-gather of equal-sized payloads with a StepHeader in front.
// Thread-compatible; reuses its buffers across steps.
class StepExchange {
 public:
  // Gathers every rank's `bytes` of payload. InvalidArgument when a rank's
  // header differs from this rank's (the group is then aborted); collective
  // errors as Communicator::AllGather.
  Status Gather(Communicator& comm, const StepHeader& header, const void* payload, std::size_t bytes);
  // Copies rank r's payload of the last Gather to out (`bytes` of it).
  void CopyPayload(int rank, void* out) const;

 private:
  std::vector<std::byte> send_;
  std::vector<std::byte> recv_;
  std::size_t bytes_ = 0;
};

// Pages one rank holds for one sequence: K/V of `kv_heads` heads each.
struct HeldPages {
  const float* const* data = nullptr;  // [n] page bytes [2][kv_heads][S][D]
  int kv_heads = 0;
  int page_size = 0;
  int head_dim = 0;
  int tail_index = -1;  // index in data of the sequence's last page; -1 if not held
  int tail_len = 0;     // its valid tokens, 1..S
};

// Partial states (o [G][D], m [G], d [G]) of KV head `kv_head`'s G query
// heads q [G][D] over the held pages listed in idx, in that order (the empty
// state when idx is empty). refs is scratch.
void AttendHeldPages(const HeldPages& held, int kv_head, std::span<const int32_t> idx, const float* q, int group,
                     float scale, std::vector<kernels::HeadPageRef>* refs, float* o, float* m, float* d);

// InvalidArgument naming the field when q is null, scale is not a positive
// finite number, num_pages < 1, tail_len is outside 1..S or the layer is not
// one of the geometry's.
Status ValidateStep(const Geometry& g, const float* q, float scale, int num_pages, int tail_len, int layer);

}  // namespace questkv
