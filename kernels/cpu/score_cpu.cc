// Page scores U_p(q) (eq. 2–3): the upper bound of max_r q·k_r inside a page.
#include <cmath>
#include <cstddef>
#include <limits>

#include "kernels/cpu/kernels_cpu.h"

namespace questkv::kernels {
namespace {

// Independent partial sums let the compiler keep a SIMD register of
// accumulators without -ffast-math (float addition is not reassociated).
// They are added pairwise, ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)): the
// order eight GPU lanes holding one partial sum each reach with three
// butterfly shuffles, every lane the same bits (addition commutes exactly).
constexpr int kLanes = 8;

// max(q·lo, q·hi) as q·(q >= 0 ? hi : lo): the same float for every
// summary with lo <= hi (rounding is monotone, so the larger exact product
// rounds to the larger float), and one product instead of two. The GPU's
// ScoreTerm (kernels/cuda/common.cuh) picks the bound the same way.
inline float Term(float q, float lo, float hi) { return q * (q >= 0.f ? hi : lo); }

// On the E4M3 grid an infinite bound is a code the GPU decodes as NaN.
inline float TermE4m3(float q, float lo, float hi) {
  const float m = q >= 0.f ? hi : lo;
  return std::isinf(m) ? std::numeric_limits<float>::quiet_NaN() : q * m;
}

template <bool kE4m3>
float PageBound(const float* q, const float* lo, const float* hi, int head_dim) {
  auto term = [](float qj, float l, float h) { return kE4m3 ? TermE4m3(qj, l, h) : Term(qj, l, h); };
  float acc[kLanes] = {};
  int j = 0;
  for (; j + kLanes <= head_dim; j += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += term(q[j + l], lo[j + l], hi[j + l]);
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; j < head_dim; ++j) sum += term(q[j], lo[j], hi[j]);
  if (kE4m3 && std::isnan(sum)) sum = std::numeric_limits<float>::infinity();
  return sum;
}

}  // namespace

void ScorePagesCpu(const float* q, int group, int head_dim, const float* slab, int kv_heads,
                   int kv_head, const uint32_t* page_ids, int n, float* scores, bool e4m3) {
  const auto bound = e4m3 ? PageBound<true> : PageBound<false>;
  const std::size_t summary_elems = std::size_t(kv_heads) * 2 * head_dim;
  // Page-major so each summary is read once from memory for all G heads.
  for (int i = 0; i < n; ++i) {
    const float* lo = slab + page_ids[i] * summary_elems + std::size_t(kv_head) * 2 * head_dim;
    const float* hi = lo + head_dim;
    for (int g = 0; g < group; ++g)
      scores[std::size_t(g) * n + i] = bound(q + std::size_t(g) * head_dim, lo, hi, head_dim);
  }
}

}  // namespace questkv::kernels
