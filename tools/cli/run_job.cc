#include "tools/cli/run_job.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <deque>
#include <future>
#include <memory>
#include <thread>

#include "tools/cli/json.h"
#include "tools/cli/progress.h"
#include "core/half.h"
#include "tools/metrics.h"
#include "questkv/runtime.h"
#include "selector/diagnostics.h"
#include "topology/topology.h"

#if QUESTKV_HAVE_CUDA
#include <cuda_runtime.h>

#include "tools/workload_cuda.h"
#endif

namespace questkv::cli {

namespace {

constexpr int64_t kPrefillChunk = 1024;

// FNV-1a, 64 bit: order-sensitive, so equal digests mean equal output streams.
void Digest(uint64_t& h, const float* data, std::size_t n) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n * sizeof(float); ++i) {
    h ^= bytes[i];
    h *= 1099511628211ull;
  }
}

Percentiles Summarise(std::vector<double> v) {
  Percentiles p;
  if (v.empty()) return p;
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[std::min(v.size() - 1, std::size_t(q * double(v.size() - 1) + 0.5))]; };
  p.p50 = at(0.50);
  p.p99 = at(0.99);
  for (double x : v) p.mean += x;
  p.mean /= double(v.size());
  return p;
}

struct Batch {
  std::vector<SeqId> ids;
  std::vector<Workload> workloads;  // one per sequence (seed + b)
  std::vector<int64_t> lengths;     // context tokens of each
};

Result<Batch> MakeBatch(Runtime& rt, const RunOptions& o) {
  Batch batch;
  for (int b = 0; b < o.batch; ++b) {
    const int64_t len = o.context_tokens - 7 * int64_t(b);  // >= 1: CheckRunOptions
    WorkloadSpec spec{o.workload, o.seed + uint64_t(b), len, DecodeTokens(o)};
    QKV_ASSIGN_OR_RETURN(Workload w, Workload::Create(o.config.geometry, spec));
    QKV_ASSIGN_OR_RETURN(SeqId id, rt.CreateSequence());
    batch.ids.push_back(id);
    batch.workloads.push_back(std::move(w));
    batch.lengths.push_back(len);
  }
  return batch;
}

// The prefill's appends in order: sequence, layer, then kPrefillChunk tokens
// at a time.
struct PrefillChunk {
  std::size_t b;
  int layer;
  int64_t t, n;
};
std::vector<PrefillChunk> PrefillChunks(const Batch& batch, int layers, int64_t* tokens) {
  std::vector<PrefillChunk> chunks;
  *tokens = 0;
  for (std::size_t b = 0; b < batch.ids.size(); ++b)
    for (int layer = 0; layer < layers; ++layer)
      for (int64_t t = 0; t < batch.lengths[b]; t += kPrefillChunk) {
        chunks.push_back({b, layer, t, std::min(kPrefillChunk, batch.lengths[b] - t)});
        *tokens += chunks.back().n;
      }
  return chunks;
}

// Chunks are generated on worker threads (the workload is a pure function of
// its coordinates, so the values do not depend on the threading) and
// appended in order on this one.
Status Prefill(Runtime& rt, const RunOptions& o, const Batch& batch) {
  const Geometry& g = o.config.geometry;
  const std::size_t row = std::size_t(g.kv_heads) * g.head_dim;
  int64_t total = 0, done = 0;
  const std::vector<PrefillChunk> chunks = PrefillChunks(batch, g.layers, &total);
  Progress bar("prefill", total, o.progress);
  struct KV {
    std::vector<float> k, v;
  };
  const std::size_t workers = std::clamp<std::size_t>(std::thread::hardware_concurrency(), 1, 16);
  std::deque<std::future<KV>> inflight;
  std::size_t next = 0;
  auto launch = [&] {
    const PrefillChunk c = chunks[next++];
    inflight.push_back(std::async(std::launch::async, [&batch, c, row] {
      KV kv{std::vector<float>(c.n * row), std::vector<float>(c.n * row)};
      batch.workloads[c.b].Tokens(c.layer, c.t, c.n, kv.k.data(), kv.v.data());
      return kv;
    }));
  };
  for (const PrefillChunk& c : chunks) {
    while (next < chunks.size() && inflight.size() < 2 * workers) launch();
    KV kv = inflight.front().get();
    inflight.pop_front();
    if (Status s = rt.Append(batch.ids[c.b], c.layer, kv.k.data(), kv.v.data(), c.n); !s.ok()) {
      for (auto& f : inflight) f.wait();
      return s;
    }
    bar.Update(done += c.n);
  }
  return Status::Ok();
}

// The CUDA backend's prefill: each chunk's K/V generated on the GPU
// (DeviceWorkload: the host generator's values, bit for bit) straight into
// device memory in the model dtype and appended from there.
Status PrefillOnGpu(Runtime& rt, const RunOptions& o, const Batch& batch) {
#if QUESTKV_HAVE_CUDA
  const Geometry& g = o.config.geometry;
  const std::size_t bytes = std::size_t(kPrefillChunk) * g.kv_heads * g.head_dim * DTypeBytes(g.dtype);
  // Generated on the runtime's stream, so each chunk's append reads it in
  // stream order and the next chunk overwrites it only after.
  struct Device {
    void* k = nullptr;
    void* v = nullptr;
    ~Device() {
      cudaFree(k);
      cudaFree(v);
    }
  } d;
  const auto stream = static_cast<cudaStream_t>(rt.cuda_stream());
  if (cudaMalloc(&d.k, bytes) != cudaSuccess || cudaMalloc(&d.v, bytes) != cudaSuccess)
    return Status::ResourceExhausted("device buffers for the prefill chunks");
  std::vector<std::unique_ptr<DeviceWorkload>> gen;
  for (const Workload& w : batch.workloads) {
    QKV_ASSIGN_OR_RETURN(std::unique_ptr<DeviceWorkload> dw, DeviceWorkload::Create(w));
    gen.push_back(std::move(dw));
  }
  int64_t total = 0, done = 0;
  const std::vector<PrefillChunk> chunks = PrefillChunks(batch, g.layers, &total);
  Progress bar("prefill (K/V generated on the GPU)", total, o.progress);
  for (const PrefillChunk& c : chunks) {
    QKV_RETURN_IF_ERROR(gen[c.b]->Tokens(c.layer, c.t, c.n, d.k, d.v, g.dtype, stream));
    QKV_RETURN_IF_ERROR(rt.AppendDevice(batch.ids[c.b], c.layer, d.k, d.v, c.n));
    bar.Update(done += c.n);
  }
  return rt.Synchronize();
#else
  (void)rt, (void)o, (void)batch;
  return Status::Unimplemented("K/V generated on the GPU needs a CUDA build");
#endif
}

// One decode step through the device-pointer calls (RunOptions::
// device_decode): the step's queries and K/V rows, generated on the host and
// rounded to the model dtype as the host calls round them, go up before the
// step; then every layer's append and decode are enqueued on the runtime's
// stream, and the step is timed from the first call to the end of its work
// on the GPU. Outputs come back after, in layer order for the digest.
//
// With `block` > 0, a speculative block: each sequence's last token and
// drafts (`block` rows of K/V and queries) appended with AppendDraftDevice
// and verified by DecodeBlockDevice.
//
// A diagnosed step runs the same calls; a diagnosed layer's decode call
// asks for its selections (so it returns with its work done) and counts
// the head-pages it skipped from the tier counters read around it (reading
// them waits for the calls before it). The other layers stay enqueued.
struct DeviceDiagnosis {
  int layer = 0;
  std::vector<PageSelection> sels;
  int64_t skipped = 0;
};

class DeviceStep {
 public:
#if QUESTKV_HAVE_CUDA
  DeviceStep(const Geometry& g, int batch, int block = 0) : g_(g), batch_(batch), block_(block) {}
  ~DeviceStep() {
    cudaFreeHost(host_);
    cudaFree(dev_);
  }
  DeviceStep(const DeviceStep&) = delete;
  DeviceStep& operator=(const DeviceStep&) = delete;

  Status Init() {
    const int rows = batch_ * std::max(block_, 1);
    row_ = std::size_t(g_.kv_heads) * g_.head_dim * rows;
    qrow_ = std::size_t(g_.q_heads) * g_.head_dim * rows;
    layer_elems_ = 2 * row_ + 2 * qrow_;  // k, v, q, out
    bytes_ = std::size_t(g_.layers) * layer_elems_ * DTypeBytes(g_.dtype);
    if (cudaHostAlloc(&host_, bytes_, cudaHostAllocDefault) != cudaSuccess || cudaMalloc(&dev_, bytes_) != cudaSuccess)
      return Status::ResourceExhausted("buffers for the decode step's device-pointer calls");
    return Status::Ok();
  }

  // Host f32 k, v [B][Hkv][D] and q [B][Hq][D] of a layer (a block: k, v
  // [B][block][Hkv][D], q [B][block][Hq][D]).
  void Stage(int layer, const float* k, const float* v, const float* q) {
    FromFloats(k, g_.dtype, row_, At(host_, layer, 0));
    FromFloats(v, g_.dtype, row_, At(host_, layer, row_));
    FromFloats(q, g_.dtype, qrow_, At(host_, layer, 2 * row_));
  }

  // Uploads the staged inputs, then runs and times the step (seconds);
  // *enqueue_s gets the host's share: until the last call returned.
  // `diagnosed` (single tokens only), in layer order, is filled in.
  Result<double> Run(Runtime& rt, const Batch& batch, AttendStats& stats, double* append_us, double* enqueue_s,
                     std::vector<DeviceDiagnosis>* diagnosed = nullptr) {
    if (diagnosed && !diagnosed->empty() && block_ > 0)
      return Status::Unimplemented("recall diagnostics of speculative blocks");
    const auto stream = static_cast<cudaStream_t>(rt.cuda_stream());
    if (cudaMemcpyAsync(dev_, host_, bytes_, cudaMemcpyHostToDevice, stream) != cudaSuccess)
      return Status::Internal("decode step upload failed");
    QKV_RETURN_IF_ERROR(rt.Synchronize());
    const std::size_t el = DTypeBytes(g_.dtype);
    const std::size_t kv_row = std::size_t(g_.kv_heads) * g_.head_dim * el;
    const auto t0 = std::chrono::steady_clock::now();
    const int n = std::max(block_, 1);
    const std::vector<int> blocks(batch_, n);
    std::size_t next = 0;  // the next entry of `diagnosed`
    for (int layer = 0; layer < g_.layers; ++layer) {
      const auto a0 = std::chrono::steady_clock::now();
      for (int b = 0; b < batch_; ++b) {
        const void* k = static_cast<char*>(At(dev_, layer, 0)) + std::size_t(b) * n * kv_row;
        const void* v = static_cast<char*>(At(dev_, layer, row_)) + std::size_t(b) * n * kv_row;
        QKV_RETURN_IF_ERROR(block_ > 0 ? rt.AppendDraftDevice(batch.ids[b], layer, k, v, n)
                                       : rt.AppendDevice(batch.ids[b], layer, k, v, 1));
      }
      *append_us += 1e6 * std::chrono::duration<double>(std::chrono::steady_clock::now() - a0).count();
      void* q = At(dev_, layer, 2 * row_);
      void* out = At(dev_, layer, 2 * row_ + qrow_);
      if (diagnosed && next < diagnosed->size() && (*diagnosed)[next].layer == layer) {
        DeviceDiagnosis& d = (*diagnosed)[next++];
        const int64_t before = rt.tier_stats().pages_skipped;
        QKV_RETURN_IF_ERROR(rt.DecodeAttentionDevice(batch.ids, layer, q, out, &d.sels, &stats));
        d.skipped = rt.tier_stats().pages_skipped - before;
        continue;
      }
      QKV_RETURN_IF_ERROR(block_ > 0 ? rt.DecodeBlockDevice(batch.ids, blocks, layer, q, out, &stats)
                                     : rt.DecodeAttentionDevice(batch.ids, layer, q, out, nullptr, &stats));
    }
    *enqueue_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    QKV_RETURN_IF_ERROR(rt.Synchronize());
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // The step's outputs, f32, layer after layer into out[L][B][Hq][D].
  Status Outputs(Runtime& rt, std::vector<float>& out) {
    const auto stream = static_cast<cudaStream_t>(rt.cuda_stream());
    out.resize(std::size_t(g_.layers) * qrow_);
    for (int layer = 0; layer < g_.layers; ++layer)
      if (cudaMemcpyAsync(At(host_, layer, 2 * row_ + qrow_), At(dev_, layer, 2 * row_ + qrow_),
                          qrow_ * DTypeBytes(g_.dtype), cudaMemcpyDeviceToHost, stream) != cudaSuccess)
        return Status::Internal("decode step readback failed");
    QKV_RETURN_IF_ERROR(rt.Synchronize());
    for (int layer = 0; layer < g_.layers; ++layer)
      ToFloats(At(host_, layer, 2 * row_ + qrow_), g_.dtype, qrow_, out.data() + std::size_t(layer) * qrow_);
    return Status::Ok();
  }

 private:
  // Element `elem` of a layer's [k | v | q | out] block.
  void* At(void* base, int layer, std::size_t elem) const {
    return static_cast<char*>(base) + (std::size_t(layer) * layer_elems_ + elem) * DTypeBytes(g_.dtype);
  }
  Geometry g_;
  int batch_, block_;
  std::size_t row_ = 0, qrow_ = 0, layer_elems_ = 0, bytes_ = 0;
  void* host_ = nullptr;  // pinned
  void* dev_ = nullptr;
#else
  DeviceStep(const Geometry&, int, int = 0) {}
  Status Init() { return Status::Unimplemented("decode on device pointers needs a CUDA build"); }
  void Stage(int, const float*, const float*, const float*) {}
  Result<double> Run(Runtime&, const Batch&, AttendStats&, double*, double*, std::vector<DeviceDiagnosis>* = nullptr) {
    return Init();
  }
  Status Outputs(Runtime&, std::vector<float>&) { return Init(); }
#endif
};

RunReport::Links LinksOf(const TierStats& t) {
  return {t.bytes_host_to_hbm, t.bytes_hbm_to_host, t.bytes_host_to_disk, t.bytes_disk_to_host};
}
int64_t HostLinkBytes(const RunReport::Links& l) { return l.host_to_hbm + l.hbm_to_host; }
// What a run's decode calls read and selected, summed over its calls.
void TakeReadCounts(const AttendStats& stats, RunReport& r) {
  r.head_pages_selected = stats.head_pages_selected;
  r.head_pages_total = stats.head_pages_total;
  r.kv_bytes_read = stats.kv_bytes_read;
  r.summary_bytes_read = stats.summary_bytes_read;
  r.rerank_key_bytes = stats.rerank_key_bytes;
  r.adaptive = {stats.adaptive_rankings, stats.adaptive_pages, stats.AdaptivePagesPercentile(95),
                stats.adaptive_pages_max, stats.adaptive_cap_hits};
}

void AddDiff(RunReport::Links& acc, const RunReport::Links& after, const RunReport::Links& before) {
  acc.host_to_hbm += after.host_to_hbm - before.host_to_hbm;
  acc.hbm_to_host += after.hbm_to_host - before.hbm_to_host;
  acc.host_to_disk += after.host_to_disk - before.host_to_disk;
  acc.disk_to_host += after.disk_to_host - before.disk_to_host;
}

// Recall, mass recall, error, slack and exact-search cost of one (step, layer),
// summed over its sequences.
struct LayerDiagnostics {
  double page_recall = 0, attention_mass_recall = 0, output_rel_error = 0, slack_mean = 0, read_fraction = 0;
  double selection_rel_error = 0, attended_rel_error = 0;
  int sequences = 0;
  RunReport::DiagnosedCall call;  // its errors: means over the sequences
};

// A diagnosed step's recall diagnostics, after the step (outside its timing;
// each layer's K/V and summaries stay as they were until its next append):
// per layer the K/V and Quest scores are gathered, then the dense scoring
// and the exact top-R search (seconds of CPU a layer at 128K, a minute at
// 1M) run on worker threads, at most max_inflight_ layers at a time (bounded
// by memory: each holds its gathered K/V), each layer's query heads spread
// over the cores left to it, all joined before the next step starts.
class Diagnostics {
 public:
  explicit Diagnostics(std::size_t view_bytes) {
    const std::size_t cap = std::size_t(8) << 30;  // gathered K/V in flight
    const std::size_t threads = std::max(1u, std::thread::hardware_concurrency());
    max_inflight_ = std::max<std::size_t>(1, std::min(threads, cap / std::max<std::size_t>(view_bytes, 1)));
    head_threads_ = int(std::max<std::size_t>(1, threads / max_inflight_));
  }
  ~Diagnostics() {
    for (auto& f : inflight_) f.wait();
  }

  // `call` names the diagnosed call (step, layer) and holds what it selected and skipped.
  Status Add(Runtime& rt, const RunOptions& o, const Batch& batch, const RunReport::DiagnosedCall& call,
             const float* q, const float* out, const std::vector<PageSelection>& sels, RunReport& r) {
    const int layer = call.layer;
    const Geometry& g = o.config.geometry;
    const std::size_t qstride = std::size_t(g.q_heads) * g.head_dim;
    const std::size_t B = batch.ids.size();
    // Joined first, so that at most max_inflight_ gathered views exist at once.
    while (inflight_.size() >= max_inflight_) QKV_RETURN_IF_ERROR(Join(r));
    auto views = std::make_shared<std::vector<DenseView>>(B);
    auto scores = std::make_shared<std::vector<std::vector<float>>>(B);
    for (std::size_t b = 0; b < B; ++b) {
      QKV_ASSIGN_OR_RETURN((*views)[b], rt.Gather(batch.ids[b], layer));
      QKV_ASSIGN_OR_RETURN((*scores)[b], rt.Scores(batch.ids[b], layer, q + b * qstride));
    }
    inflight_.push_back(std::async(
        std::launch::async, [g, top_r = o.top_r, threads = head_threads_, views, scores, sels, call,
                             qv = std::vector<float>(q, q + B * qstride),
                             ov = std::vector<float>(out, out + B * qstride), qstride]() -> Result<LayerDiagnostics> {
          LayerDiagnostics d;
          d.call = call;
          for (std::size_t b = 0; b < views->size(); ++b) {
            const DenseView& view = (*views)[b];
            const float* sc = (*scores)[b].data();
            QKV_ASSIGN_OR_RETURN(StepDiagnostics s,
                                 Diagnose(g, qv.data() + b * qstride, view, sels[b], sc, ov.data() + b * qstride,
                                          top_r, threads));
            QKV_ASSIGN_OR_RETURN(ExactTopR exact,
                                 ExactTopRSearch(g, qv.data() + b * qstride, view, sc, top_r, threads));
            const int pages = int((view.tokens + g.page_size - 1) / g.page_size);
            double read = 0;
            for (int32_t n : exact.pages_read) read += double(n) / pages;
            d.page_recall += s.page_recall;
            d.attention_mass_recall += s.attention_mass_recall;
            d.output_rel_error += s.output_rel_error;
            d.selection_rel_error += s.selection_rel_error;
            d.attended_rel_error += s.attended_rel_error;
            d.slack_mean += s.slack_mean;
            d.read_fraction += read / double(exact.pages_read.size());
            ++d.sequences;
          }
          if (d.sequences > 0) {
            d.call.selection_rel_error = d.selection_rel_error / d.sequences;
            d.call.attended_rel_error = d.attended_rel_error / d.sequences;
          }
          return d;
        }));
    return Status::Ok();
  }

  // Waits for every layer still in flight and adds it to the report.
  Status Finish(RunReport& r) {
    while (!inflight_.empty()) QKV_RETURN_IF_ERROR(Join(r));
    return Status::Ok();
  }

 private:
  Status Join(RunReport& r) {
    Result<LayerDiagnostics> res = inflight_.front().get();
    inflight_.pop_front();
    QKV_RETURN_IF_ERROR(res.status());
    const LayerDiagnostics& d = *res;
    r.page_recall += d.page_recall;
    r.attention_mass_recall += d.attention_mass_recall;
    r.output_rel_error += d.output_rel_error;
    r.selection_rel_error += d.selection_rel_error;
    r.attended_rel_error += d.attended_rel_error;
    r.slack_mean += d.slack_mean;
    r.exact_pages_read_fraction += d.read_fraction;
    r.diagnosed += d.sequences;
    r.diagnosed_calls.push_back(d.call);
    return Status::Ok();
  }

  std::size_t max_inflight_ = 1;
  int head_threads_ = 1;
  std::deque<std::future<Result<LayerDiagnostics>>> inflight_;
};

// The draft-and-verify loop of speculative decoding (RunOptions::draft), as
// EAGLE, Medusa and draft models run it: a block is the last token sampled
// (always kept) and n drafts after it, verified by one DecodeBlock call; the
// drafts are kept up to the first rejection, so a block yields 1 + accepted
// tokens (the verify's output at the last kept position samples the next
// block's first token). Tokens are the workload's next ones, appended as
// drafts (a page they fill reaches the host only once accepted); a rejected
// draft's position comes again, as the next block's first, with the same K/V.
Status SpeculativeDecode(Runtime& rt, const RunOptions& o, const Batch& batch, RunReport& r) {
  const Geometry& g = o.config.geometry;
  const int B = int(batch.ids.size()), n = o.draft, len = n + 1;
  const std::size_t row = std::size_t(g.kv_heads) * g.head_dim, qrow = std::size_t(g.q_heads) * g.head_dim;
  std::vector<float> k(std::size_t(len) * row), v(k.size()), q(std::size_t(B) * len * qrow), out(q.size());
  std::vector<int64_t> kept(B, 0);  // tokens kept past the context, per sequence
  const std::vector<int> blocks(B, len);
  std::mt19937_64 rng(o.seed * 0x9E3779B97F4A7C15ull + 1);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  Progress bar("speculative decode", o.decode_steps, o.progress);
  AttendStats stats;
  // Phases timed as Decode times them: the CUDA backend's on every 4th block
  // from block 1 (launched directly, so kept out of the block latency), the
  // CPU's on all.
  const bool cuda = o.config.backend == Backend::kCuda;
  int64_t timed_blocks = 0;
  std::vector<double> step_us, instrumented_us;
  // Tokens per second over the blocks the latency counts, past the first
  // (graph captures, list growth): over all of them when there are no others.
  int64_t rate_tokens = 0;
  double rate_seconds = 0;
  using Clock = std::chrono::steady_clock;
  // A block's time is its runtime calls' (the workload's K/V and queries are
  // generated outside it, as Decode's are), each charged to its kind too.
  double block_s = 0;
  auto charge = [&](double& kind, Clock::time_point t0) {
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    kind += s;
    block_s += s;
  };
  // Device-pointer calls (RunOptions::device_decode): every layer's block
  // staged, then appended and verified back to back on the runtime's stream.
  std::unique_ptr<DeviceStep> device;
  std::vector<float> k_all, v_all, step_out;
  if (o.device_decode) {
    device = std::make_unique<DeviceStep>(g, B, len);
    QKV_RETURN_IF_ERROR(device->Init());
    k_all.resize(std::size_t(B) * len * row);
    v_all.resize(k_all.size());
  }
  for (int64_t step = 0; step < o.decode_steps; ++step) {
    block_s = 0;
    stats.time_phases = !cuda || o.decode_steps == 1 || step % 4 == 1;
    timed_blocks += stats.time_phases;
    if (device) {
      for (int layer = 0; layer < g.layers; ++layer) {
        for (int b = 0; b < B; ++b) {
          const std::size_t at = std::size_t(b) * len * row;
          batch.workloads[b].Tokens(layer, batch.lengths[b] + kept[b], len, k_all.data() + at, v_all.data() + at);
          for (int i = 0; i < len; ++i)
            batch.workloads[b].Query(layer, kept[b] + i, q.data() + (std::size_t(b) * len + i) * qrow);
        }
        device->Stage(layer, k_all.data(), v_all.data(), q.data());
      }
      double append_us = 0, enqueue_s = 0;
      QKV_ASSIGN_OR_RETURN(const double seconds, device->Run(rt, batch, stats, &append_us, &enqueue_s));
      r.speculative.append_seconds += 1e-6 * append_us;
      r.speculative.verify_seconds += seconds - 1e-6 * append_us;
      block_s += seconds;
      QKV_RETURN_IF_ERROR(device->Outputs(rt, step_out));
      for (int layer = 0; layer < g.layers; ++layer)
        Digest(r.output_digest, step_out.data() + std::size_t(layer) * out.size(), out.size());
    } else {
      for (int layer = 0; layer < g.layers; ++layer) {
        for (int b = 0; b < B; ++b) {
          batch.workloads[b].Tokens(layer, batch.lengths[b] + kept[b], len, k.data(), v.data());
          const auto ta = Clock::now();
          QKV_RETURN_IF_ERROR(rt.AppendDraft(batch.ids[b], layer, k.data(), v.data(), len));
          charge(r.speculative.append_seconds, ta);
          for (int i = 0; i < len; ++i)
            batch.workloads[b].Query(layer, kept[b] + i, q.data() + (std::size_t(b) * len + i) * qrow);
        }
        const auto tv = Clock::now();
        QKV_RETURN_IF_ERROR(rt.DecodeBlock(batch.ids, blocks, layer, q.data(), out.data(), &stats));
        charge(r.speculative.verify_seconds, tv);
        Digest(r.output_digest, out.data(), out.size());
      }
    }
    const auto ts = Clock::now();
    int64_t tokens = 0;
    for (int b = 0; b < B; ++b) {
      int accepted = 0;
      while (accepted < n && uniform(rng) < o.accept_rate) ++accepted;
      QKV_RETURN_IF_ERROR(rt.Rollback(batch.ids[b], n - accepted));
      QKV_RETURN_IF_ERROR(rt.Accept(batch.ids[b]));
      kept[b] += 1 + accepted;
      tokens += 1 + accepted;
      r.speculative.accepted += accepted;
    }
    charge(r.speculative.settle_seconds, ts);
    r.speculative.drafted += int64_t(B) * n;
    r.speculative.tokens += tokens;
    r.speculative.seconds += block_s;
    const bool instrumented = cuda && stats.time_phases && o.decode_steps > 1;
    (instrumented ? instrumented_us : step_us).push_back(1e6 * block_s);
    if (step > 0 && !instrumented) {
      rate_tokens += tokens;
      rate_seconds += block_s;
    }
    bar.Update(step + 1);
  }
  if (rate_tokens == 0) {
    rate_tokens = r.speculative.tokens;
    rate_seconds = r.speculative.seconds;
  }
  r.speculative.tokens_per_s = rate_seconds > 0 ? double(rate_tokens) / rate_seconds : 0;
  r.step_latency_us = Summarise(std::move(step_us));
  r.step_latency_instrumented_us = Summarise(std::move(instrumented_us));
  const double timed = std::max<double>(1, double(timed_blocks));
  r.step_breakdown_us = {1e6 * r.speculative.append_seconds / std::max<double>(1, double(o.decode_steps)),
                         stats.select_us / timed, stats.resolve_us / timed, stats.attend_us / timed};
  r.speculative.head_pages_selected = stats.head_pages_selected;
  TakeReadCounts(stats, r);
  return Status::Ok();
}

Status Decode(Runtime& rt, const RunOptions& o, const Batch& batch, RunReport& r, MetricsRegistry* metrics) {
  const Geometry& g = o.config.geometry;
  const int B = int(batch.ids.size());
  const std::size_t row = std::size_t(g.kv_heads) * g.head_dim;
  const std::size_t qstride = std::size_t(g.q_heads) * g.head_dim;
  std::vector<float> k(row * B), v(row * B), q(qstride * B), out(qstride * B);
  std::vector<PageSelection> sels;
  std::vector<float> dense_out(out.size());
  double append_us = 0;
  int64_t comparison_hits = 0, comparison_misses = 0;
  // Dense attention is timed beside Quest only when every page is in memory.
  const bool in_memory = o.config.disk_dir.empty() && o.config.hbm_bytes == 0 && o.config.host_bytes == 0;
  AttendStats stats;
  int64_t longest = 0;
  for (int64_t len : batch.lengths) longest = std::max(longest, len + o.decode_steps);
  Diagnostics diagnostics(std::size_t(B) * 2 * std::size_t(longest) * row * sizeof(float));
  struct Deferred {
    RunReport::DiagnosedCall call;
    std::vector<float> q, out;
    std::vector<PageSelection> sels;
  };
  auto head_pages = [](const std::vector<PageSelection>& sels) {
    int64_t n = 0;
    for (const PageSelection& s : sels) n += int64_t(s.pages.size());
    return n;
  };
  std::vector<Deferred> deferred;
  Progress bar("decode", o.decode_steps, o.progress);
  // The CUDA backend's phases are timed on every 4th step from step 1 (a
  // timed step is launched directly, not replayed from its graph; step 0
  // pays the one-off costs: module loads, graph captures, list growth); the
  // CPU's on all. Means per step are reported: the phases of a step add up
  // to at most its time, and so do their means (medians would not).
  auto timed_step = [&](int64_t step) {
    if (o.config.backend != Backend::kCuda) return true;
    return o.decode_steps == 1 || step % 4 == 1;
  };
  // Whether timing the phases changed how the step ran (see step_latency_us).
  auto instrumented = [&](int64_t step) {
    return o.config.backend == Backend::kCuda && timed_step(step) && o.decode_steps > 1;
  };
  int64_t timed_steps = 0;
  std::vector<double> enqueue_steps;
  std::unique_ptr<DeviceStep> device;
  if (o.device_decode) {
    device = std::make_unique<DeviceStep>(g, B);
    QKV_RETURN_IF_ERROR(device->Init());
  }
  std::vector<float> step_out;
  // Dense offload, measured on a few layers before the first step: every
  // page streamed from pinned host memory (at most 1 GiB of it, the rest
  // scaled). A layer none of whose pages has a host home (all in HBM or on
  // disk) is passed over; with none, the report has no offload time.
  if (o.config.backend == Backend::kCuda && o.decode_steps > 0)
    for (int layer = 0; layer < g.layers && r.offload_layers < 2; ++layer) {
      if (o.config.policy.is_dense(layer)) continue;
      int64_t bytes = 0;
      Result<double> us = rt.TimeDenseOffload(batch.ids, layer, std::size_t(1) << 30, 5, &bytes);
      if (!us.ok() && us.status().code() == Code::kFailedPrecondition) continue;
      QKV_RETURN_IF_ERROR(us.status());
      r.offload_us_per_layer += *us;
      ++r.offload_layers;
    }
  // What dense offload would stream at a layer this step: every page of it.
  auto count_offload = [&](int layer) -> Status {
    for (int b = 0; b < B; ++b) {
      QKV_ASSIGN_OR_RETURN(int64_t len, rt.Length(batch.ids[b], layer));
      const int64_t pages = (len + g.page_size - 1) / g.page_size;
      r.dense_offload_bytes += pages * int64_t(g.page_bytes());
    }
    return Status::Ok();
  };
  // The step's new K/V row and query of every sequence at a layer, into k, v, q.
  auto generate = [&](int layer, int64_t step) {
    for (int b = 0; b < B; ++b) {
      batch.workloads[b].Tokens(layer, batch.lengths[b] + step, 1, k.data() + b * row, v.data() + b * row);
      batch.workloads[b].Query(layer, step, q.data() + b * qstride);
    }
  };
  // The (sparse) layers a diagnosed step diagnoses.
  auto diagnosed_layer = [&](int layer) {
    return !o.config.policy.is_dense(layer) &&
           (o.recall_layers.empty() ||
            std::find(o.recall_layers.begin(), o.recall_layers.end(), layer) != o.recall_layers.end());
  };
  for (int64_t step = 0; step < o.decode_steps; ++step) {
    const bool diagnose = o.recall_every > 0 && step % o.recall_every == 0;
    const bool on_device = device != nullptr;
    stats.time_phases = timed_step(step);
    timed_steps += stats.time_phases;
    double step_seconds = 0;
    const TierStats step_before = rt.tier_stats();
    const int64_t graphs_before = stats.graphs_captured;
    const int64_t comparison_hits_before = comparison_hits, comparison_misses_before = comparison_misses;
    if (on_device) {
      std::vector<DeviceDiagnosis> diagnosed;
      std::vector<std::vector<float>> diagnosed_q;
      for (int layer = 0; layer < g.layers; ++layer) {
        generate(layer, step);
        device->Stage(layer, k.data(), v.data(), q.data());
        if (diagnose && diagnosed_layer(layer)) {
          diagnosed.push_back({layer, {}, 0});
          diagnosed_q.push_back(q);
        }
      }
      double enqueue_s = 0;
      QKV_ASSIGN_OR_RETURN(step_seconds, device->Run(rt, batch, stats, &append_us, &enqueue_s, &diagnosed));
      if (!diagnose) enqueue_steps.push_back(1e6 * enqueue_s);
      QKV_RETURN_IF_ERROR(device->Outputs(rt, step_out));
      for (int layer = 0; layer < g.layers; ++layer) {
        Digest(r.output_digest, step_out.data() + std::size_t(layer) * out.size(), out.size());
        QKV_RETURN_IF_ERROR(count_offload(layer));
      }
      for (std::size_t i = 0; i < diagnosed.size(); ++i) {
        DeviceDiagnosis& d = diagnosed[i];
        const float* o_layer = step_out.data() + std::size_t(d.layer) * out.size();
        RunReport::DiagnosedCall call{step, d.layer, head_pages(d.sels), d.skipped};
        deferred.push_back({call, std::move(diagnosed_q[i]), std::vector<float>(o_layer, o_layer + out.size()),
                            std::move(d.sels)});
      }
    }
    for (int layer = 0; !on_device && layer < g.layers; ++layer) {
      generate(layer, step);
      // Selections are read back only when the diagnostics need them, and
      // the call's skips counted.
      const bool diagnose_layer = diagnose && diagnosed_layer(layer);
      const int64_t skipped_before = diagnose_layer ? rt.tier_stats().pages_skipped : 0;
      const auto t0 = std::chrono::steady_clock::now();
      for (int b = 0; b < B; ++b)
        QKV_RETURN_IF_ERROR(rt.Append(batch.ids[b], layer, k.data() + b * row, v.data() + b * row, 1));
      const auto t1 = std::chrono::steady_clock::now();
      QKV_RETURN_IF_ERROR(rt.DecodeAttention(batch.ids, layer, q.data(), out.data(),
                                             diagnose_layer ? &sels : nullptr, &stats));
      const auto t2 = std::chrono::steady_clock::now();
      const int64_t skipped = diagnose_layer ? rt.tier_stats().pages_skipped - skipped_before : 0;
      append_us += 1e6 * std::chrono::duration<double>(t1 - t0).count();
      step_seconds += std::chrono::duration<double>(t2 - t0).count();
      if (diagnose_layer && in_memory) {
        // Dense attention in memory over the same K/V, for comparison; its
        // cache lookups are not part of the run's traffic.
        const TierStats before = rt.tier_stats();
        QKV_RETURN_IF_ERROR(rt.DenseAttention(batch.ids, layer, q.data(), dense_out.data()));
        const TierStats after = rt.tier_stats();
        comparison_hits += after.hbm_hits - before.hbm_hits;
        comparison_misses += after.hbm_misses - before.hbm_misses;
        r.compared_dense_us += 1e6 * std::chrono::duration<double>(std::chrono::steady_clock::now() - t2).count();
        r.compared_quest_us += 1e6 * std::chrono::duration<double>(t2 - t1).count();
        ++r.compared_layers;
      }
      Digest(r.output_digest, out.data(), out.size());
      QKV_RETURN_IF_ERROR(count_offload(layer));
      if (diagnose_layer) deferred.push_back({{step, layer, head_pages(sels), skipped}, q, out, sels});
    }
    {
      const TierStats after = rt.tier_stats();
      RunReport::StepRecord rec;
      rec.us = step_seconds * 1e6;
      // A diagnosed step of the device-pointer decode waited at its diagnosed layers.
      rec.instrumented = instrumented(step) || (device && diagnose);
      rec.graphs_captured = stats.graphs_captured - graphs_before;
      rec.query = batch.workloads[0].Target(step).kind;
      rec.hits = after.hbm_hits - step_before.hbm_hits - (comparison_hits - comparison_hits_before);
      rec.misses = after.hbm_misses - step_before.hbm_misses - (comparison_misses - comparison_misses_before);
      rec.host_link_bytes = HostLinkBytes(LinksOf(after)) - HostLinkBytes(LinksOf(step_before));
      rec.cold_misses = after.cold_misses - step_before.cold_misses;
      rec.cold_stalls = after.cold_stalls - step_before.cold_stalls;
      rec.pages_skipped = after.pages_skipped - step_before.pages_skipped;
      r.steps.push_back(rec);
      if (metrics) {
        TierStats t = after;
        t.hbm_hits -= comparison_hits;
        t.hbm_misses -= comparison_misses;
        metrics->ObserveStep(step_seconds * 1e6);
        metrics->Publish(t);
      }
    }
    r.pages_peak = std::max(r.pages_peak, rt.live_pages());
    if (!deferred.empty()) {
      const RunReport::Links before = LinksOf(rt.tier_stats());
      for (const Deferred& d : deferred)
        QKV_RETURN_IF_ERROR(diagnostics.Add(rt, o, batch, d.call, d.q.data(), d.out.data(), d.sels, r));
      QKV_RETURN_IF_ERROR(diagnostics.Finish(r));
      AddDiff(r.bytes_moved_diagnostics, LinksOf(rt.tier_stats()), before);
      deferred.clear();
    }
    bar.Update(step + 1);
  }
  std::vector<double> step_us, instrumented_us;
  for (const RunReport::StepRecord& rec : r.steps) (rec.instrumented ? instrumented_us : step_us).push_back(rec.us);
  r.step_latency_us = Summarise(std::move(step_us));
  r.step_latency_instrumented_us = Summarise(std::move(instrumented_us));
  if (r.offload_layers > 0) r.offload_us_per_layer /= r.offload_layers;
  r.comparison_hits = comparison_hits;
  r.comparison_misses = comparison_misses;
  const double steps = std::max<double>(1, double(o.decode_steps));
  const double timed = std::max<double>(1, double(timed_steps));
  r.step_breakdown_us = {append_us / steps, stats.select_us / timed, stats.resolve_us / timed, stats.attend_us / timed};
  r.enqueue_us = Summarise(std::move(enqueue_steps));
  TakeReadCounts(stats, r);
  if (r.diagnosed > 0) {
    const double n = r.diagnosed;
    r.page_recall /= n;
    r.attention_mass_recall /= n;
    r.output_rel_error /= n;
    r.selection_rel_error /= n;
    r.attended_rel_error /= n;
    r.slack_mean /= n;
    r.exact_pages_read_fraction /= n;
  }
  return Status::Ok();
}

}  // namespace

int64_t DiagnosedTokensMin(const RunOptions& o) { return o.context_tokens - 7 * int64_t(o.batch - 1) + 1; }

Status CheckRunOptions(const RunOptions& o) {
  if (o.context_tokens < 1) return Status::InvalidArgument("--context must be >= 1");
  if (o.decode_steps < 0) return Status::InvalidArgument("--steps must be >= 0");
  if (o.batch < 1) return Status::InvalidArgument("--batch must be >= 1");
  if (o.context_tokens - 7 * int64_t(o.batch - 1) < 1)
    return Status::InvalidArgument("--batch " + std::to_string(o.batch) + " needs --context " +
                                   std::to_string(7 * int64_t(o.batch - 1) + 1) + " or more (sequence b holds " +
                                   "--context - 7b tokens), not " + std::to_string(o.context_tokens));
  if (o.top_r < 1) return Status::InvalidArgument("--top-r must be >= 1");
  for (int layer : o.recall_layers) {
    if (layer < 0 || layer >= o.config.geometry.layers)
      return Status::InvalidArgument("--recall-layers: " + std::to_string(layer) + " is not a layer (0.." +
                                     std::to_string(o.config.geometry.layers - 1) + ")");
    if (o.config.policy.is_dense(layer))
      return Status::InvalidArgument("--recall-layers: layer " + std::to_string(layer) +
                                     " is dense (--dense-layers): it attends every page, there is no selection "
                                     "to diagnose");
  }
  const bool diagnoses = o.recall_every > 0 && o.decode_steps > 0;
  if (diagnoses && o.top_r > DiagnosedTokensMin(o))
    return Status::InvalidArgument(
        "--top-r " + std::to_string(o.top_r) + " is more than the " + std::to_string(DiagnosedTokensMin(o)) +
        " tokens the shortest sequence holds when first diagnosed (--context " + std::to_string(o.context_tokens) +
        (o.batch > 1 ? " - 7 x (--batch " + std::to_string(o.batch) + " - 1)" : "") +
        " + 1 decoded); lower --top-r, raise --context, or give --recall-every 0");
  return Status::Ok();
}

namespace {
volatile std::sig_atomic_t g_stop_lingering = 0;
void StopLingering(int) { g_stop_lingering = 1; }
}  // namespace

// The report is final: the server keeps serving it for `ms`, or until
// SIGTERM or SIGINT says the scraper is done (the run then ends normally).
void LingerForScrapes(int ms) {
  std::fprintf(stderr, "questkv: run done; metrics served for %d ms more (SIGTERM ends it)\n", ms);
  g_stop_lingering = 0;
  const auto old_term = std::signal(SIGTERM, StopLingering);
  const auto old_int = std::signal(SIGINT, StopLingering);
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (!g_stop_lingering && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::signal(SIGTERM, old_term);
  std::signal(SIGINT, old_int);
}

Result<RunReport> RunJob(const RunOptions& o, const std::function<void(const RunReport&)>& finished) {
  QKV_RETURN_IF_ERROR(CheckRunOptions(o));
  RunReport r;
  r.options = o;
  r.output_digest = 14695981039346656037ull;
  if (auto topo = DiscoverTopology(); topo.ok()) r.topology = topo->ToString();
  QKV_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> rt, Runtime::Create(o.config));
  std::unique_ptr<MetricsRegistry> metrics;
  std::unique_ptr<MetricsServer> server;
  if (o.metrics_port >= 0) {
    metrics = std::make_unique<MetricsRegistry>();
    QKV_ASSIGN_OR_RETURN(server, MetricsServer::Start(o.metrics_port, metrics.get()));
    std::fprintf(stderr, "questkv: metrics on http://127.0.0.1:%d/metrics\n", server->port());
  }
  QKV_ASSIGN_OR_RETURN(Batch batch, MakeBatch(*rt, o));
  const auto t0 = std::chrono::steady_clock::now();
  QKV_RETURN_IF_ERROR(o.gpu_workload ? PrefillOnGpu(*rt, o, batch) : Prefill(*rt, o, batch));
  r.prefill_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const RunReport::Links after_prefill = LinksOf(rt->tier_stats());
  r.bytes_moved_prefill = after_prefill;
  if (metrics) metrics->Publish(rt->tier_stats());
  QKV_RETURN_IF_ERROR(o.draft > 0 ? SpeculativeDecode(*rt, o, batch, r) : Decode(*rt, o, batch, r, metrics.get()));
  r.tiers = rt->tier_stats();
  r.tiers.hbm_hits -= r.comparison_hits;
  r.tiers.hbm_misses -= r.comparison_misses;
  AddDiff(r.bytes_moved, LinksOf(r.tiers), after_prefill);
  AddDiff(r.bytes_moved, RunReport::Links{}, r.bytes_moved_diagnostics);
  r.dense_kv_bytes = r.head_pages_total * int64_t(o.config.geometry.head_page_elems()) * 2 *
                     int64_t(DTypeBytes(o.config.geometry.dtype));
  if (server && o.metrics_linger_ms > 0) LingerForScrapes(o.metrics_linger_ms);
  for (SeqId id : batch.ids) QKV_RETURN_IF_ERROR(rt->Free(id));
  if (rt->live_pages() != 0) return Status::Internal(std::to_string(rt->live_pages()) + " pages leaked");
  if (finished) finished(r);
  return r;
}

namespace {
std::string Hex(uint64_t v) {
  char buf[20];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}
std::string Mib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", double(bytes) / (1 << 20));
  return buf;
}
}  // namespace

namespace {
template <typename... Args>
void Line(std::string& out, const char* fmt, Args... args) {
  char buf[512];
  std::snprintf(buf, sizeof buf, fmt, args...);
  out += buf;
}
double Pct(int64_t part, int64_t whole) { return whole ? 100.0 * double(part) / double(whole) : 0.0; }

// The diagnosed calls split by whether they skipped: skipped of selected
// head-pages, and the mean attended error of each side (0 where none).
struct SkipSummary {
  int64_t skipped = 0, selected = 0;
  int calls_skipping = 0;
  double error_skipping = 0, error_elsewhere = 0;
};
SkipSummary SummariseSkips(const std::vector<RunReport::DiagnosedCall>& calls) {
  SkipSummary s;
  int elsewhere = 0;
  for (const RunReport::DiagnosedCall& c : calls) {
    s.skipped += c.head_pages_skipped;
    s.selected += c.head_pages_selected;
    if (c.head_pages_skipped > 0) {
      ++s.calls_skipping;
      s.error_skipping += c.attended_rel_error;
    } else {
      ++elsewhere;
      s.error_elsewhere += c.attended_rel_error;
    }
  }
  if (s.calls_skipping > 0) s.error_skipping /= s.calls_skipping;
  if (elsewhere > 0) s.error_elsewhere /= elsewhere;
  return s;
}

// The steps of one query kind, summarised.
struct KindSummary {
  QueryKind kind = QueryKind::kRandom;
  int steps = 0;
  Percentiles us;
  int64_t hits = 0, misses = 0, host_link_bytes = 0;
};
std::vector<KindSummary> ByQueryKind(const std::vector<RunReport::StepRecord>& steps) {
  std::vector<KindSummary> out;
  for (QueryKind kind : {QueryKind::kRecent, QueryKind::kTopic, QueryKind::kEntity, QueryKind::kReversal,
                         QueryKind::kNeedle, QueryKind::kRandom}) {
    KindSummary k;
    k.kind = kind;
    std::vector<double> us;
    for (const RunReport::StepRecord& s : steps) {
      if (s.query != kind) continue;
      ++k.steps;
      if (!s.instrumented) us.push_back(s.us);
      k.hits += s.hits, k.misses += s.misses, k.host_link_bytes += s.host_link_bytes;
    }
    if (k.steps == 0) continue;  // (latency over its steps run as in production only)
    k.us = Summarise(std::move(us));
    out.push_back(k);
  }
  return out;
}
}  // namespace

std::string FormatReport(const RunReport& r) {
  const RunOptions& o = r.options;
  const SelectionPolicy& p = o.config.policy;
  const TierStats& t = r.tiers;
  std::string dense, out;
  for (int l : p.dense_layers) dense += (dense.empty() ? "" : ",") + std::to_string(l);
  const long long steps = static_cast<long long>(o.decode_steps);
  Line(out, "questkv run — %s backend\n", std::string(BackendName(o.config.backend)).c_str());
  Line(out, "  machine            %s\n", r.topology.c_str());
  Line(out, "  geometry           %s\n", o.config.geometry.ToString().c_str());
  Line(out, "  workload           %s, seed %llu, batch %d, context %lld tokens, %lld decode steps\n",
       std::string(WorkloadKindName(o.workload)).c_str(), static_cast<unsigned long long>(o.seed), o.batch,
       static_cast<long long>(o.context_tokens), steps);
  Line(out, "  policy             budget %lld tokens, sink %d + local %d pages, gqa %s, dense layers [%s]\n",
       static_cast<long long>(p.token_budget), p.sink_pages, p.local_pages, std::string(GqaModeName(p.gqa)).c_str(),
       dense.c_str());
  std::string cold(ColdMissPolicyName(o.config.cold_miss));
  if (o.config.cold_miss == ColdMissPolicy::kDeadline && o.config.deadline_skip_limit < 1) {
    char limit[64];
    std::snprintf(limit, sizeof limit, " (a call waits past %g%% skipped)", 100 * o.config.deadline_skip_limit);
    cold += limit;
  }
  Line(out, "  tiers              hbm %s (peak %s), host %s (peak %s), disk %s (peak %s), summaries %s; cold miss %s\n",
       Mib(int64_t(t.hbm_capacity_bytes)).c_str(), Mib(int64_t(t.hbm_peak_bytes)).c_str(),
       Mib(int64_t(t.host_capacity_bytes)).c_str(), Mib(int64_t(t.host_peak_bytes)).c_str(),
       Mib(int64_t(t.disk_capacity_bytes)).c_str(), Mib(int64_t(t.disk_peak_bytes)).c_str(),
       Mib(int64_t(t.summary_bytes)).c_str(), cold.c_str());
  Line(out, "  prefill            %.2f s\n", r.prefill_seconds);
  Line(out, "  decode calls       %s\n",
       o.device_decode ? "device pointers, every layer enqueued back to back (diagnosed layers wait)"
                       : "host floats, each call waits for its output");
  Line(out, "  step latency       p50 %.0f us, p99 %.0f us, mean %.0f us (all %d layers, whole batch)\n",
       r.step_latency_us.p50, r.step_latency_us.p99, r.step_latency_us.mean, o.config.geometry.layers);
  if (r.step_latency_instrumented_us.p50 > 0)
    Line(out, "                     steps timed phase by phase (launched directly, not replayed): p50 %.0f us, "
              "kept out of the above\n", r.step_latency_instrumented_us.p50);
  const RunReport::Breakdown& bd = r.step_breakdown_us;
  Line(out, "  step breakdown     append %.0f us, select %.0f us, resolve/fetch %.0f us, attend %.0f us (means)\n",
       bd.append, bd.select, bd.resolve, bd.attend);
  if (o.device_decode)
    Line(out, "  host enqueue       p50 %.0f us of the step (the rest is the GPU finishing)\n", r.enqueue_us.p50);
  if (r.compared_layers > 0)
    Line(out, "  against dense      %.0f us dense vs %.0f us Quest per sparse layer call (%d sampled): %.2fx\n",
         r.compared_dense_us / r.compared_layers, r.compared_quest_us / r.compared_layers, r.compared_layers,
         r.compared_quest_us > 0 ? r.compared_dense_us / r.compared_quest_us : 0.0);
  if (r.offload_layers > 0) {
    const double step_us = r.offload_us_per_layer * o.config.geometry.layers;
    Line(out, "  dense offload      %.0f us per step streaming every page (measured on %d layers, extrapolated "
              "to %d): Quest step %.1fx faster\n",
         step_us, r.offload_layers, o.config.geometry.layers,
         r.step_latency_us.p50 > 0 ? step_us / r.step_latency_us.p50 : 0.0);
  }
  Line(out, "  head-pages read    %lld of %lld (%.1f%%)\n", static_cast<long long>(r.head_pages_selected),
       static_cast<long long>(r.head_pages_total), Pct(r.head_pages_selected, r.head_pages_total));
  if (r.adaptive.rankings > 0) {
    const RunReport::Adaptive& a = r.adaptive;
    Line(out, "  adaptive budgets   %.1f pages a ranking (P95 %lld, max %lld), %.1f%% at the cap, %lld rankings\n",
         double(a.pages) / double(a.rankings), static_cast<long long>(a.pages_p95),
         static_cast<long long>(a.pages_max), Pct(a.cap_hits, a.rankings), static_cast<long long>(a.rankings));
  }
  Line(out, "  bytes read         K/V %s + summaries %s = %.1f%% of dense K/V %s\n", Mib(r.kv_bytes_read).c_str(),
       Mib(r.summary_bytes_read).c_str(), Pct(r.kv_bytes_read + r.summary_bytes_read, r.dense_kv_bytes),
       Mib(r.dense_kv_bytes).c_str());
  const RunReport::Links& m = r.bytes_moved;
  Line(out, "  bytes moved        host->hbm %s, hbm->host %s, host->disk %s, disk->host %s (decode steps)\n",
       Mib(m.host_to_hbm).c_str(), Mib(m.hbm_to_host).c_str(), Mib(m.host_to_disk).c_str(), Mib(m.disk_to_host).c_str());
  Line(out, "  host link          %s against dense offload %s: %.2f%% (%.1f%% saved)\n", Mib(HostLinkBytes(m)).c_str(),
       Mib(r.dense_offload_bytes).c_str(), Pct(HostLinkBytes(m), r.dense_offload_bytes),
       100.0 - Pct(HostLinkBytes(m), r.dense_offload_bytes));
  Line(out, "  hbm cache          hits %lld, misses %lld (%.1f%% hit), evictions %lld, read in place %lld\n",
       static_cast<long long>(t.hbm_hits), static_cast<long long>(t.hbm_misses), Pct(t.hbm_hits, t.hbm_hits + t.hbm_misses),
       static_cast<long long>(t.hbm_evictions), static_cast<long long>(t.hbm_bypasses));
  for (const KindSummary& k : ByQueryKind(r.steps))
    Line(out, "  %-18s %d steps, p50 %.0f us, host link %s a step, %.1f%% hit\n",
         ("query " + std::string(QueryKindName(k.kind))).c_str(), k.steps, k.us.p50,
         Mib(k.host_link_bytes / k.steps).c_str(), Pct(k.hits, k.hits + k.misses));
  Line(out, "  disk               cold misses %lld, stalls %lld (%lld calls past the skip limit), pages skipped %lld, "
       "demotions %lld, promotions %lld (%lld ahead of need), I/O errors %lld, corruptions %lld\n",
       static_cast<long long>(t.cold_misses), static_cast<long long>(t.cold_stalls),
       static_cast<long long>(t.deadline_waits), static_cast<long long>(t.pages_skipped),
       static_cast<long long>(t.demotions), static_cast<long long>(t.promotions),
       static_cast<long long>(t.prefetches),
       static_cast<long long>(t.io_errors), static_cast<long long>(t.corruptions));
  if (r.diagnosed == 0) {
    Line(out, "  recall             not sampled (--recall-every 0, or every layer dense)\n");
  } else {
    std::string layers = "every sparse layer";
    if (!o.recall_layers.empty()) {
      layers = "layers";
      for (std::size_t i = 0; i < o.recall_layers.size(); ++i)
        layers += (i ? "," : " ") + std::to_string(o.recall_layers[i]);
    }
    Line(out, "  recall (%d samples) page %.4f, attention mass %.4f, output rel. error %.2e (every %d steps, %s)\n",
         r.diagnosed, r.page_recall, r.attention_mass_recall, r.output_rel_error, o.recall_every, layers.c_str());
    Line(out, "  output error       of the selection %.2e; attended against the selection %.2e\n",
         r.selection_rel_error, r.attended_rel_error);
    const SkipSummary sk = SummariseSkips(r.diagnosed_calls);
    Line(out, "  skips at samples   %lld of %lld selected head-pages, in %d of %zu calls; attended error %.2e "
              "where skipped, %.2e elsewhere\n",
         static_cast<long long>(sk.skipped), static_cast<long long>(sk.selected), sk.calls_skipping,
         r.diagnosed_calls.size(), sk.error_skipping, sk.error_elsewhere);
    Line(out, "  slack / exact      mean slack %.3f; branch-and-bound read %.1f%% of pages for exact top-%d\n",
         r.slack_mean, 100 * r.exact_pages_read_fraction, o.top_r);
  }
  if (o.draft > 0) {
    const RunReport::Speculative& s = r.speculative;
    const double per = s.tokens ? 1.0 / double(s.tokens) : 0;
    Line(out, "  speculative        %d drafts a block at accept rate %.2f: %lld of %lld accepted, %lld tokens, "
              "%.1f tokens/s; per token %.1f head-pages, %.0f bytes host->hbm\n",
         o.draft, o.accept_rate, (long long)s.accepted, (long long)s.drafted, (long long)s.tokens, s.tokens_per_s,
         double(s.head_pages_selected) * per, double(r.bytes_moved.host_to_hbm) * per);
    Line(out, "  speculative time   %.1f s: append drafts %.1f%%, verify %.1f%%, rollback + accept %.1f%%\n", s.seconds,
         s.seconds > 0 ? 100 * s.append_seconds / s.seconds : 0, s.seconds > 0 ? 100 * s.verify_seconds / s.seconds : 0,
         s.seconds > 0 ? 100 * s.settle_seconds / s.seconds : 0);
  }
  Line(out, "  output digest      %s\n", Hex(r.output_digest).c_str());
  return out;
}

namespace {
void LinksJson(JsonWriter& j, std::string_view key, const RunReport::Links& l) {
  j.BeginObject(key)
      .Field("host_to_hbm", l.host_to_hbm)
      .Field("hbm_to_host", l.hbm_to_host)
      .Field("host_to_disk", l.host_to_disk)
      .Field("disk_to_host", l.disk_to_host)
      .EndObject();
}
void TierJson(JsonWriter& j, std::string_view key, uint64_t capacity, uint64_t peak, uint64_t used) {
  j.BeginObject(key).Field("capacity_bytes", capacity).Field("peak_bytes", peak).Field("used_bytes", used).EndObject();
}
}  // namespace

std::string ReportJson(const RunReport& r) {
  const RunOptions& o = r.options;
  const Geometry& g = o.config.geometry;
  const SelectionPolicy& p = o.config.policy;
  JsonWriter j;
  j.BeginObject();
  j.Field("backend", BackendName(o.config.backend)).Field("machine", r.topology);
  j.BeginObject("geometry")
      .Field("layers", g.layers)
      .Field("q_heads", g.q_heads)
      .Field("kv_heads", g.kv_heads)
      .Field("head_dim", g.head_dim)
      .Field("page_size", g.page_size)
      .Field("dtype", DTypeName(g.dtype))
      .Field("summary_dtype", SummaryDTypeName(g.summary_dtype))
      .EndObject();
  j.Field("workload", WorkloadKindName(o.workload)).Field("seed", o.seed).Field("batch", o.batch);
  j.Field("context_tokens", o.context_tokens).Field("decode_steps", o.decode_steps);
  j.Field("token_budget", p.token_budget).Field("sink_pages", p.sink_pages).Field("local_pages", p.local_pages);
  j.Field("gqa", GqaModeName(p.gqa)).Field("block_selection", BlockSelectionName(p.block_selection));
  j.Field("rerank", p.rerank);
  j.Field("group_pages", p.group_pages);
  j.Field("unread_bound_mass", p.unread_bound_mass).Field("adaptive_floor", p.adaptive_floor);
  j.BeginArray("dense_layers");
  for (int l : p.dense_layers) j.Value(l);
  j.EndArray();
  LinksJson(j, "bytes_moved", r.bytes_moved);
  LinksJson(j, "bytes_moved_prefill", r.bytes_moved_prefill);
  LinksJson(j, "bytes_moved_diagnostics", r.bytes_moved_diagnostics);
  j.Field("dense_offload_bytes", r.dense_offload_bytes);
  const int64_t link = HostLinkBytes(r.bytes_moved);
  j.Field("host_link_bytes", link);
  j.Field("pcie_saved", r.dense_offload_bytes ? 1.0 - double(link) / double(r.dense_offload_bytes) : 0.0);
  const TierStats& t = r.tiers;
  j.Field("cold_miss", ColdMissPolicyName(r.options.config.cold_miss));
  j.Field("deadline_skip_limit", r.options.config.deadline_skip_limit);
  j.BeginObject("tiers");
  TierJson(j, "hbm", t.hbm_capacity_bytes, t.hbm_peak_bytes, t.hbm_used_bytes);
  TierJson(j, "host", t.host_capacity_bytes, t.host_peak_bytes, t.host_used_bytes);
  TierJson(j, "disk", t.disk_capacity_bytes, t.disk_peak_bytes, t.disk_used_bytes);
  j.Field("summary_bytes", t.summary_bytes);
  j.EndObject();
  j.BeginObject("hbm_cache")
      .Field("hits", t.hbm_hits)
      .Field("misses", t.hbm_misses)
      .Field("hit_rate", t.hbm_hits + t.hbm_misses ? double(t.hbm_hits) / double(t.hbm_hits + t.hbm_misses) : 0.0)
      .Field("evictions", t.hbm_evictions)
      .Field("read_in_place", t.hbm_bypasses)
      .EndObject();
  j.BeginObject("disk_events")
      .Field("cold_misses", t.cold_misses)
      .Field("cold_stalls", t.cold_stalls)
      .Field("pages_skipped", t.pages_skipped)
      .Field("deadline_waits", t.deadline_waits)
      .Field("demotions", t.demotions)
      .Field("promotions", t.promotions)
      .Field("clean_drops", t.clean_drops)
      .Field("prefetches", t.prefetches)
      .Field("deferred_seals", t.deferred_seals)
      .Field("demotion_orders", t.demotion_orders)
      .Field("io_errors", t.io_errors)
      .Field("corruptions", t.corruptions)
      .EndObject();
  j.Field("kv_bytes_read", r.kv_bytes_read).Field("summary_bytes_read", r.summary_bytes_read);
  j.Field("rerank_key_bytes", r.rerank_key_bytes);
  j.BeginObject("adaptive")
      .Field("rankings", r.adaptive.rankings)
      .Field("pages", r.adaptive.pages)
      .Field("pages_p95", r.adaptive.pages_p95)
      .Field("pages_max", r.adaptive.pages_max)
      .Field("cap_hits", r.adaptive.cap_hits)
      .EndObject();
  j.Field("dense_kv_bytes", r.dense_kv_bytes);
  j.Field("head_pages_selected", r.head_pages_selected).Field("head_pages_total", r.head_pages_total);
  j.Field("pages_peak", uint64_t(r.pages_peak));
  j.BeginObject("recall")
      .Field("samples", r.diagnosed)
      .Field("top_r", o.top_r)
      .Field("page", r.page_recall)
      .Field("attention_mass", r.attention_mass_recall)
      .Field("output_rel_error", r.output_rel_error)
      .Field("selection_rel_error", r.selection_rel_error)
      .Field("attended_rel_error", r.attended_rel_error)
      .Field("slack_mean", r.slack_mean)
      .Field("exact_pages_read_fraction", r.exact_pages_read_fraction)
      .Field("every", o.recall_every)
      .BeginArray("layers");  // empty: every sparse layer
  for (int layer : o.recall_layers) j.Value(int64_t(layer));
  j.EndArray().BeginArray("calls");
  for (const RunReport::DiagnosedCall& c : r.diagnosed_calls)
    j.BeginObject()
        .Field("step", c.step)
        .Field("layer", c.layer)
        .Field("head_pages_selected", c.head_pages_selected)
        .Field("head_pages_skipped", c.head_pages_skipped)
        .Field("selection_rel_error", c.selection_rel_error)
        .Field("attended_rel_error", c.attended_rel_error)
        .EndObject();
  j.EndArray().EndObject();
  j.BeginObject("step_latency_us")
      .Field("p50", r.step_latency_us.p50)
      .Field("p99", r.step_latency_us.p99)
      .Field("mean", r.step_latency_us.mean)
      .EndObject();
  j.BeginObject("step_latency_instrumented_us")
      .Field("p50", r.step_latency_instrumented_us.p50)
      .Field("p99", r.step_latency_instrumented_us.p99)
      .Field("mean", r.step_latency_instrumented_us.mean)
      .EndObject();
  j.BeginObject("enqueue_us").Field("p50", r.enqueue_us.p50).Field("p99", r.enqueue_us.p99).EndObject();
  j.BeginObject("step_breakdown_us")
      .Field("append", r.step_breakdown_us.append)
      .Field("select", r.step_breakdown_us.select)
      .Field("resolve", r.step_breakdown_us.resolve)
      .Field("attend", r.step_breakdown_us.attend)
      .EndObject();
  if (r.compared_layers > 0)
    j.BeginObject("dense_comparison")
        .Field("layer_calls", r.compared_layers)
        .Field("dense_us", r.compared_dense_us / r.compared_layers)
        .Field("quest_us", r.compared_quest_us / r.compared_layers)
        .EndObject();
  if (r.offload_layers > 0) {
    const double step_us = r.offload_us_per_layer * g.layers;
    j.BeginObject("dense_offload_time")
        .Field("measured_layers", r.offload_layers)
        .Field("us_per_layer", r.offload_us_per_layer)
        .Field("step_us_extrapolated", step_us)
        .Field("quest_speedup", r.step_latency_us.p50 > 0 ? step_us / r.step_latency_us.p50 : 0.0)
        .EndObject();
  }
  j.BeginArray("by_query");
  for (const KindSummary& k : ByQueryKind(r.steps))
    j.BeginObject()
        .Field("query", QueryKindName(k.kind))
        .Field("steps", k.steps)
        .Field("p50_us", k.us.p50)
        .Field("mean_us", k.us.mean)
        .Field("hits", k.hits)
        .Field("misses", k.misses)
        .Field("host_link_bytes", k.host_link_bytes)
        .EndObject();
  j.EndArray();
  j.BeginArray("per_step");
  for (const RunReport::StepRecord& s : r.steps)
    j.BeginObject()
        .Field("us", s.us)
        .Field("instrumented", s.instrumented)
        .Field("query", QueryKindName(s.query))
        .Field("hits", s.hits)
        .Field("misses", s.misses)
        .Field("host_link_bytes", s.host_link_bytes)
        .Field("cold_misses", s.cold_misses)
        .Field("cold_stalls", s.cold_stalls)
        .Field("pages_skipped", s.pages_skipped)
        .Field("graphs_captured", s.graphs_captured)
        .EndObject();
  j.EndArray();
  j.Field("prefill_seconds", r.prefill_seconds);
  j.Field("decode_api", o.device_decode ? "device" : "host");
  if (o.draft > 0)
    j.BeginObject("speculative")
        .Field("draft", o.draft)
        .Field("accept_rate", o.accept_rate)
        .Field("drafted", r.speculative.drafted)
        .Field("accepted", r.speculative.accepted)
        .Field("seconds", r.speculative.seconds)
        .Field("append_seconds", r.speculative.append_seconds)
        .Field("verify_seconds", r.speculative.verify_seconds)
        .Field("settle_seconds", r.speculative.settle_seconds)
        .Field("tokens", r.speculative.tokens)
        .Field("tokens_per_s", r.speculative.tokens_per_s)
        .Field("head_pages_selected", r.speculative.head_pages_selected)
        .EndObject();
  j.Field("output_digest", Hex(r.output_digest));
  j.EndObject();
  return j.str();
}

}  // namespace questkv::cli
