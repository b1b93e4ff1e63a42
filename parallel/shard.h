// How a sequence's pages (context parallel) or a model's KV heads (head
// parallel) are divided among the ranks of a group. Pure functions of the
// sizes, so every rank computes every other rank's share without asking.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "questkv/status.h"

namespace questkv {

enum class ShardLayout : uint8_t {
  kContiguous,  // rank r owns logical pages [floor(N r / R), floor(N (r+1) / R))
  kRoundRobin,  // rank r owns the logical pages p with p % R == r
};
std::string_view ShardLayoutName(ShardLayout layout);

// The logical pages rank `rank` of `ranks` owns out of `num_pages`,
// ascending. A rank may own none (fewer pages than ranks). InvalidArgument
// for ranks < 1, a rank outside [0, ranks) or num_pages < 0.
Result<std::vector<int32_t>> ShardPages(ShardLayout layout, int num_pages, int ranks, int rank);

// Index of logical page p among rank `rank`'s pages (ShardPages order), or
// -1 when another rank owns it. Arguments as ShardPages, already valid.
int LocalPageIndex(ShardLayout layout, int num_pages, int ranks, int rank, int page);

// A rank's KV heads [first, first + count).
struct HeadRange {
  int first = 0;
  int count = 0;
};

// Contiguous KV head ranges, one per rank, in rank order. `counts` empty:
// balanced (the first kv_heads % ranks ranks own one more). Otherwise the
// ranks' counts, each >= 1, summing to kv_heads. InvalidArgument for
// ranks < 1, ranks > kv_heads, or counts of the wrong length or sum.
Result<std::vector<HeadRange>> SplitHeads(int kv_heads, int ranks, std::span<const int> counts = {});

}  // namespace questkv
