// Read-only streaming ceilings of this GPU, the limit the score kernels' summary
// scan is up against (the bench's "copy" ceiling is a device-to-device
// cudaMemcpyAsync, which reads and writes):
//   ldg       16-byte loads, four in flight a thread;
//   cp.async  16-byte cp.async pieces into per-warp rings (the score kernel's
//             mechanism), 8 KiB stages;
//   bulk      1D bulk copies (TMA) into a per-block ring, mbarrier-completed;
//   pattern   the staged score kernel's access pattern without its arithmetic
//             (ScoreKernel in kernels/cuda/select.cu: 2 warps x 2 stages x
//             8 KiB a block, 6 blocks an SM, summaries [page][32 heads][512 B]).
// Each line: TB/s over a 2 GiB buffer, median of 15 timed calls after two
// untimed ones (events). Usage: questkv_read_ceiling_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/cuda/common.cuh"

#define CHECK(x)                                                             \
  do {                                                                       \
    const cudaError_t e_ = (x);                                              \
    if (e_ != cudaSuccess) {                                                 \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));          \
      std::exit(1);                                                          \
    }                                                                        \
  } while (0)

namespace {

using questkv::kernels::cuda::CommitCopies;
using questkv::kernels::cuda::WaitCopies;

constexpr unsigned kNever = 0x12345678u;  // folded data never equals it: keeps the loads alive

__global__ void LdgKernel(const uint4* __restrict__ p, size_t n, unsigned* out) {
  unsigned acc = 0;
  const size_t st = size_t(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  for (; i + 3 * st < n; i += 4 * st) {
    const uint4 a = __ldcs(p + i), b = __ldcs(p + i + st), c = __ldcs(p + i + 2 * st), d = __ldcs(p + i + 3 * st);
    acc ^= a.x ^ b.y ^ c.z ^ d.w;
  }
  for (; i < n; i += st) acc ^= p[i].x;
  if (acc == kNever) *out = acc;
}

// The plain cp.async form (the kernels' CopyAsync16 passes a source size for
// zero-filling; measured the same, bench/results/2026-12-04-gpu-score-kernel-profile.md).
__device__ __forceinline__ void Copy16(void* dst, const void* src) {
  const unsigned d = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}

// Stage k of a warp: 8 KiB, 16 cp.async pieces a lane. kMode 0: contiguous
// stages. kMode 1: the score pattern, group g = (chunk of 32 pages, head h),
// its two phases in turn, phase ph reading [ph*128, +128) and [256 + ph*128,
// +128) of each of its 32 head-pages (16 KiB apart). kMode 2: 256 contiguous
// bytes of each of the 32 head-pages a phase. kMode 3: 16 whole 512-byte
// head-pages a stage.
template <int kMode>
__device__ __forceinline__ const char* Piece(const char* p, size_t st, int m, int lane) {
  if constexpr (kMode == 0) return p + st * 8192 + (m * 32 + lane) * 16;
  if constexpr (kMode == 3) {
    const size_t c = st / 64, h = (st % 64) / 2, half = st % 2;
    return p + ((c * 32 + half * 16 + m) * 32 + h) * 512 + lane * 16;
  }
  const size_t g = st / 2, c = g / 32, h = g % 32;
  const int ph = int(st % 2), j = 2 * m + (lane >> 4), piece = lane & 15;
  const char* hp = p + ((c * 32 + j) * 32 + h) * 512;
  if constexpr (kMode == 1) return hp + (piece >> 3) * 256 + ph * 128 + (piece & 7) * 16;
  return hp + ph * 256 + piece * 16;
}

template <int kMode, int kWarps, int kStages>
__global__ void __launch_bounds__(kWarps * 32) RingKernel(const char* __restrict__ p, size_t bytes, unsigned* out) {
  __shared__ __align__(16) char buf[kWarps][kStages][8192];
  const int lane = int(threadIdx.x & 31), w = int(threadIdx.x >> 5);
  const size_t gw = blockIdx.x * size_t(kWarps) + w, nw = size_t(gridDim.x) * kWarps, stages = bytes / 8192;
  // The warp's k-th stage: the score pattern keeps a group's two phases on one warp.
  auto stage = [&](size_t k) { return kMode == 1 || kMode == 2 ? (gw + (k / 2) * nw) * 2 + k % 2 : gw + k * nw; };
  auto issue = [&](size_t k) {
    if (stage(k) < stages)
      for (int m = 0; m < 16; ++m) Copy16(&buf[w][k % kStages][(m * 32 + lane) * 16], Piece<kMode>(p, stage(k), m, lane));
    CommitCopies();
  };
  for (int k = 0; k < kStages - 1; ++k) issue(k);
  unsigned acc = 0;
  for (size_t k = 0; stage(k) < stages; ++k) {
    issue(k + kStages - 1);
    WaitCopies<kStages - 1>();
    __syncwarp();
    for (int m = 0; m < 16; ++m) acc ^= reinterpret_cast<const uint4*>(buf[w][k % kStages])[m * 32 + lane].x;
    __syncwarp();  // read before a later issue refills it
  }
  if (acc == kNever) *out = acc;
}

// A ring of kStages bulk copies of kStageBytes a block; thread 0 issues, all read.
template <int kStages, int kStageBytes>
__global__ void __launch_bounds__(256) BulkKernel(const char* __restrict__ p, size_t bytes, unsigned* out) {
  extern __shared__ __align__(128) char ring[];
  __shared__ __align__(8) uint64_t full[kStages];
  const size_t chunks = bytes / kStageBytes;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s)
      asm volatile("mbarrier.init.shared.b64 [%0], 1;\n" ::"r"(unsigned(__cvta_generic_to_shared(&full[s]))));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](size_t c, int s) {
    const unsigned bar = unsigned(__cvta_generic_to_shared(&full[s]));
    const unsigned dst = unsigned(__cvta_generic_to_shared(ring + s * kStageBytes));
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;\n" ::"r"(bar), "r"(kStageBytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(p + c * kStageBytes), "r"(kStageBytes), "r"(bar)
                 : "memory");
  };
  if (threadIdx.x == 0)
    for (int s = 0; s < kStages; ++s)
      if (blockIdx.x + size_t(s) * gridDim.x < chunks) issue(blockIdx.x + size_t(s) * gridDim.x, s);
  unsigned acc = 0, parity = 0;
  int s = 0;
  for (size_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const unsigned bar = unsigned(__cvta_generic_to_shared(&full[s]));
    for (unsigned done = 0; !done;)
      asm volatile("{ .reg .pred q; mbarrier.try_wait.parity.shared.b64 q, [%1], %2; selp.u32 %0, 1, 0, q; }\n"
                   : "=r"(done)
                   : "r"(bar), "r"(parity)
                   : "memory");
    const uint4* b = reinterpret_cast<const uint4*>(ring + s * kStageBytes);
    for (int i = threadIdx.x; i < kStageBytes / 16; i += 256) acc ^= b[i].x;
    __syncthreads();  // every thread has read stage s
    const size_t next = c + size_t(kStages) * gridDim.x;
    if (threadIdx.x == 0 && next < chunks) issue(next, s);
    if (++s == kStages) s = 0, parity ^= 1;
  }
  if (acc == kNever) *out = acc;
}

template <typename F>
float MedianMs(F launch) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  launch();
  launch();
  CHECK(cudaDeviceSynchronize());
  std::vector<float> ms;
  for (int r = 0; r < 15; ++r) {
    CHECK(cudaEventRecord(a));
    launch();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main() {
  const size_t bytes = size_t(2) << 30;
  char *p = nullptr, *copy = nullptr;
  unsigned* out = nullptr;
  CHECK(cudaMalloc(&p, bytes));
  CHECK(cudaMalloc(&copy, bytes / 2));
  CHECK(cudaMalloc(&out, sizeof(unsigned)));
  CHECK(cudaMemset(p, 1, bytes));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  auto line = [&](const char* what, double moved, float ms) {
    std::printf("%-62s %6.3f TB/s\n", what, moved / (ms * 1e-3) / 1e12);
  };
  line("memcpy device-to-device 1 GiB (read + write counted)", double(bytes),
       MedianMs([&] { CHECK(cudaMemcpyAsync(copy, p, bytes / 2, cudaMemcpyDeviceToDevice)); }));
  line("ldg 16 B x 4, 8 blocks of 256 an SM", double(bytes),
       MedianMs([&] { LdgKernel<<<sms * 8, 256>>>(reinterpret_cast<const uint4*>(p), bytes / 16, out); }));
  line("cp.async 2 warps x 2 stages x 8 KiB, 6 blocks an SM", double(bytes),
       MedianMs([&] { RingKernel<0, 2, 2><<<sms * 6, 64>>>(p, bytes, out); }));
  line("cp.async 2 warps x 3 stages x 8 KiB, 4 blocks an SM", double(bytes),
       MedianMs([&] { RingKernel<0, 2, 3><<<sms * 4, 64>>>(p, bytes, out); }));
  auto bulk = [&](auto kernel, int stage_bytes, int stages, int blocks_per_sm, const char* what) {
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, stages * stage_bytes));
    line(what, double(bytes),
         MedianMs([&] { kernel<<<sms * blocks_per_sm, 256, stages * stage_bytes>>>(p, bytes, out); }));
  };
  bulk(BulkKernel<4, 16384>, 16384, 4, 3, "bulk 4 stages x 16 KiB, 3 blocks an SM");
  bulk(BulkKernel<4, 32768>, 32768, 4, 1, "bulk 4 stages x 32 KiB, 1 block an SM");
  line("pattern: the score kernel's (2 x 128 B of 32 head-pages)", double(bytes),
       MedianMs([&] { RingKernel<1, 2, 2><<<sms * 6, 64>>>(p, bytes, out); }));
  line("pattern: 256 contiguous B of 32 head-pages", double(bytes),
       MedianMs([&] { RingKernel<2, 2, 2><<<sms * 6, 64>>>(p, bytes, out); }));
  line("pattern: 16 whole 512 B head-pages", double(bytes),
       MedianMs([&] { RingKernel<3, 2, 2><<<sms * 6, 64>>>(p, bytes, out); }));
  CHECK(cudaFree(p));
  CHECK(cudaFree(copy));
  CHECK(cudaFree(out));
  return 0;
}
