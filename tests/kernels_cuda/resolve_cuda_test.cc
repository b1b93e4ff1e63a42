// LaunchResolve against ResolveCpu over several steps of random selections:
// residency tables, slot tables, partition lists, attention slots and counts,
// host queues (as sets), counters and the whole slot pool (bit for bit) must
// be equal after every step. Homes live in mapped pinned memory: the CPU twin
// reads them through host pointers, the device through its own. Odd sizes,
// pages shared by two sequences (one fetch for both), disk homes, pinned
// tails, partitions too small (bypasses), queues too small (overflow), lists
// named per sequence (part_lists), and a step replayed from a captured CUDA graph.
// Fused (fill_in_attention, with and without staging): the resolve leaves its
// misses as ~job; the test runs the jobs with LaunchGather (as the attention
// would store them) and then expects the twin's pool bit for bit, each
// fetched entry's job to fill the twin's slot, and each read-only job (a
// page two sequences share, filled by the other's entry) to read the bytes
// of the twin's slot.
#include <algorithm>
#include <cstring>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "kernels/cpu/kernels_cpu.h"
#include "tests/kernels_cuda/cuda_test_util.h"

namespace questkv::kernels::cuda::test {
namespace {

struct ResolveCase {
  int batch, kv_heads, page_size, head_dim;
  DType dtype;
  int pages_per_seq, cache_slots, budget;
  double cold_frac;
  int shared_pages;
};
void PrintTo(const ResolveCase& c, std::ostream* os) {
  *os << "B" << c.batch << "_H" << c.kv_heads << "_S" << c.page_size << "_D" << c.head_dim << "_"
      << DTypeName(c.dtype) << "_n" << c.pages_per_seq << "_slots" << c.cache_slots << "_K" << c.budget << "_cold"
      << int(c.cold_frac * 100) << "_shared" << c.shared_pages;
}

// Owns a mapped pinned allocation.
struct Pinned {
  void* host = nullptr;
  void* device = nullptr;
  explicit Pinned(std::size_t bytes) {
    if (cudaHostAlloc(&host, bytes, cudaHostAllocMapped) == cudaSuccess) cudaHostGetDevicePointer(&device, host, 0);
  }
  ~Pinned() { cudaFreeHost(host); }
};

struct Tables {
  std::vector<int32_t> hbm_slot;
  std::vector<uint32_t> slot_page;
  std::vector<int32_t> slot_head;
  std::vector<int64_t> last_use;
  std::vector<uint8_t> pinned;
  std::vector<int32_t> part_indptr, part_slots;
  std::vector<uint8_t> pool;
};

struct Sel {
  std::vector<int32_t> indptr, count, pages;
};

// How the device resolves: with its gather, or leaving the misses to the
// attention (fill_in_attention), with `stage` of them staged a call.
struct Fetch {
  bool fill = false;
  int stage = 0;
};

void RunResolveCase(const ResolveCase& c, uint32_t seed, Fetch fetch = {}) {
  std::mt19937 rng(seed);
  const int B = c.batch, H = c.kv_heads, n = c.pages_per_seq;
  const std::size_t piece = std::size_t(c.page_size) * c.head_dim * DTypeBytes(c.dtype);
  // Page table: sequences 0 and 1 share their first pages.
  const int shared = B >= 2 ? std::min(c.shared_pages, n - 1) : 0;
  const int total = B * n - shared;
  std::vector<uint32_t> ids(total);
  for (int i = 0; i < total; ++i) ids[i] = uint32_t(i);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<int32_t> page_indptr{0};
  std::vector<uint32_t> page_ids;
  for (int b = 0, next = 0; b < B; ++b) {
    for (int i = 0; i < n; ++i) page_ids.push_back(b == 1 && i < shared ? page_ids[i] : ids[next++]);
    page_indptr.push_back(int32_t(page_ids.size()));
  }
  // Homes: random bytes in pinned memory; some pages live on disk.
  const std::size_t page_bytes = 2 * H * piece;
  Pinned homes(page_bytes * total);
  ASSERT_NE(homes.device, nullptr);
  auto* hbytes = static_cast<uint8_t*>(homes.host);
  for (std::size_t i = 0; i < page_bytes * total / 4; ++i) {
    const uint32_t x = rng();
    std::memcpy(hbytes + 4 * i, &x, 4);
  }
  std::vector<const void*> addr_cpu(total, nullptr), addr_dev(total, nullptr);
  std::bernoulli_distribution cold(c.cold_frac);
  for (int p = 0; p < total; ++p)
    if (!cold(rng)) {
      addr_cpu[p] = hbytes + p * page_bytes;
      addr_dev[p] = static_cast<uint8_t*>(homes.device) + p * page_bytes;
    }
  // Slots: per sequence H pinned tails and cache_slots cached, shuffled.
  Tables t;
  t.hbm_slot.assign(std::size_t(total) * H, -1);
  t.part_indptr.push_back(0);
  auto add_slot = [&](uint32_t page, int head, bool pin, int64_t use) {
    const int32_t s = int32_t(t.slot_page.size());
    t.slot_page.push_back(page);
    t.slot_head.push_back(head);
    t.pinned.push_back(pin);
    t.last_use.push_back(use);
    t.pool.resize(t.pool.size() + 2 * piece, 0xEE);
    if (page != resolve::kEmptySlot) {
      t.hbm_slot[std::size_t(page) * H + head] = s;
      for (int kv = 0; kv < 2; ++kv)
        std::memcpy(t.pool.data() + (std::size_t(s) * 2 + kv) * piece, hbytes + page * page_bytes + (kv * H + head) * piece, piece);
    }
    return s;
  };
  for (int b = 0; b < B; ++b) {
    std::vector<int32_t> list;
    for (int h = 0; h < H; ++h) list.push_back(add_slot(page_ids[page_indptr[b] + n - 1], h, true, -1));
    for (int i = 0; i < c.cache_slots; ++i) {
      uint32_t page = resolve::kEmptySlot;
      const int head = int(rng() % H);
      if (i % 2 == 0) {
        page = page_ids[page_indptr[b] + rng() % (n - 1)];
        if (t.hbm_slot[std::size_t(page) * H + head] >= 0) page = resolve::kEmptySlot;
      }
      list.push_back(add_slot(page, head, false, page == resolve::kEmptySlot ? -1 : -1 - int(rng() % 3)));
    }
    std::shuffle(list.begin(), list.end(), rng);
    t.part_slots.insert(t.part_slots.end(), list.begin(), list.end());
    t.part_indptr.push_back(int32_t(t.part_slots.size()));
  }
  const int64_t slots = int64_t(t.slot_page.size());

  // Device state, kept across steps.
  DeviceBuffer d_page_indptr, d_page_ids, d_addr, d_hbm, d_spage, d_shead, d_use, d_pin, d_pindptr, d_pslots, d_pool;
  Upload(d_page_indptr, page_indptr);
  Upload(d_page_ids, page_ids);
  Upload(d_addr, addr_dev);
  Upload(d_hbm, t.hbm_slot);
  Upload(d_spage, t.slot_page);
  Upload(d_shead, t.slot_head);
  Upload(d_use, t.last_use);
  Upload(d_pin, t.pinned);
  Upload(d_pindptr, t.part_indptr);
  Upload(d_pslots, t.part_slots);
  Upload(d_pool, t.pool);
  DeviceBuffer d_counters(sizeof(ResolveCounters));
  cudaMemset(d_counters.get(), 0, sizeof(ResolveCounters));
  resolve::Counters cpu_counters{};
  cudaStream_t stream;
  QKV_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  for (int64_t step = 0; step < 6; ++step) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed << " step " << step);
    // Selection: up to `budget` random pages plus the tail, spare capacity.
    Sel s;
    s.indptr.push_back(0);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h) {
        std::set<int> chosen{n - 1};
        const int k = int(rng() % (std::min(c.budget, n - 1) + 1));
        while (int(chosen.size()) < k + 1) chosen.insert(int(rng() % (n - 1)));
        s.pages.insert(s.pages.end(), chosen.begin(), chosen.end());
        for (int i = 0, spare = int(rng() % 3); i < spare; ++i) s.pages.push_back(-5);
        s.count.push_back(int32_t(chosen.size()));
        s.indptr.push_back(int32_t(s.pages.size()));
      }
    const int rows = B * H;
    const int64_t entries = s.indptr[rows];
    const bool strict = step % 2 == 1;
    const int cap = step % 3 == 2 ? 3 : int(entries);

    // CPU twin.
    std::vector<int32_t> c_out(entries, -7), c_count(rows, -7), c_ncold(1), c_nbyp(1);
    std::vector<resolve::Request> c_cold(cap), c_byp(cap);
    ResolveCpuParams cp;
    cp.batch = B;
    cp.kv_heads = H;
    cp.piece_bytes = piece;
    cp.step = step;
    cp.strict = strict;
    cp.page_indptr = page_indptr.data();
    cp.page_ids = page_ids.data();
    cp.sel_indptr = s.indptr.data();
    cp.sel_count = s.count.data();
    cp.sel_pages = s.pages.data();
    cp.host_addr = addr_cpu.data();
    cp.hbm_slot = t.hbm_slot.data();
    cp.slot_page = t.slot_page.data();
    cp.slot_head = t.slot_head.data();
    cp.slot_last_use = t.last_use.data();
    cp.slot_pinned = t.pinned.data();
    cp.part_indptr = t.part_indptr.data();
    cp.part_slots = t.part_slots.data();
    cp.slots = t.pool.data();
    cp.out_slots = c_out.data();
    cp.out_count = c_count.data();
    cp.cold = c_cold.data();
    cp.cold_count = c_ncold.data();
    cp.bypass = c_byp.data();
    cp.bypass_count = c_nbyp.data();
    cp.queue_capacity = cap;
    cp.counters = &cpu_counters;
    ResolveCpu(cp);

    // Device.
    ResolveShape shape{B, H, c.page_size, c.head_dim, c.dtype, strict ? ColdMissPolicy::kStrict : ColdMissPolicy::kDeadline,
                       fetch.fill, fetch.stage};
    ResolvePlan plan;
    std::string err;
    ASSERT_TRUE(PlanResolve(shape, entries, int64_t(t.part_slots.size()), NumSms(), 0, &plan, &err)) << err;
    DeviceBuffer d_sindptr, d_scount, d_spages, d_out(entries * 4), d_count(rows * 4), d_cold(cap * sizeof(ResolveRequest)),
        d_byp(cap * sizeof(ResolveRequest)), d_ncold(4), d_nbyp(4), d_ws(plan.workspace_bytes);
    Upload(d_sindptr, s.indptr);
    Upload(d_scount, s.count);
    Upload(d_spages, s.pages);
    cudaMemset(d_out.get(), 0xFF, d_out.bytes());
    cudaMemset(d_count.get(), 0xFF, d_count.bytes());
    cudaMemset(d_ws.get(), 0xA5, d_ws.bytes());
    ResolveParams p;
    p.step = step;
    p.page_indptr = d_page_indptr.as<int32_t>();
    p.page_ids = d_page_ids.as<uint32_t>();
    p.sel_indptr = d_sindptr.as<int32_t>();
    p.sel_count = d_scount.as<int32_t>();
    p.sel_pages = d_spages.as<int32_t>();
    p.host_addr = d_addr.as<const void*>();
    p.hbm_slot = d_hbm.as<int32_t>();
    p.slot_page = d_spage.as<uint32_t>();
    p.slot_head = d_shead.as<int32_t>();
    p.slot_last_use = d_use.as<int64_t>();
    p.slot_pinned = d_pin.as<uint8_t>();
    p.part_indptr = d_pindptr.as<int32_t>();
    p.part_slots = d_pslots.as<int32_t>();
    // Odd steps name each sequence's list by its own pointer (the runtime's
    // way: one device list per partition), here into the same buffer.
    std::vector<int32_t*> lists;
    for (int b = 0; b < B; ++b) lists.push_back(d_pslots.as<int32_t>() + t.part_indptr[b]);
    DeviceBuffer d_lists;
    Upload(d_lists, lists);
    if (step % 2 == 1) {
      p.part_lists = d_lists.as<int32_t* const>();
      p.part_slots = nullptr;
    }
    p.slots = d_pool.get();
    p.out_slots = d_out.as<int32_t>();
    p.out_count = d_count.as<int32_t>();
    p.cold = d_cold.as<ResolveRequest>();
    p.cold_count = d_ncold.as<int32_t>();
    p.bypass = d_byp.as<ResolveRequest>();
    p.bypass_count = d_nbyp.as<int32_t>();
    p.queue_capacity = cap;
    p.counters = d_counters.as<ResolveCounters>();
    p.workspace = d_ws.get();
    DeviceBuffer d_step;
    if (step == 3) {  // through a captured graph, the step read from device memory
      Upload(d_step, std::vector<int64_t>{step});
      p.step_ptr = d_step.as<int64_t>();
      p.step = -999;  // must not be used
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      QKV_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      QKV_CUDA_OK(LaunchResolve(plan, p, stream));
      QKV_CUDA_OK(cudaStreamEndCapture(stream, &graph));
      QKV_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
      QKV_CUDA_OK(cudaGraphLaunch(exec, stream));
      QKV_CUDA_OK(cudaStreamSynchronize(stream));
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
    } else {
      QKV_CUDA_OK(LaunchResolve(plan, p, stream));
    }
    // Fused: the jobs left to the attention, then stored as it would store them.
    std::vector<GatherJob> fills;
    if (fetch.fill) {
      const ResolveFillList fl = ResolveFills(plan, d_ws.get());
      int32_t n = 0;
      QKV_CUDA_OK(cudaMemcpyAsync(&n, fl.count, 4, cudaMemcpyDeviceToHost, stream));
      QKV_CUDA_OK(cudaStreamSynchronize(stream));
      fills.resize(std::max(n, 0));
      QKV_CUDA_OK(cudaMemcpy(fills.data(), fl.jobs, fills.size() * sizeof(GatherJob), cudaMemcpyDeviceToHost));
      QKV_CUDA_OK(LaunchGather(fl.jobs, fl.count, piece, NumSms(), stream));
    }
    ResolveCounters* host_counters = nullptr;
    QKV_CUDA_OK(cudaMallocHost(&host_counters, sizeof(ResolveCounters)));
    QKV_CUDA_OK(CopyResolveCountersAsync(p.counters, host_counters, stream));
    QKV_CUDA_OK(cudaStreamSynchronize(stream));
    QKV_CUDA_OK(cudaGetLastError());
    static_assert(sizeof(ResolveCounters) == sizeof(resolve::Counters));
    const bool counters_equal = std::memcmp(host_counters, &cpu_counters, sizeof(ResolveCounters)) == 0;
    cudaFreeHost(host_counters);
    ASSERT_TRUE(counters_equal);

    ASSERT_EQ(Download<int32_t>(d_hbm, t.hbm_slot.size()), t.hbm_slot);
    ASSERT_EQ(Download<uint32_t>(d_spage, slots), t.slot_page);
    ASSERT_EQ(Download<int32_t>(d_shead, slots), t.slot_head);
    ASSERT_EQ(Download<int64_t>(d_use, slots), t.last_use);
    ASSERT_EQ(Download<int32_t>(d_pslots, t.part_slots.size()), t.part_slots);
    ASSERT_TRUE(Download<uint8_t>(d_pool, t.pool.size()) == t.pool) << "slot pool bytes differ";
    const auto g_count = Download<int32_t>(d_count, rows);
    auto g_out = Download<int32_t>(d_out, entries);
    ASSERT_EQ(g_count, c_count);
    int read_only = 0;
    for (int r = 0; r < rows && fetch.fill; ++r)
      for (int j = 0; j < c_count[r]; ++j) {
        int32_t& id = g_out[s.indptr[r] + j];
        if (id >= 0) continue;
        ASSERT_LT(~id, int(fills.size())) << "row " << r;
        const GatherJob& job = fills[~id];
        const int32_t want = c_out[s.indptr[r] + j];
        if (job.dst) {  // this entry's own fill: of the twin's slot
          id = int32_t((static_cast<const uint8_t*>(job.dst) - d_pool.as<uint8_t>()) / int64_t(2 * piece));
          continue;
        }
        // Read only: the job's source holds the bytes the twin's slot holds.
        ++read_only;
        std::vector<uint8_t> kv(2 * piece);
        QKV_CUDA_OK(cudaMemcpy(kv.data(), job.k, piece, cudaMemcpyDefault));
        QKV_CUDA_OK(cudaMemcpy(kv.data() + piece, job.v, piece, cudaMemcpyDefault));
        ASSERT_EQ(0, std::memcmp(kv.data(), t.pool.data() + std::size_t(want) * 2 * piece, 2 * piece))
            << "row " << r << " entry " << j << ": a read-only job's bytes";
        id = want;
      }
    if (fetch.fill)
      ::testing::Test::RecordProperty("read_only_jobs_step" + std::to_string(step), std::to_string(read_only));
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < c_count[r]; ++j) ASSERT_EQ(g_out[s.indptr[r] + j], c_out[s.indptr[r] + j]) << "row " << r;
    ASSERT_EQ(Download<int32_t>(d_ncold, 1)[0], c_ncold[0]);
    ASSERT_EQ(Download<int32_t>(d_nbyp, 1)[0], c_nbyp[0]);
    auto as_set = [](const std::vector<ResolveRequest>& q, int k) {
      std::set<std::tuple<uint32_t, int, int, int>> out;
      for (int i = 0; i < k; ++i) out.insert({q[i].page, q[i].head, q[i].row, q[i].entry});
      return out;
    };
    auto cpu_set = [](const std::vector<resolve::Request>& q, int k) {
      std::set<std::tuple<uint32_t, int, int, int>> out;
      for (int i = 0; i < k; ++i) out.insert({q[i].page, q[i].head, q[i].row, q[i].entry});
      return out;
    };
    const int kc = std::min(c_ncold[0], cap), kb = std::min(c_nbyp[0], cap);
    if (kc == c_ncold[0]) {
      EXPECT_EQ(as_set(Download<ResolveRequest>(d_cold, cap), kc), cpu_set(c_cold, kc));
    }
    if (kb == c_nbyp[0]) {
      EXPECT_EQ(as_set(Download<ResolveRequest>(d_byp, cap), kb), cpu_set(c_byp, kb));
    }
  }
  cudaStreamDestroy(stream);
}

class ResolveCudaTest : public ::testing::TestWithParam<ResolveCase> {};

TEST_P(ResolveCudaTest, MatchesCpuTwinOverSteps) {
  QKV_REQUIRE_GPU();
  for (uint32_t seed : {11u, 12u}) RunResolveCase(GetParam(), seed + uint32_t(GetParam().batch));
}

// Misses left to the attention: none staged, the first 5 a call staged, all staged.
TEST_P(ResolveCudaTest, FusedMatchesCpuTwinOverSteps) {
  QKV_REQUIRE_GPU();
  for (int stage : {0, 5, 1 << 20}) {
    SCOPED_TRACE(::testing::Message() << "stage_pages " << stage);
    RunResolveCase(GetParam(), 21u + uint32_t(GetParam().batch), Fetch{true, stage});
  }
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, ResolveCudaTest,
    ::testing::Values(ResolveCase{1, 1, 1, 64, DType::kF32, 5, 2, 3, 0.0, 0},
                      ResolveCase{3, 2, 3, 64, DType::kF16, 17, 6, 9, 0.2, 4},
                      ResolveCase{7, 3, 7, 8, DType::kF32, 23, 40, 12, 0.1, 8},
                      ResolveCase{2, 8, 17, 64, DType::kBF16, 40, 0, 20, 0.0, 10},
                      ResolveCase{23, 2, 16, 128, DType::kF16, 30, 25, 16, 0.3, 12},
                      ResolveCase{5, 2, 8, 16, DType::kF32, 9, 3, 8, 0.0, 8},
                      // many misses: 1000+ entries and 600+ slots per sequence (several block chunks)
                      ResolveCase{4, 8, 16, 128, DType::kF16, 256, 600, 160, 0.05, 64},
                      // lists of 9000+ slots (three 4096-slot rounds of the assign), thousands of misses
                      ResolveCase{2, 8, 16, 32, DType::kF16, 2048, 9000, 600, 0.05, 64},
                      // more misses than eligible slots across rounds: bypasses past the second round
                      ResolveCase{1, 4, 16, 32, DType::kF32, 3000, 5000, 1500, 0.0, 0}));

// E4M3 is a summary dtype only: the plan refuses it for K/V (host only, no GPU needed).
TEST(ResolvePlanReject, E4m3KeysAndValues) {
  ResolveShape shape;
  shape.batch = 1, shape.kv_heads = 2, shape.page_size = 16, shape.head_dim = 64, shape.dtype = DType::kE4M3;
  ResolvePlan plan;
  std::string err;
  EXPECT_FALSE(PlanResolve(shape, 8, 8, 132, 0, &plan, &err));
  EXPECT_NE(err.find("e4m3"), std::string::npos) << err;
  shape.dtype = DType::kF16;
  EXPECT_TRUE(PlanResolve(shape, 8, 8, 132, 0, &plan, &err)) << err;
}

}  // namespace
}  // namespace questkv::kernels::cuda::test
