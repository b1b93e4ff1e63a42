// LaunchRerank (after LaunchSelect of RerankShape's widened budget) against a
// CPU reference written from selector/select.cc's Rerank and the CPU
// backend's exact scorer: candidates the top ceil(rerank * k) by the bound
// outside the sink and local pages; each candidate's exact score the group's
// max or mean of its largest logit over its valid keys, read from an HBM
// slot or a host home, or its bound when it has neither; the best k kept,
// ties toward the lower page. Selections must be equal exactly.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/kernels_cpu.h"
#include "tests/kernels_cuda/cuda_test_util.h"
#include "tests/testing/reference.h"

namespace questkv::kernels::cuda::test {
namespace {

struct RerankCase {
  int batch, kv_heads, group, head_dim, page_size;
  int64_t page_budget;
  double rerank;
  GqaMode gqa;
  DType dtype;
  bool ties;  // keys of few distinct values: many equal logits
};
void PrintTo(const RerankCase& c, std::ostream* os) {
  *os << (c.gqa == GqaMode::kMax ? "max" : "mean") << "_B" << c.batch << "_H" << c.kv_heads << "_G" << c.group << "_D"
      << c.head_dim << "_S" << c.page_size << "_K" << c.page_budget << "_c" << c.rerank << "_" << DTypeName(c.dtype)
      << (c.ties ? "_ties" : "");
}

// Where a head-page's keys are: an HBM slot, a host home, or neither (disk).
enum class Where { kHbm, kHost, kDisk };

// The reference for one row: page indices, ascending.
std::vector<int> CpuRerank(const RerankCase& c, const float* q, const float* summaries, const float* keys,
                           const std::vector<Where>& where, const uint32_t* ids, int n, int last_len, int h) {
  const int G = c.group, D = c.head_dim, H = c.kv_heads, S = c.page_size;
  std::vector<int> row;
  if (c.page_budget >= n) {
    row.resize(n);
    std::iota(row.begin(), row.end(), 0);
    return row;
  }
  std::vector<uint8_t> skip(n, 0);
  const int sink = std::min(1, n), local = std::min(2, n);
  for (int i = 0; i < sink; ++i) skip[i] = 1;
  for (int i = n - local; i < n; ++i) skip[i] = 1;
  const int fixed = int(std::count(skip.begin(), skip.end(), 1));
  const int k = int(std::max<int64_t>(0, c.page_budget - fixed));
  std::vector<float> scores(std::size_t(G) * n), agg(n);
  ScorePagesCpu(q + std::size_t(h) * G * D, G, D, summaries, H, h, ids, n, scores.data());
  for (int i = 0; i < n; ++i) {
    agg[i] = scores[i];
    for (int g = 1; g < G; ++g)
      agg[i] = c.gqa == GqaMode::kMax ? std::max(agg[i], scores[std::size_t(g) * n + i]) : agg[i] + scores[std::size_t(g) * n + i];
    if (c.gqa == GqaMode::kMean) agg[i] /= float(G);
  }
  const int want = int(std::min<double>(std::ceil(c.rerank * double(k)), double(n)));
  std::vector<int> chosen(n), scratch(n);
  const int got = TopKCpu(agg.data(), n, skip.data(), want, chosen.data(), scratch.data());
  std::vector<int> cand(chosen.begin(), chosen.begin() + got);
  std::vector<float> exact(std::max(got, 1));
  for (int i = 0; i < got; ++i) {
    const int p = cand[i];
    const std::size_t head_page = std::size_t(ids[p]) * H + h;
    if (where[head_page] == Where::kDisk) {
      exact[i] = agg[p];
      continue;
    }
    const float* kp = keys + head_page * S * D;
    const int len = p == n - 1 ? last_len : S;
    float a = c.gqa == GqaMode::kMax ? -std::numeric_limits<float>::infinity() : 0.f;
    for (int g = 0; g < G; ++g) {
      const float* qh = q + (std::size_t(h) * G + g) * D;
      float best = -std::numeric_limits<float>::infinity();
      for (int t = 0; t < len; ++t) {
        float dot = 0;
        for (int d = 0; d < D; ++d) dot += qh[d] * kp[std::size_t(t) * D + d];
        best = std::max(best, dot);
      }
      a = c.gqa == GqaMode::kMax ? std::max(a, best) : a + best / float(G);
    }
    exact[i] = a;
  }
  std::vector<uint8_t> mark(skip);
  const int kept = TopKCpu(exact.data(), got, nullptr, k, chosen.data(), scratch.data());
  for (int i = 0; i < kept; ++i) mark[cand[chosen[i]]] = 1;
  for (int i = 0; i < n; ++i)
    if (mark[i]) row.push_back(i);
  return row;
}

void RunRerankCase(const RerankCase& c, uint64_t seed) {
  const int B = c.batch, H = c.kv_heads, G = c.group, D = c.head_dim, S = c.page_size;
  std::mt19937_64 rng(seed);
  // Token lengths 1, S-1, S, S+1, 4099, and random ones.
  const int odd[] = {1, S - 1, S, S + 1, 4099, 3 * S + 5, 700, 40 * S};
  std::vector<int32_t> counts(B), indptr(B + 1, 0), last_len(B);
  for (int b = 0; b < B; ++b) {
    const int tokens = b < 8 ? odd[b] : 1 + int(rng() % 3000);
    counts[b] = (tokens + S - 1) / S;
    last_len[b] = tokens - (counts[b] - 1) * S;
    indptr[b + 1] = indptr[b] + counts[b];
  }
  const int pages = indptr[B], id_space = pages + 7;
  std::vector<uint32_t> perm(id_space);
  std::iota(perm.begin(), perm.end(), 0u);
  std::shuffle(perm.begin(), perm.end(), rng);
  const std::vector<uint32_t> ids(perm.begin(), perm.begin() + pages);
  // Keys [PageId][H][S][D] (the invalid tail rows too: the kernel must not read them), their boxes.
  std::vector<float> keys = questkv::test::RandomNormal(std::size_t(id_space) * H * S * D, seed + 1);
  if (c.ties)
    for (float& v : keys) v = std::round(v);
  keys = RoundTo(keys, c.dtype);
  std::vector<float> summaries(std::size_t(id_space) * H * 2 * D);
  for (int b = 0; b < B; ++b)
    for (int p = 0; p < counts[b]; ++p)
      for (int h = 0; h < H; ++h) {
        const std::size_t hp = std::size_t(ids[indptr[b] + p]) * H + h;
        const int len = p == counts[b] - 1 ? last_len[b] : S;
        for (int d = 0; d < D; ++d) {
          float lo = std::numeric_limits<float>::infinity(), hi = -lo;
          for (int t = 0; t < len; ++t) lo = std::min(lo, keys[(hp * S + t) * D + d]), hi = std::max(hi, keys[(hp * S + t) * D + d]);
          summaries[hp * 2 * D + d] = lo;
          summaries[hp * 2 * D + D + d] = hi;
        }
      }
  std::vector<float> q = RoundTo(questkv::test::RandomNormal(std::size_t(B) * H * G * D, seed + 2), c.dtype);
  if (c.ties)
    for (float& v : q) v = std::round(v);
  // A third of the head-pages in HBM slots, a third in host homes, a third on disk.
  std::vector<Where> where(std::size_t(id_space) * H);
  for (auto& w : where) w = Where(rng() % 3);
  const std::size_t piece = std::size_t(S) * D * DTypeBytes(c.dtype);
  std::vector<int32_t> hbm_slot(where.size(), -1);
  std::vector<uint8_t> pool_bytes, key_bytes = Encode(keys, c.dtype);
  int32_t slots = 0;
  for (std::size_t hp = 0; hp < where.size(); ++hp)
    if (where[hp] == Where::kHbm) hbm_slot[hp] = slots++;
  pool_bytes.assign(std::size_t(std::max(slots, 1)) * 2 * piece, 0xFF);  // V halves: NaN-ish garbage, never read
  for (std::size_t hp = 0; hp < where.size(); ++hp)
    if (hbm_slot[hp] >= 0) std::memcpy(pool_bytes.data() + std::size_t(hbm_slot[hp]) * 2 * piece, key_bytes.data() + hp * piece, piece);
  // Host homes [2][H][S][D] in mapped pinned memory; a page whose heads are all on disk has none.
  char* homes = nullptr;
  const std::size_t home_bytes = 2 * H * piece;
  ASSERT_EQ(cudaHostAlloc(&homes, std::size_t(id_space) * home_bytes, cudaHostAllocMapped), cudaSuccess);
  std::vector<const void*> host_addr(id_space, nullptr);
  for (int id = 0; id < id_space; ++id) {
    bool any = false;
    for (int h = 0; h < H; ++h) {
      const std::size_t hp = std::size_t(id) * H + h;
      char* dst = homes + std::size_t(id) * home_bytes + std::size_t(h) * piece;
      if (where[hp] == Where::kHost) {
        std::memcpy(dst, key_bytes.data() + hp * piece, piece);
        any = true;
      }
    }
    // A head on disk must not be readable: pages with one keep no home (their
    // host heads then count as on disk too).
    bool disk = false;
    for (int h = 0; h < H; ++h) disk |= where[std::size_t(id) * H + h] == Where::kDisk;
    if (any && !disk) {
      void* dev = nullptr;
      ASSERT_EQ(cudaHostGetDevicePointer(&dev, homes + std::size_t(id) * home_bytes, 0), cudaSuccess);
      host_addr[id] = dev;
    }
    if (!host_addr[id])
      for (int h = 0; h < H; ++h)
        if (where[std::size_t(id) * H + h] == Where::kHost) where[std::size_t(id) * H + h] = Where::kDisk;
  }

  SelectShape s;
  s.batch = B;
  s.kv_heads = H;
  s.group = G;
  s.head_dim = D;
  s.page_size = S;
  s.page_budget = c.page_budget;
  s.sink_pages = 1;
  s.local_pages = 2;
  s.gqa = c.gqa;
  const SelectShape wide = RerankShape(s, c.rerank);
  SelectPlan plan, wplan;
  std::string err;
  ASSERT_TRUE(PlanSelect(s, counts.data(), NumSms(), &plan, &err)) << err;
  ASSERT_TRUE(PlanSelect(wide, counts.data(), NumSms(), &wplan, &err)) << err;
  const int rows = B * H;
  int max_listed = 0;
  for (int r = 0; r < rows; ++r) max_listed = std::max(max_listed, wplan.out_indptr[r + 1] - wplan.out_indptr[r]);

  DeviceBuffer d_q, d_sum, d_indptr, d_ids, d_last, d_slot, d_pool, d_host, d_cind, d_cand, d_ccount, d_ws, d_oind,
      d_out, d_count, d_exact;
  Upload(d_q, Encode(q, c.dtype));
  Upload(d_sum, Encode(summaries, c.dtype));
  Upload(d_indptr, indptr);
  Upload(d_ids, ids);
  Upload(d_last, last_len);
  Upload(d_slot, hbm_slot);
  Upload(d_pool, pool_bytes);
  Upload(d_host, host_addr);
  Upload(d_cind, wplan.out_indptr);
  Upload(d_cand, std::vector<int32_t>(std::max(wplan.out_indptr[rows], 1), -7));
  Upload(d_ccount, std::vector<int32_t>(rows, -7));
  Upload(d_oind, plan.out_indptr);
  Upload(d_out, std::vector<int32_t>(std::max(plan.out_indptr[rows], 1), -7));  // poison
  Upload(d_count, std::vector<int32_t>(rows, -7));
  d_ws.Resize(std::max<std::size_t>(wplan.workspace_bytes, 1));

  SelectParams sp;
  sp.shape = wide;
  sp.q_dtype = c.dtype;
  sp.summary_dtype = c.dtype;
  sp.q = d_q.get();
  sp.summaries = d_sum.get();
  sp.page_indptr = d_indptr.as<int32_t>();
  sp.page_ids = d_ids.as<uint32_t>();
  sp.out_indptr = d_cind.as<int32_t>();
  sp.out_pages = d_cand.as<int32_t>();
  sp.out_count = d_ccount.as<int32_t>();
  sp.workspace = d_ws.get();
  QKV_CUDA_OK(LaunchSelect(wplan, sp, nullptr));
  RerankParams rp;
  rp.shape = s;
  rp.kv_dtype = c.dtype;
  rp.summary_dtype = c.dtype;
  rp.q = d_q.get();
  rp.summaries = d_sum.get();
  rp.page_indptr = d_indptr.as<int32_t>();
  rp.page_ids = d_ids.as<uint32_t>();
  rp.last_len = d_last.as<int32_t>();
  rp.hbm_slot = d_slot.as<int32_t>();
  rp.slots = d_pool.get();
  rp.host_addr = d_host.as<const void* const>();
  rp.cand_indptr = d_cind.as<int32_t>();
  rp.cand_pages = d_cand.as<int32_t>();
  rp.cand_count = d_ccount.as<int32_t>();
  rp.max_listed = max_listed;
  d_exact.Resize(std::max<std::size_t>(std::size_t(wplan.out_indptr[rows]) * sizeof(float), 4));
  rp.workspace = d_exact.as<float>();
  rp.out_indptr = d_oind.as<int32_t>();
  rp.out_pages = d_out.as<int32_t>();
  rp.out_count = d_count.as<int32_t>();
  QKV_CUDA_OK(LaunchRerank(rp, nullptr));
  QKV_CUDA_OK(cudaDeviceSynchronize());
  const auto got_pages = Download<int32_t>(d_out, plan.out_indptr[rows]);
  const auto got_count = Download<int32_t>(d_count, rows);
  cudaFreeHost(homes);

  int changed = 0;  // rows whose re-rank differs from plain Quest's top-k
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const int row = b * H + h;
      const auto want = CpuRerank(c, q.data() + std::size_t(b) * H * G * D, summaries.data(), keys.data(), where,
                                  ids.data() + indptr[b], counts[b], last_len[b], h);
      ASSERT_EQ(got_count[row], plan.out_indptr[row + 1] - plan.out_indptr[row]) << "sequence " << b << " head " << h;
      const std::vector<int> got(got_pages.begin() + plan.out_indptr[row], got_pages.begin() + plan.out_indptr[row + 1]);
      ASSERT_EQ(got, want) << "sequence " << b << " (" << counts[b] << " pages), KV head " << h;
      RerankCase plain = c;
      plain.rerank = 1;  // candidates = the budget: the bound's own top-k
      changed += want != CpuRerank(plain, q.data() + std::size_t(b) * H * G * D, summaries.data(), keys.data(), where,
                                   ids.data() + indptr[b], counts[b], last_len[b], h);
    }
  if (c.page_budget > 3) {
    EXPECT_GT(changed, 0) << "no row's selection changed: the test shows little";
  }
}

class RerankCudaTest : public ::testing::TestWithParam<RerankCase> {};

TEST_P(RerankCudaTest, EqualsCpuReference) {
  QKV_REQUIRE_GPU();
  for (uint64_t seed : {1u, 2u, 3u}) RunRerankCase(GetParam(), 100 * seed + GetParam().batch);
}

constexpr DType F32 = DType::kF32, F16 = DType::kF16, BF16 = DType::kBF16;
INSTANTIATE_TEST_SUITE_P(
    Cases, RerankCudaTest,
    ::testing::Values(RerankCase{7, 2, 4, 128, 16, 8, 2.5, GqaMode::kMax, F16, false},
                      RerankCase{7, 2, 4, 128, 16, 8, 2.5, GqaMode::kMean, F32, false},
                      RerankCase{5, 2, 1, 64, 16, 12, 3, GqaMode::kMax, BF16, true},
                      RerankCase{9, 1, 8, 64, 8, 20, 1.5, GqaMode::kMean, F16, true},
                      RerankCase{6, 2, 2, 256, 32, 6, 4, GqaMode::kMax, F32, false},
                      // Budget at the sink and local pages: nothing to re-rank.
                      RerankCase{5, 2, 4, 64, 16, 3, 2, GqaMode::kMax, F16, false}));

}  // namespace
}  // namespace questkv::kernels::cuda::test
