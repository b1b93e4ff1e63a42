#include "parallel/shard.h"

#include <string>

namespace questkv {

namespace {

// First logical page of rank r under the contiguous layout.
int ContiguousStart(int num_pages, int ranks, int r) { return int(int64_t(num_pages) * r / ranks); }

}  // namespace

std::string_view ShardLayoutName(ShardLayout layout) {
  return layout == ShardLayout::kContiguous ? "contiguous" : "round-robin";
}

Result<std::vector<int32_t>> ShardPages(ShardLayout layout, int num_pages, int ranks, int rank) {
  if (ranks < 1) return Status::InvalidArgument("ShardPages: ranks = " + std::to_string(ranks) + ", must be >= 1");
  if (rank < 0 || rank >= ranks)
    return Status::InvalidArgument("ShardPages: rank " + std::to_string(rank) + " is not in [0, " +
                                   std::to_string(ranks) + ")");
  if (num_pages < 0)
    return Status::InvalidArgument("ShardPages: num_pages = " + std::to_string(num_pages) + ", must be >= 0");
  std::vector<int32_t> pages;
  if (layout == ShardLayout::kContiguous) {
    for (int p = ContiguousStart(num_pages, ranks, rank); p < ContiguousStart(num_pages, ranks, rank + 1); ++p)
      pages.push_back(p);
  } else {
    for (int p = rank; p < num_pages; p += ranks) pages.push_back(p);
  }
  return pages;
}

int LocalPageIndex(ShardLayout layout, int num_pages, int ranks, int rank, int page) {
  if (layout == ShardLayout::kRoundRobin) return page % ranks == rank ? page / ranks : -1;
  const int start = ContiguousStart(num_pages, ranks, rank);
  return page >= start && page < ContiguousStart(num_pages, ranks, rank + 1) ? page - start : -1;
}

Result<std::vector<HeadRange>> SplitHeads(int kv_heads, int ranks, std::span<const int> counts) {
  if (ranks < 1) return Status::InvalidArgument("SplitHeads: ranks = " + std::to_string(ranks) + ", must be >= 1");
  if (ranks > kv_heads)
    return Status::InvalidArgument("SplitHeads: " + std::to_string(ranks) + " ranks for " + std::to_string(kv_heads) +
                                   " KV heads; head parallel needs at least one KV head per rank");
  std::vector<HeadRange> ranges(ranks);
  if (counts.empty()) {
    for (int r = 0, first = 0; r < ranks; ++r) {
      ranges[r] = {first, kv_heads / ranks + (r < kv_heads % ranks ? 1 : 0)};
      first += ranges[r].count;
    }
    return ranges;
  }
  if (counts.size() != std::size_t(ranks))
    return Status::InvalidArgument("SplitHeads: " + std::to_string(counts.size()) + " head counts for " +
                                   std::to_string(ranks) + " ranks");
  int first = 0;
  for (int r = 0; r < ranks; ++r) {
    if (counts[r] < 1)
      return Status::InvalidArgument("SplitHeads: rank " + std::to_string(r) + " has " + std::to_string(counts[r]) +
                                     " KV heads, must be >= 1");
    ranges[r] = {first, counts[r]};
    first += counts[r];
  }
  if (first != kv_heads)
    return Status::InvalidArgument("SplitHeads: head counts sum to " + std::to_string(first) + ", the model has " +
                                   std::to_string(kv_heads) + " KV heads");
  return ranges;
}

}  // namespace questkv
