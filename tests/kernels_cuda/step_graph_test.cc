// One decode layer's whole device step (DESIGN.md §4) — LaunchAppend (one new
// token per sequence into its tail page, summary updated), LaunchSelect,
// LaunchResolve (hits; misses gathered zero-copy from homes in mapped pinned
// host memory, evicting LRU slots of per-sequence partition lists named by
// part_lists), RunAttend (with last_len) — on one stream, captured in a CUDA
// graph: a layer's step captured in a CUDA graph and replayed gives the same
// result. Two identical copies of the layer's device state: one is
// stepped by the graph, the other by direct launches of the same chain, and
// after every step the outputs, residency tables, partition lists, counters,
// summaries and the whole slot pool must be equal bit for bit:
//   step 0  capture, instantiate, launch  vs  direct launch
//   step 1  replay of the same graph after new K/V/q/start/last_len were
//           written into the same buffers; ResolveParams::step is captured by
//           value, so the direct launch uses the same step value
//   step 2  the chain recaptured with step + 1 and swapped into the
//           instantiated graph with cudaGraphExecUpdate (an engine's way to
//           advance the step without re-instantiating)
// and the selections equal the CPU policy (ScorePagesCpu + TopKCpu, sink,
// local window) and the attention output agrees with AttendPagesCpu over the
// selected pages within 2e-3 relative (f16).
// With misses filled in attention (ResolveShape::fill_in_attention: no gather
// kernel, the attention reads each miss from its home and stores it into its
// slot) a third copy `u` is stepped the other way (resolve's gather, then
// attention over slots only): outputs, tables, lists, counters and the slot
// pool must equal it bit for bit, the resolved entries once the fetched ones
// (~job) are read as the slots their jobs fill.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "kernels/attention_state.h"
#include "kernels/cpu/kernels_cpu.h"
#include "tests/kernels_cuda/cuda_test_util.h"
#include "tests/testing/reference.h"

namespace questkv::kernels::cuda::test {
namespace {

constexpr int kB = 3, kH = 2, kG = 4, kD = 128, kS = 16;
constexpr int kRows = kB * kH;
constexpr DType kKv = DType::kF16;
constexpr int64_t kPageBudget = 8;
constexpr int kSink = 1, kLocal = 2;
constexpr int kSteps = 3;
constexpr int64_t kStep0 = 40;  // ResolveParams::step of steps 0 and 1; step 2 uses kStep0 + 1
// Tokens before step 0; after steps 0, 1, 2 the sequences hold 1/17/4099,
// 2/18/4100 and 3/19/4101 tokens: no step opens a new page, so one plan (and
// one graph) serves all three.
constexpr int kTokensBefore[kB] = {0, 16, 4098};
constexpr std::size_t kPageElems = std::size_t(2) * kH * kS * kD;  // [2][Hkv][S][D]
constexpr std::size_t kPiece = std::size_t(kS) * kD * 2;           // one head-page's K (f16), bytes

// Owns a mapped pinned allocation (homes of sealed pages).
struct MappedHost {
  void* host = nullptr;
  void* device = nullptr;
  explicit MappedHost(std::size_t bytes) {
    if (cudaHostAlloc(&host, bytes, cudaHostAllocMapped) == cudaSuccess) cudaHostGetDevicePointer(&device, host, 0);
  }
  ~MappedHost() { cudaFreeHost(host); }
  MappedHost(const MappedHost&) = delete;
  MappedHost& operator=(const MappedHost&) = delete;
};

// Writes `host` into an existing buffer without reallocating it: the graph
// captured its address.
template <typename T>
void Overwrite(DeviceBuffer& buf, const std::vector<T>& host) {
  ASSERT_EQ(buf.bytes(), host.size() * sizeof(T));
  ASSERT_EQ(cudaMemcpy(buf.get(), host.data(), buf.bytes(), cudaMemcpyHostToDevice), cudaSuccess);
}

// First difference of two equal-length arrays, as a failure naming `what`.
template <typename T>
void ExpectSame(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  std::size_t first = got.size(), n = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      if (first == got.size()) first = i;
      ++n;
    }
  if (n) ADD_FAILURE() << what << ": " << n << " of " << got.size() << " elements differ, first at " << first;
}

// The host's view of the layer: the page table, the truth of every page's
// K/V and summary (f16-exact floats), the slots' initial contents.
struct Layer {
  std::vector<int32_t> page_counts, page_indptr;
  std::vector<uint32_t> page_ids;
  int id_space = 0;
  std::vector<float> kv;    // [id][2][Hkv][S][D]
  std::vector<float> slab;  // [id][Hkv][2][D]
  std::vector<int> tail_len;  // valid tokens of each sequence's tail page
  // Initial tables.
  std::vector<int32_t> hbm_slot;
  std::vector<uint32_t> slot_page;
  std::vector<int32_t> slot_head;
  std::vector<int64_t> last_use;
  std::vector<uint8_t> pinned;
  std::vector<int32_t> part_indptr;
  std::vector<std::vector<int32_t>> lists;
  std::vector<uint8_t> pool;  // [slot][2][S][D] f16

  uint32_t tail_id(int b) const { return page_ids[page_indptr[b + 1] - 1]; }
  const float* k_rows(uint32_t id, int h) const { return kv.data() + id * kPageElems + std::size_t(h) * kS * kD; }
  const float* v_rows(uint32_t id, int h) const {
    return kv.data() + id * kPageElems + std::size_t(kH + h) * kS * kD;
  }
  // A slot's bytes: the head-page's K and V rows; rows at or past `len` NaN.
  std::vector<uint8_t> SlotBytes(uint32_t id, int h, int len) const {
    std::vector<float> x(std::size_t(2) * kS * kD, NAN);
    std::copy(k_rows(id, h), k_rows(id, h) + std::size_t(len) * kD, x.begin());
    std::copy(v_rows(id, h), v_rows(id, h) + std::size_t(len) * kD, x.begin() + kS * kD);
    return Encode(x, kKv);
  }
};

Layer BuildLayer(DType sum_dtype, std::mt19937& rng) {
  Layer L;
  L.page_indptr.push_back(0);
  for (int b = 0; b < kB; ++b) {
    L.page_counts.push_back(kTokensBefore[b] / kS + 1);  // sealed pages + the tail (none fills up)
    L.page_indptr.push_back(L.page_indptr.back() + L.page_counts.back());
    L.tail_len.push_back(kTokensBefore[b] % kS);
  }
  const int pages = L.page_indptr[kB];
  L.id_space = pages + 7;  // ids scattered over a larger space
  std::vector<uint32_t> perm(L.id_space);
  std::iota(perm.begin(), perm.end(), 0u);
  std::shuffle(perm.begin(), perm.end(), rng);
  L.page_ids.assign(perm.begin(), perm.begin() + pages);

  // K/V: normal; a dozen "hot" pages of sequence 2 have keys of twice the
  // spread, so their min/max boxes win the top-K for any query and steps
  // choose among them (hits and misses both happen).
  L.kv = questkv::test::RandomNormal(std::size_t(L.id_space) * kPageElems, rng());
  std::set<int> hot;
  while (hot.size() < 12) hot.insert(1 + int(rng() % (L.page_counts[2] - 1 - kLocal)));
  for (int i : hot) {
    float* page = L.kv.data() + std::size_t(L.page_ids[L.page_indptr[2] + i]) * kPageElems;
    for (std::size_t j = 0; j < std::size_t(kH) * kS * kD; ++j) page[j] *= 2.f;  // K half of the page
  }
  L.kv = RoundTo(L.kv, kKv);
  L.slab.assign(std::size_t(L.id_space) * kH * 2 * kD, 0.f);
  for (int id = 0; id < L.id_space; ++id) ResetSummaryCpu(L.slab.data() + std::size_t(id) * kH * 2 * kD, kH, kD);
  for (int b = 0; b < kB; ++b)
    for (int i = 0; i < L.page_counts[b]; ++i) {
      const uint32_t id = L.page_ids[L.page_indptr[b] + i];
      const int len = i + 1 < L.page_counts[b] ? kS : L.tail_len[b];
      RebuildSummaryCpu(L.kv.data() + id * kPageElems, L.slab.data() + std::size_t(id) * kH * 2 * kD, kH, kS, kD, len);
    }
  L.slab = RoundTo(L.slab, sum_dtype);  // exact: min/max of f16 values (and +-inf)

  // Slots: per sequence Hkv pinned tails and a cache partition — sequence 0
  // one empty slot, sequence 1 its sealed page's head 0 and two empty slots
  // (head 1 misses into one), sequence 2 28 slots all holding head-pages
  // (8 hot, 20 cold) so every miss evicts. 28 >= 2 x 14 selected sealed
  // head-pages per step: even when step 1 reuses step 0's step value (its
  // slots are not victims then) no miss is left without a slot.
  struct Desc {
    int part;
    uint32_t page;
    int head;
    bool pin;
    int64_t use;
  };
  std::vector<Desc> descs;
  for (int b = 0; b < kB; ++b)
    for (int h = 0; h < kH; ++h) descs.push_back({b, L.tail_id(b), h, true, -1});
  descs.push_back({0, resolve::kEmptySlot, 0, false, -1});
  descs.push_back({1, L.page_ids[L.page_indptr[1]], 0, false, -3});
  descs.push_back({1, resolve::kEmptySlot, 0, false, -1});
  descs.push_back({1, resolve::kEmptySlot, 1, false, -1});
  {
    std::set<std::pair<int, int>> cached;  // (logical page, head) of sequence 2
    const std::vector<int> hot_v(hot.begin(), hot.end());
    while (cached.size() < 8) cached.insert({hot_v[rng() % hot_v.size()], int(rng() % kH)});
    while (cached.size() < 28) {
      const int i = int(rng() % (L.page_counts[2] - 1));
      if (!hot.count(i)) cached.insert({i, int(rng() % kH)});
    }
    for (const auto& [i, h] : cached)
      descs.push_back({2, L.page_ids[L.page_indptr[2] + i], h, false, -1 - int64_t(rng() % 8)});
  }
  std::shuffle(descs.begin(), descs.end(), rng);  // slot numbers interleave the partitions
  const int slots = int(descs.size());
  L.hbm_slot.assign(std::size_t(L.id_space) * kH, -1);
  L.lists.assign(kB, {});
  L.pool.assign(std::size_t(slots) * 2 * kPiece, 0xEE);  // empty slots: garbage
  for (int s = 0; s < slots; ++s) {
    const Desc& d = descs[s];
    L.slot_page.push_back(d.page);
    L.slot_head.push_back(d.head);
    L.pinned.push_back(d.pin);
    L.last_use.push_back(d.use);
    L.lists[d.part].push_back(s);
    if (d.page == resolve::kEmptySlot) continue;
    L.hbm_slot[std::size_t(d.page) * kH + d.head] = s;
    int len = kS;
    for (int b = 0; b < kB; ++b)
      if (d.page == L.tail_id(b)) len = L.tail_len[b];
    const std::vector<uint8_t> bytes = L.SlotBytes(d.page, d.head, len);
    std::memcpy(L.pool.data() + std::size_t(s) * 2 * kPiece, bytes.data(), bytes.size());
  }
  L.part_indptr.push_back(0);
  for (auto& list : L.lists) {
    std::shuffle(list.begin(), list.end(), rng);
    L.part_indptr.push_back(L.part_indptr.back() + int32_t(list.size()));
  }
  return L;
}

// select.cc's policy for one sequence (all KV heads), from float inputs (as
// in select_cuda_test.cc, GQA max).
std::vector<std::vector<int>> CpuSelect(const float* q, const float* slab, const uint32_t* ids, int n) {
  std::vector<std::vector<int>> rows(kH);
  if (kPageBudget >= n) {
    for (auto& r : rows) r.resize(n), std::iota(r.begin(), r.end(), 0);
    return rows;
  }
  std::vector<uint8_t> skip(n, 0);
  for (int i = 0; i < std::min(kSink, n); ++i) skip[i] = 1;
  for (int i = n - std::min(kLocal, n); i < n; ++i) skip[i] = 1;
  const int k = int(std::max<int64_t>(0, kPageBudget - std::count(skip.begin(), skip.end(), 1)));
  std::vector<float> scores(std::size_t(kG) * n), agg(n);
  std::vector<int> chosen(n), scratch(n);
  for (int h = 0; h < kH; ++h) {
    ScorePagesCpu(q + std::size_t(h) * kG * kD, kG, kD, slab, kH, h, ids, n, scores.data());
    agg.assign(scores.begin(), scores.begin() + n);
    for (int g = 1; g < kG; ++g)
      for (int i = 0; i < n; ++i) agg[i] = std::max(agg[i], scores[std::size_t(g) * n + i]);
    std::vector<uint8_t> mark(skip);
    const int got = TopKCpu(agg.data(), n, skip.data(), k, chosen.data(), scratch.data());
    for (int i = 0; i < got; ++i) mark[chosen[i]] = 1;
    for (int i = 0; i < n; ++i)
      if (mark[i]) rows[h].push_back(i);
  }
  return rows;
}

// Inputs every copy reads (never written by the step).
struct Inputs {
  DeviceBuffer page_indptr, page_ids, host_addr, pinned, part_indptr, sel_indptr;
  DeviceBuffer append_indptr, start_pos, k, v, q, last_len;  // rewritten in place between steps
};

// One copy of the layer's mutable device state and the step's outputs.
struct State {
  DeviceBuffer pool, summaries, hbm_slot, slot_page, slot_head, last_use, counters;
  DeviceBuffer list[kB], lists;
  DeviceBuffer sel_pages, sel_count, res_slots, res_count, cold, bypass, cold_count, bypass_count;
  DeviceBuffer sel_ws, res_ws, att_ws, o, lse;
};

struct Plans {
  SelectPlan select;
  ResolvePlan resolve;
  AttendPlan attend;
  DType sum_dtype;
  int queue_capacity;
};

struct StepParam {
  DType sum_dtype;
  bool fill_in_attention;
  int stage_pages;  // ResolveShape::stage_pages
};

void InitState(const Layer& L, const Plans& P, State& st) {
  Upload(st.pool, L.pool);
  Upload(st.summaries, Encode(L.slab, P.sum_dtype));
  Upload(st.hbm_slot, L.hbm_slot);
  Upload(st.slot_page, L.slot_page);
  Upload(st.slot_head, L.slot_head);
  Upload(st.last_use, L.last_use);
  st.counters.Resize(sizeof(ResolveCounters));
  ASSERT_EQ(cudaMemset(st.counters.get(), 0, st.counters.bytes()), cudaSuccess);
  std::vector<int32_t*> ptrs;
  for (int b = 0; b < kB; ++b) {
    Upload(st.list[b], L.lists[b]);  // each partition's list in its own allocation
    ptrs.push_back(st.list[b].as<int32_t>());
  }
  Upload(st.lists, ptrs);
  const int nnz = P.select.out_indptr.back();
  Upload(st.sel_pages, std::vector<int32_t>(nnz, -7));  // poison
  Upload(st.sel_count, std::vector<int32_t>(kRows, -7));
  Upload(st.res_slots, std::vector<int32_t>(nnz, -7));
  Upload(st.res_count, std::vector<int32_t>(kRows, -7));
  Upload(st.cold, std::vector<ResolveRequest>(P.queue_capacity, ResolveRequest{0, -1, -1, -1}));
  Upload(st.bypass, std::vector<ResolveRequest>(P.queue_capacity, ResolveRequest{0, -1, -1, -1}));
  Upload(st.cold_count, std::vector<int32_t>{-7});
  Upload(st.bypass_count, std::vector<int32_t>{-7});
  st.sel_ws.Resize(std::max<std::size_t>(P.select.workspace_bytes, 1));
  st.res_ws.Resize(std::max<std::size_t>(P.resolve.workspace_bytes, 1));
  st.att_ws.Resize(std::max<std::size_t>(P.attend.workspace_bytes, 1));
  ASSERT_EQ(cudaMemset(st.sel_ws.get(), 0xA5, st.sel_ws.bytes()), cudaSuccess);
  ASSERT_EQ(cudaMemset(st.res_ws.get(), 0xA5, st.res_ws.bytes()), cudaSuccess);
  ASSERT_EQ(cudaMemset(st.att_ws.get(), 0, st.att_ws.bytes()), cudaSuccess);  // RunAttend's counters start at zero
  Upload(st.o, Encode(std::vector<float>(std::size_t(kRows) * kG * kD, NAN), kKv));  // poison
  Upload(st.lse, std::vector<float>(std::size_t(kRows) * kG, NAN));
}

// The step's four launches on `stream`, in order; nothing else.
cudaError_t LaunchStep(const Plans& P, const Inputs& in, const State& st, int64_t step, cudaStream_t stream) {
  AppendParams ap;
  ap.kv_dtype = kKv;
  ap.summary_dtype = P.sum_dtype;
  ap.batch = kB;
  ap.kv_heads = kH;
  ap.page_size = kS;
  ap.head_dim = kD;
  ap.max_new_tokens = 1;
  ap.append_indptr = in.append_indptr.as<int32_t>();
  ap.start_pos = in.start_pos.as<int32_t>();
  ap.page_indptr = in.page_indptr.as<int32_t>();
  ap.page_ids = in.page_ids.as<uint32_t>();
  ap.hbm_slot = st.hbm_slot.as<int32_t>();
  ap.k = in.k.get();
  ap.v = in.v.get();
  ap.slots = st.pool.get();
  ap.summaries = st.summaries.get();
  if (const cudaError_t e = LaunchAppend(ap, stream); e != cudaSuccess) return e;

  SelectParams sp;
  sp.shape.batch = kB;
  sp.shape.kv_heads = kH;
  sp.shape.group = kG;
  sp.shape.head_dim = kD;
  sp.shape.page_size = kS;
  sp.shape.page_budget = kPageBudget;
  sp.shape.sink_pages = kSink;
  sp.shape.local_pages = kLocal;
  sp.shape.gqa = GqaMode::kMax;
  sp.q_dtype = kKv;
  sp.summary_dtype = P.sum_dtype;
  sp.q = in.q.get();
  sp.summaries = st.summaries.get();
  sp.page_indptr = in.page_indptr.as<int32_t>();
  sp.page_ids = in.page_ids.as<uint32_t>();
  sp.out_indptr = in.sel_indptr.as<int32_t>();
  sp.out_pages = st.sel_pages.as<int32_t>();
  sp.out_count = st.sel_count.as<int32_t>();
  sp.workspace = st.sel_ws.get();
  if (const cudaError_t e = LaunchSelect(P.select, sp, stream); e != cudaSuccess) return e;

  ResolveParams rp;
  rp.step = step;
  rp.page_indptr = in.page_indptr.as<int32_t>();
  rp.page_ids = in.page_ids.as<uint32_t>();
  rp.sel_indptr = in.sel_indptr.as<int32_t>();
  rp.sel_count = st.sel_count.as<int32_t>();
  rp.sel_pages = st.sel_pages.as<int32_t>();
  rp.host_addr = in.host_addr.as<const void*>();
  rp.hbm_slot = st.hbm_slot.as<int32_t>();
  rp.slot_page = st.slot_page.as<uint32_t>();
  rp.slot_head = st.slot_head.as<int32_t>();
  rp.slot_last_use = st.last_use.as<int64_t>();
  rp.slot_pinned = in.pinned.as<uint8_t>();
  rp.part_indptr = in.part_indptr.as<int32_t>();
  rp.part_slots = nullptr;
  rp.part_lists = st.lists.as<int32_t* const>();
  rp.slots = st.pool.get();
  rp.out_slots = st.res_slots.as<int32_t>();
  rp.out_count = st.res_count.as<int32_t>();
  rp.cold = st.cold.as<ResolveRequest>();
  rp.cold_count = st.cold_count.as<int32_t>();
  rp.bypass = st.bypass.as<ResolveRequest>();
  rp.bypass_count = st.bypass_count.as<int32_t>();
  rp.queue_capacity = P.queue_capacity;
  rp.counters = st.counters.as<ResolveCounters>();
  rp.workspace = st.res_ws.get();
  if (const cudaError_t e = LaunchResolve(P.resolve, rp, stream); e != cudaSuccess) return e;

  AttendParams at;
  if (P.resolve.shape.fill_in_attention) at.fills = ResolveFills(P.resolve, st.res_ws.get()).jobs;
  at.scale = 1.f / std::sqrt(float(kD));
  at.q = in.q.get();
  at.slots = st.pool.get();
  at.indptr = in.sel_indptr.as<int32_t>();
  at.count = st.res_count.as<int32_t>();
  at.slot_ids = st.res_slots.as<int32_t>();
  at.last_len = in.last_len.as<int32_t>();
  at.o = st.o.get();
  at.lse = st.lse.as<float>();
  at.workspace = st.att_ws.get();
  return RunAttend(P.attend, at, stream);
}

// Everything a step leaves on the device, read back.
struct Snapshot {
  std::vector<uint8_t> pool, summaries, o, counters;
  std::vector<float> lse;
  std::vector<int32_t> hbm_slot, slot_head, sel_pages, sel_count, res_slots, res_count, queues;
  std::vector<uint32_t> slot_page;
  std::vector<int64_t> last_use;
  std::vector<std::vector<int32_t>> lists;
};

Snapshot Take(const Layer& L, const State& st) {
  Snapshot s;
  const std::size_t slots = L.slot_page.size();
  s.pool = Download<uint8_t>(st.pool, st.pool.bytes());
  s.summaries = Download<uint8_t>(st.summaries, st.summaries.bytes());
  s.o = Download<uint8_t>(st.o, st.o.bytes());
  s.counters = Download<uint8_t>(st.counters, sizeof(ResolveCounters));
  s.lse = Download<float>(st.lse, st.lse.bytes() / 4);
  s.hbm_slot = Download<int32_t>(st.hbm_slot, L.hbm_slot.size());
  s.slot_page = Download<uint32_t>(st.slot_page, slots);
  s.slot_head = Download<int32_t>(st.slot_head, slots);
  s.last_use = Download<int64_t>(st.last_use, slots);
  s.sel_pages = Download<int32_t>(st.sel_pages, st.sel_pages.bytes() / 4);
  s.sel_count = Download<int32_t>(st.sel_count, kRows);
  s.res_slots = Download<int32_t>(st.res_slots, st.res_slots.bytes() / 4);
  s.res_count = Download<int32_t>(st.res_count, kRows);
  s.queues = {Download<int32_t>(st.cold_count, 1)[0], Download<int32_t>(st.bypass_count, 1)[0]};
  for (int b = 0; b < kB; ++b) s.lists.push_back(Download<int32_t>(st.list[b], L.lists[b].size()));
  return s;
}

// Resolved entries the attention fetched (~job) as the slots their jobs
// filled; returns how many there were, and in *staged how many of them it
// read from the resolve's staging (in its workspace) rather than a home.
int DecodeFills(const Plans& P, const State& st, Snapshot* s, int* staged = nullptr) {
  if (!P.resolve.shape.fill_in_attention) return 0;
  const ResolveFillList fills = ResolveFills(P.resolve, st.res_ws.get());
  int32_t n = 0;
  EXPECT_EQ(cudaMemcpy(&n, fills.count, 4, cudaMemcpyDeviceToHost), cudaSuccess);
  std::vector<GatherJob> jobs(std::max(n, 0));
  EXPECT_EQ(cudaMemcpy(jobs.data(), fills.jobs, jobs.size() * sizeof(GatherJob), cudaMemcpyDeviceToHost), cudaSuccess);
  int fetched = 0;
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < s->res_count[r]; ++j) {
      int32_t& id = s->res_slots[P.select.out_indptr[r] + j];
      if (id >= 0) continue;
      ++fetched;
      EXPECT_LT(~id, n) << "row " << r << " entry " << j;
      if (~id >= n) continue;
      const auto* ws = static_cast<const uint8_t*>(st.res_ws.get());
      const auto* k = static_cast<const uint8_t*>(jobs[~id].k);
      if (staged && k >= ws && k < ws + st.res_ws.bytes()) ++*staged;
      // No page is shared here: every fetch fills its own slot.
      const auto off = static_cast<const uint8_t*>(jobs[~id].dst) - static_cast<const uint8_t*>(st.pool.get());
      EXPECT_TRUE(jobs[~id].dst != nullptr && off % (2 * kPiece) == 0) << "row " << r << " entry " << j;
      id = int32_t(off / int64_t(2 * kPiece));
    }
  return fetched;
}

void ExpectSameSnapshot(const Snapshot& g, const Snapshot& d) {
  ExpectSame(g.o, d.o, "attention output (bytes)");
  ExpectSame(g.lse, d.lse, "lse");
  ExpectSame(g.sel_pages, d.sel_pages, "selected pages");
  ExpectSame(g.sel_count, d.sel_count, "selected counts");
  ExpectSame(g.res_slots, d.res_slots, "resolved slots");
  ExpectSame(g.res_count, d.res_count, "resolved counts");
  ExpectSame(g.hbm_slot, d.hbm_slot, "hbm_slot");
  ExpectSame(g.slot_page, d.slot_page, "slot_page");
  ExpectSame(g.slot_head, d.slot_head, "slot_head");
  ExpectSame(g.last_use, d.last_use, "slot_last_use");
  for (int b = 0; b < kB; ++b) ExpectSame(g.lists[b], d.lists[b], "partition list " + std::to_string(b));
  ExpectSame(g.counters, d.counters, "counters (bytes)");
  ExpectSame(g.queues, d.queues, "cold/bypass counts");
  ExpectSame(g.summaries, d.summaries, "summaries (bytes)");
  ExpectSame(g.pool, d.pool, "slot pool (bytes)");
}

// Owns a graph, its executable and a stream.
struct GraphHolder {
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ~GraphHolder() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    if (stream) cudaStreamDestroy(stream);
  }
};

class LayerStepGraphTest : public ::testing::TestWithParam<StepParam> {};

TEST_P(LayerStepGraphTest, CapturedStepEqualsDirectLaunchesAndCpu) {
  QKV_REQUIRE_GPU();
  const DType sum_dtype = GetParam().sum_dtype;
  const bool fill = GetParam().fill_in_attention;
  const int stage = GetParam().stage_pages;
  std::mt19937 rng(4242 + int(sum_dtype));
  Layer L = BuildLayer(sum_dtype, rng);
  const int slots = int(L.slot_page.size());

  Plans P;
  P.sum_dtype = sum_dtype;
  std::string err;
  SelectShape ss;
  ss.batch = kB;
  ss.kv_heads = kH;
  ss.group = kG;
  ss.head_dim = kD;
  ss.page_size = kS;
  ss.page_budget = kPageBudget;
  ss.sink_pages = kSink;
  ss.local_pages = kLocal;
  ss.gqa = GqaMode::kMax;
  ASSERT_TRUE(PlanSelect(ss, L.page_counts.data(), NumSms(), &P.select, &err)) << err;
  const int nnz = P.select.out_indptr.back();
  EXPECT_EQ(nnz, kH * (1 + 2 + int(kPageBudget)));  // kMax: exact row counts
  P.queue_capacity = nnz;
  const ResolveShape rs{kB, kH, kS, kD, kKv, ColdMissPolicy::kDeadline, fill, stage};
  ASSERT_TRUE(PlanResolve(rs, nnz, L.part_indptr.back(), NumSms(), 0, &P.resolve, &err)) << err;
  ASSERT_EQ(P.resolve.piece_bytes, kPiece);
  ASSERT_EQ(P.resolve.shape.fill_in_attention, fill);
  ASSERT_EQ(P.resolve.stage_cap, fill ? std::min(stage, nnz) : 0);
  AttendShape as;
  as.rows = kRows;
  as.kv_heads = kH;
  as.group = kG;
  as.head_dim = kD;
  as.page_size = kS;
  as.dtype = kKv;
  ASSERT_TRUE(PlanAttend(as, int(kPageBudget), NumSms(), &P.attend, &err)) << err;
  Plans PU = P;  // the third copy's: the resolve gathers its misses
  const ResolveShape rs_gather{kB, kH, kS, kD, kKv, ColdMissPolicy::kDeadline};
  ASSERT_TRUE(PlanResolve(rs_gather, nnz, L.part_indptr.back(), NumSms(), 0, &PU.resolve, &err)) << err;

  // Homes of the sealed pages, in mapped pinned memory: [2][Hkv][S][D] f16.
  const std::size_t page_bytes = kPageElems * 2;
  MappedHost homes(page_bytes * L.id_space);
  ASSERT_NE(homes.device, nullptr) << "cudaHostAlloc(cudaHostAllocMapped) / cudaHostGetDevicePointer failed";
  std::vector<const void*> host_addr(L.id_space, nullptr);  // tails and unused ids: none
  for (int b = 0; b < kB; ++b)
    for (int i = 0; i + 1 < L.page_counts[b]; ++i) {
      const uint32_t id = L.page_ids[L.page_indptr[b] + i];
      const std::vector<uint8_t> bytes =
          Encode(std::vector<float>(L.kv.begin() + id * kPageElems, L.kv.begin() + (id + 1) * kPageElems), kKv);
      std::memcpy(static_cast<uint8_t*>(homes.host) + id * page_bytes, bytes.data(), page_bytes);
      host_addr[id] = static_cast<uint8_t*>(homes.device) + id * page_bytes;
    }

  Inputs in;
  Upload(in.page_indptr, L.page_indptr);
  Upload(in.page_ids, L.page_ids);
  Upload(in.host_addr, host_addr);
  Upload(in.pinned, L.pinned);
  Upload(in.part_indptr, L.part_indptr);
  Upload(in.sel_indptr, P.select.out_indptr);
  Upload(in.append_indptr, std::vector<int32_t>{0, 1, 2, 3});
  Upload(in.start_pos, std::vector<int32_t>(kB, 0));
  Upload(in.k, std::vector<uint8_t>(std::size_t(kB) * kH * kD * 2, 0));
  Upload(in.v, std::vector<uint8_t>(std::size_t(kB) * kH * kD * 2, 0));
  Upload(in.q, std::vector<uint8_t>(std::size_t(kRows) * kG * kD * 2, 0));
  Upload(in.last_len, std::vector<int32_t>(kB, 1));

  // Identical copies: `g` stepped by the graph, `d` by direct launches, and
  // with fill_in_attention `u` by direct launches that gather instead.
  State g, d, u;
  ASSERT_NO_FATAL_FAILURE(InitState(L, P, g));
  ASSERT_NO_FATAL_FAILURE(InitState(L, P, d));
  if (fill) {
    ASSERT_NO_FATAL_FAILURE(InitState(L, PU, u));
  }
  int fetched_total = 0;
  QKV_CUDA_OK(cudaDeviceSynchronize());

  GraphHolder gh;
  QKV_CUDA_OK(cudaStreamCreateWithFlags(&gh.stream, cudaStreamNonBlocking));
  const cudaStream_t stream = gh.stream;
  uint64_t total_selected = 0;

  for (int step = 0; step < kSteps; ++step) {
    SCOPED_TRACE(::testing::Message() << "summaries " << DTypeName(sum_dtype) << ", step " << step);
    const int64_t step_value = step < 2 ? kStep0 : kStep0 + 1;

    // This step's inputs, written into the buffers the graph captured.
    std::vector<int32_t> start(kB), last_len(kB);
    for (int b = 0; b < kB; ++b) {
      start[b] = kTokensBefore[b] + step;
      last_len[b] = L.tail_len[b] + 1;
    }
    const std::vector<float> k = RoundTo(questkv::test::RandomNormal(std::size_t(kB) * kH * kD, 100 + step), kKv);
    const std::vector<float> v = RoundTo(questkv::test::RandomNormal(std::size_t(kB) * kH * kD, 200 + step), kKv);
    const std::vector<float> q = RoundTo(questkv::test::RandomNormal(std::size_t(kRows) * kG * kD, 300 + step), kKv);
    ASSERT_NO_FATAL_FAILURE(Overwrite(in.start_pos, start));
    ASSERT_NO_FATAL_FAILURE(Overwrite(in.last_len, last_len));
    ASSERT_NO_FATAL_FAILURE(Overwrite(in.k, Encode(k, kKv)));
    ASSERT_NO_FATAL_FAILURE(Overwrite(in.v, Encode(v, kKv)));
    ASSERT_NO_FATAL_FAILURE(Overwrite(in.q, Encode(q, kKv)));

    // The host truth takes the same token (AppendTokensCpu: the append twin).
    for (int b = 0; b < kB; ++b) {
      const uint32_t id = L.tail_id(b);
      AppendTokensCpu(L.kv.data() + id * kPageElems, L.slab.data() + std::size_t(id) * kH * 2 * kD, kH, kS, kD,
                      L.tail_len[b], k.data() + std::size_t(b) * kH * kD, v.data() + std::size_t(b) * kH * kD, 1);
      ++L.tail_len[b];
    }

    // Graph path on copy g.
    if (step == 0 || step == 2) {
      cudaGraph_t graph = nullptr;
      QKV_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      const cudaError_t launched = LaunchStep(P, in, g, step_value, stream);
      const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
      if (step == 0) gh.graph = graph;
      ASSERT_EQ(launched, cudaSuccess) << "launch during capture: " << cudaGetErrorString(launched) << " "
                                       << LastErrorMessage();
      ASSERT_EQ(ended, cudaSuccess) << "cudaStreamEndCapture: " << cudaGetErrorString(ended);
      if (step == 0) {
        QKV_CUDA_OK(cudaGraphInstantiate(&gh.exec, gh.graph, 0));
        size_t nodes = 0;
        QKV_CUDA_OK(cudaGraphGetNodes(gh.graph, nullptr, &nodes));
        EXPECT_GE(nodes, 4u) << "the captured step holds the four kernels' launches";
      } else {
        // Same topology, new step value: update the instantiated graph in place.
        cudaGraphExecUpdateResultInfo info{};
        const cudaError_t up = cudaGraphExecUpdate(gh.exec, graph, &info);
        cudaGraphDestroy(graph);
        ASSERT_EQ(up, cudaSuccess) << "cudaGraphExecUpdate: " << cudaGetErrorString(up) << ", result "
                                   << int(info.result);
      }
    }
    QKV_CUDA_OK(cudaGraphLaunch(gh.exec, stream));
    QKV_CUDA_OK(cudaStreamSynchronize(stream));
    QKV_CUDA_OK(cudaGetLastError());

    // Direct path on copy d, same stream, same step value.
    QKV_CUDA_OK(LaunchStep(P, in, d, step_value, stream));
    QKV_CUDA_OK(cudaStreamSynchronize(stream));
    QKV_CUDA_OK(cudaGetLastError());

    // (Fetch jobs are numbered in the order the sequences' assign blocks
    // ran: compare the slots they fill, not their numbers.)
    Snapshot sg = Take(L, g), sd = Take(L, d);
    int staged = 0;
    const int fetched = DecodeFills(P, g, &sg, &staged);
    EXPECT_EQ(DecodeFills(P, d, &sd), fetched);
    // The call's first stage_cap misses come from the staging, the rest from homes.
    EXPECT_EQ(staged, std::min(fetched, P.resolve.stage_cap)) << "fetched " << fetched;
    RecordProperty("fetched_staged_step" + std::to_string(step), std::to_string(fetched) + "/" + std::to_string(staged));
    fetched_total += fetched;
    ASSERT_NO_FATAL_FAILURE(ExpectSameSnapshot(sg, sd));
    if (fill) {  // the same step with the resolve's gather: the same bits
      QKV_CUDA_OK(LaunchStep(PU, in, u, step_value, stream));
      QKV_CUDA_OK(cudaStreamSynchronize(stream));
      QKV_CUDA_OK(cudaGetLastError());
      const Snapshot su = Take(L, u);
      EXPECT_TRUE(std::all_of(su.res_slots.begin(), su.res_slots.end(), [](int32_t x) { return x >= 0 || x == -7; }))
          << "a gathering resolve names slots only";
      ASSERT_NO_FATAL_FAILURE(ExpectSameSnapshot(sg, su));
    }
    if (HasFailure()) return;  // one step's differences are enough to read

    // ---- against the CPU ----------------------------------------------------
    // Append: the summaries equal the twin's, bit for bit.
    const std::vector<float> got_slab = Decode(sg.summaries, sum_dtype);
    ASSERT_EQ(got_slab.size(), L.slab.size());
    ASSERT_EQ(0, std::memcmp(got_slab.data(), L.slab.data(), L.slab.size() * 4)) << "summaries differ from the CPU twin";

    // Counters: everything placed, nothing on disk, nothing bypassed.
    ResolveCounters c;
    std::memcpy(&c, sg.counters.data(), sizeof(c));
    total_selected += uint64_t(nnz);
    EXPECT_EQ(c.selected, total_selected);
    EXPECT_EQ(c.misses_disk, 0u);
    EXPECT_EQ(c.bypasses, 0u);
    EXPECT_EQ(c.hits + c.misses_host, c.selected);
    EXPECT_EQ(c.bytes_host_to_hbm, c.misses_host * 2 * kPiece);
    EXPECT_EQ(sg.queues, (std::vector<int32_t>{0, 0}));

    // Residency: every cached head-page's cell names its slot and back.
    for (int s = 0; s < slots; ++s) {
      if (sg.slot_page[s] == resolve::kEmptySlot) continue;
      ASSERT_EQ(sg.hbm_slot[std::size_t(sg.slot_page[s]) * kH + sg.slot_head[s]], s) << "slot " << s;
    }
    for (std::size_t cell = 0; cell < sg.hbm_slot.size(); ++cell)
      if (sg.hbm_slot[cell] >= 0) {
        ASSERT_LT(sg.hbm_slot[cell], slots);
        ASSERT_EQ(sg.slot_page[sg.hbm_slot[cell]], uint32_t(cell / kH)) << "cell " << cell;
        ASSERT_EQ(sg.slot_head[sg.hbm_slot[cell]], int(cell % kH)) << "cell " << cell;
      }
    // Partition lists: still a permutation of the initial slots of each.
    for (int b = 0; b < kB; ++b) {
      std::vector<int32_t> a = sg.lists[b], w = L.lists[b];
      std::sort(a.begin(), a.end());
      std::sort(w.begin(), w.end());
      ASSERT_EQ(a, w) << "partition " << b;
    }
    // Slot contents: every cached sealed head-page holds its home's bytes,
    // every tail its valid rows (the new token included).
    for (int s = 0; s < slots; ++s) {
      if (sg.slot_page[s] == resolve::kEmptySlot) continue;
      int len = kS;
      for (int b = 0; b < kB; ++b)
        if (sg.slot_page[s] == L.tail_id(b)) len = L.tail_len[b];
      const std::vector<uint8_t> want = L.SlotBytes(sg.slot_page[s], sg.slot_head[s], len);
      const uint8_t* got = sg.pool.data() + std::size_t(s) * 2 * kPiece;
      const std::size_t rows_bytes = std::size_t(len) * kD * 2;
      ASSERT_EQ(0, std::memcmp(got, want.data(), rows_bytes)) << "slot " << s << " K";
      ASSERT_EQ(0, std::memcmp(got + kPiece, want.data() + kPiece, rows_bytes)) << "slot " << s << " V";
    }

    // Selection: the CPU policy over the twin's summaries.
    std::vector<float> got_o = Decode(sg.o, kKv);
    std::vector<float> want_o(std::size_t(kG) * kD), want_m(kG), want_d(kG);
    double worst = 0;
    for (int b = 0; b < kB; ++b) {
      const int n = L.page_counts[b];
      const auto want = CpuSelect(q.data() + std::size_t(b) * kH * kG * kD, L.slab.data(),
                                  L.page_ids.data() + L.page_indptr[b], n);
      for (int h = 0; h < kH; ++h) {
        const int r = b * kH + h, base = P.select.out_indptr[r];
        ASSERT_EQ(sg.sel_count[r], int(want[h].size())) << "row " << r;
        const std::vector<int> got(sg.sel_pages.begin() + base, sg.sel_pages.begin() + base + sg.sel_count[r]);
        ASSERT_EQ(got, want[h]) << "selection of row " << r;
        // Resolve: each entry's slot holds that head-page, in selection order.
        ASSERT_EQ(sg.res_count[r], sg.sel_count[r]) << "row " << r;
        for (int j = 0; j < sg.res_count[r]; ++j) {
          const int32_t s = sg.res_slots[base + j];
          ASSERT_TRUE(s >= 0 && s < slots) << "row " << r << " entry " << j;
          EXPECT_EQ(sg.slot_page[s], L.page_ids[L.page_indptr[b] + got[j]]) << "row " << r << " entry " << j;
          EXPECT_EQ(sg.slot_head[s], h) << "row " << r << " entry " << j;
        }
        // Attention: AttendPagesCpu over the selected head-pages.
        std::vector<HeadPageRef> refs;
        for (int i : want[h]) {
          const uint32_t id = L.page_ids[L.page_indptr[b] + i];
          refs.push_back({L.k_rows(id, h), L.v_rows(id, h), i + 1 == n ? L.tail_len[b] : kS});
        }
        AttendPagesCpu(q.data() + std::size_t(r) * kG * kD, kG, kD, refs.data(), int(refs.size()),
                       1.f / std::sqrt(float(kD)), want_o.data(), want_m.data(), want_d.data());
        for (int gq = 0; gq < kG; ++gq) {
          const double e =
              questkv::test::RelL2Error(got_o.data() + (std::size_t(r) * kG + gq) * kD, want_o.data() + gq * kD, kD);
          worst = std::max(worst, e);
          EXPECT_LE(e, 2e-3) << "row " << r << " query head " << gq;
          EXPECT_NEAR(sg.lse[r * kG + gq], StateLse(want_m[gq], want_d[gq]), 1e-4 * (1 + std::abs(want_m[gq])))
              << "row " << r << " query head " << gq;
        }
      }
    }
    RecordProperty("worst_rel_l2_step" + std::to_string(step), std::to_string(worst));
  }

  // Over the three steps the cache both hit and missed, and misses evicted.
  const Snapshot last = Take(L, g);
  ResolveCounters c;
  std::memcpy(&c, last.counters.data(), sizeof(c));
  EXPECT_GT(c.hits, 0u);
  EXPECT_GT(c.misses_host, 0u);
  EXPECT_GT(c.evictions, 0u);
  // Every miss of a fused step was fetched by the attention.
  EXPECT_EQ(uint64_t(fetched_total), fill ? c.misses_host : 0u);
  RecordProperty("hits", std::to_string(c.hits));
  RecordProperty("misses_host", std::to_string(c.misses_host));
  RecordProperty("evictions", std::to_string(c.evictions));
}

INSTANTIATE_TEST_SUITE_P(Summaries, LayerStepGraphTest,
                         // stage 0: every miss read from its home by the attention; 3: the
                         // first three of a call staged, the rest from homes; 4096: all staged
                         ::testing::Values(StepParam{DType::kF32, false, 0}, StepParam{DType::kF16, false, 0},
                                           StepParam{DType::kF32, true, 3}, StepParam{DType::kF16, true, 0},
                                           StepParam{DType::kF16, true, 4096}),
                         [](const ::testing::TestParamInfo<StepParam>& info) {
                           return std::string("summary_") + DTypeName(info.param.sum_dtype) +
                                  (info.param.fill_in_attention
                                       ? "_fill_in_attention_stage" + std::to_string(info.param.stage_pages)
                                       : "_gather");
                         });

}  // namespace
}  // namespace questkv::kernels::cuda::test
