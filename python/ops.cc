// PyTorch ops over questkv (DESIGN.md §8), registered with TORCH_LIBRARY as
// torch.ops.questkv.* and torch.classes.questkv.Runtime. Two surfaces:
//   * questkv owns the cache: a Runtime object (sequences, append, decode,
//     dense, stats) over questkv::Runtime;
//   * the engine owns its paged KV: update_summaries and select_pages, pure
//     functions of an engine's paged K cache and FlashInfer-style CSR page
//     tables, with the runtime's own selection rule (selector/select.h).
// Every questkv error becomes a RuntimeError carrying its message; shapes,
// dtypes, devices and contiguity are checked before anything changes.
#include <torch/custom_class.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <memory>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/kernels_cpu.h"
#include "questkv/runtime.h"
#include "runtime/engine_select.h"
#include "selector/select.h"

namespace questkv::torch_ops {
namespace {

using at::Tensor;

void Check(const Status& s) { TORCH_CHECK(s.ok(), s.ToString()); }
template <typename T>
T Value(Result<T> r) {
  Check(r.status());
  return std::move(r).value();
}

// A tensor the host API can read: float32, CPU, contiguous, of `shape`.
void CheckHostF32(const Tensor& t, const char* name, std::vector<int64_t> shape) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor (the CUDA path takes the model dtype on the GPU)");
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, not ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.sizes().vec() == shape, name, " has shape ", t.sizes(), ", expected ", at::IntArrayRef(shape));
}

// A tensor the device API can read: on the GPU, in the model dtype,
// contiguous, of `shape`.
void CheckDevice(const Tensor& t, const char* name, std::vector<int64_t> shape, DType dtype) {
  const at::ScalarType want = dtype == DType::kF16 ? at::kHalf : dtype == DType::kBF16 ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == want, name, " must be ", want, " (the model dtype) on the GPU, not ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.sizes().vec() == shape, name, " has shape ", t.sizes(), ", expected ", at::IntArrayRef(shape));
}

double Real(const c10::Dict<std::string, std::string>& d, const std::string& key, double fallback) {
  if (!d.contains(key)) return fallback;
  const std::string v = d.at(key);
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  TORCH_CHECK(!v.empty() && end == v.c_str() + v.size(), "questkv.Runtime: ", key, " = '", v, "' is not a number");
  return x;
}

int64_t Int(const c10::Dict<std::string, std::string>& d, const std::string& key, int64_t fallback) {
  if (!d.contains(key)) return fallback;
  const std::string v = d.at(key);
  std::size_t used = 0;
  int64_t x = 0;
  try {
    x = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(used == v.size() && !v.empty(), "questkv.Runtime: ", key, " = '", v, "' is not an integer");
  return x;
}

template <typename T>
T Narrow(int64_t v, const std::string& key) {
  TORCH_CHECK(std::in_range<T>(v), "questkv.Runtime: ", key, " = ", v, " is out of range");
  return T(v);
}

std::vector<int64_t> IntList(const c10::Dict<std::string, std::string>& d, const std::string& key,
                             std::vector<int64_t> fallback) {
  if (!d.contains(key)) return fallback;
  std::vector<int64_t> out;
  const std::string v = d.at(key);
  std::size_t start = 0;
  while (start < v.size()) {
    const std::size_t comma = std::min(v.find(',', start), v.size());
    c10::Dict<std::string, std::string> one;
    one.insert(key, v.substr(start, comma - start));
    out.push_back(Int(one, key, 0));
    start = comma + 1;
  }
  return out;
}

// The Config a Runtime is built from, from string keys named as Config's
// fields (the Python package turns keyword arguments into this).
Config ConfigFrom(const c10::Dict<std::string, std::string>& d) {
  static const char* kKeys[] = {"layers", "q_heads", "kv_heads", "head_dim", "page_size", "dtype", "summary_dtype",
                                "token_budget", "sink_pages", "local_pages", "gqa", "dense_layers",
                                "layer_token_budgets", "max_pages", "hbm_bytes", "host_bytes", "disk_dir",
                                "disk_bytes", "cold_miss", "io_backend", "io_checks_off_thread", "prefetch_pages", "backend", "cuda_graphs",
                                "cuda_mma_scores", "block_selection", "rerank", "group_pages", "unread_bound_mass", "adaptive_floor",
                                "deadline_skip_limit"};
  for (const auto& kv : d) {
    const bool known = std::any_of(std::begin(kKeys), std::end(kKeys), [&](const char* k) { return kv.key() == k; });
    TORCH_CHECK(known, "questkv.Runtime: unknown option '", kv.key(), "'");
  }
  Config c;
  Geometry& g = c.geometry;
  g.layers = Narrow<int>(Int(d, "layers", g.layers), "layers");
  g.q_heads = Narrow<int>(Int(d, "q_heads", g.q_heads), "q_heads");
  g.kv_heads = Narrow<int>(Int(d, "kv_heads", g.kv_heads), "kv_heads");
  g.head_dim = Narrow<int>(Int(d, "head_dim", g.head_dim), "head_dim");
  g.page_size = Narrow<int>(Int(d, "page_size", g.page_size), "page_size");
  if (d.contains("dtype")) g.dtype = Value(ParseDType(d.at("dtype")));
  if (d.contains("summary_dtype")) g.summary_dtype = Value(ParseSummaryDType(d.at("summary_dtype")));
  SelectionPolicy& p = c.policy;
  p.token_budget = Int(d, "token_budget", p.token_budget);
  p.sink_pages = Narrow<int>(Int(d, "sink_pages", p.sink_pages), "sink_pages");
  p.local_pages = Narrow<int>(Int(d, "local_pages", p.local_pages), "local_pages");
  if (d.contains("gqa")) p.gqa = Value(ParseGqaMode(d.at("gqa")));
  if (d.contains("block_selection")) p.block_selection = Value(ParseBlockSelection(d.at("block_selection")));
  p.rerank = Real(d, "rerank", p.rerank);
  p.group_pages = Narrow<int>(Int(d, "group_pages", p.group_pages), "group_pages");
  p.unread_bound_mass = Real(d, "unread_bound_mass", p.unread_bound_mass);
  p.adaptive_floor = Int(d, "adaptive_floor", p.adaptive_floor);
  std::vector<int64_t> dense = IntList(d, "dense_layers", {p.dense_layers.begin(), p.dense_layers.end()});
  p.dense_layers.clear();
  for (int64_t l : dense) p.dense_layers.push_back(Narrow<int>(l, "dense_layers"));
  p.layer_token_budgets = IntList(d, "layer_token_budgets", {});
  c.max_pages = Narrow<uint32_t>(Int(d, "max_pages", c.max_pages), "max_pages");
  c.hbm_bytes = Narrow<uint64_t>(Int(d, "hbm_bytes", 0), "hbm_bytes");
  c.host_bytes = Narrow<uint64_t>(Int(d, "host_bytes", 0), "host_bytes");
  if (d.contains("disk_dir")) c.disk_dir = d.at("disk_dir");
  c.disk_bytes = Narrow<uint64_t>(Int(d, "disk_bytes", 0), "disk_bytes");
  if (d.contains("cold_miss")) c.cold_miss = Value(ParseColdMissPolicy(d.at("cold_miss")));
  if (d.contains("io_backend")) c.io_backend = Value(ParseIoBackendKind(d.at("io_backend")));
  c.io_checks_off_thread = Int(d, "io_checks_off_thread", c.io_checks_off_thread) != 0;
  c.prefetch_pages = Narrow<int>(Int(d, "prefetch_pages", c.prefetch_pages), "prefetch_pages");
  c.deadline_skip_limit = Real(d, "deadline_skip_limit", c.deadline_skip_limit);
  if (d.contains("backend")) c.backend = Value(ParseBackend(d.at("backend")));
  c.cuda_graphs = Int(d, "cuda_graphs", 1) != 0;
  c.cuda_mma_scores = Int(d, "cuda_mma_scores", 0) != 0;
  return c;
}

// torch.classes.questkv.Runtime: questkv owns the cache.
class RuntimeHolder : public torch::CustomClassHolder {
 public:
  explicit RuntimeHolder(c10::Dict<std::string, std::string> options)
      : rt_(Value(Runtime::Create(ConfigFrom(options)))), g_(rt_->config().geometry) {}

  int64_t CreateSequence() { return int64_t(Value(rt_->CreateSequence())); }
  int64_t Fork(int64_t parent) { return int64_t(Value(rt_->Fork(Seq(parent)))); }
  int64_t FromPrefix(int64_t parent, int64_t pages) {
    return int64_t(Value(rt_->CreateFromPrefix(Seq(parent), pages)));
  }
  void Rollback(int64_t seq, int64_t tokens) { Check(rt_->Rollback(Seq(seq), tokens)); }
  void Accept(int64_t seq) { Check(rt_->Accept(Seq(seq))); }
  void Free(int64_t seq) { Check(rt_->Free(Seq(seq))); }
  int64_t Length(int64_t seq, int64_t layer) { return Value(rt_->Length(Seq(seq), Layer(layer))); }

  // k, v: [n][Hkv][D]; drafts with `draft` (Runtime::AppendDraft). CPU
  // tensors are float32 (the host API); CUDA tensors are the model dtype,
  // read on the runtime's stream (the device API; the Python package orders
  // that stream after the caller's).
  void Append(int64_t seq, int64_t layer, const Tensor& k, const Tensor& v, bool draft) {
    TORCH_CHECK(k.dim() == 3, "k must be [n, kv_heads, head_dim], not ", k.sizes());
    const std::vector<int64_t> shape = {k.size(0), g_.kv_heads, g_.head_dim};
    if (k.is_cuda()) {
      CheckDevice(k, "k", shape, g_.dtype);
      CheckDevice(v, "v", shape, g_.dtype);
      TORCH_CHECK(v.device() == k.device(), "k and v must be on the same device");
      Check(draft ? rt_->AppendDraftDevice(Seq(seq), Layer(layer), k.data_ptr(), v.data_ptr(), k.size(0))
                  : rt_->AppendDevice(Seq(seq), Layer(layer), k.data_ptr(), v.data_ptr(), k.size(0)));
      return;
    }
    CheckHostF32(k, "k", shape);
    CheckHostF32(v, "v", shape);
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    Check(draft ? rt_->AppendDraft(Seq(seq), Layer(layer), kp, vp, k.size(0))
                : rt_->Append(Seq(seq), Layer(layer), kp, vp, k.size(0)));
  }

  // q: [B][Hq][D] -> out [B][Hq][D]; `out` when defined is written in place.
  Tensor Decode(std::vector<int64_t> seqs, int64_t layer, const Tensor& q, c10::optional<Tensor> out) {
    return Attend(seqs, layer, q, std::move(out), /*dense=*/false);
  }
  Tensor Dense(std::vector<int64_t> seqs, int64_t layer, const Tensor& q, c10::optional<Tensor> out) {
    return Attend(seqs, layer, q, std::move(out), /*dense=*/true);
  }
  // q: [sum(block)][Hq][D], one row per block token (see Runtime::DecodeBlock).
  Tensor DecodeBlock(std::vector<int64_t> seqs, std::vector<int64_t> block, int64_t layer, const Tensor& q) {
    TORCH_CHECK(!seqs.empty() && block.size() == seqs.size(), "block needs one size per sequence");
    int64_t rows = 0;
    std::vector<int> sizes;
    for (int64_t n : block) {
      TORCH_CHECK(n >= 1 && n <= (int64_t(1) << 30), "block size ", n, " is outside 1..2^30");
      sizes.push_back(int(n));
      rows += n;
    }
    const std::vector<int64_t> shape = {rows, g_.q_heads, g_.head_dim};
    std::vector<SeqId> ids;
    for (int64_t s : seqs) ids.push_back(Seq(s));
    if (q.is_cuda()) {
      CheckDevice(q, "q", shape, g_.dtype);
      Tensor o = at::empty(shape, q.options());
      AttendStats stats;
      stats.time_phases = false;
      Check(rt_->DecodeBlockDevice(ids, sizes, Layer(layer), q.data_ptr(), o.data_ptr(), &stats));
      Count(stats);
      return o;
    }
    CheckHostF32(q, "q", shape);
    Tensor o = at::empty(shape, q.options());
    AttendStats stats;
    stats.time_phases = false;
    Check(rt_->DecodeBlock(ids, sizes, Layer(layer), q.data_ptr<float>(), o.data_ptr<float>(), &stats));
    Count(stats);
    return o;
  }
  // The runtime's CUDA stream (cudaStream_t as an integer; 0 on the CPU backend).
  int64_t CudaStream() { return int64_t(reinterpret_cast<uintptr_t>(rt_->cuda_stream())); }

  c10::Dict<std::string, int64_t> Stats() {
    const TierStats t = rt_->tier_stats();
    c10::Dict<std::string, int64_t> d;
    d.insert("bytes_host_to_hbm", t.bytes_host_to_hbm);
    d.insert("bytes_hbm_to_host", t.bytes_hbm_to_host);
    d.insert("bytes_host_to_disk", t.bytes_host_to_disk);
    d.insert("bytes_disk_to_host", t.bytes_disk_to_host);
    d.insert("hbm_hits", t.hbm_hits);
    d.insert("hbm_misses", t.hbm_misses);
    d.insert("cold_misses", t.cold_misses);
    d.insert("cold_stalls", t.cold_stalls);
    d.insert("pages_skipped", t.pages_skipped);
    d.insert("deadline_waits", t.deadline_waits);
    d.insert("demotions", t.demotions);
    d.insert("promotions", t.promotions);
    d.insert("io_errors", t.io_errors);
    d.insert("corruptions", t.corruptions);
    d.insert("hbm_used_bytes", int64_t(t.hbm_used_bytes));
    d.insert("host_used_bytes", int64_t(t.host_used_bytes));
    d.insert("disk_used_bytes", int64_t(t.disk_used_bytes));
    d.insert("summary_bytes", int64_t(t.summary_bytes));
    d.insert("head_pages_selected", attend_.head_pages_selected);
    d.insert("head_pages_total", attend_.head_pages_total);
    d.insert("kv_bytes_read", attend_.kv_bytes_read);
    d.insert("summary_bytes_read", attend_.summary_bytes_read);
    d.insert("rerank_key_bytes", attend_.rerank_key_bytes);
    d.insert("adaptive_rankings", attend_.adaptive_rankings);
    d.insert("adaptive_pages", attend_.adaptive_pages);
    d.insert("adaptive_pages_max", attend_.adaptive_pages_max);
    d.insert("adaptive_cap_hits", attend_.adaptive_cap_hits);
    d.insert("adaptive_pages_p95", attend_.AdaptivePagesPercentile(95));
    d.insert("live_pages", int64_t(rt_->live_pages()));
    d.insert("live_sequences", int64_t(rt_->live_sequences()));
    return d;
  }
  void Synchronize() { Check(rt_->Synchronize()); }

 private:
  static SeqId Seq(int64_t s) {
    TORCH_CHECK(s >= 0, "sequence id ", s, " is negative");
    return SeqId(s);
  }
  int Layer(int64_t layer) const {
    TORCH_CHECK(layer >= 0 && layer < g_.layers, "layer ", layer, " is outside 0..", g_.layers - 1);
    return int(layer);
  }

  Tensor Attend(const std::vector<int64_t>& seqs, int64_t layer, const Tensor& q, c10::optional<Tensor> out,
                bool dense) {
    TORCH_CHECK(!seqs.empty(), "empty batch");
    const std::vector<int64_t> shape = {int64_t(seqs.size()), g_.q_heads, g_.head_dim};
    std::vector<SeqId> ids;
    for (int64_t s : seqs) ids.push_back(Seq(s));
    const int l = Layer(layer);
    AttendStats stats;
    stats.time_phases = false;
    if (q.is_cuda()) {
      TORCH_CHECK(!dense, "dense attention takes CPU tensors");
      CheckDevice(q, "q", shape, g_.dtype);
      Tensor o = out.has_value() ? *out : at::empty(shape, q.options());
      CheckDevice(o, "out", shape, g_.dtype);
      TORCH_CHECK(o.device() == q.device(), "q and out must be on the same device");
      Check(rt_->DecodeAttentionDevice(ids, l, q.data_ptr(), o.data_ptr(), nullptr, &stats));
      Count(stats);
      return o;
    }
    CheckHostF32(q, "q", shape);
    Tensor o = out.has_value() ? *out : at::empty(shape, q.options());
    CheckHostF32(o, "out", shape);
    Check(dense ? rt_->DenseAttention(ids, l, q.data_ptr<float>(), o.data_ptr<float>())
                : rt_->DecodeAttention(ids, l, q.data_ptr<float>(), o.data_ptr<float>(), nullptr, &stats));
    Count(stats);
    return o;
  }
  void Count(const AttendStats& stats) {
    attend_.head_pages_selected += stats.head_pages_selected;
    attend_.head_pages_total += stats.head_pages_total;
    attend_.kv_bytes_read += stats.kv_bytes_read;
    attend_.summary_bytes_read += stats.summary_bytes_read;
    attend_.rerank_key_bytes += stats.rerank_key_bytes;
    attend_.adaptive_rankings += stats.adaptive_rankings;
    attend_.adaptive_pages += stats.adaptive_pages;
    attend_.adaptive_pages_max = std::max(attend_.adaptive_pages_max, stats.adaptive_pages_max);
    attend_.adaptive_cap_hits += stats.adaptive_cap_hits;
    for (int i = 0; i <= AttendStats::kAdaptiveHistPages; ++i) attend_.adaptive_hist[i] += stats.adaptive_hist[i];
  }

  std::unique_ptr<Runtime> rt_;
  Geometry g_;
  AttendStats attend_;  // summed over decode calls
};

// ---- the engine owns its paged KV -----------------------------------------------

// The dtype of a CUDA tensor the engine path takes (f32, f16, bf16).
DType DeviceDtype(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kF32;
    case at::kHalf: return DType::kF16;
    case at::kBFloat16: return DType::kBF16;
    default: TORCH_CHECK(false, name, " must be float32, float16 or bfloat16 on the GPU, not ", t.scalar_type());
  }
  return DType::kF32;
}

// An int32 vector of n entries on the CPU or on `device` (a CUDA engine's
// page table may live there), as a contiguous host tensor (a copy where it
// is not one): what the checks and the host path read.
Tensor HostInts(const Tensor& t, const char* name, int64_t n, at::Device device = at::kCPU) {
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == at::kInt, name, " must be an int32 vector");
  TORCH_CHECK(t.device().is_cpu() || t.device() == device, name, " must be on the CPU",
              device.is_cpu() ? std::string() : " or on " + device.str());
  TORCH_CHECK(t.size(0) == n, name, " has ", t.size(0), " entries, expected ", n);
  return t.cpu().contiguous();
}

// Every pages[i] in 0..P-1 and lens[i] in 1..S.
void CheckPagesAndLens(const Tensor& pages, const Tensor& lens, int64_t P, int64_t S) {
  const int32_t* pg = pages.data_ptr<int32_t>();
  const int32_t* ln = lens.data_ptr<int32_t>();
  for (int64_t i = 0; i < pages.size(0); ++i) {
    TORCH_CHECK(pg[i] >= 0 && pg[i] < P, "pages[", i, "] = ", pg[i], " is outside 0..", P - 1);
    TORCH_CHECK(ln[i] >= 1 && ln[i] <= S, "lens[", i, "] = ", ln[i], " is outside 1..", S);
  }
}

// indptr starts at 0 and grows (every sequence holds a page); every index in
// 0..P-1.
void CheckPageTable(const Tensor& indptr, const Tensor& indices, int64_t B, int64_t P) {
  const int32_t* ip = indptr.data_ptr<int32_t>();
  TORCH_CHECK(ip[0] == 0, "indptr[0] must be 0");
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(ip[b + 1] > ip[b], "sequence ", b, " holds no page");
  TORCH_CHECK(indices.size(0) == ip[B], "indices has ", indices.size(0), " entries, expected ", ip[B]);
  const int32_t* ix = indices.data_ptr<int32_t>();
  for (int64_t i = 0; i < ip[B]; ++i)
    TORCH_CHECK(ix[i] >= 0 && ix[i] < P, "indices[", i, "] = ", ix[i], " is outside 0..", P - 1);
}

SelectionPolicy EnginePolicy(int64_t token_budget, int64_t sink_pages, int64_t local_pages, const std::string& gqa) {
  SelectionPolicy p;
  p.token_budget = token_budget;
  p.sink_pages = int(sink_pages);
  p.local_pages = int(local_pages);
  p.gqa = Value(ParseGqaMode(gqa));
  p.dense_layers.clear();
  return p;
}

// k_cache: [P][S][Hkv][D] ("NHD") or [P][Hkv][S][D] ("HND"); summaries:
// [P][Hkv][2][D], written for each listed page from its first lens[i] keys
// (1..S): exact whatever the page held before, so append and rollback alike
// are one call on the touched pages. float32 CPU tensors, or CUDA tensors of
// one dtype (float32, float16, bfloat16) written on `stream` (the caller's
// current CUDA stream; pages and lens on the CPU or the GPU).
void UpdateSummaries(const Tensor& k_cache, Tensor summaries, const Tensor& pages, const Tensor& lens,
                     const std::string& layout, int64_t stream) {
  TORCH_CHECK(layout == "NHD" || layout == "HND", "layout must be NHD or HND, not ", layout);
  TORCH_CHECK(k_cache.dim() == 4, "k_cache must be 4-d, not ", k_cache.sizes());
  const int64_t P = k_cache.size(0);
  const int64_t S = layout == "NHD" ? k_cache.size(1) : k_cache.size(2);
  const int64_t H = layout == "NHD" ? k_cache.size(2) : k_cache.size(1);
  const int64_t D = k_cache.size(3);
  TORCH_CHECK(pages.dim() == 1, "pages must be a vector");
  if (k_cache.is_cuda()) {
    const DType dt = DeviceDtype(k_cache, "k_cache");
    CheckDevice(k_cache, "k_cache", k_cache.sizes().vec(), dt);
    TORCH_CHECK(summaries.device() == k_cache.device(), "summaries must be on ", k_cache.device());
    CheckDevice(summaries, "summaries", {P, H, 2, D}, dt);
    const Tensor pg = HostInts(pages, "pages", pages.size(0), k_cache.device());
    CheckPagesAndLens(pg, HostInts(lens, "lens", pages.size(0), k_cache.device()), P, S);
    TORCH_CHECK(pages.size(0) * H <= std::numeric_limits<int32_t>::max(), "too many pages in one call");
    const at::DeviceGuard guard(k_cache.device());
    const Tensor pages_d = pages.to(k_cache.device()).contiguous(), lens_d = lens.to(k_cache.device()).contiguous();
    DeviceSummaryArgs a;
    a.dtype = dt;
    a.k_cache = k_cache.data_ptr();
    a.summaries = summaries.data_ptr();
    a.pages = pages_d.data_ptr<int32_t>();
    a.lens = lens_d.data_ptr<int32_t>();
    a.n = int(pages.size(0));
    a.kv_heads = int(H);
    a.head_dim = int(D);
    a.page_size = int(S);
    a.nhd = layout == "NHD";
    Check(DeviceUpdateSummaries(a, reinterpret_cast<void*>(stream)));
    return;
  }
  CheckHostF32(k_cache, "k_cache", k_cache.sizes().vec());
  CheckHostF32(summaries, "summaries", {P, H, 2, D});
  const Tensor pages_h = HostInts(pages, "pages", pages.size(0)), lens_h = HostInts(lens, "lens", pages.size(0));
  CheckPagesAndLens(pages_h, lens_h, P, S);
  const int32_t* pg = pages_h.data_ptr<int32_t>();
  const int32_t* ln = lens_h.data_ptr<int32_t>();
  const float* kc = k_cache.data_ptr<float>();
  float* sm = summaries.data_ptr<float>();
  std::vector<float> keys(std::size_t(S * D));
  for (int64_t i = 0; i < pages.size(0); ++i) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t t = 0; t < ln[i]; ++t) {
        const int64_t at = layout == "NHD" ? ((pg[i] * S + t) * H + h) * D : ((pg[i] * H + h) * S + t) * D;
        std::copy_n(kc + at, D, keys.data() + t * D);
      }
      const float* heads[1] = {keys.data()};
      kernels::RebuildSummaryHeadsCpu(heads, sm + (int64_t(pg[i]) * H + h) * 2 * D, 1, int(D), ln[i]);
    }
  }
}

// The pages selected on the GPU: q and summaries CUDA tensors of one dtype,
// the page table on the CPU or the GPU, work on `stream`. Rows are as wide as
// the most pages a row can hold (kUnion: a bound), padded with -1.
Tensor SelectPagesCuda(const Tensor& q, const Tensor& summaries, const Tensor& indptr, const Tensor& indices,
                       const Tensor& last_page_len, const Geometry& g, const SelectionPolicy& policy, int64_t stream) {
  const int64_t B = q.size(0), P = summaries.size(0);
  const DType dt = DeviceDtype(q, "q");
  CheckDevice(q, "q", {B, g.q_heads, g.head_dim}, dt);
  TORCH_CHECK(summaries.device() == q.device(), "summaries must be on ", q.device());
  CheckDevice(summaries, "summaries", {P, g.kv_heads, 2, g.head_dim}, dt);
  const Tensor ip = HostInts(indptr, "indptr", B + 1, q.device());
  HostInts(last_page_len, "last_page_len", B, q.device());
  TORCH_CHECK(indices.dim() == 1, "indices must be a vector");
  CheckPageTable(ip, HostInts(indices, "indices", indices.size(0), q.device()), B, P);
  Check(g.Validate());
  Check(policy.Validate(g));
  const at::DeviceGuard guard(q.device());
  const Tensor indptr_d = indptr.to(q.device()).contiguous(), indices_d = indices.to(q.device()).contiguous();
  DeviceSelectArgs a;
  a.geometry = g;
  a.policy = policy;
  a.dtype = dt;
  a.q = q.data_ptr();
  a.summaries = summaries.data_ptr();
  a.indptr = indptr_d.data_ptr<int32_t>();
  a.indices = indices_d.data_ptr<int32_t>();
  const int32_t* h_ip = ip.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) a.page_counts.push_back(h_ip[b + 1] - h_ip[b]);
  Tensor out;
  Check(DeviceSelectPages(
      a,
      [&](int width) {
        out = at::empty({B, g.kv_heads, width}, q.options().dtype(at::kInt));
        return out.data_ptr<int32_t>();
      },
      reinterpret_cast<void*>(stream)));
  return out;
}

// q: [B][Hq][D]; summaries: [P][Hkv][2][D]; indptr [B+1], indices [nnz] (page
// ids in logical order), last_page_len [B]: FlashInfer's CSR page table.
// Returns [B][Hkv][K] int32 page ids (from `indices`), each row ascending in
// logical order, padded with -1: the pages the runtime would attend for the
// same summaries and policy (sink, local window and tail included).
Tensor SelectPages(const Tensor& q, const Tensor& summaries, const Tensor& indptr, const Tensor& indices,
                   const Tensor& last_page_len, int64_t page_size, int64_t token_budget, int64_t sink_pages,
                   int64_t local_pages, const std::string& gqa, int64_t stream) {
  TORCH_CHECK(q.dim() == 3 && summaries.dim() == 4, "q must be [B, Hq, D] and summaries [P, Hkv, 2, D]");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), P = summaries.size(0), H = summaries.size(1);
  Geometry g;
  g.layers = 1, g.q_heads = int(Hq), g.kv_heads = int(H), g.head_dim = int(D), g.page_size = int(page_size);
  const SelectionPolicy p = EnginePolicy(token_budget, sink_pages, local_pages, gqa);
  if (q.is_cuda()) return SelectPagesCuda(q, summaries, indptr, indices, last_page_len, g, p, stream);
  CheckHostF32(q, "q", {B, Hq, D});
  CheckHostF32(summaries, "summaries", {P, H, 2, D});
  const Tensor indptr_h = HostInts(indptr, "indptr", B + 1), indices_h = HostInts(indices, "indices", indices.size(0));
  HostInts(last_page_len, "last_page_len", B);
  CheckPageTable(indptr_h, indices_h, B, P);
  Check(g.Validate());
  Check(p.Validate(g));
  const int32_t* ip = indptr_h.data_ptr<int32_t>();
  const int32_t* ix = indices_h.data_ptr<int32_t>();
  Selector selector(g, p);
  std::vector<uint32_t> ids(ix, ix + ip[B]);
  std::vector<PageSelection> sel(B);
  int64_t widest = 1;
  for (int64_t b = 0; b < B; ++b) {
    SelectInput in;
    in.q = q.data_ptr<float>() + b * Hq * D;
    in.summary_slab = summaries.data_ptr<float>();
    in.page_ids = ids.data() + ip[b];
    in.num_pages = ip[b + 1] - ip[b];
    in.layer = 0;
    Check(selector.Select(in, &sel[b]));
    for (int h = 0; h < H; ++h) widest = std::max<int64_t>(widest, sel[b].count(h));
  }
  Tensor out = at::full({B, H, widest}, -1, indices.options());
  int32_t* o = out.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < sel[b].count(h); ++i) o[(b * H + h) * widest + i] = ix[ip[b] + sel[b].row(h)[i]];
  return out;
}

}  // namespace
}  // namespace questkv::torch_ops

TORCH_LIBRARY(questkv, m) {
  using questkv::torch_ops::RuntimeHolder;
  m.class_<RuntimeHolder>("Runtime")
      .def(torch::init<c10::Dict<std::string, std::string>>())
      .def("create_sequence", &RuntimeHolder::CreateSequence)
      .def("fork", &RuntimeHolder::Fork)
      .def("from_prefix", &RuntimeHolder::FromPrefix)
      .def("rollback", &RuntimeHolder::Rollback)
      .def("accept", &RuntimeHolder::Accept)
      .def("free", &RuntimeHolder::Free)
      .def("length", &RuntimeHolder::Length)
      .def("append", &RuntimeHolder::Append)
      .def("decode", &RuntimeHolder::Decode)
      .def("dense", &RuntimeHolder::Dense)
      .def("decode_block", &RuntimeHolder::DecodeBlock)
      .def("stats", &RuntimeHolder::Stats)
      .def("synchronize", &RuntimeHolder::Synchronize)
      .def("cuda_stream", &RuntimeHolder::CudaStream);
  m.def("update_summaries(Tensor k_cache, Tensor(a!) summaries, Tensor pages, Tensor lens, str layout, int stream=0) -> ()",
        &questkv::torch_ops::UpdateSummaries);
  m.def("select_pages(Tensor q, Tensor summaries, Tensor indptr, Tensor indices, Tensor last_page_len, int page_size, "
        "int token_budget, int sink_pages, int local_pages, str gqa, int stream=0) -> Tensor",
        &questkv::torch_ops::SelectPages);
}
