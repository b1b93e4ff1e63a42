// RunAttend against AttendPagesCpu (fp32 twin) over odd sizes: ragged rows of
// head-pages in shuffled slots, a short tail page, empty rows, split-K on and
// off; entries fetched from mapped pinned host homes (AttendParams::fills:
// stored into their slots, or read only), whose slots hold NaN until then;
// plus a CUDA-graph replay of select + attend that must equal the direct run
// bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/attention_state.h"
#include "kernels/cpu/kernels_cpu.h"
#include "tests/kernels_cuda/cuda_test_util.h"
#include "tests/testing/reference.h"

namespace questkv::kernels::cuda::test {
namespace {

struct AttendCase {
  DType dtype;
  int batch, kv_heads, group, head_dim, page_size;
};
// Readable test names in ctest.
void PrintTo(const AttendCase& c, std::ostream* os) {
  *os << DTypeName(c.dtype) << "_B" << c.batch << "_H" << c.kv_heads << "_G" << c.group << "_D" << c.head_dim << "_S"
      << c.page_size;
}

double Tolerance(DType t) { return t == DType::kF32 ? 2e-5 : t == DType::kF16 ? 2e-3 : 1.2e-2; }

// Owns a mapped pinned allocation.
struct MappedHost {
  void* host = nullptr;
  void* device = nullptr;
  explicit MappedHost(std::size_t bytes) {
    if (bytes && cudaHostAlloc(&host, bytes, cudaHostAllocMapped) == cudaSuccess)
      cudaHostGetDevicePointer(&device, host, 0);
  }
  ~MappedHost() { cudaFreeHost(host); }
  MappedHost(const MappedHost&) = delete;
  MappedHost& operator=(const MappedHost&) = delete;
};

// One random problem; returns the worst relative L2 error over rows. With
// `fetch`, about a third of the sealed entries are fills: their bytes come
// from a host home, their slots hold NaN; every other fill names its slot
// (which must hold the home's bytes afterwards), the rest are read only
// (their slots must stay as they were).
double RunAttendCase(const AttendCase& c, int num_sms, uint64_t seed, bool fetch = false) {
  const int B = c.batch, H = c.kv_heads, G = c.group, D = c.head_dim, S = c.page_size;
  const int rows = B * H;
  std::mt19937 rng{uint32_t(seed)};
  // Sequence lengths 1, S-1, S, S+1, 4099, then random; row entries are a
  // random subset of the sequence's pages in random order, the tail last.
  const int odd[] = {1, S - 1, S, S + 1, 4099, 0 /* empty row */, 5 * S + 3, 300};
  std::vector<int> tokens(B);
  // (Fetching: batch 1 starts at 4099 tokens, so it has sealed pages.)
  for (int b = 0; b < B; ++b) tokens[b] = b < 8 ? odd[fetch ? (b + 4) % 8 : b] : int(rng() % 2000);
  std::vector<int32_t> last_len(B);
  std::vector<int32_t> indptr(rows + 1, 0), count(rows);
  std::vector<std::vector<int>> row_pages(rows);
  int slots = 0;
  for (int b = 0; b < B; ++b) {
    const int n = (tokens[b] + S - 1) / S;
    last_len[b] = n ? tokens[b] - (n - 1) * S : S;
    for (int h = 0; h < H; ++h) {
      auto& r = row_pages[b * H + h];
      for (int i = 0; i + 1 < n; ++i)
        if (rng() % 3 != 0) r.push_back(slots + i);
      std::shuffle(r.begin(), r.end(), rng);
      if (n) r.push_back(slots + n - 1);  // the tail, last
      slots += n;
    }
  }
  for (int r = 0; r < rows; ++r) {
    count[r] = int(row_pages[r].size());
    indptr[r + 1] = indptr[r] + count[r] + 2;  // capacity 2 beyond use: count must be honoured
  }
  // Slots scattered: logical slot i lives at slot_map[i].
  std::vector<int32_t> slot_map(slots + 5);
  std::iota(slot_map.begin(), slot_map.end(), 0);
  std::shuffle(slot_map.begin(), slot_map.end(), rng);
  std::vector<int32_t> slot_ids(indptr[rows], 123456789);  // unused capacity is garbage
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < count[r]; ++j) slot_ids[indptr[r] + j] = slot_map[row_pages[r][j]];

  const std::size_t pool_elems = std::size_t(slot_map.size()) * 2 * S * D;
  std::vector<float> pool = RoundTo(questkv::test::RandomNormal(pool_elems, seed + 1), c.dtype);
  // Rows past a tail's valid length hold NaN: they must never be read.
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const auto& r = row_pages[b * H + h];
      if (r.empty()) continue;
      float* k = pool.data() + std::size_t(slot_map[r.back()]) * 2 * S * D;
      for (int t = last_len[b]; t < S; ++t)
        for (int j = 0; j < D; ++j) k[t * D + j] = k[(S + t) * D + j] = NAN;
    }
  std::vector<float> q = RoundTo(questkv::test::RandomNormal(std::size_t(rows) * G * D, seed + 2, 0.f, 2.f), c.dtype);
  const float scale = 1.f / std::sqrt(float(D));

  // Fills: the head-page's true bytes in its home, NaN in its slot.
  const std::size_t piece = std::size_t(S) * D * DTypeBytes(c.dtype);
  const std::vector<uint8_t> truth = Encode(pool, c.dtype);
  std::vector<float> poisoned = pool;
  struct Fetch {
    int32_t slot;
    bool store;
  };
  std::vector<Fetch> fetches;
  for (int r = 0; fetch && r < rows; ++r)
    for (int j = 0; j + 1 < count[r]; ++j)
      if (rng() % 3 == 0) {
        const int32_t slot = slot_ids[indptr[r] + j];
        slot_ids[indptr[r] + j] = ~int32_t(fetches.size());
        fetches.push_back({slot, fetches.size() % 2 == 0});
        std::fill_n(poisoned.begin() + std::size_t(slot) * 2 * S * D, 2 * S * D, NAN);
      }
  MappedHost homes(fetches.size() * 2 * piece);
  std::vector<GatherJob> jobs;
  if (!fetches.empty()) {
    EXPECT_NE(homes.device, nullptr);
  }
  for (std::size_t i = 0; i < fetches.size() && homes.device; ++i) {
    // The home holds [K piece][V piece] here; the kernel takes each by pointer.
    std::memcpy(static_cast<uint8_t*>(homes.host) + i * 2 * piece, truth.data() + std::size_t(fetches[i].slot) * 2 * piece,
                2 * piece);
    uint8_t* home = static_cast<uint8_t*>(homes.device) + i * 2 * piece;
    jobs.push_back({home, home + piece, nullptr});  // dst: set once the pool is on the device
  }

  AttendShape s;
  s.rows = rows;
  s.kv_heads = H;
  s.group = G;
  s.head_dim = D;
  s.page_size = S;
  s.dtype = c.dtype;
  int max_pages = 0;
  for (int r = 0; r < rows; ++r) max_pages = std::max(max_pages, count[r]);
  AttendPlan plan;
  std::string err;
  EXPECT_TRUE(PlanAttend(s, max_pages, num_sms, &plan, &err)) << err;

  DeviceBuffer d_q, d_pool, d_indptr, d_count, d_slots, d_last, d_o, d_lse, d_ws, d_jobs;
  Upload(d_q, Encode(q, c.dtype));
  const std::vector<uint8_t> pool_before = Encode(poisoned, c.dtype);
  Upload(d_pool, pool_before);
  for (std::size_t i = 0; i < jobs.size(); ++i)
    if (fetches[i].store) jobs[i].dst = static_cast<uint8_t*>(d_pool.get()) + std::size_t(fetches[i].slot) * 2 * piece;
  if (!jobs.empty()) Upload(d_jobs, jobs);
  Upload(d_indptr, indptr);
  Upload(d_count, count);
  Upload(d_slots, slot_ids);
  Upload(d_last, last_len);
  Upload(d_o, Encode(std::vector<float>(std::size_t(rows) * G * D, NAN), c.dtype));  // poison
  Upload(d_lse, std::vector<float>(std::size_t(rows) * G, NAN));
  d_ws.Resize(std::max<std::size_t>(plan.workspace_bytes, 1));
  EXPECT_EQ(cudaMemset(d_ws.get(), 0, d_ws.bytes()), cudaSuccess);  // RunAttend's counters start at zero
  AttendParams p;
  p.scale = scale;
  p.q = d_q.get();
  p.slots = d_pool.get();
  p.indptr = d_indptr.as<int32_t>();
  p.count = d_count.as<int32_t>();
  p.slot_ids = d_slots.as<int32_t>();
  p.last_len = d_last.as<int32_t>();
  p.o = d_o.get();
  p.lse = d_lse.as<float>();
  p.workspace = d_ws.get();
  if (!jobs.empty()) p.fills = d_jobs.as<GatherJob>();
  EXPECT_EQ(RunAttend(plan, p, nullptr), cudaSuccess) << LastErrorMessage();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> o = Decode(Download<uint8_t>(d_o, d_o.bytes()), c.dtype);
  const std::vector<float> lse = Download<float>(d_lse, std::size_t(rows) * G);
  if (fetch) {
    EXPECT_FALSE(fetches.empty()) << "no entry was fetched";
    // Stored fills hold their homes' bytes; every other slot is as it was.
    std::vector<uint8_t> want = pool_before;
    for (const Fetch& f : fetches)
      if (f.store) std::memcpy(want.data() + std::size_t(f.slot) * 2 * piece, truth.data() + std::size_t(f.slot) * 2 * piece, 2 * piece);
    EXPECT_TRUE(Download<uint8_t>(d_pool, d_pool.bytes()) == want) << "slot pool after the fills";
  }

  double worst = 0;
  std::vector<float> want_o(std::size_t(G) * D), want_m(G), want_d(G);
  for (int r = 0; r < rows; ++r) {
    std::vector<HeadPageRef> refs;
    for (int j = 0; j < count[r]; ++j) {
      const float* base = pool.data() + std::size_t(slot_map[row_pages[r][j]]) * 2 * S * D;
      refs.push_back({base, base + S * D, j == count[r] - 1 ? last_len[r / H] : S});
    }
    AttendPagesCpu(q.data() + std::size_t(r) * G * D, G, D, refs.data(), int(refs.size()), scale, want_o.data(),
                   want_m.data(), want_d.data());
    const float* got = o.data() + std::size_t(r) * G * D;
    if (refs.empty()) {
      for (int i = 0; i < G * D; ++i) EXPECT_EQ(got[i], 0.f) << "empty row " << r;
      for (int g = 0; g < G; ++g) EXPECT_EQ(lse[r * G + g], kNegInf);
      continue;
    }
    for (int g = 0; g < G; ++g) {
      const double e = questkv::test::RelL2Error(got + g * D, want_o.data() + g * D, D);
      worst = std::max(worst, e);
      EXPECT_NEAR(lse[r * G + g], StateLse(want_m[g], want_d[g]), 1e-4 * (1 + std::abs(want_m[g])))
          << "row " << r << " head " << g;
    }
  }
  return worst;
}

class AttendCudaTest : public ::testing::TestWithParam<AttendCase> {};

TEST_P(AttendCudaTest, MatchesCpuTwin) {
  QKV_REQUIRE_GPU();
  const AttendCase c = GetParam();
  // num_sms 1: one split per row; the real count: split-K with the merge.
  for (int sms : {1, NumSms()}) {
    const double worst = RunAttendCase(c, sms, 7 + sms + c.batch);
    EXPECT_LE(worst, Tolerance(c.dtype)) << "num_sms " << sms;
    RecordProperty("worst_rel_l2_sms" + std::to_string(sms), std::to_string(worst));
  }
}

// Head-pages fetched from host homes while the others are read from HBM: the
// same outputs within the same tolerance, the stored fills in their slots.
TEST_P(AttendCudaTest, FetchesFillsFromHostHomes) {
  QKV_REQUIRE_GPU();
  const AttendCase c = GetParam();
  for (int sms : {1, NumSms()}) {
    const double worst = RunAttendCase(c, sms, 31 + sms + c.batch, /*fetch=*/true);
    EXPECT_LE(worst, Tolerance(c.dtype)) << "num_sms " << sms;
  }
}

constexpr DType F32 = DType::kF32, F16 = DType::kF16, BF16 = DType::kBF16;
INSTANTIATE_TEST_SUITE_P(
    Sizes, AttendCudaTest,
    ::testing::Values(AttendCase{F32, 1, 1, 1, 128, 16}, AttendCase{F32, 3, 2, 4, 64, 8},
                      AttendCase{F32, 7, 2, 8, 256, 32}, AttendCase{F32, 23, 1, 4, 128, 64},
                      AttendCase{F16, 1, 8, 4, 128, 16}, AttendCase{F16, 3, 2, 1, 64, 64},
                      AttendCase{F16, 7, 1, 8, 128, 8}, AttendCase{F16, 23, 2, 4, 256, 16},
                      AttendCase{BF16, 1, 2, 8, 64, 32}, AttendCase{BF16, 3, 1, 4, 256, 8},
                      AttendCase{BF16, 7, 2, 1, 128, 64}, AttendCase{BF16, 23, 1, 2, 128, 16},
                      AttendCase{F16, 3, 2, 4, 128, 32}, AttendCase{F32, 3, 2, 1, 256, 64},
                      // Llama-3-8B's shape in bf16 over a ragged batch of 23; G 8, D 64, S 64.
                      AttendCase{BF16, 23, 2, 4, 128, 16}, AttendCase{F16, 7, 1, 8, 64, 64},
                      // Llama-3-70B's group of 8 at D 128, S 16 (the tensor-core path), bf16.
                      AttendCase{BF16, 9, 8, 8, 128, 16}));

TEST(AttendPlanTest, RejectsUnsupportedSizesWithAMessage) {
  AttendShape s;
  s.rows = 4;
  s.kv_heads = 2;
  s.group = 4;
  s.head_dim = 96;
  s.page_size = 16;
  AttendPlan plan;
  std::string err;
  EXPECT_FALSE(PlanAttend(s, 10, 132, &plan, &err));
  EXPECT_NE(err.find("head_dim = 96"), std::string::npos) << err;
  s.head_dim = 128;
  s.page_size = 12;
  EXPECT_FALSE(PlanAttend(s, 10, 132, &plan, &err));
  EXPECT_NE(err.find("page_size = 12"), std::string::npos) << err;
  // The run step's dispatch names a value a forged plan slipped past PlanAttend.
  s.page_size = 16;
  ASSERT_TRUE(PlanAttend(s, 10, 132, &plan, &err)) << err;
  plan.shape.page_size = 24;
  AttendParams p;
  EXPECT_EQ(RunAttend(plan, p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(LastErrorMessage().find("page_size = 24"), std::string::npos) << LastErrorMessage();
}

// A split plan fills one wave of the kernel's own occupancy: the G = 8
// tensor-core kernel holds fewer blocks a multiprocessor than the others,
// and a plan made for four would spill a second, short wave.
TEST(AttendPlanTest, SplitsFitOneWaveOfTheKernelsOccupancy) {
  QKV_REQUIRE_GPU();
  const int sms = NumSms();
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16})
    for (int group : {1, 4, 8})
      for (int head_dim : {64, 128, 256}) {
        const AttendShape s{16 * 8, 8, group, head_dim, 16, dt};
        const int per_sm = AttendBlocksPerSm(s);
        ASSERT_GE(per_sm, 1);
        ASSERT_LE(per_sm, 4);
        EXPECT_EQ(AttendBlocksPerSm(s), per_sm);  // the cached answer
        for (int max_pages : {32, 128, 256}) {
          AttendPlan plan;
          std::string err;
          ASSERT_TRUE(PlanAttend(s, max_pages, sms, &plan, &err)) << err;
          const long long blocks = (long long)s.rows * plan.splits;
          if (plan.splits > 2) {  // two splits are the floor, whatever the wave
            EXPECT_LE(blocks, (long long)per_sm * sms)
                << "dtype " << int(dt) << " G " << group << " D " << head_dim << " pages " << max_pages;
          }
          EXPECT_GE((long long)plan.splits * plan.pages_per_split, max_pages);
        }
      }
}

// Select + attend captured once in a CUDA graph; replays equal a direct run
// bit for bit, and a replay after new queries sees the new queries.
TEST(AttendGraphTest, CapturedStepReplaysExactly) {
  QKV_REQUIRE_GPU();
  const int H = 2, G = 4, D = 128, S = 16, B = 3;
  const int counts_h[B] = {300, 41, 1000};
  std::vector<int32_t> counts(counts_h, counts_h + B), page_indptr(B + 1, 0);
  for (int b = 0; b < B; ++b) page_indptr[b + 1] = page_indptr[b] + counts[b];
  const int pages = page_indptr[B];
  std::vector<uint32_t> ids(pages);
  std::iota(ids.begin(), ids.end(), 0u);
  std::vector<int32_t> hbm_slot(std::size_t(pages) * H);
  std::iota(hbm_slot.begin(), hbm_slot.end(), 0);
  const DType T = DType::kF16;
  std::vector<float> pool = questkv::test::RandomNormal(std::size_t(pages) * H * 2 * S * D, 5);
  std::vector<float> slab(std::size_t(pages) * H * 2 * D);
  for (int p = 0; p < pages; ++p)
    for (int h = 0; h < H; ++h)
      RebuildSummaryHeadsCpu(std::vector<const float*>{pool.data() + (std::size_t(p) * H + h) * 2 * S * D}.data(),
                             slab.data() + (std::size_t(p) * H + h) * 2 * D, 1, D, S);
  SelectShape ss;
  ss.batch = B;
  ss.kv_heads = H;
  ss.group = G;
  ss.head_dim = D;
  ss.page_size = S;
  ss.page_budget = 64;
  SelectPlan splan;
  std::string err;
  ASSERT_TRUE(PlanSelect(ss, counts.data(), NumSms(), &splan, &err)) << err;
  AttendShape as;
  as.rows = B * H;
  as.kv_heads = H;
  as.group = G;
  as.head_dim = D;
  as.page_size = S;
  as.dtype = T;
  AttendPlan aplan;
  ASSERT_TRUE(PlanAttend(as, 64, NumSms(), &aplan, &err)) << err;

  DeviceBuffer d_q, d_pool, d_slab, d_pind, d_ids, d_hbm, d_oind, d_pages, d_slots, d_count, d_sws, d_o, d_aws, d_last;
  Upload(d_q, Encode(questkv::test::RandomNormal(std::size_t(B) * H * G * D, 6), T));
  Upload(d_pool, Encode(pool, T));
  Upload(d_slab, Encode(slab, T));
  Upload(d_pind, page_indptr);
  Upload(d_ids, ids);
  Upload(d_hbm, hbm_slot);
  Upload(d_oind, splan.out_indptr);
  Upload(d_last, std::vector<int32_t>(B, S));
  const int nnz = splan.out_indptr.back();
  d_pages.Resize(nnz * 4);
  d_slots.Resize(nnz * 4);
  d_count.Resize(B * H * 4);
  d_sws.Resize(std::max<std::size_t>(splan.workspace_bytes, 1));
  d_aws.Resize(std::max<std::size_t>(aplan.workspace_bytes, 1));
  QKV_CUDA_OK(cudaMemset(d_aws.get(), 0, d_aws.bytes()));  // RunAttend's counters start at zero
  d_o.Resize(std::size_t(B) * H * G * D * 2);
  SelectParams sp;
  sp.shape = ss;
  sp.q_dtype = T;
  sp.summary_dtype = T;
  sp.q = d_q.get();
  sp.summaries = d_slab.get();
  sp.page_indptr = d_pind.as<int32_t>();
  sp.page_ids = d_ids.as<uint32_t>();
  sp.hbm_slot = d_hbm.as<int32_t>();
  sp.out_indptr = d_oind.as<int32_t>();
  sp.out_pages = d_pages.as<int32_t>();
  sp.out_slots = d_slots.as<int32_t>();
  sp.out_count = d_count.as<int32_t>();
  sp.workspace = d_sws.get();
  AttendParams ap;
  ap.scale = 1.f / std::sqrt(float(D));
  ap.q = d_q.get();
  ap.slots = d_pool.get();
  ap.indptr = d_oind.as<int32_t>();
  ap.count = d_count.as<int32_t>();
  ap.slot_ids = d_slots.as<int32_t>();
  ap.last_len = d_last.as<int32_t>();
  ap.o = d_o.get();
  ap.workspace = d_aws.get();

  cudaStream_t stream;
  QKV_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  QKV_CUDA_OK(LaunchSelect(splan, sp, stream));
  QKV_CUDA_OK(RunAttend(aplan, ap, stream));
  QKV_CUDA_OK(cudaStreamSynchronize(stream));
  const auto direct = Download<uint16_t>(d_o, d_o.bytes() / 2);

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  QKV_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  QKV_CUDA_OK(LaunchSelect(splan, sp, stream));
  QKV_CUDA_OK(RunAttend(aplan, ap, stream));
  QKV_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  QKV_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 3; ++rep) {
    QKV_CUDA_OK(cudaMemsetAsync(d_o.get(), 0xFF, d_o.bytes(), stream));
    QKV_CUDA_OK(cudaGraphLaunch(exec, stream));
    QKV_CUDA_OK(cudaStreamSynchronize(stream));
    EXPECT_EQ(Download<uint16_t>(d_o, d_o.bytes() / 2), direct) << "replay " << rep;
  }
  // New queries, same graph: the replay follows the data.
  Upload(d_q, Encode(questkv::test::RandomNormal(std::size_t(B) * H * G * D, 77), T));
  QKV_CUDA_OK(cudaGraphLaunch(exec, stream));
  QKV_CUDA_OK(cudaStreamSynchronize(stream));
  const auto replay = Download<uint16_t>(d_o, d_o.bytes() / 2);
  QKV_CUDA_OK(LaunchSelect(splan, sp, stream));
  QKV_CUDA_OK(RunAttend(aplan, ap, stream));
  QKV_CUDA_OK(cudaStreamSynchronize(stream));
  EXPECT_EQ(Download<uint16_t>(d_o, d_o.bytes() / 2), replay);
  EXPECT_NE(replay, direct);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace questkv::kernels::cuda::test
