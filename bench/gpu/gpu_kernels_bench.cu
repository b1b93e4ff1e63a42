// GPU kernel benchmarks (plain main, CUDA events, cold L2): the workloads,
//   copy     device-to-device copy bandwidth, the ceiling of this run
//   attend   sparse decode attention over `budget` tokens of random slots
//   select   summary scan + top-K at long contexts
//   step     one layer's Quest step vs the same attention kernel over every
//            page (dense), with the ideal 1/rho; launched one by one, and
//            replayed as a CUDA graph (as the runtime runs it). The whole
//            step is the runtime's: append + select + resolve + attend; the
//            select + attend column (select emitting slots) is kept beside it
// Each timed call follows a 512 MiB L2-flushing memset (untimed); figures are
// medians of --reps calls after warm-up. Writes JSON lines to --json and
// prints a table last. Inputs are fresh hash-random numbers (never zeros).
// Each attention figure comes with a cudaMemcpyAsync of the same bytes: the
// ceiling at that size.
//   usage: questkv_gpu_kernels_bench [--json FILE] [--reps N]
//          [--select-only [--contexts 8192,32768,131072] [--geometry llama2-7b|llama3-8b] [--batches 1,16]]
//          [--split-long-rows]  (rows of 16K+ pages: the top-K's phases one launch each, for an A/B)
//          [--mma-scores]  (the select's scores on the tensor cores, SelectShape::mma_scores, for an A/B)
//          [--attend-only [--geometry ..] [--batches ..]]  (copy + attend: a quick A/B of the attention)
//          [--summary-dtype f16|e4m3]  (the select and step summaries; default f16; TB/s figures
//                                       count their bytes at 2 or 1 a element)
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdarg>
#include <string>
#include <type_traits>
#include <vector>

#include "bench/gpu/check.cuh"
#include "kernels/cuda/kernels_cuda.h"
#include "core/e4m3.h"

using namespace questkv::kernels::cuda;


namespace {

__device__ inline uint32_t Hash(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return uint32_t(x);
}

// Uniform(-1, 1) halves.
__global__ void FillHalf(__half* x, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] = __float2half(float(Hash(i * 0x9E3779B97F4A7C15ULL + seed)) * (2.f / 4294967296.f) - 1.f);
}

// Summaries [pages][Hkv][2][D]: min = c - w, max = c + w (uint8_t: E4M3
// codes, min rounded down and max up).
template <typename T>
__global__ void FillSummary(T* s, size_t heads, int d, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < heads * d; i += size_t(gridDim.x) * blockDim.x) {
    const float c = float(Hash(i + seed)) * (2.f / 4294967296.f) - 1.f;
    const float w = float(Hash(i + seed * 3 + 1)) * (1.f / 4294967296.f);
    const size_t head = i / d, j = i % d;
    if constexpr (std::is_same_v<T, uint8_t>) {
      s[head * 2 * d + j] = questkv::e4m3::RoundDown(c - w);
      s[head * 2 * d + d + j] = questkv::e4m3::RoundUp(c + w);
    } else {
      s[head * 2 * d + j] = __float2half(c - w);
      s[head * 2 * d + d + j] = __float2half(c + w);
    }
  }
}

__global__ void Iota(int32_t* x, size_t n, int32_t stride, int32_t mod) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] = int32_t((i * size_t(stride)) % size_t(mod));
}

struct Dev {
  void* p = nullptr;
  size_t bytes = 0;
  // Zeroed: RunAttend's workspace counters must start at zero.
  explicit Dev(size_t b) : bytes(b) {
    CHECK(cudaMalloc(&p, std::max<size_t>(b, 16)));
    CHECK(cudaMemset(p, 0, std::max<size_t>(b, 16)));
  }
  ~Dev() { cudaFree(p); }
  template <typename T> T* as() const { return static_cast<T*>(p); }
};

struct Timer {
  cudaEvent_t a, b;
  Dev flush{512ull << 20};
  Timer() { cudaEventCreate(&a), cudaEventCreate(&b); }
  // Median microseconds of fn() over reps cold-L2 calls, after 3 warm-ups.
  template <typename F> double MedianUs(int reps, F fn) {
    for (int i = 0; i < 3; ++i) fn();
    std::vector<float> t;
    for (int i = 0; i < reps; ++i) {
      CHECK(cudaMemsetAsync(flush.p, i & 0xFF, flush.bytes));
      CHECK(cudaEventRecord(a));
      fn();
      CHECK(cudaEventRecord(b));
      CHECK(cudaEventSynchronize(b));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, a, b));
      t.push_back(ms * 1000.f);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
};

struct Geo {
  const char* name;
  int kv_heads, group;
};
const Geo kGeos[] = {{"llama2-7b", 32, 1}, {"llama3-8b", 8, 4}};
// The attention sweep adds a group of 8 (Llama-3-70B: 64 query heads over 8 KV heads, one layer).
const Geo kAttendGeos[] = {kGeos[0], kGeos[1], {"llama3-70b", 8, 8}};
constexpr int D = 128, S = 16;
int g_sms = 0;
bool g_split_long_rows = false;  // --split-long-rows
bool g_mma_scores = false;       // --mma-scores
DType g_summary_dtype = DType::kF16;  // --summary-dtype
FILE* g_json = nullptr;
std::vector<std::string> g_table;

void Json(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void Json(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfprintf(g_json, fmt, ap);
  va_end(ap);
  fputc('\n', g_json);
  fflush(g_json);
}

double CopyBandwidth(Timer& tm) {
  const size_t bytes = 2ull << 30;
  Dev a(bytes), b(bytes);
  FillHalf<<<4096, 256>>>(a.as<__half>(), bytes / 2, 1);
  const double us = tm.MedianUs(10, [&] { CHECK(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice)); });
  const double tbs = 2.0 * bytes / us / 1e6;
  Json("{\"bench\":\"copy\",\"bytes\":%zu,\"us\":%.2f,\"tb_s_rw\":%.3f}", bytes, us, tbs);
  std::printf("copy: %.3f TB/s (read+write, 2 GiB, median of 10)\n", tbs);
  return tbs;
}

// Attention over `budget` tokens of random slots in a 4 GiB pool.
void BenchAttend(Timer& tm, int reps, const std::string& only_geo = {}, const std::vector<int>& batches = {1, 16}) {
  const size_t slot_bytes = size_t(2) * S * D * 2;
  const size_t slots = (4ull << 30) / slot_bytes;
  Dev pool(slots * slot_bytes);
  FillHalf<<<4096, 256>>>(pool.as<__half>(), pool.bytes / 2, 2);
  for (const Geo& g : kAttendGeos)
    for (int batch : batches)
      for (int budget : {512, 1024, 2048, 4096}) {
        if (!only_geo.empty() && only_geo != g.name) continue;
        const int rows = batch * g.kv_heads, per_row = budget / S;
        Dev q(size_t(rows) * g.group * D * 2), o(size_t(rows) * g.group * D * 2);
        FillHalf<<<64, 256>>>(q.as<__half>(), q.bytes / 2, 3);
        std::vector<int32_t> indptr(rows + 1);
        for (int r = 0; r <= rows; ++r) indptr[r] = r * per_row;
        Dev d_indptr(indptr.size() * 4), d_slots(size_t(rows) * per_row * 4);
        CHECK(cudaMemcpy(d_indptr.p, indptr.data(), indptr.size() * 4, cudaMemcpyHostToDevice));
        Iota<<<256, 256>>>(d_slots.as<int32_t>(), size_t(rows) * per_row, 7919, int32_t(slots));
        AttendShape s{rows, g.kv_heads, g.group, D, S, DType::kF16};
        AttendPlan plan;
        std::string err;
        if (!PlanAttend(s, per_row, g_sms, &plan, &err)) std::fprintf(stderr, "%s\n", err.c_str()), std::exit(1);
        Dev ws(plan.workspace_bytes);
        AttendParams p;
        p.scale = 1.f / std::sqrt(float(D));
        p.q = q.p;
        p.slots = pool.p;
        p.indptr = d_indptr.as<int32_t>();
        p.slot_ids = d_slots.as<int32_t>();
        p.o = o.p;
        p.workspace = ws.p;
        const double us = tm.MedianUs(reps, [&] { CHECK(RunAttend(plan, p, nullptr)); });
        const double bytes = double(rows) * per_row * slot_bytes;
        const double tbs = bytes / us / 1e6;
        // The same bytes copied by cudaMemcpyAsync (device to device): the
        // ceiling at this size, where fixed latency weighs beside bandwidth.
        Dev copy_src{size_t(bytes)}, copy_dst{size_t(bytes)};
        const double copy_us = tm.MedianUs(
            reps, [&] { CHECK(cudaMemcpyAsync(copy_dst.p, copy_src.p, size_t(bytes), cudaMemcpyDeviceToDevice)); });
        Json("{\"bench\":\"attend\",\"geometry\":\"%s\",\"batch\":%d,\"budget\":%d,\"splits\":%d,\"us\":%.2f,"
             "\"kv_bytes\":%.0f,\"tb_s\":%.3f,\"same_size_copy_us\":%.2f}",
             g.name, batch, budget, plan.splits, us, bytes, tbs, copy_us);
        char line[256];
        std::snprintf(line, sizeof line,
                      "attend  %-9s b=%-2d budget=%-4d           %8.1f us  %5.2f TB/s  (%5.1f MiB, %d splits; a copy of these bytes %.1f us)",
                      g.name, batch, budget, us, tbs, bytes / (1 << 20), plan.splits, copy_us);
        g_table.push_back(line);
      }
}

// One layer's step at `context` tokens: select + attend, and dense.
struct StepResult {
  double select_us, attend_us, step_us, dense_us, summary_bytes;
  double step_graph_us, dense_graph_us;  // the same launches captured once in a CUDA graph, its replays timed
  // The whole step as the runtime runs it: append + select + resolve + attend
  // (whole_*), and its append and resolve alone.
  double append_us, resolve_us, whole_us, whole_graph_us;
};

// Median microseconds of replays of the graph that captures enqueue(stream)
// (as the runtime's decode step runs: one graph launch, no per-kernel launch
// gaps), cold L2 like Timer::MedianUs.
template <typename F> double GraphUs(Timer& tm, int reps, F enqueue) {
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaGraph_t graph;
  CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  enqueue(st);
  CHECK(cudaStreamEndCapture(st, &graph));
  cudaGraphExec_t exec;
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double us = tm.MedianUs(reps, [&] { CHECK(cudaGraphLaunch(exec, nullptr)); });
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaStreamDestroy(st));
  return us;
}

StepResult BenchStep(Timer& tm, const Geo& g, int batch, long long context, int budget, int reps, bool dense) {
  const int n = int(context / S);
  const int H = g.kv_heads, G = g.group, rows = batch * H;
  const size_t head_pages = size_t(batch) * n * H;
  const size_t slot_bytes = size_t(2) * S * D * 2;
  const size_t summary_bytes = head_pages * 2 * D * DTypeBytes(g_summary_dtype);
  Dev pool(dense ? head_pages * slot_bytes : 16), summ(summary_bytes);
  if (dense) FillHalf<<<8192, 256>>>(pool.as<__half>(), pool.bytes / 2, 11);
  if (g_summary_dtype == DType::kE4M3) FillSummary<<<8192, 256>>>(summ.as<uint8_t>(), head_pages, D, 12);
  else FillSummary<<<8192, 256>>>(summ.as<__half>(), head_pages, D, 12);
  Dev q(size_t(rows) * G * D * 2), o(size_t(rows) * G * D * 2);
  FillHalf<<<64, 256>>>(q.as<__half>(), q.bytes / 2, 13);
  std::vector<int32_t> counts(batch, n), page_indptr(batch + 1);
  for (int b = 0; b <= batch; ++b) page_indptr[b] = b * n;
  Dev d_pind(page_indptr.size() * 4), d_ids(size_t(batch) * n * 4), d_hbm(head_pages * 4);
  CHECK(cudaMemcpy(d_pind.p, page_indptr.data(), page_indptr.size() * 4, cudaMemcpyHostToDevice));
  Iota<<<1024, 256>>>(d_ids.as<int32_t>(), size_t(batch) * n, 1, batch * n);
  // Sparse steps read only selected slots: any slot table works; dense needs real slots.
  const int32_t slot_mod = dense ? int32_t(head_pages) : 1;
  Iota<<<1024, 256>>>(d_hbm.as<int32_t>(), head_pages, 1, std::max<int32_t>(slot_mod, 1));
  StepResult r{};
  r.summary_bytes = double(summary_bytes);
  std::string err;

  SelectShape ss;
  ss.batch = batch;
  ss.kv_heads = H;
  ss.group = G;
  ss.head_dim = D;
  ss.page_size = S;
  ss.page_budget = budget / S;
  ss.sink_pages = 1;
  ss.local_pages = 8;
  ss.mma_scores = g_mma_scores;
  SelectPlan splan;
  if (!PlanSelect(ss, counts.data(), g_sms, &splan, &err)) std::fprintf(stderr, "%s\n", err.c_str()), std::exit(1);
  if (g_split_long_rows) splan.split_long_rows = true;  // else the SelectShape's (false)
  const int cap = splan.out_indptr[1];
  Dev d_oind(splan.out_indptr.size() * 4), d_pages(size_t(splan.out_indptr.back()) * 4),
      d_slots(size_t(splan.out_indptr.back()) * 4), d_count(rows * 4), sws(splan.workspace_bytes);
  CHECK(cudaMemcpy(d_oind.p, splan.out_indptr.data(), splan.out_indptr.size() * 4, cudaMemcpyHostToDevice));
  SelectParams sp;
  sp.shape = ss;
  sp.q_dtype = DType::kF16;
  sp.summary_dtype = g_summary_dtype;
  sp.q = q.p;
  sp.summaries = summ.p;
  sp.page_indptr = d_pind.as<int32_t>();
  sp.page_ids = d_ids.as<uint32_t>();
  sp.hbm_slot = d_hbm.as<int32_t>();
  sp.out_indptr = d_oind.as<int32_t>();
  sp.out_pages = d_pages.as<int32_t>();
  sp.out_slots = d_slots.as<int32_t>();
  sp.out_count = d_count.as<int32_t>();
  sp.workspace = sws.p;
  // Sparse attention reads the selected slots of a 4 GiB pool when the step has no real one.
  const size_t sparse_slots = (4ull << 30) / slot_bytes;
  Dev spool(dense ? 16 : sparse_slots * slot_bytes);
  if (!dense) {
    FillHalf<<<4096, 256>>>(spool.as<__half>(), spool.bytes / 2, 14);
    Iota<<<1024, 256>>>(d_hbm.as<int32_t>(), head_pages, 7919, int32_t(sparse_slots));
  }
  AttendShape as{rows, H, G, D, S, DType::kF16};
  AttendPlan aplan;
  if (!PlanAttend(as, cap, g_sms, &aplan, &err)) std::fprintf(stderr, "%s\n", err.c_str()), std::exit(1);
  Dev aws(aplan.workspace_bytes);
  AttendParams ap;
  ap.scale = 1.f / std::sqrt(float(D));
  ap.q = q.p;
  ap.slots = dense ? pool.p : spool.p;
  ap.indptr = d_oind.as<int32_t>();
  ap.count = d_count.as<int32_t>();
  ap.slot_ids = d_slots.as<int32_t>();
  ap.o = o.p;
  ap.workspace = aws.p;
  r.select_us = tm.MedianUs(reps, [&] { CHECK(LaunchSelect(splan, sp, nullptr)); });
  r.attend_us = tm.MedianUs(reps, [&] { CHECK(RunAttend(aplan, ap, nullptr)); });
  r.step_us = tm.MedianUs(reps, [&] {
    CHECK(LaunchSelect(splan, sp, nullptr));
    CHECK(RunAttend(aplan, ap, nullptr));
  });
  r.step_graph_us = GraphUs(tm, reps, [&](cudaStream_t st) {
    CHECK(LaunchSelect(splan, sp, st));
    CHECK(RunAttend(aplan, ap, st));
  });

  // The whole step as runtime/cuda/ runs a decode layer (DESIGN.md
  // §4): append one new token a sequence into its tail page (the page's
  // summary folded), select pages only, resolve them against hbm_slot (every
  // head-page resident: all hits, with the runtime's plan: misses filled in
  // the attention, 16 MiB of staging), attend the resolved slots with the
  // tail's valid length. The append writes the same token at every call, so
  // every call sees the same K/V and summaries.
  void* const kv_pool = dense ? pool.p : spool.p;
  const size_t pool_slots = dense ? head_pages : sparse_slots;
  Dev knew(size_t(rows) * D * 2), vnew(size_t(rows) * D * 2);
  FillHalf<<<64, 256>>>(knew.as<__half>(), knew.bytes / 2, 15);
  FillHalf<<<64, 256>>>(vnew.as<__half>(), vnew.bytes / 2, 16);
  std::vector<int32_t> app_indptr(batch + 1), start_pos(batch, n * S - 1), last_len(batch, S);
  for (int b = 0; b <= batch; ++b) app_indptr[b] = b;
  Dev d_app(app_indptr.size() * 4), d_start(size_t(batch) * 4), d_last(size_t(batch) * 4);
  CHECK(cudaMemcpy(d_app.p, app_indptr.data(), app_indptr.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_start.p, start_pos.data(), start_pos.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_last.p, last_len.data(), last_len.size() * 4, cudaMemcpyHostToDevice));
  AppendParams app;
  app.kv_dtype = DType::kF16;
  app.summary_dtype = g_summary_dtype;
  app.batch = batch;
  app.kv_heads = H;
  app.page_size = S;
  app.head_dim = D;
  app.max_new_tokens = 1;
  app.append_indptr = d_app.as<int32_t>();
  app.start_pos = d_start.as<int32_t>();
  app.page_indptr = d_pind.as<int32_t>();
  app.page_ids = d_ids.as<uint32_t>();
  app.hbm_slot = d_hbm.as<int32_t>();
  app.k = knew.p;
  app.v = vnew.p;
  app.slots = kv_pool;
  app.summaries = summ.p;
  SelectParams wsp = sp;  // pages only: the resolve names the slots
  wsp.hbm_slot = nullptr;
  wsp.out_slots = nullptr;
  const size_t piece = size_t(S) * D * 2;
  const ResolveShape rshape{batch, H, S, D, DType::kF16, ColdMissPolicy::kDeadline, true, int((16u << 20) / (2 * piece))};
  ResolvePlan rplan;
  const int entries = splan.out_indptr.back();
  if (!PlanResolve(rshape, entries, 0, g_sms, g_sms, &rplan, &err)) std::fprintf(stderr, "%s\n", err.c_str()), std::exit(1);
  constexpr int kQueue = 1024;
  Dev last_use(pool_slots * 8), pinned(pool_slots), slot_page(pool_slots * 4), slot_head(pool_slots * 4),
      host_addr(size_t(batch) * n * sizeof(void*)), part_indptr(size_t(batch + 1) * 4), res_slots(size_t(entries) * 4),
      res_count(size_t(rows) * 4), queues(2 * kQueue * sizeof(ResolveRequest) + 8), counters(sizeof(ResolveCounters)),
      rws(rplan.workspace_bytes), o2(o.bytes);
  CHECK(cudaMemset(slot_page.p, 0xFF, slot_page.bytes));  // free: an all-hit step never reads it
  ResolveParams rp;
  rp.step = 1;
  rp.page_indptr = d_pind.as<int32_t>();
  rp.page_ids = d_ids.as<uint32_t>();
  rp.sel_indptr = d_oind.as<int32_t>();
  rp.sel_count = d_count.as<int32_t>();
  rp.sel_pages = d_pages.as<int32_t>();
  rp.host_addr = host_addr.as<const void* const>();
  rp.hbm_slot = d_hbm.as<int32_t>();
  rp.slot_page = slot_page.as<uint32_t>();
  rp.slot_head = slot_head.as<int32_t>();
  rp.slot_last_use = last_use.as<int64_t>();
  rp.slot_pinned = pinned.as<uint8_t>();
  rp.part_indptr = part_indptr.as<int32_t>();  // empty lists: no miss to place
  rp.part_slots = nullptr;
  rp.slots = kv_pool;
  rp.out_slots = res_slots.as<int32_t>();
  rp.out_count = res_count.as<int32_t>();
  char* qb = queues.as<char>();
  rp.cold = reinterpret_cast<ResolveRequest*>(qb);
  rp.bypass = reinterpret_cast<ResolveRequest*>(qb + kQueue * sizeof(ResolveRequest));
  rp.cold_count = reinterpret_cast<int32_t*>(qb + 2 * kQueue * sizeof(ResolveRequest));
  rp.bypass_count = rp.cold_count + 1;
  rp.queue_capacity = kQueue;
  rp.counters = counters.as<ResolveCounters>();
  rp.workspace = rws.p;
  AttendParams wap = ap;
  wap.count = res_count.as<int32_t>();
  wap.slot_ids = res_slots.as<int32_t>();
  wap.last_len = d_last.as<int32_t>();
  wap.fills = ResolveFills(rplan, rws.p).jobs;
  wap.o = o2.p;
  auto whole = [&](cudaStream_t st) {
    CHECK(LaunchAppend(app, st));
    CHECK(LaunchSelect(splan, wsp, st));
    CHECK(LaunchResolve(rplan, rp, st));
    CHECK(RunAttend(aplan, wap, st));
  };
  // Correctness before speed: after an append the select + attend above
  // (slots from the select) and the whole step (slots from the resolve) read
  // the same head-pages in the same order, so their outputs agree bit for
  // bit, and the resolve found every selected head-page resident.
  whole(nullptr);
  CHECK(LaunchSelect(splan, sp, nullptr));
  CHECK(RunAttend(aplan, ap, nullptr));
  {
    std::vector<uint8_t> a(o.bytes), b(o.bytes);
    std::vector<int32_t> c1(rows), c2(rows);
    CHECK(cudaMemcpy(a.data(), o.p, o.bytes, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(b.data(), o2.p, o.bytes, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(c1.data(), d_count.p, rows * 4, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(c2.data(), res_count.p, rows * 4, cudaMemcpyDeviceToHost));
    ResolveCounters rc;
    CHECK(cudaMemcpy(&rc, counters.p, sizeof rc, cudaMemcpyDeviceToHost));
    if (a != b || c1 != c2 || rc.hits != rc.selected || rc.selected == 0) {
      std::fprintf(stderr, "whole step %s b=%d ctx=%lld: outputs or counts differ from select + attend (hits %llu of %llu)\n",
                   g.name, batch, context, rc.hits, rc.selected);
      std::exit(1);
    }
  }
  r.append_us = tm.MedianUs(reps, [&] { CHECK(LaunchAppend(app, nullptr)); });
  r.resolve_us = tm.MedianUs(reps, [&] { CHECK(LaunchResolve(rplan, rp, nullptr)); });
  r.whole_us = tm.MedianUs(reps, [&] { whole(nullptr); });
  r.whole_graph_us = GraphUs(tm, reps, whole);
  if (dense) {
    std::vector<int32_t> dind(rows + 1);
    for (int i = 0; i <= rows; ++i) dind[i] = i * n;
    Dev d_dind(dind.size() * 4), d_dslots(head_pages * 4);
    CHECK(cudaMemcpy(d_dind.p, dind.data(), dind.size() * 4, cudaMemcpyHostToDevice));
    // Row r = (b, h) holds page i's slot (b*n + i)*H + h.
    std::vector<int32_t> ds(head_pages);
    for (int b = 0; b < batch; ++b)
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < n; ++i) ds[(size_t(b) * H + h) * n + i] = int32_t((size_t(b) * n + i) * H + h);
    CHECK(cudaMemcpy(d_dslots.p, ds.data(), ds.size() * 4, cudaMemcpyHostToDevice));
    AttendPlan dplan;
    if (!PlanAttend(as, n, g_sms, &dplan, &err)) std::fprintf(stderr, "%s\n", err.c_str()), std::exit(1);
    Dev dws(dplan.workspace_bytes);
    AttendParams dp = ap;
    dp.indptr = d_dind.as<int32_t>();
    dp.count = nullptr;
    dp.slot_ids = d_dslots.as<int32_t>();
    dp.workspace = dws.p;
    r.dense_us = tm.MedianUs(reps, [&] { CHECK(RunAttend(dplan, dp, nullptr)); });
    r.dense_graph_us = GraphUs(tm, reps, [&](cudaStream_t st) { CHECK(RunAttend(dplan, dp, st)); });
  }
  CHECK(cudaDeviceSynchronize());
  return r;
}

void BenchSteps(Timer& tm, int reps) {
  const int budget = 2048;
  for (const Geo& g : kGeos)
    for (int batch : {1, 16})
      for (long long ctx : {8192LL, 32768LL, 131072LL, 524288LL, 1048576LL}) {
        const double kv_bytes = double(batch) * ctx * g.kv_heads * D * 2 * 2;
        if (kv_bytes > 40e9) continue;  // dense pool must fit comfortably
        const StepResult r = BenchStep(tm, g, batch, ctx, budget, reps, true);
        const double rho = 1.0 / S + double(budget) / ctx;
        const double speedup = r.dense_us / r.step_us;
        const double dense_tbs = kv_bytes / r.dense_us / 1e6;
        const double sel_tbs = r.summary_bytes / r.select_us / 1e6;
        Json("{\"bench\":\"step\",\"geometry\":\"%s\",\"batch\":%d,\"context\":%lld,\"budget\":%d,\"select_us\":%.2f,"
             "\"attend_us\":%.2f,\"step_us\":%.2f,\"dense_us\":%.2f,\"dense_tb_s\":%.3f,\"select_summary_tb_s\":%.3f,"
             "\"speedup\":%.3f,\"ideal\":%.3f,\"step_graph_us\":%.2f,\"dense_graph_us\":%.2f,\"speedup_graph\":%.3f,"
             "\"append_us\":%.2f,\"resolve_us\":%.2f,\"whole_us\":%.2f,\"whole_graph_us\":%.2f,\"whole_speedup\":%.3f,"
             "\"whole_speedup_graph\":%.3f}",
             g.name, batch, ctx, budget, r.select_us, r.attend_us, r.step_us, r.dense_us, dense_tbs, sel_tbs, speedup,
             1.0 / rho, r.step_graph_us, r.dense_graph_us, r.dense_graph_us / r.step_graph_us, r.append_us,
             r.resolve_us, r.whole_us, r.whole_graph_us, r.dense_us / r.whole_us, r.dense_graph_us / r.whole_graph_us);
        char line[512];
        std::snprintf(line, sizeof line,
                      "step    %-9s b=%-2d ctx=%-7lld append %5.1f select %7.1f us (%4.2f TB/s) resolve %5.1f attend %6.1f  "
                      "whole %7.1f (select+attend %7.1f)  dense %8.1f us (%4.2f TB/s)  speedup %5.2fx ideal %5.2fx  "
                      "graph: whole %7.1f dense %8.1f %5.2fx",
                      g.name, batch, ctx, r.append_us, r.select_us, sel_tbs, r.resolve_us, r.attend_us, r.whole_us,
                      r.step_us, r.dense_us, dense_tbs, r.dense_us / r.whole_us, 1.0 / rho, r.whole_graph_us,
                      r.dense_graph_us, r.dense_graph_us / r.whole_graph_us);
        g_table.push_back(line);
      }
  // Select alone where the dense pool would not fit.
  for (const Geo& g : kGeos)
    for (int batch : {1, 16})
      for (long long ctx : {131072LL, 524288LL, 1048576LL}) {
        const double kv_bytes = double(batch) * ctx * g.kv_heads * D * 2 * 2;
        if (kv_bytes <= 40e9) continue;
        const StepResult r = BenchStep(tm, g, batch, ctx, budget, reps, false);
        const double sel_tbs = r.summary_bytes / r.select_us / 1e6;
        Json("{\"bench\":\"select\",\"geometry\":\"%s\",\"batch\":%d,\"context\":%lld,\"budget\":%d,\"select_us\":%.2f,"
             "\"attend_us\":%.2f,\"step_us\":%.2f,\"select_summary_tb_s\":%.3f,\"step_graph_us\":%.2f,"
             "\"append_us\":%.2f,\"resolve_us\":%.2f,\"whole_us\":%.2f,\"whole_graph_us\":%.2f}",
             g.name, batch, ctx, budget, r.select_us, r.attend_us, r.step_us, sel_tbs, r.step_graph_us, r.append_us,
             r.resolve_us, r.whole_us, r.whole_graph_us);
        char line[400];
        std::snprintf(line, sizeof line,
                      "select  %-9s b=%-2d ctx=%-7lld append %5.1f select %7.1f us (%4.2f TB/s) resolve %5.1f attend %6.1f  "
                      "whole %7.1f (select+attend %7.1f)  graph whole %7.1f  (no dense: KV > 40 GB)",
                      g.name, batch, ctx, r.append_us, r.select_us, sel_tbs, r.resolve_us, r.attend_us, r.whole_us,
                      r.step_us, r.whole_graph_us);
        g_table.push_back(line);
      }
}

// "8192,32768" -> {8192, 32768} (--select-only's --contexts and --batches).
template <typename T> std::vector<T> CommaList(char* arg) {
  std::vector<T> v;
  for (char* t = std::strtok(arg, ","); t; t = std::strtok(nullptr, ",")) v.push_back(T(std::atoll(t)));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  const char* json = "gpu_kernels_bench.json";
  int reps = 20;
  bool select_only = false, attend_only = false;
  std::vector<long long> select_contexts = {8192, 32768, 131072};
  std::string select_geo;  // empty: every geometry
  std::vector<int> select_batches = {1, 16};
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--select-only")) select_only = true;
    else if (!std::strcmp(argv[i], "--attend-only")) attend_only = true;
    else if (!std::strcmp(argv[i], "--contexts") && i + 1 < argc) select_contexts = CommaList<long long>(argv[++i]);
    else if (!std::strcmp(argv[i], "--geometry") && i + 1 < argc) select_geo = argv[++i];  // the -only modes
    else if (!std::strcmp(argv[i], "--batches") && i + 1 < argc) select_batches = CommaList<int>(argv[++i]);
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--split-long-rows")) g_split_long_rows = true;
    else if (!std::strcmp(argv[i], "--mma-scores")) g_mma_scores = true;
    else if (!std::strcmp(argv[i], "--summary-dtype") && i + 1 < argc) {
      const char* v = argv[++i];
      if (!std::strcmp(v, "f16")) g_summary_dtype = DType::kF16;
      else if (!std::strcmp(v, "e4m3")) g_summary_dtype = DType::kE4M3;
      else return std::fprintf(stderr, "--summary-dtype %s: f16 or e4m3\n", v), 1;
    }
  }
  g_json = std::fopen(json, "w");
  if (!g_json) return std::perror(json), 1;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  g_sms = prop.multiProcessorCount;
  std::printf("device: %s, %d SMs, L2 %d MiB\n", prop.name, g_sms, prop.l2CacheSize >> 20);
  Json("{\"bench\":\"device\",\"name\":\"%s\",\"sms\":%d,\"summary_dtype\":\"%s\",\"mma_scores\":%d}", prop.name,
       g_sms, DTypeName(g_summary_dtype), int(g_mma_scores));
  if (g_summary_dtype != DType::kF16) std::printf("summaries: %s\n", DTypeName(g_summary_dtype));
  if (g_mma_scores) std::printf("scores: tensor cores (mma)\n");
  Timer tm;
  if (select_only) {  // quick A/B of select: no dense pools, no attention sweep
    for (const Geo& g : kGeos)
      for (int batch : select_batches)
        for (long long ctx : select_contexts) {
          if (!select_geo.empty() && select_geo != g.name) continue;
          const StepResult r = BenchStep(tm, g, batch, ctx, 2048, reps, false);
          std::printf("select  %-9s b=%-2d ctx=%-7lld select %7.1f us  attend %6.1f  step %7.1f  graph step %7.1f  "
                      "append %5.1f resolve %5.1f whole %7.1f graph whole %7.1f\n",
                      g.name, batch, ctx, r.select_us, r.attend_us, r.step_us, r.step_graph_us, r.append_us,
                      r.resolve_us, r.whole_us, r.whole_graph_us);
          Json("{\"bench\":\"select\",\"geometry\":\"%s\",\"batch\":%d,\"context\":%lld,\"select_us\":%.2f,"
               "\"attend_us\":%.2f,\"step_us\":%.2f,\"step_graph_us\":%.2f,\"append_us\":%.2f,\"resolve_us\":%.2f,"
               "\"whole_us\":%.2f,\"whole_graph_us\":%.2f}",
               g.name, batch, ctx, r.select_us, r.attend_us, r.step_us, r.step_graph_us, r.append_us, r.resolve_us,
               r.whole_us, r.whole_graph_us);
        }
    std::fclose(g_json);
    return 0;
  }
  const double copy = CopyBandwidth(tm);
  if (attend_only) {
    BenchAttend(tm, reps, select_geo, select_batches);
    for (const auto& l : g_table) std::printf("%s\n", l.c_str());
    std::fclose(g_json);
    return 0;
  }
  BenchAttend(tm, reps);
  BenchSteps(tm, reps);
  std::printf("\n== questkv GPU kernels (fp16 K/V, %s summaries, D=128, S=16, budget 2048 in steps; medians, "
              "cold L2) ==\n",
              DTypeName(g_summary_dtype));
  std::printf("copy %.3f TB/s read+write; judge read-mostly kernels against ~4.6 TB/s\n", copy);
  for (const auto& l : g_table) std::printf("%s\n", l.c_str());
  std::fclose(g_json);
  return 0;
}
