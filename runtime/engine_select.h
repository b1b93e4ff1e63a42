// Quest over an engine's own paged KV cache on the GPU: the summaries of its
// pages rebuilt from its key cache, and the pages each (sequence, KV head)
// attends, as page ids of its own page table (FlashInfer's CSR indptr /
// indices). Device pointers, on the caller's stream, nothing kept between
// calls; python/ops.cc's update_summaries and select_pages on CUDA tensors.
// The host twins are kernels::RebuildSummaryHeadsCpu and Selector; the
// selections are the CPU selector's for the same float values.
//
// Arguments are the caller's to check (shapes, ranges of pages and indices);
// these return InvalidArgument for sizes the kernels do not cover and
// Unimplemented when built without CUDA.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "questkv/status.h"
#include "questkv/config.h"

namespace questkv {

struct DeviceSummaryArgs {
  DType dtype = DType::kF16;       // of the key cache and the summaries: f32, f16 or bf16
  const void* k_cache = nullptr;   // [P][S][Hkv][D] (nhd) or [P][Hkv][S][D]
  void* summaries = nullptr;       // [P][Hkv][2][D]
  const int32_t* pages = nullptr;  // [n] on the device
  const int32_t* lens = nullptr;   // [n] on the device, 1..S
  int n = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int page_size = 0;
  bool nhd = true;
};
Status DeviceUpdateSummaries(const DeviceSummaryArgs& a, void* stream);

struct DeviceSelectArgs {
  Geometry geometry;                 // q_heads, kv_heads, head_dim, page_size (layers unused)
  SelectionPolicy policy;            // token_budget, sink_pages, local_pages, gqa
  DType dtype = DType::kF16;         // of q and the summaries: f32, f16 or bf16
  const void* q = nullptr;           // [B][Hq][D]
  const void* summaries = nullptr;   // [P][Hkv][2][D]
  const int32_t* indptr = nullptr;   // [B + 1] on the device
  const int32_t* indices = nullptr;  // [indptr[B]] on the device: page ids in logical order
  std::vector<int32_t> page_counts;  // [B] on the host: indptr[b + 1] - indptr[b], each >= 1
};
// Each row's page ids ascending in logical order, padded with -1, into
// out[B][Hkv][width]: width is the most pages a row can hold (kUnion: a
// bound), and `out(width)` gives that device memory (the caller's tensor).
Status DeviceSelectPages(const DeviceSelectArgs& a, const std::function<int32_t*(int width)>& out, void* stream);

}  // namespace questkv
