// LaunchAppend against AppendTokensHeadsCpu: a ragged batch gets a prefill
// chunk, then a single decode token per sequence, into head-pages in shuffled
// slots; the slot pool and the summaries must match bit for bit (E4M3
// summaries: code for code, the twin snapping its float summaries onto the
// grid after each call, as the device rounds once a call).
#include <algorithm>
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

struct AppendCase {
  DType kv, sum;
  int batch, kv_heads, page_size, head_dim;
};
// Readable test names in ctest.
void PrintTo(const AppendCase& c, std::ostream* os) {
  *os << DTypeName(c.kv) << "_sum" << DTypeName(c.sum) << "_B" << c.batch << "_H" << c.kv_heads << "_S" << c.page_size
      << "_D" << c.head_dim;
}

// Float summaries [..][2][D] as the device stores them in `dtype`.
std::vector<uint8_t> SummaryBytes(const std::vector<float>& summ, DType dtype, int head_dim) {
  if (dtype != DType::kE4M3) return Encode(summ, dtype);
  std::vector<uint8_t> codes(summ.size());
  EncodeSummaryE4m3Cpu(summ.data(), int(summ.size() / (2 * head_dim)), head_dim, codes.data());
  return codes;
}

// Index of the first element where a and b differ (a.size() == b.size()), or -1.
long long FirstDifference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  const auto at = std::mismatch(a.begin(), a.end(), b.begin());
  return at.first == a.end() ? -1 : (long long)(at.first - a.begin());
}

class AppendCudaTest : public ::testing::TestWithParam<AppendCase> {};

TEST_P(AppendCudaTest, MatchesCpuTwinBitForBit) {
  QKV_REQUIRE_GPU();
  const AppendCase c = GetParam();
  const int S = c.page_size, D = c.head_dim, H = c.kv_heads, B = c.batch;
  const bool e4m3 = c.sum == DType::kE4M3;
  std::mt19937 rng(1234 + B * 7 + S + D);
  // Lengths cover 1, S-1, S, S+1 and 4099 tokens across the two calls.
  const int odd[] = {1, S - 1, S, S + 1, 4099, 0, 2 * S, 37};
  std::vector<int> prefill(B), total(B);
  for (int b = 0; b < B; ++b) {
    prefill[b] = odd[(b + rng() % 3) % 8];
    if (B > 7 && prefill[b] == 4099) prefill[b] = 3 * S + 1;  // keep the big batch quick
    total[b] = prefill[b] + 1;
  }
  // Page table with PageIds scattered over a larger id space, slots shuffled.
  std::vector<int32_t> page_indptr(B + 1, 0);
  for (int b = 0; b < B; ++b) page_indptr[b + 1] = page_indptr[b] + (total[b] + S - 1) / S;
  const int pages = page_indptr[B];
  const int id_space = pages * 2 + 3;
  std::vector<uint32_t> ids(id_space);
  std::iota(ids.begin(), ids.end(), 0u);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<uint32_t> page_ids(ids.begin(), ids.begin() + pages);
  const int slots = id_space * H;
  std::vector<int32_t> slot_perm(slots);
  std::iota(slot_perm.begin(), slot_perm.end(), 0);
  std::shuffle(slot_perm.begin(), slot_perm.end(), rng);
  std::vector<int32_t> hbm_slot(std::size_t(id_space) * H);
  for (std::size_t i = 0; i < hbm_slot.size(); ++i) hbm_slot[i] = slot_perm[i];

  // Pool starts as random garbage (bits outside the appended rows must stay),
  // summaries as the empty box.
  std::vector<float> pool = RoundTo(questkv::test::RandomNormal(std::size_t(slots) * 2 * S * D, 99), c.kv);
  std::vector<float> summ(std::size_t(id_space) * H * 2 * D);
  for (int p = 0; p < id_space; ++p) ResetSummaryCpu(summ.data() + std::size_t(p) * H * 2 * D, H, D);
  if (!e4m3) summ = RoundTo(summ, c.sum);  // the empty box is on the E4M3 grid

  DeviceBuffer d_pool, d_summ, d_indptr, d_ids, d_slot;
  Upload(d_pool, Encode(pool, c.kv));
  Upload(d_summ, SummaryBytes(summ, c.sum, D));
  Upload(d_indptr, page_indptr);
  Upload(d_ids, page_ids);
  Upload(d_slot, hbm_slot);

  for (int call = 0; call < 2; ++call) {
    std::vector<int32_t> append_indptr(B + 1, 0), start(B);
    int max_new = 0;
    for (int b = 0; b < B; ++b) {
      const int n = call == 0 ? prefill[b] : 1;
      start[b] = call == 0 ? 0 : prefill[b];
      append_indptr[b + 1] = append_indptr[b] + n;
      max_new = std::max(max_new, n);
    }
    const int rows = append_indptr[B];
    std::vector<float> k = questkv::test::RandomNormal(std::size_t(rows) * H * D, 10 + call);
    // E4M3: keys past ±448 (bounds whose codes are ±inf), large finite ones,
    // and ones below 2^-6 (subnormal codes).
    if (e4m3)
      for (std::size_t i = 0; i < k.size(); ++i)
        k[i] *= i % 29 == 3 ? 700.f : i % 17 == 5 ? 100.f : i % 13 == 7 ? 1e-3f : 1.f;
    k = RoundTo(k, c.kv);
    std::vector<float> v = RoundTo(questkv::test::RandomNormal(std::size_t(rows) * H * D, 20 + call), c.kv);
    // Signed zeros and ties in the keys exercise the comparison order.
    for (std::size_t i = 0; i < k.size(); i += 17) k[i] = (i % 2) ? 0.f : -0.f;

    DeviceBuffer d_aind, d_start, d_k, d_v;
    Upload(d_aind, append_indptr);
    Upload(d_start, start);
    Upload(d_k, Encode(k, c.kv));
    Upload(d_v, Encode(v, c.kv));
    AppendParams p;
    p.kv_dtype = c.kv;
    p.summary_dtype = c.sum;
    p.batch = B;
    p.kv_heads = H;
    p.page_size = S;
    p.head_dim = D;
    p.max_new_tokens = max_new;
    if (B == 1 && call == 1) {  // a decode token's header in the launch, none in memory
      p.start = start[0];
    } else {
      p.append_indptr = d_aind.as<int32_t>();
      p.start_pos = d_start.as<int32_t>();
      p.page_indptr = d_indptr.as<int32_t>();
    }
    p.page_ids = d_ids.as<uint32_t>();
    p.hbm_slot = d_slot.as<int32_t>();
    p.k = d_k.get();
    p.v = d_v.get();
    p.slots = d_pool.get();
    p.summaries = d_summ.get();
    QKV_CUDA_OK(LaunchAppend(p, nullptr));
    QKV_CUDA_OK(cudaDeviceSynchronize());

    // CPU twin, page by page.
    for (int b = 0; b < B; ++b) {
      int t = start[b];
      const int end = start[b] + append_indptr[b + 1] - append_indptr[b];
      while (t < end) {
        const int lp = t / S, off = t % S, n = std::min(end - t, S - off);
        const uint32_t id = page_ids[page_indptr[b] + lp];
        std::vector<float*> kh(H), vh(H);
        for (int h = 0; h < H; ++h) {
          float* slot = pool.data() + std::size_t(hbm_slot[std::size_t(id) * H + h]) * 2 * S * D;
          kh[h] = slot;
          vh[h] = slot + S * D;
        }
        const std::size_t src = (std::size_t(append_indptr[b]) + (t - start[b])) * H * D;
        AppendTokensHeadsCpu(kh.data(), vh.data(), summ.data() + std::size_t(id) * H * 2 * D, H, D, off,
                             k.data() + src, v.data() + src, n);
        t += n;
      }
    }
    if (e4m3) SnapSummaryE4m3Cpu(summ.data(), id_space * H, D);
    const std::vector<float> got_pool = Decode(Download<uint8_t>(d_pool, d_pool.bytes()), c.kv);
    ASSERT_EQ(got_pool.size(), pool.size());
    ASSERT_EQ(0, std::memcmp(got_pool.data(), pool.data(), pool.size() * 4)) << "pool differs after call " << call;
    if (e4m3) {
      const std::vector<uint8_t> got_codes = Download<uint8_t>(d_summ, d_summ.bytes());
      const std::vector<uint8_t> want_codes = SummaryBytes(summ, c.sum, D);
      ASSERT_EQ(got_codes.size(), want_codes.size());
      const long long at = FirstDifference(got_codes, want_codes);
      ASSERT_EQ(at, -1) << "summary codes differ after call " << call << " at element " << at << ": 0x" << std::hex
                        << int(got_codes[at]) << " vs 0x" << int(want_codes[at]) << " (" << summ[at] << ")";
    } else {
      const std::vector<float> got_summ = Decode(Download<uint8_t>(d_summ, d_summ.bytes()), c.sum);
      const std::vector<float> want_summ = RoundTo(summ, c.sum);
      ASSERT_EQ(0, std::memcmp(got_summ.data(), want_summ.data(), want_summ.size() * 4))
          << "summaries differ after call " << call;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, AppendCudaTest,
                         ::testing::Values(AppendCase{DType::kF32, DType::kF32, 1, 2, 16, 128},
                                           AppendCase{DType::kF16, DType::kF32, 3, 2, 8, 64},
                                           AppendCase{DType::kBF16, DType::kBF16, 7, 3, 64, 128},
                                           AppendCase{DType::kF16, DType::kF16, 23, 2, 16, 256},
                                           AppendCase{DType::kF32, DType::kF32, 7, 1, 32, 64}));

INSTANTIATE_TEST_SUITE_P(E4m3, AppendCudaTest,
                         ::testing::Values(AppendCase{DType::kF16, DType::kE4M3, 1, 2, 16, 128},
                                           AppendCase{DType::kBF16, DType::kE4M3, 3, 2, 8, 64},
                                           AppendCase{DType::kF32, DType::kE4M3, 7, 3, 64, 256},
                                           AppendCase{DType::kF16, DType::kE4M3, 7, 1, 32, 128}));

TEST(AppendCudaResetTest, EmptyBox) {
  QKV_REQUIRE_GPU();
  const int H = 2, D = 64;
  std::vector<float> summ = questkv::test::RandomNormal(std::size_t(5) * H * 2 * D, 3);
  DeviceBuffer d_summ, d_ids;
  Upload(d_summ, summ);
  Upload(d_ids, std::vector<uint32_t>{4, 1});
  QKV_CUDA_OK(LaunchResetSummaries(d_summ.get(), DType::kF32, d_ids.as<uint32_t>(), 2, H, D, nullptr));
  for (uint32_t id : {4u, 1u}) ResetSummaryCpu(summ.data() + std::size_t(id) * H * 2 * D, H, D);
  EXPECT_EQ(Download<float>(d_summ, summ.size()), summ);
}

TEST(AppendCudaResetTest, EmptyBoxE4m3) {
  QKV_REQUIRE_GPU();
  const int H = 2, D = 64;
  const std::size_t per_page = std::size_t(H) * 2 * D;
  std::vector<uint8_t> codes(5 * per_page);
  for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = uint8_t(i * 131 + 7);
  DeviceBuffer d_summ, d_ids;
  Upload(d_summ, codes);
  Upload(d_ids, std::vector<uint32_t>{4, 1});
  QKV_CUDA_OK(LaunchResetSummaries(d_summ.get(), DType::kE4M3, d_ids.as<uint32_t>(), 2, H, D, nullptr));
  std::vector<float> box(per_page);
  ResetSummaryCpu(box.data(), H, D);
  for (uint32_t id : {4u, 1u}) EncodeSummaryE4m3Cpu(box.data(), H, D, codes.data() + id * per_page);
  EXPECT_EQ(Download<uint8_t>(d_summ, codes.size()), codes);
}

// One token of one KV head, its header in the launch.
AppendParams OneToken(int batch) {
  AppendParams p;
  p.batch = batch;
  p.kv_heads = 1;
  p.page_size = 16;
  p.head_dim = 128;
  p.max_new_tokens = 1;
  return p;
}

// E4M3 is a summary dtype only: K/V in it are refused before any launch
// (no GPU needed).
TEST(AppendCudaRejectTest, E4m3KeysAndValues) {
  AppendParams p = OneToken(1);
  p.kv_dtype = DType::kE4M3;
  p.summary_dtype = DType::kE4M3;
  EXPECT_EQ(LaunchAppend(p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(LastErrorMessage().find("unsupported dtype = 3 (supported: f32, f16, bf16)"), std::string::npos)
      << LastErrorMessage();
}

// A header in the launch describes one sequence: a batch of two is refused
// before any launch (no GPU needed).
TEST(AppendCudaRejectTest, LaunchHeaderOfSeveralSequences) {
  AppendParams p = OneToken(2);
  EXPECT_EQ(LaunchAppend(p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(LastErrorMessage().find("header in the launch"), std::string::npos) << LastErrorMessage();
  p.batch = 1;
  p.start = -1;
  EXPECT_EQ(LaunchAppend(p, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace questkv::kernels::cuda::test
