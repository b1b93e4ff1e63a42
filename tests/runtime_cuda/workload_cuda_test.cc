// DeviceWorkload (tools/workload_cuda.h) against Workload::Tokens: both
// workloads, several geometries and layers, ranges that straddle the
// structured layout (sinks, needle / entity / mention runs, span and drift
// boundaries, the decode tail, pieces of one call), in f32, f16 and bf16.
//
// Required: f32 within 1e-5 absolute-or-relative (|d - c| <= 1e-5 max(1, |c|))
// per element; f16/bf16 equal to the CPU value rounded to nearest even, except
// where the f32 values differ and a rounding boundary lies between them.
// Claimed by the design, and checked too: f32 bit for bit (the device patches
// the host libm's logf/sincosf values in), so every count of inexact elements
// below is 0. Each case prints its measured error.
// Skips, saying why, without a usable GPU.
#include "tools/workload_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iostream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "tools/workload.h"
#include "tests/kernels_cuda/cuda_test_util.h"

namespace questkv {
namespace {

using kernels::cuda::test::DeviceBuffer;

uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

uint16_t Round16(float x, DType t) {
  uint16_t out;
  if (t == DType::kF16) {
    const __half h = __float2half_rn(x);
    std::memcpy(&out, &h, 2);
  } else {
    const __nv_bfloat16 h = __float2bfloat16_rn(x);
    std::memcpy(&out, &h, 2);
  }
  return out;
}

Workload MakeWorkload(WorkloadKind kind, int kv_heads, int head_dim, int64_t context, int64_t steps,
                      uint64_t seed = 11) {
  Geometry g;
  g.layers = 3;
  g.kv_heads = kv_heads;
  g.q_heads = 2 * kv_heads;
  g.head_dim = head_dim;
  g.page_size = 16;
  Result<Workload> w = Workload::Create(g, WorkloadSpec{kind, seed, context, steps});
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  return std::move(w).value();
}

std::unique_ptr<DeviceWorkload> MakeDevice(const Workload& w) {
  Result<std::unique_ptr<DeviceWorkload>> d = DeviceWorkload::Create(w);
  EXPECT_TRUE(d.ok()) << d.status().ToString();
  return d.ok() ? std::move(d).value() : nullptr;
}

// K and V of tokens [begin, begin + n) of a layer from the GPU, raw bytes.
struct RawKv {
  std::vector<uint8_t> k, v;
};

RawKv GpuTokens(const DeviceWorkload& dw, int layer, int64_t begin, int64_t n, DType dtype, cudaStream_t stream) {
  const Geometry& g = dw.workload().geometry();
  const std::size_t bytes = std::size_t(n) * g.kv_heads * g.head_dim * DTypeBytes(dtype);
  DeviceBuffer k(bytes), v(bytes);
  const Status s = dw.Tokens(layer, begin, n, k.get(), v.get(), dtype, stream);
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  RawKv out{std::vector<uint8_t>(bytes), std::vector<uint8_t>(bytes)};
  EXPECT_EQ(cudaMemcpy(out.k.data(), k.get(), bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(out.v.data(), v.get(), bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

std::vector<float> AsFloats(const std::vector<uint8_t>& raw) {
  std::vector<float> f(raw.size() / 4);
  std::memcpy(f.data(), raw.data(), raw.size());
  return f;
}

std::vector<uint16_t> AsHalves(const std::vector<uint8_t>& raw) {
  std::vector<uint16_t> h(raw.size() / 2);
  std::memcpy(h.data(), raw.data(), raw.size());
  return h;
}

// Agreement of GPU against CPU over many elements.
struct Agreement {
  int64_t elems = 0;
  int64_t inexact = 0;       // f32 bits differ
  int64_t over_tol = 0;      // f32 beyond 1e-5 absolute-or-relative
  double max_abs = 0;        // f32
  double max_abs_or_rel = 0; // f32: max |d - c| / max(1, |c|)
  int64_t half_mismatch = 0;      // f16/bf16 != round(cpu) and not explained by an f32 difference
  int64_t half_boundary = 0;      // f16/bf16 != round(cpu), explained (a boundary between d and c)
  int64_t half_not_rounded = 0;   // f16/bf16 != round(the GPU's own f32)

  void F32(const std::vector<float>& cpu, const std::vector<float>& gpu) {
    EXPECT_EQ(cpu.size(), gpu.size());
    for (std::size_t i = 0; i < cpu.size() && i < gpu.size(); ++i) {
      ++elems;
      if (Bits(cpu[i]) == Bits(gpu[i])) continue;
      ++inexact;
      const double d = std::fabs(double(gpu[i]) - double(cpu[i]));
      const double r = d / std::max(1.0, std::fabs(double(cpu[i])));
      max_abs = std::max(max_abs, d);
      max_abs_or_rel = std::max(max_abs_or_rel, std::isnan(r) ? 1e30 : r);
      if (!(r <= 1e-5)) ++over_tol;
    }
  }

  void Half(const std::vector<float>& cpu, const std::vector<float>& gpu32, const std::vector<uint16_t>& gpu16,
            DType t) {
    EXPECT_EQ(cpu.size(), gpu16.size());
    for (std::size_t i = 0; i < cpu.size() && i < gpu16.size(); ++i) {
      if (gpu16[i] != Round16(gpu32[i], t)) ++half_not_rounded;
      if (gpu16[i] == Round16(cpu[i], t)) continue;
      if (Bits(gpu32[i]) != Bits(cpu[i])) ++half_boundary; else ++half_mismatch;
    }
  }

  void Expect(const std::string& what) const {
    std::cout << "[ measured ] " << what << ": " << elems << " f32 elements, " << inexact << " not bit-exact, max abs "
              << max_abs << ", max abs-or-rel " << max_abs_or_rel << "; f16/bf16: " << half_boundary
              << " differ at a rounding boundary, " << half_mismatch << " otherwise\n";
    EXPECT_GT(elems, 0) << what;
    EXPECT_EQ(over_tol, 0) << what << ": max abs-or-rel error " << max_abs_or_rel;
    EXPECT_EQ(half_mismatch, 0) << what;
    EXPECT_EQ(half_not_rounded, 0) << what;
    EXPECT_EQ(inexact, 0) << what << ": not bit-exact (max abs " << max_abs << ")";
  }
};

struct Range {
  int64_t begin, n;
};

// Ranges that straddle what the structured layout puts where, clipped to the workload.
std::vector<Range> InterestingRanges(const Workload& w) {
  const int64_t total = w.total_tokens(), context = w.spec().context_tokens;
  std::vector<Range> r = {{0, 1}, {0, 6}, {2, 1000}, {1, 4099}, {2043, 10}, {3001, 4099}, {4095, 1},
                          {context - 2, total - context + 2}, {total - 1, 1}, {total / 2 + 17, 1000},
                          {5, 70000}};  // past one call's piece of 31 drift intervals where the context allows
  const WorkloadTokenTables t = w.TokenTables();
  // Entities, needles and a few mentions: exactly, one token, and with margins.
  for (std::size_t i = 0; i < t.runs.size(); i += std::max<std::size_t>(1, t.runs.size() / 12)) {
    const auto& run = t.runs[i];
    r.push_back({run.begin, run.end - run.begin});
    r.push_back({run.end - 1, 1});
    r.push_back({run.begin - 3, run.end - run.begin + 6});
    r.push_back({run.begin - 500, 1000});
  }
  for (std::size_t i = 1; i + 1 < t.span_begins.size(); i += std::max<std::size_t>(1, t.span_begins.size() / 6))
    r.push_back({t.span_begins[i] - 2, 5});
  std::vector<Range> out;
  for (Range x : r) {
    x.begin = std::clamp<int64_t>(x.begin, 0, total - 1);
    x.n = std::clamp<int64_t>(x.n, 1, total - x.begin);
    out.push_back(x);
  }
  return out;
}

struct Case {
  WorkloadKind kind;
  int kv_heads, head_dim;
  int64_t context;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << WorkloadKindName(c.kind) << "_Hkv" << c.kv_heads << "_D" << c.head_dim << "_T" << c.context;
}

class WorkloadCudaTest : public ::testing::TestWithParam<Case> {};

TEST_P(WorkloadCudaTest, MatchesCpuTokens) {
  QKV_REQUIRE_GPU();
  const Case c = GetParam();
  const Workload w = MakeWorkload(c.kind, c.kv_heads, c.head_dim, c.context, 40);
  std::unique_ptr<DeviceWorkload> dw = MakeDevice(w);
  ASSERT_TRUE(dw);
  const DeviceWorkload::LibmPatches patches = dw->libm_patches();
  std::cout << "[ measured ] libm inputs patched with the host's values: logf " << patches.log << ", sin/cos "
            << patches.sincos << " (of " << (1 << 24) << " each)\n";
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const Geometry& g = w.geometry();
  Agreement agree;
  for (int layer = 0; layer < g.layers; ++layer)
    for (const Range& r : InterestingRanges(w)) {
      const std::size_t elems = std::size_t(r.n) * g.kv_heads * g.head_dim;
      std::vector<float> k(elems), v(elems);
      w.Tokens(layer, r.begin, r.n, k.data(), v.data());
      const RawKv f32 = GpuTokens(*dw, layer, r.begin, r.n, DType::kF32, stream);
      const std::vector<float> k32 = AsFloats(f32.k), v32 = AsFloats(f32.v);
      agree.F32(k, k32);
      agree.F32(v, v32);
      for (DType t : {DType::kF16, DType::kBF16}) {
        const RawKv h = GpuTokens(*dw, layer, r.begin, r.n, t, stream);
        agree.Half(k, k32, AsHalves(h.k), t);
        agree.Half(v, v32, AsHalves(h.v), t);
      }
    }
  cudaStreamDestroy(stream);
  std::string name;
  {
    std::ostringstream os;
    PrintTo(c, &os);
    name = os.str();
  }
  agree.Expect(name);
}

INSTANTIATE_TEST_SUITE_P(
    Workloads, WorkloadCudaTest,
    ::testing::Values(Case{WorkloadKind::kStructured, 2, 64, 72000},  // one call spans several pieces
                      Case{WorkloadKind::kStructured, 8, 128, 20000}, Case{WorkloadKind::kStructured, 2, 128, 9000},
                      Case{WorkloadKind::kStructured, 8, 64, 9000},
                      Case{WorkloadKind::kStructured, 3, 33, 5000},  // odd D: the last pair has one element
                      Case{WorkloadKind::kStructured, 2, 64, 700},   // sinks and topics only, no runs
                      Case{WorkloadKind::kGaussian, 2, 64, 9000}, Case{WorkloadKind::kGaussian, 8, 128, 9000}),
    [](const ::testing::TestParamInfo<Case>& info) {
      std::ostringstream os;
      PrintTo(info.param, &os);
      return os.str();
    });

// A whole layer in one call against the CPU, page by page: Quest's page
// scores (sum_d max(q_d min_d, q_d max_d), max over the group) of every
// decode query and the top 32 pages per KV head come out the same.
TEST(WorkloadCuda, QuestSelectionsUnchanged) {
  QKV_REQUIRE_GPU();
  const Workload w = MakeWorkload(WorkloadKind::kStructured, 2, 64, 8192, 64);
  std::unique_ptr<DeviceWorkload> dw = MakeDevice(w);
  ASSERT_TRUE(dw);
  const Geometry& g = w.geometry();
  const int layer = 1, dim = g.head_dim, page = g.page_size;
  const int64_t context = w.spec().context_tokens, pages = context / page;
  const std::size_t elems = std::size_t(context) * g.kv_heads * dim;
  std::vector<float> cpu_k(elems), cpu_v(elems);
  w.Tokens(layer, 0, context, cpu_k.data(), cpu_v.data());
  const std::vector<float> gpu_k = AsFloats(GpuTokens(*dw, layer, 0, context, DType::kF32, nullptr).k);
  Agreement agree;
  agree.F32(cpu_k, gpu_k);

  // Page summaries [page][Hkv][D] (min, max), then scores of one KV head's group.
  struct Boxes {
    std::vector<float> lo, hi;
  };
  auto boxes = [&](const std::vector<float>& k) {
    Boxes b{std::vector<float>(std::size_t(pages) * g.kv_heads * dim, INFINITY),
            std::vector<float>(std::size_t(pages) * g.kv_heads * dim, -INFINITY)};
    for (int64_t t = 0; t < pages * page; ++t)
      for (int i = 0; i < g.kv_heads * dim; ++i) {
        const std::size_t at = std::size_t(t / page) * g.kv_heads * dim + i;
        b.lo[at] = std::min(b.lo[at], k[std::size_t(t) * g.kv_heads * dim + i]);
        b.hi[at] = std::max(b.hi[at], k[std::size_t(t) * g.kv_heads * dim + i]);
      }
    return b;
  };
  const Boxes cpu_boxes = boxes(cpu_k), gpu_boxes = boxes(gpu_k);
  auto scores = [&](const Boxes& b, const std::vector<float>& q, int h) {
    std::vector<float> best(pages, -INFINITY);
    for (int64_t p = 0; p < pages; ++p)
      for (int gq = 0; gq < g.group(); ++gq) {
        const float* qh = &q[std::size_t(h * g.group() + gq) * dim];
        const std::size_t at = (std::size_t(p) * g.kv_heads + h) * dim;
        double s = 0;
        for (int d = 0; d < dim; ++d) s += std::max(qh[d] * b.lo[at + d], qh[d] * b.hi[at + d]);
        best[p] = std::max(best[p], float(s));
      }
    return best;
  };
  auto top = [](const std::vector<float>& s, int k) {
    std::vector<int> idx(s.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int a, int b) { return s[a] > s[b] || (s[a] == s[b] && a < b); });
    idx.resize(k);
    std::sort(idx.begin(), idx.end());
    return idx;
  };
  double max_score_diff = 0;
  int differing = 0;
  std::vector<float> q(std::size_t(g.q_heads) * dim);
  for (int64_t step = 0; step < w.spec().decode_steps; ++step) {
    w.Query(layer, step, q.data());
    for (int h = 0; h < g.kv_heads; ++h) {
      const std::vector<float> a = scores(cpu_boxes, q, h), b = scores(gpu_boxes, q, h);
      for (int64_t p = 0; p < pages; ++p) max_score_diff = std::max(max_score_diff, double(std::fabs(a[p] - b[p])));
      if (top(a, 32) != top(b, 32)) ++differing;
    }
  }
  std::cout << "[ measured ] selection: max |page score difference| " << max_score_diff << ", " << differing
            << " of " << w.spec().decode_steps * g.kv_heads << " top-32 selections differ\n";
  EXPECT_EQ(differing, 0);
  agree.Expect("whole layer, structured Hkv2 D64 T8192");
}

TEST(WorkloadCuda, RejectsBadCalls) {
  QKV_REQUIRE_GPU();
  const Workload w = MakeWorkload(WorkloadKind::kStructured, 2, 64, 2048, 8);
  std::unique_ptr<DeviceWorkload> dw = MakeDevice(w);
  ASSERT_TRUE(dw);
  DeviceBuffer k(1 << 20), v(1 << 20);
  EXPECT_EQ(dw->Tokens(3, 0, 1, k.get(), v.get(), DType::kF32, nullptr).code(), Code::kInvalidArgument);
  EXPECT_EQ(dw->Tokens(-1, 0, 1, k.get(), v.get(), DType::kF32, nullptr).code(), Code::kInvalidArgument);
  EXPECT_EQ(dw->Tokens(0, -1, 1, k.get(), v.get(), DType::kF32, nullptr).code(), Code::kInvalidArgument);
  EXPECT_EQ(dw->Tokens(0, 2050, 7, k.get(), v.get(), DType::kF32, nullptr).code(), Code::kInvalidArgument);
  EXPECT_EQ(dw->Tokens(0, 0, 1, nullptr, v.get(), DType::kF32, nullptr).code(), Code::kInvalidArgument);
  EXPECT_TRUE(dw->Tokens(0, 2056, 0, nullptr, nullptr, DType::kF32, nullptr).ok());
  EXPECT_TRUE(dw->Tokens(0, 2049, 7, k.get(), v.get(), DType::kF32, nullptr).ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// Not a check: how fast a long prefill layer comes out (printed).
TEST(WorkloadCuda, Throughput) {
  QKV_REQUIRE_GPU();
  const int64_t tokens = 131072;
  const Workload w = MakeWorkload(WorkloadKind::kStructured, 8, 128, tokens, 0);
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_ptr<DeviceWorkload> dw = MakeDevice(w);
  ASSERT_TRUE(dw);
  const double create_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::size_t bytes = std::size_t(tokens) * 8 * 128 * 2;
  DeviceBuffer k(bytes), v(bytes);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  ASSERT_TRUE(dw->Tokens(0, 0, tokens, k.get(), v.get(), DType::kBF16, nullptr).ok());  // warm up
  cudaEventRecord(a);
  for (int layer = 0; layer < 3; ++layer)
    ASSERT_TRUE(dw->Tokens(layer, 0, tokens, k.get(), v.get(), DType::kBF16, nullptr).ok());
  cudaEventRecord(b);
  ASSERT_EQ(cudaEventSynchronize(b), cudaSuccess);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  const double per_layer_s = ms / 3 / 1e3;
  std::cout << "[ measured ] Create " << create_s << " s (with the libm patch when first); " << tokens
            << " tokens x Hkv 8 x D 128 bf16, one layer: " << per_layer_s * 1e3 << " ms, "
            << double(tokens) / per_layer_s / 1e6 << " M tokens/s per layer\n";
  cudaEventDestroy(a);
  cudaEventDestroy(b);
}

}  // namespace
}  // namespace questkv
