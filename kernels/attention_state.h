// Partial softmax state of one query head over a subset of tokens, and its
// merge. The one merge used everywhere: split-K over pages, hit/miss overlap,
// and (later) across ranks.
//
// A state over tokens T holds m = max_{t∈T} s_t (scaled logits), d =
// Σ exp(s_t − m) and o = Σ exp(s_t − m) v_t / d (normalised). The empty state
// is m = −inf, d = 0, o = 0; merging anything with it returns the other side,
// and merging two empty states is empty.
#pragma once

#include <cmath>
#include <limits>

namespace questkv::kernels {

inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Merges (o_b, m_b, d_b) into (o_a, m_a, d_a) in place; o has `dim` floats.
// Host and device alike (the CUDA twin uses the same arithmetic).
inline void MergeState(float* o_a, float& m_a, float& d_a, const float* o_b, float m_b,
                       float d_b, int dim) {
  if (d_b == 0.f) return;
  if (d_a == 0.f) {
    for (int i = 0; i < dim; ++i) o_a[i] = o_b[i];
    m_a = m_b;
    d_a = d_b;
    return;
  }
  const float m = m_a > m_b ? m_a : m_b;
  const float wa = d_a * std::exp(m_a - m);
  const float wb = d_b * std::exp(m_b - m);
  const float inv = 1.f / (wa + wb);
  for (int i = 0; i < dim; ++i) o_a[i] = (o_a[i] * wa + o_b[i] * wb) * inv;
  m_a = m;
  d_a = wa + wb;
}

// log-sum-exp of a state: m + log d (−inf for the empty state).
inline float StateLse(float m, float d) { return d == 0.f ? kNegInf : m + std::log(d); }

}  // namespace questkv::kernels
