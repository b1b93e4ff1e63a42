// Miss gather from pinned host memory (plain main, CUDA events, medians):
//   h2d      one 1 GiB pinned cudaMemcpyAsync: the host->device limit
//   gather   LaunchGather over 512 MiB of random missed head-pages (8 KiB:
//            fp16 S=16 D=128; 4 KiB: D=64), each K and V piece read from its
//            place in a 2 GiB mapped pinned pool; grid sweep
//   resolve  the whole LaunchResolve (classify, assign, finalize, gather)
//            when every selected head-page misses: 8 sequences x 8 KV heads
//   overlap  the sparse attention (RunAttend, llama3-8b shape, batch 16,
//            2048-token budget) alone and beside a running gather on another
//            stream: attention slowdown and gather bandwidth under load
//   fill     a decode step's misses fetched by the attention itself
//            (AttendParams::fills, llama3-8b shape, batch 1 and 16, 2048-token
//            budget, a fraction of the entries in pinned host homes) against
//            the resolve's way, the gather then the attention: same output
//            bits, time per call, and the fetched bytes' rate against h2d
// Prints a table last; --json FILE writes one JSON object per line.
#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench/gpu/check.cuh"
#include "kernels/cuda/kernels_cuda.h"

using namespace questkv::kernels::cuda;


namespace {

FILE* g_json = nullptr;
std::vector<std::string> g_table;

void Row(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void Row(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  std::printf("%s\n", buf);
  g_table.push_back(buf);
}

void Json(const std::string& s) {
  if (g_json) std::fprintf(g_json, "%s\n", s.c_str());
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
  }
  double Ms() {
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms;
  }
};

__global__ void FillRandom(uint32_t* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 0x9E3779B1u ^ seed;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    // fp16 pairs in (-1, 1): keep exponents small so attention stays finite.
    x[i] = h & 0xBBFFBBFFu;
  }
}

constexpr std::size_t kPoolBytes = std::size_t(2) << 30;
constexpr std::size_t kMissBytes = std::size_t(512) << 20;
constexpr int kBatch = 8, kHeads = 8;

struct Shared {
  char* pool_host = nullptr;
  char* pool_dev = nullptr;  // device view of the same pinned pool
  char* dst = nullptr;       // 512 MiB device slot pool
  cudaStream_t s, s2;
  int sms = 0;
  int reps = 9;
};

// Random (page, head) pieces of the pinned pool: page layout [2][Hkv][S][D].
std::vector<GatherJob> RandomJobs(const Shared& g, std::size_t head_page, std::mt19937& rng) {
  const std::size_t piece = head_page / 2, page = head_page * kHeads;
  const std::size_t pages = kPoolBytes / page, n = kMissBytes / head_page;
  std::vector<GatherJob> jobs(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t p = rng() % pages, h = rng() % kHeads;
    const char* home = g.pool_dev + p * page;
    jobs[i] = GatherJob{home + h * piece, home + (kHeads + h) * piece, g.dst + i * head_page};
  }
  std::shuffle(jobs.begin(), jobs.end(), rng);
  return jobs;
}

double H2dLimit(const Shared& g) {
  const std::size_t bytes = std::size_t(1) << 30;
  char* d;
  CHECK(cudaMalloc(&d, bytes));
  Timer t;
  std::vector<double> ms;
  for (int r = 0; r < g.reps + 1; ++r) {
    CHECK(cudaEventRecord(t.a, g.s));
    CHECK(cudaMemcpyAsync(d, g.pool_host, bytes, cudaMemcpyHostToDevice, g.s));
    CHECK(cudaEventRecord(t.b, g.s));
    CHECK(cudaEventSynchronize(t.b));
    if (r) ms.push_back(t.Ms());
  }
  CHECK(cudaFree(d));
  const double gbs = double(bytes) / Median(ms) / 1e6;
  Row("h2d     pinned cudaMemcpyAsync 1 GiB            %8.1f GB/s", gbs);
  Json("{\"bench\":\"h2d\",\"gbs\":" + std::to_string(gbs) + "}");
  return gbs;
}

// Median seconds of LaunchGather over `jobs` with `blocks`.
double TimeGather(const Shared& g, const GatherJob* d_jobs, const int32_t* d_count, std::size_t piece, int blocks) {
  Timer t;
  std::vector<double> ms;
  for (int r = 0; r < g.reps + 1; ++r) {
    CHECK(cudaEventRecord(t.a, g.s));
    CHECK(LaunchGather(d_jobs, d_count, piece, blocks, g.s));
    CHECK(cudaEventRecord(t.b, g.s));
    CHECK(cudaEventSynchronize(t.b));
    if (r) ms.push_back(t.Ms());
  }
  return Median(ms) / 1e3;
}

int BenchGather(const Shared& g, std::size_t head_page, double limit, GatherJob** keep_jobs, int32_t** keep_count) {
  std::mt19937 rng{uint32_t(head_page)};
  const auto jobs = RandomJobs(g, head_page, rng);
  GatherJob* d_jobs;
  int32_t* d_count;
  CHECK(cudaMalloc(&d_jobs, jobs.size() * sizeof(GatherJob)));
  CHECK(cudaMalloc(&d_count, 4));
  CHECK(cudaMemcpy(d_jobs, jobs.data(), jobs.size() * sizeof(GatherJob), cudaMemcpyHostToDevice));
  const int32_t n = int32_t(jobs.size());
  CHECK(cudaMemcpy(d_count, &n, 4, cudaMemcpyHostToDevice));
  // Check a few random jobs' bytes at each loads-in-flight depth LaunchGather picks.
  for (int blocks : {g.sms / 4, g.sms / 2, 4 * g.sms}) {
  CHECK(cudaMemsetAsync(g.dst, 0, kMissBytes, g.s));
  CHECK(LaunchGather(d_jobs, d_count, head_page / 2, blocks, g.s));
  CHECK(cudaStreamSynchronize(g.s));
  for (int k = 0; k < 16; ++k) {
    const std::size_t i = rng() % jobs.size();
    std::vector<char> got(head_page);
    CHECK(cudaMemcpy(got.data(), jobs[i].dst, head_page, cudaMemcpyDeviceToHost));
    const char* kh = g.pool_host + (static_cast<const char*>(jobs[i].k) - g.pool_dev);
    const char* vh = g.pool_host + (static_cast<const char*>(jobs[i].v) - g.pool_dev);
    if (std::memcmp(got.data(), kh, head_page / 2) || std::memcmp(got.data() + head_page / 2, vh, head_page / 2)) {
      std::fprintf(stderr, "gather: wrong bytes in job %zu\n", i);
      std::exit(1);
    }
  }
  }
  // The smallest grid within 3% of the best: what the overlap run uses, so
  // the gather holds as few SMs as it needs.
  std::vector<std::pair<int, double>> runs;
  for (int blocks : {g.sms / 16, g.sms / 8, g.sms / 4, g.sms / 2, g.sms, 4 * g.sms, 16 * g.sms}) {
    const double sec = TimeGather(g, d_jobs, d_count, head_page / 2, blocks);
    runs.push_back({blocks, sec});
    const double gbs = kMissBytes / sec / 1e9;
    Row("gather  %zu KiB head-pages x %6d  grid %5d   %8.1f GB/s  %5.1f%% of h2d", head_page >> 10, n, blocks, gbs,
        100 * gbs / limit);
    Json("{\"bench\":\"gather\",\"head_page\":" + std::to_string(head_page) + ",\"blocks\":" + std::to_string(blocks) +
         ",\"gbs\":" + std::to_string(gbs) + "}");
  }
  double best = 1e30;
  for (const auto& r : runs) best = std::min(best, r.second);
  int best_blocks = 0;
  for (const auto& r : runs)
    if (!best_blocks && r.second <= best * 1.03) best_blocks = r.first;
  *keep_jobs = d_jobs;
  *keep_count = d_count;
  return best_blocks;
}

// Every selected head-page misses: fresh tables before each (untimed) run.
void BenchResolve(const Shared& g, std::size_t head_page, int head_dim, double limit, int gather_blocks) {
  const int S = 16, H = kHeads, B = kBatch;
  const std::size_t page_bytes = head_page * H;
  const int per_row = int(kMissBytes / head_page / (B * H));
  const int pages_per_seq = 4096;
  const int total_pages = B * pages_per_seq;
  if (std::size_t(total_pages) * page_bytes > kPoolBytes) std::exit(2);
  std::mt19937 rng(7);
  std::vector<int32_t> page_indptr(B + 1), sel_indptr(B * H + 1), sel_pages, part_indptr(B + 1), part_slots;
  std::vector<uint32_t> page_ids(total_pages);
  for (int i = 0; i < total_pages; ++i) page_ids[i] = uint32_t(i);
  std::shuffle(page_ids.begin(), page_ids.end(), rng);
  for (int b = 0; b <= B; ++b) page_indptr[b] = b * pages_per_seq;
  std::vector<int> logical(pages_per_seq);
  for (int r = 0; r < B * H; ++r) {
    for (int i = 0; i < pages_per_seq; ++i) logical[i] = i;
    std::shuffle(logical.begin(), logical.end(), rng);
    std::sort(logical.begin(), logical.begin() + per_row);
    sel_pages.insert(sel_pages.end(), logical.begin(), logical.begin() + per_row);
    sel_indptr[r + 1] = int32_t(sel_pages.size());
  }
  const int slots = int(sel_pages.size());
  for (int b = 0; b <= B; ++b) part_indptr[b] = b * (slots / B);
  for (int s = 0; s < slots; ++s) part_slots.push_back(s);
  std::vector<const void*> addr(total_pages);
  for (int p = 0; p < total_pages; ++p) addr[p] = g.pool_dev + std::size_t(p) * page_bytes;

  auto up = [&](const auto& v) {
    void* d;
    CHECK(cudaMalloc(&d, v.size() * sizeof(v[0])));
    CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(v[0]), cudaMemcpyHostToDevice));
    return d;
  };
  auto alloc = [&](std::size_t bytes) {
    void* d;
    CHECK(cudaMalloc(&d, bytes));
    return d;
  };
  ResolveShape shape{B, H, S, head_dim, DType::kF16, ColdMissPolicy::kDeadline};
  ResolvePlan plan;
  std::string err;
  if (!PlanResolve(shape, slots, slots, g.sms, gather_blocks, &plan, &err)) {
    std::fprintf(stderr, "%s\n", err.c_str());
    std::exit(1);
  }
  ResolveParams p;
  p.page_indptr = static_cast<int32_t*>(up(page_indptr));
  p.page_ids = static_cast<uint32_t*>(up(page_ids));
  p.sel_indptr = static_cast<int32_t*>(up(sel_indptr));
  p.sel_pages = static_cast<int32_t*>(up(sel_pages));
  p.host_addr = static_cast<const void* const*>(up(addr));
  p.hbm_slot = static_cast<int32_t*>(alloc(std::size_t(total_pages) * H * 4));
  p.slot_page = static_cast<uint32_t*>(alloc(slots * 4));
  p.slot_head = static_cast<int32_t*>(alloc(slots * 4));
  p.slot_last_use = static_cast<int64_t*>(alloc(slots * 8));
  p.slot_pinned = static_cast<uint8_t*>(alloc(slots));
  p.part_indptr = static_cast<int32_t*>(up(part_indptr));
  int32_t* d_part_init = static_cast<int32_t*>(up(part_slots));
  p.part_slots = static_cast<int32_t*>(alloc(slots * 4));
  p.slots = g.dst;
  p.out_slots = static_cast<int32_t*>(alloc(slots * 4));
  p.out_count = static_cast<int32_t*>(alloc(B * H * 4));
  p.queue_capacity = 1024;
  p.cold = static_cast<ResolveRequest*>(alloc(1024 * sizeof(ResolveRequest)));
  p.bypass = static_cast<ResolveRequest*>(alloc(1024 * sizeof(ResolveRequest)));
  p.cold_count = static_cast<int32_t*>(alloc(4));
  p.bypass_count = static_cast<int32_t*>(alloc(4));
  p.counters = static_cast<ResolveCounters*>(alloc(sizeof(ResolveCounters)));
  p.workspace = alloc(plan.workspace_bytes);
  CHECK(cudaMemset(const_cast<uint8_t*>(p.slot_pinned), 0, slots));
  CHECK(cudaMemset(p.counters, 0, sizeof(ResolveCounters)));
  Timer t;
  std::vector<double> ms;
  for (int r = 0; r < g.reps + 1; ++r) {
    CHECK(cudaMemsetAsync(p.hbm_slot, 0xFF, std::size_t(total_pages) * H * 4, g.s));
    CHECK(cudaMemsetAsync(p.slot_page, 0xFF, slots * 4, g.s));
    CHECK(cudaMemsetAsync(p.slot_last_use, 0xFF, slots * 8, g.s));
    CHECK(cudaMemcpyAsync(p.part_slots, d_part_init, slots * 4, cudaMemcpyDeviceToDevice, g.s));
    p.step = r;
    CHECK(cudaEventRecord(t.a, g.s));
    CHECK(LaunchResolve(plan, p, g.s));
    CHECK(cudaEventRecord(t.b, g.s));
    CHECK(cudaEventSynchronize(t.b));
    if (r) ms.push_back(t.Ms());
  }
  ResolveCounters c;
  CHECK(cudaMemcpy(&c, p.counters, sizeof c, cudaMemcpyDeviceToHost));
  const double sec = Median(ms) / 1e3;
  const double gbs = double(slots) * head_page / sec / 1e9;
  Row("resolve %zu KiB all-miss x %6d (B%d H%d) grid %4d %8.1f GB/s  %5.1f%% of h2d  %8.0f us  (misses/run %llu)",
      head_page >> 10, slots, B, H, plan.gather_blocks, gbs, 100 * gbs / limit, sec * 1e6,
      (unsigned long long)(c.misses_host / (g.reps + 1)));
  Json("{\"bench\":\"resolve\",\"head_page\":" + std::to_string(head_page) + ",\"gather_blocks\":" + std::to_string(plan.gather_blocks) + ",\"gbs\":" + std::to_string(gbs) +
       ",\"us\":" + std::to_string(sec * 1e6) + "}");
}

// Attention beside a gather on another stream.
void BenchOverlap(const Shared& g, const GatherJob* d_jobs, const int32_t* d_count, int gather_blocks) {
  AttendShape a{16 * 8, 8, 4, 128, 16, DType::kF16};
  const int pages = 2048 / 16, pool_slots = 32768;
  AttendPlan plan;
  std::string err;
  if (!PlanAttend(a, pages, g.sms, &plan, &err)) {
    std::fprintf(stderr, "%s\n", err.c_str());
    std::exit(1);
  }
  std::mt19937 rng(3);
  std::vector<int32_t> indptr(a.rows + 1), ids(std::size_t(a.rows) * pages);
  for (int r = 0; r <= a.rows; ++r) indptr[r] = r * pages;
  for (auto& x : ids) x = int32_t(rng() % pool_slots);
  const std::size_t slot_bytes = 2 * 16 * 128 * 2;
  void *q, *kv, *o, *ws;
  int32_t *d_indptr, *d_ids;
  CHECK(cudaMalloc(&q, std::size_t(a.rows) * 4 * 128 * 2));
  CHECK(cudaMalloc(&kv, pool_slots * slot_bytes));
  CHECK(cudaMalloc(&o, std::size_t(a.rows) * 4 * 128 * 2));
  CHECK(cudaMalloc(&ws, std::max<std::size_t>(plan.workspace_bytes, 16)));
  CHECK(cudaMalloc(&d_indptr, indptr.size() * 4));
  CHECK(cudaMalloc(&d_ids, ids.size() * 4));
  CHECK(cudaMemcpy(d_indptr, indptr.data(), indptr.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  FillRandom<<<1024, 256>>>(static_cast<uint32_t*>(q), std::size_t(a.rows) * 4 * 128 / 2, 1);
  FillRandom<<<1024, 256>>>(static_cast<uint32_t*>(kv), pool_slots * slot_bytes / 4, 2);
  CHECK(cudaDeviceSynchronize());
  AttendParams ap;
  ap.scale = 0.0883883f;
  ap.q = q;
  ap.slots = kv;
  ap.indptr = d_indptr;
  ap.slot_ids = d_ids;
  ap.o = o;
  ap.workspace = ws;

  // Calls on stream `st`, each between two events; offsets from `since`.
  struct Call {
    double start_ms, end_ms, us;
  };
  constexpr int kCalls = 400;  // ~20 ms: longer than one 512 MiB gather
  std::vector<Timer> ev(kCalls);
  auto launch_calls = [&](cudaStream_t st, int n) {
    for (int i = 0; i < n; ++i) {
      CHECK(cudaEventRecord(ev[i].a, st));
      CHECK(RunAttend(plan, ap, st));
      CHECK(cudaEventRecord(ev[i].b, st));
    }
  };
  auto collect = [&](int n, cudaEvent_t since) {
    CHECK(cudaDeviceSynchronize());
    std::vector<Call> out;
    for (int i = 1; i < n; ++i) {
      float s0 = 0, s1 = 0;
      if (since) {
        CHECK(cudaEventElapsedTime(&s0, since, ev[i].a));
        CHECK(cudaEventElapsedTime(&s1, since, ev[i].b));
      }
      out.push_back(Call{s0, s1, ev[i].Ms() * 1e3});
    }
    return out;
  };
  launch_calls(g.s, 60);
  collect(60, nullptr);
  launch_calls(g.s, 200);
  std::vector<double> alone;
  for (const Call& c : collect(200, nullptr)) alone.push_back(c.us);
  // Gather on s2, attention calls on `st` launched right behind it; keep the
  // calls that ran entirely inside the gather's interval.
  auto beside_run = [&](cudaStream_t st, int blocks, std::vector<double>* beside, double* gather_sec,
                        double* first_start_ms) {
    Timer tg;
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaEventRecord(tg.a, g.s2));
    CHECK(LaunchGather(d_jobs, d_count, 4096, blocks, g.s2));
    CHECK(cudaEventRecord(tg.b, g.s2));
    launch_calls(st, kCalls);
    const auto calls = collect(kCalls, tg.a);
    *gather_sec = tg.Ms() / 1e3;
    *first_start_ms = calls.front().start_ms;
    for (const Call& c : calls)
      if (c.start_ms >= 0 && c.end_ms <= *gather_sec * 1e3) beside->push_back(c.us);
  };
  const double a0 = Median(alone);
  // The gather's grid against the attention beside it: a gather holding
  // every SM slows attention several times; a capped grid leaves SMs free.
  std::vector<int> grids = {g.sms / 16, g.sms / 8, g.sms / 4, g.sms / 2, g.sms, 4 * g.sms};
  if (std::find(grids.begin(), grids.end(), gather_blocks) == grids.end()) grids.push_back(gather_blocks);
  for (int blocks : grids) {
    const double g_alone = TimeGather(g, d_jobs, d_count, 4096, blocks);
    std::vector<double> beside;
    double g_sec = 0, first = 0;
    beside_run(g.s, blocks, &beside, &g_sec, &first);
    const double a1 = beside.empty() ? 0 : Median(beside);
    Row("overlap grid %4d  gather 8 KiB alone %5.1f GB/s beside %5.1f GB/s | attend llama3-8b b=16 budget=2048 alone"
        " %6.1f us beside %6.1f us (%4.2fx, %zu calls inside, first began %.2f ms after the gather)",
        blocks, kMissBytes / g_alone / 1e9, kMissBytes / g_sec / 1e9, a0, a1, a0 > 0 ? a1 / a0 : 0.0, beside.size(),
        first);
    Json("{\"bench\":\"overlap\",\"gather_blocks\":" + std::to_string(blocks) + ",\"attend_us_alone\":" +
         std::to_string(a0) + ",\"attend_us_beside\":" + std::to_string(a1) + ",\"calls_inside\":" +
         std::to_string(beside.size()) + ",\"gather_gbs_alone\":" + std::to_string(kMissBytes / g_alone / 1e9) +
         ",\"gather_gbs_beside\":" + std::to_string(kMissBytes / g_sec / 1e9) + "}");
  }
}

// The misses of a step fetched by the attention against gather-then-attend.
void BenchFill(const Shared& g, double limit) {
  const int H = 8, G = 4, D = 128, S = 16, pages = 2048 / S;
  const std::size_t piece = std::size_t(S) * D * 2, head_page = 2 * piece;
  for (int batch : {1, 16}) {
    AttendShape a{batch * H, H, G, D, S, DType::kF16};
    AttendPlan plan;
    std::string err;
    if (!PlanAttend(a, pages, g.sms, &plan, &err)) {
      std::fprintf(stderr, "%s\n", err.c_str());
      std::exit(1);
    }
    const int entries = a.rows * pages;
    void *q, *pool, *o_fill, *o_gather, *ws;
    int32_t *d_indptr, *d_fill_ids, *d_slot_ids, *d_count;
    GatherJob* d_jobs;  // the fused attention's fills and the gather's jobs alike
    CHECK(cudaMalloc(&q, std::size_t(a.rows) * G * D * 2));
    CHECK(cudaMalloc(&pool, std::size_t(entries) * head_page));
    CHECK(cudaMalloc(&o_fill, std::size_t(a.rows) * G * D * 2));
    CHECK(cudaMalloc(&o_gather, std::size_t(a.rows) * G * D * 2));
    CHECK(cudaMalloc(&ws, std::max<std::size_t>(plan.workspace_bytes, 16)));
    CHECK(cudaMemset(ws, 0, std::max<std::size_t>(plan.workspace_bytes, 16)));
    CHECK(cudaMalloc(&d_indptr, (a.rows + 1) * 4));
    CHECK(cudaMalloc(&d_fill_ids, entries * 4));
    CHECK(cudaMalloc(&d_slot_ids, entries * 4));
    CHECK(cudaMalloc(&d_count, 4));
    CHECK(cudaMalloc(&d_jobs, entries * sizeof(GatherJob)));
    FillRandom<<<1024, 256>>>(static_cast<uint32_t*>(q), std::size_t(a.rows) * G * D / 2, 5);
    FillRandom<<<1024, 256>>>(static_cast<uint32_t*>(pool), std::size_t(entries) * head_page / 4, 6);
    std::vector<int32_t> indptr(a.rows + 1);
    for (int r = 0; r <= a.rows; ++r) indptr[r] = r * pages;
    CHECK(cudaMemcpy(d_indptr, indptr.data(), indptr.size() * 4, cudaMemcpyHostToDevice));
    const std::size_t home_pages = kPoolBytes / (head_page * H);
    for (double frac : {0.0, 0.05, 0.25, 1.0}) {
      std::mt19937 rng(uint32_t(1000 * frac) + batch);
      // Entry e's slot is e (shuffled); a fetched one's home is a random
      // (page, head) of the pinned pool, its job filling slot e.
      std::vector<int32_t> slot_ids(entries), fill_ids(entries);
      for (int e = 0; e < entries; ++e) slot_ids[e] = e;
      std::shuffle(slot_ids.begin(), slot_ids.end(), rng);
      std::vector<GatherJob> jobs;
      std::bernoulli_distribution fetched(frac);
      for (int e = 0; e < entries; ++e) {
        fill_ids[e] = slot_ids[e];
        if (!fetched(rng)) continue;
        const std::size_t pg = rng() % home_pages, h = rng() % H;
        const char* home = g.pool_dev + pg * head_page * H;
        fill_ids[e] = ~int32_t(jobs.size());
        jobs.push_back({home + h * piece, home + (H + h) * piece, static_cast<char*>(pool) + slot_ids[e] * head_page});
      }
      const int32_t n = int32_t(jobs.size());
      CHECK(cudaMemcpy(d_slot_ids, slot_ids.data(), entries * 4, cudaMemcpyHostToDevice));
      CHECK(cudaMemcpy(d_fill_ids, fill_ids.data(), entries * 4, cudaMemcpyHostToDevice));
      if (n) CHECK(cudaMemcpy(d_jobs, jobs.data(), n * sizeof(GatherJob), cudaMemcpyHostToDevice));
      CHECK(cudaMemcpy(d_count, &n, 4, cudaMemcpyHostToDevice));
      AttendParams base;
      base.scale = 0.0883883f;
      base.q = q;
      base.slots = pool;
      base.indptr = d_indptr;
      base.workspace = ws;
      AttendParams fused = base, plain = base;
      fused.slot_ids = d_fill_ids;
      fused.fills = d_jobs;
      fused.o = o_fill;
      plain.slot_ids = d_slot_ids;
      plain.o = o_gather;
      // Correctness first: the same output bits both ways.
      CHECK(RunAttend(plan, fused, g.s));
      CHECK(LaunchGather(d_jobs, d_count, piece, g.sms, g.s));
      CHECK(RunAttend(plan, plain, g.s));
      CHECK(cudaStreamSynchronize(g.s));
      std::vector<char> of(std::size_t(a.rows) * G * D * 2), og(of.size());
      CHECK(cudaMemcpy(of.data(), o_fill, of.size(), cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(og.data(), o_gather, og.size(), cudaMemcpyDeviceToHost));
      if (std::memcmp(of.data(), og.data(), of.size())) {
        std::fprintf(stderr, "fill: fused output differs from gather-then-attend (batch %d, %.2f fetched)\n", batch,
                     frac);
        std::exit(1);
      }
      Timer t;
      std::vector<double> us_fused, us_plain;
      for (int r = 0; r < g.reps + 1; ++r) {
        CHECK(cudaEventRecord(t.a, g.s));
        CHECK(RunAttend(plan, fused, g.s));
        CHECK(cudaEventRecord(t.b, g.s));
        CHECK(cudaEventSynchronize(t.b));
        if (r) us_fused.push_back(t.Ms() * 1e3);
        CHECK(cudaEventRecord(t.a, g.s));
        CHECK(LaunchGather(d_jobs, d_count, piece, g.sms, g.s));
        CHECK(RunAttend(plan, plain, g.s));
        CHECK(cudaEventRecord(t.b, g.s));
        CHECK(cudaEventSynchronize(t.b));
        if (r) us_plain.push_back(t.Ms() * 1e3);
      }
      const double uf = Median(us_fused), up = Median(us_plain);
      const double fetched_mib = double(n) * head_page / (1 << 20);
      const double gbs = n ? double(n) * head_page / (uf * 1e-6) / 1e9 : 0.0;
      Row("fill    b=%-2d fetched %4.0f%% (%7.2f MiB)  attend+fetch %7.1f us  gather then attend %7.1f us  (%4.2fx)"
          "  fetched at %5.1f GB/s, %5.1f%% of h2d",
          batch, 100 * frac, fetched_mib, uf, up, up / uf, gbs, 100 * gbs / limit);
      Json("{\"bench\":\"fill\",\"batch\":" + std::to_string(batch) + ",\"fraction\":" + std::to_string(frac) +
           ",\"fetched_bytes\":" + std::to_string(int64_t(n) * int64_t(head_page)) + ",\"us_fused\":" +
           std::to_string(uf) + ",\"us_gather_then_attend\":" + std::to_string(up) + ",\"gbs\":" +
           std::to_string(gbs) + "}");
    }
    for (void* x : {q, pool, o_fill, o_gather, ws}) CHECK(cudaFree(x));
    for (void* x : {static_cast<void*>(d_indptr), static_cast<void*>(d_fill_ids), static_cast<void*>(d_slot_ids),
                    static_cast<void*>(d_count), static_cast<void*>(d_jobs)})
      CHECK(cudaFree(x));
  }
}

}  // namespace

int main(int argc, char** argv) {
  Shared g;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) g_json = std::fopen(argv[++i], "w");
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) g.reps = std::atoi(argv[++i]);
  }
  CHECK(cudaDeviceGetAttribute(&g.sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaHostAlloc(&g.pool_host, kPoolBytes, cudaHostAllocMapped));
  CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&g.pool_dev), g.pool_host, 0));
  // Finite fp16 values in (-1, 1) (as FillRandom), so attention over homes stays finite.
  for (std::size_t i = 0; i < kPoolBytes / 8; ++i)
    reinterpret_cast<uint64_t*>(g.pool_host)[i] = (i * 0x9E3779B97F4A7C15ULL) & 0xBBFFBBFFBBFFBBFFULL;
  CHECK(cudaMalloc(&g.dst, kMissBytes));
  CHECK(cudaStreamCreateWithFlags(&g.s, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&g.s2, cudaStreamNonBlocking));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("== gather bench: %s, %d SMs ==\n", prop.name, g.sms);

  const double limit = H2dLimit(g);
  BenchFill(g, limit);
  GatherJob *jobs8, *jobs4;
  int32_t *count8, *count4;
  const int best8 = BenchGather(g, 8192, limit, &jobs8, &count8);
  BenchGather(g, 4096, limit, &jobs4, &count4);
  for (int blocks : {0, g.sms / 8, g.sms / 4}) {  // 0: PlanResolve's default grid
    BenchResolve(g, 8192, 128, limit, blocks);
    BenchResolve(g, 4096, 64, limit, blocks);
  }
  BenchOverlap(g, jobs8, count8, best8);
  std::printf("\n== table ==\n");
  for (const auto& r : g_table) std::printf("%s\n", r.c_str());
  if (g_json) std::fclose(g_json);
  return 0;
}
