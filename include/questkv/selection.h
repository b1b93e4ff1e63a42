// What a decode step selected, and a sequence's K/V laid out for inspection:
// plain values that the runtime hands out (Runtime::DecodeAttention's
// selections, Runtime::Gather) and the selector produces.
#pragma once

#include <cstdint>
#include <vector>

namespace questkv {

// Ascending logical page indices per KV head: row h is
// pages[indptr[h] .. indptr[h+1]).
struct PageSelection {
  std::vector<int32_t> indptr;  // [Hkv + 1], indptr[0] = 0
  std::vector<int32_t> pages;   // [nnz]
  int count(int h) const { return indptr[h + 1] - indptr[h]; }
  const int32_t* row(int h) const { return pages.data() + indptr[h]; }
};

// The K/V of one (sequence, layer) laid out for inspection: per KV head,
// contiguous [T][D] keys and values in logical token order.
struct DenseView {
  int tokens = 0;                   // T
  std::vector<float> k;             // [Hkv][T][D]
  std::vector<float> v;             // [Hkv][T][D]
};

}  // namespace questkv
