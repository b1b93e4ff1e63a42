// Shared by the parallel suites: a random sequence of one layer (queries,
// K/V pages, summaries built from the keys), the single-rank reference the
// parallel decoders must reproduce (Selector + AttendPagesCpu), and a rank's
// share of a sequence under context parallelism.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/attention_state.h"
#include "kernels/cpu/kernels_cpu.h"
#include "parallel/context_parallel.h"
#include "parallel/shard.h"
#include "questkv/config.h"
#include "selector/select.h"
#include "tests/testing/reference.h"

namespace questkv::test {

struct Sequence {
  Geometry g;
  int num_pages = 0;
  int tail_len = 0;
  std::vector<float> q;                   // [Hq][D]
  std::vector<std::vector<float>> pages;  // [num_pages] each [2][Hkv][S][D]
  std::vector<const float*> page_ptrs;    // [num_pages]
  std::vector<float> slab;                // [PageId][Hkv][2][D]
  std::vector<uint32_t> ids;              // [num_pages] shuffled PageIds
};

inline Geometry MakeGeometry(int kv_heads, int group, int page_size = 4, int head_dim = 24) {
  Geometry g;
  g.layers = 2;
  g.kv_heads = kv_heads;
  g.q_heads = kv_heads * group;
  g.head_dim = head_dim;
  g.page_size = page_size;
  return g;
}

// Random K/V; with `patterns` > 0 every page copies one of that many random
// pages, so whole pages (and their scores) tie.
inline Sequence MakeSequence(const Geometry& g, int num_pages, int tail_len, uint64_t seed, int patterns = 0) {
  Sequence s;
  s.g = g;
  s.num_pages = num_pages;
  s.tail_len = tail_len;
  s.q = RandomNormal(std::size_t(g.q_heads) * g.head_dim, seed);
  const int distinct = patterns > 0 ? patterns : num_pages;
  std::vector<std::vector<float>> pool;
  for (int i = 0; i < distinct; ++i) pool.push_back(RandomNormal(g.page_elems(), seed + 1 + i));
  std::mt19937_64 rng(seed);
  for (int i = 0; i < num_pages; ++i) s.pages.push_back(pool[patterns > 0 ? rng() % distinct : i]);
  for (const auto& p : s.pages) s.page_ptrs.push_back(p.data());
  s.ids.resize(num_pages);
  std::iota(s.ids.begin(), s.ids.end(), 2u);  // ids 0, 1 stay unused
  std::shuffle(s.ids.begin(), s.ids.end(), rng);
  s.slab.assign((num_pages + 2) * g.summary_elems(), std::nanf(""));
  for (int i = 0; i < num_pages; ++i)
    kernels::RebuildSummaryCpu(s.pages[i].data(), s.slab.data() + s.ids[i] * g.summary_elems(), g.kv_heads,
                               g.page_size, g.head_dim, i == num_pages - 1 ? tail_len : g.page_size);
  return s;
}

inline SelectionPolicy MakePolicy(int budget_pages, int sink, int local, GqaMode mode, int page_size) {
  SelectionPolicy p;
  p.token_budget = int64_t(budget_pages) * page_size + page_size - 1;  // floor(budget / S) = budget_pages
  p.sink_pages = sink;
  p.local_pages = local;
  p.gqa = mode;
  p.dense_layers = {0};
  return p;
}

inline float Scale(const Geometry& g) { return 1.f / std::sqrt(float(g.head_dim)); }

struct Reference {
  PageSelection selection;
  std::vector<float> o;    // [Hq][D]
  std::vector<float> lse;  // [Hq]
};

// The single-rank run: Selector over all pages, then AttendPagesCpu over each
// KV head's selected pages in ascending order, with the queries attend_q
// ([Hq][D]; null: s.q, the ones the Selector ranks with).
inline Reference SingleRank(const Sequence& s, const SelectionPolicy& p, int layer,
                            const float* attend_q = nullptr) {
  const Geometry& g = s.g;
  Reference ref;
  Selector selector(g, p);
  const Status st = selector.Select({s.q.data(), s.slab.data(), s.ids.data(), s.num_pages, layer}, &ref.selection);
  EXPECT_TRUE(st.ok()) << st.ToString();
  const int group = g.group(), dim = g.head_dim;
  const std::size_t head_page = g.head_page_elems();
  ref.o.resize(std::size_t(g.q_heads) * dim);
  ref.lse.resize(g.q_heads);
  std::vector<float> m(group), d(group);
  for (int h = 0; h < g.kv_heads; ++h) {
    std::vector<kernels::HeadPageRef> refs;
    for (int i = 0; i < ref.selection.count(h); ++i) {
      const int page = ref.selection.row(h)[i];
      const float* base = s.pages[page].data();
      refs.push_back({base + h * head_page, base + (g.kv_heads + h) * head_page,
                      page == s.num_pages - 1 ? s.tail_len : g.page_size});
    }
    const float* q = (attend_q ? attend_q : s.q.data()) + std::size_t(h) * group * dim;
    kernels::AttendPagesCpu(q, group, dim, refs.data(), int(refs.size()), Scale(g),
                            ref.o.data() + std::size_t(h) * group * dim, m.data(), d.data());
    for (int gi = 0; gi < group; ++gi) ref.lse[h * group + gi] = kernels::StateLse(m[gi], d[gi]);
  }
  return ref;
}

// What rank `rank` of a context-parallel group holds: its own slab (local
// PageIds, reversed so they differ from the indices) and its pages' K/V.
struct Share {
  std::vector<float> slab;
  std::vector<uint32_t> ids;
  std::vector<const float*> pages;
};

inline Share ShareOf(const Sequence& s, ShardLayout layout, int ranks, int rank) {
  const std::vector<int32_t> owned = ShardPages(layout, s.num_pages, ranks, rank).value();
  const std::size_t e = s.g.summary_elems();
  const int n = int(owned.size());
  Share share;
  share.slab.resize(std::size_t(n) * e);
  for (int i = 0; i < n; ++i) {
    share.ids.push_back(uint32_t(n - 1 - i));
    std::memcpy(share.slab.data() + share.ids[i] * e, s.slab.data() + s.ids[owned[i]] * e, e * sizeof(float));
    share.pages.push_back(s.page_ptrs[owned[i]]);
  }
  return share;
}

// A rank's ContextParallel input for its share.
inline ContextShard ShardInput(const Sequence& s, const Share& share, int layer) {
  ContextShard in;
  in.q = s.q.data();
  in.summary_slab = share.slab.data();
  in.page_ids = share.ids.data();
  in.pages = share.pages.data();
  in.num_local = int(share.pages.size());
  in.num_pages = s.num_pages;
  in.tail_len = s.tail_len;
  in.layer = layer;
  in.scale = Scale(s.g);
  return in;
}

inline std::vector<std::vector<int>> Rows(const PageSelection& s, int first, int count) {
  std::vector<std::vector<int>> rows;
  for (int h = first; h < first + count; ++h) rows.emplace_back(s.row(h), s.row(h) + s.count(h));
  return rows;
}

}  // namespace questkv::test
