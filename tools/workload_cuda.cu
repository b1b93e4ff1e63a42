// DeviceWorkload: Workload::Tokens on the GPU (tools/workload_cuda.h says
// how the bits are kept equal to the CPU's). Each device step below names
// the CPU code in tools/workload.cc it repeats.
#include "tools/workload_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace questkv {
namespace {

// ---- The counter-based generator (workload.cc: Mix64, Draw) --------------------

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

__device__ __forceinline__ uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__device__ __forceinline__ uint64_t Draw(uint64_t key, uint64_t index) { return Mix64(key + kGolden * (index + 1)); }

// ---- FillNormal's libm calls -------------------------------------------------------
// A draw's top 24 bits give u1 = (i + 1) 2^-24 and logf(u1); its low 24 bits
// give u2 = i 2^-24, angle = 2pi_f * u2 and sinf/cosf(angle). Both inputs
// are exact floats; the angle is one rounded multiply on either side.

constexpr int kLibmInputBits = 24;
constexpr uint32_t kLibmInputs = 1u << kLibmInputBits;
constexpr uint32_t kLibmWords = kLibmInputs / 32;
constexpr float kTwoPi = 0x1.921fb6p+2f;  // 2.0f * std::numbers::pi_v<float>, FillNormal's kTwoPi

__host__ __device__ __forceinline__ float U1(uint32_t i) { return float(i + 1) * 0x1.0p-24f; }
__host__ __device__ __forceinline__ float U2(uint32_t i) { return float(i) * 0x1.0p-24f; }

// The device's own values, rounded from double. Not inlined, so that the
// reference kernel and the generator run the very same code.
__device__ __noinline__ float RawLog(uint32_t i) { return __double2float_rn(log(double(U1(i)))); }

__device__ __noinline__ float2 RawCosSin(uint32_t i) {
  double s, c;
  sincos(double(__fmul_rn(kTwoPi, U2(i))), &s, &c);
  return make_float2(__double2float_rn(c), __double2float_rn(s));
}

// Inputs where the host's libm differs from the Raw* values: a bitmap of
// 32-input words, each with the number of patched inputs in earlier words,
// and the host's values in input order.
struct LibmPatchView {
  const uint2* log_words = nullptr;  // [kLibmWords] {bits, rank of the word's first}
  const float* log_values = nullptr;
  const uint2* cos_sin_words = nullptr;
  const float2* cos_sin_values = nullptr;  // (cos, sin)
};

template <typename V>
__device__ __forceinline__ const V* Patched(const uint2* words, const V* values, uint32_t i) {
  const uint2 w = __ldg(&words[i >> 5]);
  const uint32_t bit = 1u << (i & 31);
  return (w.x & bit) ? &values[w.y + __popc(w.x & (bit - 1))] : nullptr;
}

// FillNormal's pair from one draw: (radius cos, radius sin).
__device__ __forceinline__ float2 NormalPair(uint64_t bits, const LibmPatchView& m) {
  const uint32_t li = uint32_t(bits >> 40);
  const uint32_t ai = uint32_t(bits) & (kLibmInputs - 1);
  const float* pl = Patched(m.log_words, m.log_values, li);
  const float lg = pl ? *pl : RawLog(li);
  const float2* pa = Patched(m.cos_sin_words, m.cos_sin_values, ai);
  const float2 cs = pa ? *pa : RawCosSin(ai);
  const float radius = __fsqrt_rn(__fmul_rn(-2.0f, lg));
  return make_float2(__fmul_rn(radius, cs.x), __fmul_rn(radius, cs.y));
}

// workload.cc's Dot (products of floats are exact in double; the sum runs in
// the same order) and Normalize's scale.
__device__ __forceinline__ double DotSeq(const float* a, const float* b, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) s = __dadd_rn(s, __dmul_rn(double(a[i]), double(b[i])));
  return s;
}

__device__ __forceinline__ float InvNorm(double squared) {
  const double norm = __dsqrt_rn(squared);
  return norm > 0 ? __double2float_rn(__ddiv_rn(1.0, norm)) : 0.0f;
}

// out += scale * x, rounded twice as on the CPU.
__device__ __forceinline__ float AddScaled(float out, float scale, float x) { return __fadd_rn(out, __fmul_rn(scale, x)); }

// ---- Tables on the device ------------------------------------------------------------

struct Tables {
  int heads = 0, dim = 0, pairs = 0;
  bool structured = false;
  const uint64_t* key_noise = nullptr;    // [L][Hkv]
  const uint64_t* value_noise = nullptr;  // [L][Hkv]
  const uint64_t* anchor_keys = nullptr;  // [L][Hkv][topics]
  WorkloadTokenTables::Constants c;
  const int64_t* span_begins = nullptr;  // [spans + 1]
  int64_t spans = 0;
  const int* span_topics = nullptr;
  const WorkloadTokenTables::Run* runs = nullptr;
  int64_t num_runs = 0;
  const float* key_dirs = nullptr;  // [L][Hkv][dirs][D]
  const float* value_dirs = nullptr;
  LibmPatchView libm;
};

// One piece of a Tokens call: tokens [begin, begin + n) of a layer, with the
// anchors of knots [knot0, knot0 + knots).
struct Piece {
  int layer = 0;
  int64_t begin = 0, n = 0;
  int64_t knot0 = 0, knots = 0;
  float* anchors = nullptr;  // [knots][Hkv][topics][D]
  void* k = nullptr;
  void* v = nullptr;
};

// ---- Anchors (workload.cc: Anchor) -----------------------------------------------------
// One block per (knot, head, topic); the noise in parallel, the sums in
// thread 0 in the CPU's order.
__global__ void AnchorsKernel(Tables t, Piece p) {
  extern __shared__ float x[];  // [D]
  __shared__ float coef;
  const int dim = t.dim;
  const int64_t count = p.knots * t.heads * t.c.topics;
  for (int64_t id = blockIdx.x; id < count; id += gridDim.x) {
    const int topic = int(id % t.c.topics);
    const int h = int(id / t.c.topics % t.heads);
    const int64_t knot = p.knot0 + id / (int64_t(t.c.topics) * t.heads);
    const int64_t head = int64_t(p.layer) * t.heads + h;
    const uint64_t key = t.anchor_keys[head * t.c.topics + topic];
    for (int j = threadIdx.x; j < t.pairs; j += blockDim.x) {
      const float2 z = NormalPair(Draw(key, uint64_t(knot) * t.pairs + j), t.libm);
      x[2 * j] = z.x;
      if (2 * j + 1 < dim) x[2 * j + 1] = z.y;
    }
    __syncthreads();
    // ProjectOut: x -= float(x . b) b for each basis direction in turn.
    const float* basis = t.key_dirs + std::size_t(head) * t.c.dirs * dim;
    for (int b = 0; b < t.c.basis_dirs; ++b) {
      if (threadIdx.x == 0) coef = __double2float_rn(DotSeq(x, basis + std::size_t(b) * dim, dim));
      __syncthreads();
      for (int d = threadIdx.x; d < dim; d += blockDim.x)
        x[d] = __fsub_rn(x[d], __fmul_rn(coef, basis[std::size_t(b) * dim + d]));
      __syncthreads();
    }
    if (threadIdx.x == 0) coef = InvNorm(DotSeq(x, x, dim));
    __syncthreads();
    const float* topic_dir = basis + std::size_t(t.c.topic_dir0 + topic) * dim;
    float* out = p.anchors + std::size_t(id) * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x)
      out[d] = __fadd_rn(__fmul_rn(t.c.anchor_fixed, topic_dir[d]), __fmul_rn(t.c.anchor_drift, __fmul_rn(x[d], coef)));
    __syncthreads();
  }
}

// ---- Tokens (workload.cc: Tokens, RoleCursor, AddSignal, CentroidCache) -------------------

enum Kind : int { kTopicRow, kSinkRow, kSpecialRow };

// The role of a structured position: RoleCursor::role and topic.
__device__ __forceinline__ void RoleOf(const Tables& t, int64_t pos, int* kind, int* dir_or_topic) {
  if (pos < t.c.sink_tokens) {
    *kind = kSinkRow;
    *dir_or_topic = t.c.sink_dir;
    return;
  }
  int64_t lo = 0, hi = t.num_runs;  // first run with end > pos
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (t.runs[mid].end <= pos) lo = mid + 1; else hi = mid;
  }
  if (lo < t.num_runs && t.runs[lo].begin <= pos) {
    *kind = kSpecialRow;
    *dir_or_topic = t.runs[lo].dir;
    return;
  }
  lo = 0, hi = t.spans + 1;  // upper_bound(span_begins, pos) - 1
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (t.span_begins[mid] <= pos) lo = mid + 1; else hi = mid;
  }
  *kind = kTopicRow;
  *dir_or_topic = t.span_topics[lo - 1];
}

template <typename T>
__device__ __forceinline__ void Store(void* out, std::size_t at, float x) {
  if constexpr (std::is_same_v<T, float>) static_cast<float*>(out)[at] = x;
  else if constexpr (std::is_same_v<T, __half>) static_cast<__half*>(out)[at] = __float2half_rn(x);
  else static_cast<__nv_bfloat16*>(out)[at] = __float2bfloat16_rn(x);
}

// Rows (token, head) in token-major order, `rows_per_block` to a block of
// rows_per_block * pairs threads; a thread owns elements 2j and 2j+1 of its
// row's K and V. A topic row's centroid norm is summed by the row's thread 0
// in element order.
template <typename T>
__global__ void TokensKernel(Tables t, Piece p, int rows_per_block) {
  extern __shared__ float smem[];
  float* blend = smem;                              // [rows_per_block][D]
  float* inv_norm = smem + rows_per_block * t.dim;  // [rows_per_block]
  const int dim = t.dim;
  const int r = threadIdx.x / t.pairs;
  const int j = threadIdx.x % t.pairs;
  const int d0 = 2 * j;
  const bool has1 = d0 + 1 < dim;
  const int64_t rows = p.n * t.heads;
  const int64_t tiles = (rows + rows_per_block - 1) / rows_per_block;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t row = tile * rows_per_block + r;
    const bool valid = row < rows;
    const int64_t pos = p.begin + (valid ? row / t.heads : 0);
    const int h = int(row % t.heads);
    const int64_t head = int64_t(p.layer) * t.heads + h;
    float2 k = make_float2(0, 0), v = make_float2(0, 0);
    if (valid) {
      k = NormalPair(Draw(t.key_noise[head], uint64_t(pos) * t.pairs + j), t.libm);
      v = NormalPair(Draw(t.value_noise[head], uint64_t(pos) * t.pairs + j), t.libm);
    }
    if (t.structured) {  // uniform over the grid: the barriers below are reached by all
      int kind = kSinkRow, which = 0;
      if (valid) RoleOf(t, pos, &kind, &which);
      const bool topic_row = valid && kind == kTopicRow;
      float* row_blend = blend + r * dim;
      if (topic_row) {  // CentroidCache::Get: (1 - f) lo + f hi
        const int64_t knot = pos / t.c.drift_tokens;
        const float f = float(pos - knot * t.c.drift_tokens) / float(t.c.drift_tokens);
        const std::size_t knot_stride = std::size_t(t.heads) * t.c.topics * dim;
        const float* lo = p.anchors + (knot - p.knot0) * knot_stride + (std::size_t(h) * t.c.topics + which) * dim;
        const float* hi = lo + knot_stride;
        row_blend[d0] = __fadd_rn(__fmul_rn(1.0f - f, lo[d0]), __fmul_rn(f, hi[d0]));
        if (has1) row_blend[d0 + 1] = __fadd_rn(__fmul_rn(1.0f - f, lo[d0 + 1]), __fmul_rn(f, hi[d0 + 1]));
      }
      __syncthreads();
      if (topic_row && j == 0) inv_norm[r] = InvNorm(DotSeq(row_blend, row_blend, dim));
      __syncthreads();
      if (valid) {  // AddSignal
        const float* kd = t.key_dirs + std::size_t(head) * t.c.dirs * dim;
        const float* vd = t.value_dirs + std::size_t(head) * t.c.dirs * dim;
        if (kind == kSinkRow) {
          const float* dir = kd + std::size_t(which) * dim;
          k.x = AddScaled(k.x, t.c.sink_key_scale, dir[d0]);
          v.x = __fmul_rn(v.x, t.c.sink_value_scale);
          if (has1) {
            k.y = AddScaled(k.y, t.c.sink_key_scale, dir[d0 + 1]);
            v.y = __fmul_rn(v.y, t.c.sink_value_scale);
          }
        } else {
          const int vdir = kind == kTopicRow ? t.c.topic_dir0 + which : which;
          const float* vdv = vd + std::size_t(vdir) * dim;
          float k0, k1 = 0;
          if (kind == kTopicRow) {
            const float inv = inv_norm[r];
            k0 = __fmul_rn(row_blend[d0], inv);
            if (has1) k1 = __fmul_rn(row_blend[d0 + 1], inv);
          } else {
            k0 = kd[std::size_t(which) * dim + d0];
            if (has1) k1 = kd[std::size_t(which) * dim + d0 + 1];
          }
          k.x = AddScaled(k.x, t.c.key_scale, k0);
          v.x = AddScaled(v.x, t.c.value_scale, vdv[d0]);
          if (has1) {
            k.y = AddScaled(k.y, t.c.key_scale, k1);
            v.y = AddScaled(v.y, t.c.value_scale, vdv[d0 + 1]);
          }
        }
      }
    }
    if (valid) {
      const std::size_t at = std::size_t(row) * dim + d0;
      Store<T>(p.k, at, k.x);
      Store<T>(p.v, at, v.x);
      if (has1) {
        Store<T>(p.k, at + 1, k.y);
        Store<T>(p.v, at + 1, v.y);
      }
    }
  }
}

// The device's Raw* values of inputs [first, first + count).
__global__ void LibmRawKernel(uint32_t first, uint32_t count, float* logs, float2* cos_sin) {
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) {
    logs[i] = RawLog(first + i);
    cos_sin[i] = RawCosSin(first + i);
  }
}

// ---- Host side ----------------------------------------------------------------------

Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  const std::string m = std::string(what) + ": " + cudaGetErrorString(e);
  if (e == cudaErrorMemoryAllocation) return Status::ResourceExhausted(m);
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver || e == cudaErrorInitializationError)
    return Status::FailedPrecondition("no usable CUDA device: " + m);
  return Status::Internal(m);
}

uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

// The host libm's values, as FillNormal calls it (g++ merges its std::cos
// and std::sin into one sincosf call; glibc's sinf and cosf give the same).
float HostLog(uint32_t i) { return std::log(U1(i)); }
float2 HostCosSin(uint32_t i) {
  const float angle = kTwoPi * U2(i);
  return make_float2(std::cos(angle), std::sin(angle));
}

struct HostLibmPatch {
  std::vector<uint2> log_words, cos_sin_words;
  std::vector<float> log_values;
  std::vector<float2> cos_sin_values;
};

// Ranks the set bits of `bits` and gathers the host values of their inputs.
template <typename V, typename F>
void FinishPatch(const std::vector<uint32_t>& bits, F host_value, std::vector<uint2>* words, std::vector<V>* values) {
  words->resize(kLibmWords);
  uint32_t rank = 0;
  for (uint32_t w = 0; w < kLibmWords; ++w) {
    (*words)[w] = make_uint2(bits[w], rank);
    for (uint32_t b = 0; b < 32; ++b)
      if (bits[w] >> b & 1u) values->push_back(host_value(w * 32 + b));
    rank += uint32_t(__builtin_popcount(bits[w]));
  }
}

Result<std::shared_ptr<const HostLibmPatch>> BuildLibmPatch() {
  constexpr uint32_t kChunk = 1u << 22;
  float* d_logs = nullptr;
  float2* d_cos_sin = nullptr;
  QKV_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&d_logs, kChunk * sizeof(float)), "cudaMalloc"));
  cudaError_t e = cudaMalloc(&d_cos_sin, kChunk * sizeof(float2));
  std::vector<float> logs(kChunk);
  std::vector<float2> cos_sin(kChunk);
  std::vector<uint32_t> log_bits(kLibmWords, 0), cos_sin_bits(kLibmWords, 0);
  const int threads = int(std::clamp(std::thread::hardware_concurrency(), 1u, 8u));
  for (uint32_t first = 0; first < kLibmInputs && e == cudaSuccess; first += kChunk) {
    LibmRawKernel<<<1024, 256>>>(first, kChunk, d_logs, d_cos_sin);
    e = cudaGetLastError();
    if (e == cudaSuccess) e = cudaMemcpy(logs.data(), d_logs, kChunk * sizeof(float), cudaMemcpyDeviceToHost);
    if (e == cudaSuccess)
      e = cudaMemcpy(cos_sin.data(), d_cos_sin, kChunk * sizeof(float2), cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) break;
    // Threads own whole 32-input words.
    const uint32_t words = kChunk / 32, per = (words + threads - 1) / threads;
    std::vector<std::thread> pool;
    for (int th = 0; th < threads; ++th)
      pool.emplace_back([&, th] {
        for (uint32_t w = th * per; w < std::min(words, (th + 1) * per); ++w)
          for (uint32_t b = 0; b < 32; ++b) {
            const uint32_t local = w * 32 + b, i = first + local;
            const uint32_t bit = 1u << b, word = i >> 5;
            if (Bits(HostLog(i)) != Bits(logs[local])) log_bits[word] |= bit;
            const float2 cs = HostCosSin(i);
            if (Bits(cs.x) != Bits(cos_sin[local].x) || Bits(cs.y) != Bits(cos_sin[local].y))
              cos_sin_bits[word] |= bit;
          }
      });
    for (std::thread& th : pool) th.join();
  }
  cudaFree(d_logs);
  cudaFree(d_cos_sin);
  QKV_RETURN_IF_ERROR(CudaStatus(e, "libm reference"));
  auto patch = std::make_shared<HostLibmPatch>();
  FinishPatch(log_bits, HostLog, &patch->log_words, &patch->log_values);
  FinishPatch(cos_sin_bits, HostCosSin, &patch->cos_sin_words, &patch->cos_sin_values);
  return std::shared_ptr<const HostLibmPatch>(std::move(patch));
}

// Built once per process; a failure is retried by the next call.
Result<std::shared_ptr<const HostLibmPatch>> LibmPatch() {
  static std::mutex mu;
  static std::shared_ptr<const HostLibmPatch> cached;
  std::lock_guard<std::mutex> lock(mu);
  if (!cached) {
    QKV_ASSIGN_OR_RETURN(cached, BuildLibmPatch());
  }
  return cached;
}

// Tokens per launch pair (anchors, tokens): bounds the anchor scratch.
constexpr int64_t kPieceKnots = 32;
constexpr int kBlockThreads = 256;

}  // namespace

struct DeviceWorkload::Impl {
  explicit Impl(const Workload& w) : workload(w) {}
  ~Impl() {
    for (void* p : allocations) cudaFree(p);
  }

  template <typename T>
  Status Upload(const std::vector<T>& host, const T** out) {
    *out = nullptr;
    if (host.empty()) return Status::Ok();
    void* p = nullptr;
    QKV_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&p, host.size() * sizeof(T)), "cudaMalloc"));
    allocations.push_back(p);
    QKV_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy"));
    *out = static_cast<const T*>(p);
    return Status::Ok();
  }

  Workload workload;
  int device = 0;
  Tables tables;
  LibmPatches patches;
  std::vector<void*> allocations;
};

DeviceWorkload::DeviceWorkload(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DeviceWorkload::~DeviceWorkload() = default;

const Workload& DeviceWorkload::workload() const { return impl_->workload; }
DeviceWorkload::LibmPatches DeviceWorkload::libm_patches() const { return impl_->patches; }

Result<std::unique_ptr<DeviceWorkload>> DeviceWorkload::Create(const Workload& workload) {
  int count = 0;
  QKV_RETURN_IF_ERROR(CudaStatus(cudaGetDeviceCount(&count), "cudaGetDeviceCount"));
  if (count == 0) return Status::FailedPrecondition("no CUDA device");
  auto impl = std::make_unique<Impl>(workload);
  QKV_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&impl->device), "cudaGetDevice"));
  int pools = 0;
  QKV_RETURN_IF_ERROR(CudaStatus(
      cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, impl->device), "cudaDeviceGetAttribute"));
  if (!pools) return Status::FailedPrecondition("the CUDA device has no stream-ordered allocator");

  QKV_ASSIGN_OR_RETURN(std::shared_ptr<const HostLibmPatch> patch, LibmPatch());
  Tables& t = impl->tables;
  QKV_RETURN_IF_ERROR(impl->Upload(patch->log_words, &t.libm.log_words));
  QKV_RETURN_IF_ERROR(impl->Upload(patch->log_values, &t.libm.log_values));
  QKV_RETURN_IF_ERROR(impl->Upload(patch->cos_sin_words, &t.libm.cos_sin_words));
  QKV_RETURN_IF_ERROR(impl->Upload(patch->cos_sin_values, &t.libm.cos_sin_values));
  impl->patches = {int64_t(patch->log_values.size()), int64_t(patch->cos_sin_values.size())};

  const Geometry& g = workload.geometry();
  const WorkloadTokenTables src = workload.TokenTables();
  t.heads = g.kv_heads;
  t.dim = g.head_dim;
  t.pairs = (g.head_dim + 1) / 2;
  t.structured = src.structured;
  QKV_RETURN_IF_ERROR(impl->Upload(src.key_noise, &t.key_noise));
  QKV_RETURN_IF_ERROR(impl->Upload(src.value_noise, &t.value_noise));
  if (t.structured) {
    QKV_RETURN_IF_ERROR(impl->Upload(src.anchor_keys, &t.anchor_keys));
    t.c = src.constants;
    QKV_RETURN_IF_ERROR(impl->Upload(src.span_begins, &t.span_begins));
    t.spans = int64_t(src.span_begins.size()) - 1;
    QKV_RETURN_IF_ERROR(impl->Upload(src.span_topics, &t.span_topics));
    QKV_RETURN_IF_ERROR(impl->Upload(src.runs, &t.runs));
    t.num_runs = int64_t(src.runs.size());
    QKV_RETURN_IF_ERROR(impl->Upload(src.key_dirs, &t.key_dirs));
    QKV_RETURN_IF_ERROR(impl->Upload(src.value_dirs, &t.value_dirs));
  }
  return std::unique_ptr<DeviceWorkload>(new DeviceWorkload(std::move(impl)));
}

Status DeviceWorkload::Tokens(int layer, int64_t begin, int64_t n, void* k_dev, void* v_dev, DType dtype,
                              cudaStream_t stream) const {
  const Impl& im = *impl_;
  const Tables& t = im.tables;
  const int64_t total = im.workload.total_tokens();
  if (layer < 0 || layer >= im.workload.geometry().layers)
    return Status::InvalidArgument("layer " + std::to_string(layer) + " is not in [0, " +
                                   std::to_string(im.workload.geometry().layers) + ")");
  if (begin < 0 || n < 0 || begin > total - n)
    return Status::InvalidArgument("tokens [" + std::to_string(begin) + ", +" + std::to_string(n) +
                                   ") are not in [0, " + std::to_string(total) + ")");
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16)
    return Status::InvalidArgument("unknown dtype " + std::to_string(int(dtype)));
  if (n == 0) return Status::Ok();
  if (!k_dev || !v_dev) return Status::InvalidArgument("null K or V output");
  int device = -1;
  QKV_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), "cudaGetDevice"));
  if (device != im.device)
    return Status::FailedPrecondition("DeviceWorkload of device " + std::to_string(im.device) +
                                      " called with device " + std::to_string(device) + " current");

  const int rows_per_block = std::max(1, kBlockThreads / t.pairs);
  const int threads = rows_per_block * t.pairs;
  const std::size_t token_smem = t.structured ? (std::size_t(rows_per_block) * t.dim + rows_per_block) * 4 : 0;
  const std::size_t row_bytes = std::size_t(t.heads) * t.dim * DTypeBytes(dtype);
  auto launch_tokens = [&](const Piece& p) {
    const int64_t tiles = (p.n * t.heads + rows_per_block - 1) / rows_per_block;
    const int grid = int(std::min<int64_t>(tiles, int64_t(1) << 20));
    switch (dtype) {
      case DType::kF32: TokensKernel<float><<<grid, threads, token_smem, stream>>>(t, p, rows_per_block); break;
      case DType::kF16: TokensKernel<__half><<<grid, threads, token_smem, stream>>>(t, p, rows_per_block); break;
      case DType::kBF16:
        TokensKernel<__nv_bfloat16><<<grid, threads, token_smem, stream>>>(t, p, rows_per_block);
        break;
      case DType::kE4M3: return Status::InvalidArgument("workload K/V cannot be e4m3 (a summary format)");
    }
    return CudaStatus(cudaGetLastError(), "workload tokens kernel");
  };

  if (!t.structured) {
    Piece p;
    p.layer = layer;
    p.begin = begin;
    p.n = n;
    p.k = k_dev;
    p.v = v_dev;
    return launch_tokens(p);
  }

  // Pieces of at most kPieceKnots - 1 drift intervals, each with its anchors
  // (knot / drift of its first token .. of its last, and the next).
  const int64_t piece_tokens = (kPieceKnots - 1) * t.c.drift_tokens;
  const std::size_t anchor_bytes = std::size_t(kPieceKnots + 1) * t.heads * t.c.topics * t.dim * sizeof(float);
  float* anchors = nullptr;
  QKV_RETURN_IF_ERROR(
      CudaStatus(cudaMallocAsync(reinterpret_cast<void**>(&anchors), anchor_bytes, stream), "cudaMallocAsync"));
  const int anchor_threads = std::min(kBlockThreads, (t.pairs + 31) / 32 * 32);
  auto launch_piece = [&](int64_t at) {
    Piece p;
    p.layer = layer;
    p.begin = at;
    p.n = std::min(piece_tokens, begin + n - at);
    p.knot0 = at / t.c.drift_tokens;
    p.knots = (at + p.n - 1) / t.c.drift_tokens - p.knot0 + 2;
    p.anchors = anchors;
    p.k = static_cast<char*>(k_dev) + (at - begin) * row_bytes;
    p.v = static_cast<char*>(v_dev) + (at - begin) * row_bytes;
    const int64_t anchor_count = p.knots * t.heads * t.c.topics;
    AnchorsKernel<<<int(std::min<int64_t>(anchor_count, int64_t(1) << 20)), anchor_threads,
                    std::size_t(t.dim) * sizeof(float), stream>>>(t, p);
    QKV_RETURN_IF_ERROR(CudaStatus(cudaGetLastError(), "workload anchors kernel"));
    return launch_tokens(p);
  };
  for (int64_t at = begin; at < begin + n; at += piece_tokens) {
    const Status s = launch_piece(at);
    if (!s.ok()) {
      cudaFreeAsync(anchors, stream);
      return s;
    }
  }
  return CudaStatus(cudaFreeAsync(anchors, stream), "cudaFreeAsync");
}

}  // namespace questkv
