// Page tables. One sequence's pages in one layer are a PageList (PageIds in
// logical order plus its token count); a batch is flattened into the CSR form
// that kernels consume, like FlashInfer's paged KV:
//   indptr[B+1]        first element 0; sequence b owns indices[indptr[b]..indptr[b+1])
//   indices[nnz]       PageIds in logical order
//   last_page_len[B]   valid tokens of each sequence's last page, 1..S
#pragma once

#include <cstdint>
#include <vector>

#include "tiers/page_allocator.h"

namespace questkv {

struct PageList {
  std::vector<PageId> pages;
  int64_t tokens = 0;

  // Valid tokens of the last page (1..S), 0 when empty.
  int last_page_len(int page_size) const {
    return tokens == 0 ? 0 : int(tokens - int64_t(pages.size() - 1) * page_size);
  }
  // Number of full (sealed) pages.
  int64_t sealed_pages(int page_size) const { return tokens / page_size; }
};

struct PageTableCsr {
  std::vector<int32_t> indptr;
  std::vector<uint32_t> indices;
  std::vector<int32_t> last_page_len;

  int batch() const { return int(last_page_len.size()); }
  int num_pages(int b) const { return indptr[b + 1] - indptr[b]; }
  const uint32_t* pages(int b) const { return indices.data() + indptr[b]; }

  // Rebuilds the CSR from lists (reusing capacity: no allocation at steady state).
  void Assign(const std::vector<const PageList*>& lists, int page_size);
};

}  // namespace questkv
