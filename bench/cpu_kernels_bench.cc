// CPU kernel benchmarks (Google Benchmark). Named workloads:
//
//   ScorePages/tokens/D/G    U_p for every page of one KV head, S = 16:
//                            tokens 8K, 32K, 128K; D 64, 128; G 1, 4.
//                            Bytes = summaries read (2·D floats per page).
//   TopK/pages/k             top-k of random scores: pages 2K..64K, k 64..256.
//                            Bytes = scores read.
//   AttendPages/budget       sparse attention of G = 4 query heads, D = 128,
//                            S = 16, over `budget` tokens of pages scattered in
//                            a 32K-token pool: budget 512..4096.
//                            Bytes = K and V rows read.
//   Select/tokens            whole-layer Selector (Llama-3-8B shape: 32 query /
//                            8 KV heads, D 128, S 16, budget 2048, kMax):
//                            tokens 32K, 128K. Bytes = summaries read.
//
// Run: questkv_cpu_kernels_bench [--benchmark_min_time=0.05]
//      [--benchmark_format=json]
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cpu/kernels_cpu.h"
#include "selector/select.h"

namespace questkv {
namespace {

constexpr int kPageSize = 16;

std::vector<float> Normal(std::size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist;
  std::vector<float> x(n);
  for (float& e : x) e = dist(rng);
  return x;
}

// A summary slab of `pages` pages with `kv_heads` heads, boxes lo <= hi.
std::vector<float> Slab(int pages, int kv_heads, int d, uint64_t seed) {
  std::vector<float> slab = Normal(std::size_t(pages) * kv_heads * 2 * d, seed);
  for (std::size_t i = 0; i < slab.size(); i += 2 * d)
    for (int j = 0; j < d; ++j) slab[i + j] = std::min(slab[i + j], slab[i + d + j] - 0.5f);
  return slab;
}

std::vector<uint32_t> Ids(int pages) {
  std::vector<uint32_t> ids(pages);
  std::iota(ids.begin(), ids.end(), 0u);
  return ids;
}

void BM_ScorePages(benchmark::State& state) {
  const int tokens = int(state.range(0)), d = int(state.range(1)), group = int(state.range(2));
  const int pages = tokens / kPageSize;
  const auto slab = Slab(pages, 1, d, 1);
  const auto ids = Ids(pages);
  const auto q = Normal(std::size_t(group) * d, 2);
  std::vector<float> scores(std::size_t(group) * pages);
  for (auto _ : state) {
    kernels::ScorePagesCpu(q.data(), group, d, slab.data(), 1, 0, ids.data(), pages, scores.data());
    benchmark::DoNotOptimize(scores.data());
  }
  state.SetBytesProcessed(state.iterations() * int64_t(pages) * 2 * d * sizeof(float));
}
BENCHMARK(BM_ScorePages)
    ->Name("ScorePages")
    ->ArgNames({"tokens", "D", "G"})
    ->ArgsProduct({{8 << 10, 32 << 10, 128 << 10}, {64, 128}, {1, 4}});

void BM_TopK(benchmark::State& state) {
  const int n = int(state.range(0)), k = int(state.range(1));
  const auto scores = Normal(n, 3);
  std::vector<int> out(k), scratch(n);
  for (auto _ : state) {
    benchmark::DoNotOptimize(
        kernels::TopKCpu(scores.data(), n, nullptr, k, out.data(), scratch.data()));
  }
  state.SetBytesProcessed(state.iterations() * int64_t(n) * sizeof(float));
}
BENCHMARK(BM_TopK)
    ->Name("TopK")
    ->ArgNames({"pages", "k"})
    ->ArgsProduct({{2 << 10, 8 << 10, 64 << 10}, {64, 256}});

void BM_AttendPages(benchmark::State& state) {
  const int budget = int(state.range(0)), d = 128, group = 4;
  const int pool_pages = (32 << 10) / kPageSize, chosen = budget / kPageSize;
  const auto k = Normal(std::size_t(pool_pages) * kPageSize * d, 4);
  const auto v = Normal(k.size(), 5);
  const auto q = Normal(std::size_t(group) * d, 6);
  std::vector<int> order(pool_pages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(7));
  std::vector<kernels::HeadPageRef> refs;
  for (int i = 0; i < chosen; ++i) {
    const std::size_t at = std::size_t(order[i]) * kPageSize * d;
    refs.push_back({k.data() + at, v.data() + at, kPageSize});
  }
  std::vector<float> o(std::size_t(group) * d), m(group), den(group);
  for (auto _ : state) {
    kernels::AttendPagesCpu(q.data(), group, d, refs.data(), chosen, 0.088388f, o.data(), m.data(),
                            den.data());
    benchmark::DoNotOptimize(o.data());
  }
  state.SetBytesProcessed(state.iterations() * int64_t(chosen) * 2 * kPageSize * d * sizeof(float));
}
BENCHMARK(BM_AttendPages)
    ->Name("AttendPages")
    ->ArgName("budget")
    ->RangeMultiplier(2)
    ->Range(512, 4096);

void BM_Select(benchmark::State& state) {
  Geometry g;
  g.layers = 4;
  g.q_heads = 32;
  g.kv_heads = 8;
  g.head_dim = 128;
  g.page_size = kPageSize;
  SelectionPolicy p;
  p.token_budget = 2048;
  const int pages = int(state.range(0)) / kPageSize;
  const auto slab = Slab(pages, g.kv_heads, g.head_dim, 8);
  const auto ids = Ids(pages);
  const auto q = Normal(std::size_t(g.q_heads) * g.head_dim, 9);
  Selector selector(g, p);
  PageSelection out;
  for (auto _ : state) {
    if (!selector.Select({q.data(), slab.data(), ids.data(), pages, 2}, &out).ok()) {
      state.SkipWithError("Select failed");
      break;
    }
    benchmark::DoNotOptimize(out.pages.data());
  }
  state.SetBytesProcessed(state.iterations() * int64_t(slab.size()) * sizeof(float));
}
BENCHMARK(BM_Select)->Name("Select")->ArgName("tokens")->Arg(32 << 10)->Arg(128 << 10);

}  // namespace
}  // namespace questkv

BENCHMARK_MAIN();
