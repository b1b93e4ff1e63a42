// Dense attention in double with a two-pass softmax (max, then sums). Shares
// no code with AttendPagesCpu so that each can check the other.
#include <cassert>
#include <cmath>
#include <cstddef>
#include <limits>

#include "kernels/cpu/kernels_cpu.h"

namespace questkv::kernels {
namespace {

constexpr int kMaxHeadDim = 512;  // Geometry::Validate's bound

double DotDouble(const float* q, const float* k, int head_dim) {
  double sum = 0;
  for (int j = 0; j < head_dim; ++j) sum += double(q[j]) * double(k[j]);
  return sum;
}

}  // namespace

void DenseAttentionReference(const float* q, const float* k, const float* v, int tokens,
                             int head_dim, std::size_t stride, double scale, float* out) {
  assert(head_dim <= kMaxHeadDim);
  double max_logit = -std::numeric_limits<double>::infinity();
  for (int t = 0; t < tokens; ++t)
    max_logit = std::fmax(max_logit, scale * DotDouble(q, k + t * stride, head_dim));
  double acc[kMaxHeadDim] = {};
  double denom = 0;
  for (int t = 0; t < tokens; ++t) {
    const double w = std::exp(scale * DotDouble(q, k + t * stride, head_dim) - max_logit);
    denom += w;
    const float* v_row = v + t * stride;
    for (int j = 0; j < head_dim; ++j) acc[j] += w * v_row[j];
  }
  // No tokens gives the empty state's output, zeros.
  for (int j = 0; j < head_dim; ++j) out[j] = tokens > 0 ? float(acc[j] / denom) : 0.f;
}

}  // namespace questkv::kernels
