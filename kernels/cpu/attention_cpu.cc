// Sparse decode attention over head-pages (split-K with the online-softmax
// merge of kernels/attention_state.h). Each page (or row block of a long page)
// gives a partial state per query head, computed in two passes over the block:
// logits from the K rows, then the weighted sum of the V rows. Every K and V
// row is loaded once and used by all query heads of the chunk.
#include <cassert>
#include <cmath>
#include <cstddef>

#include "kernels/attention_state.h"
#include "kernels/cpu/kernels_cpu.h"

namespace questkv::kernels {
namespace {

// Fixed bounds keep the kernel allocation-free (stack scratch, 40 KiB).
// Groups wider than kHeadChunk re-read each page once per chunk of heads;
// pages longer than kRowBlock are attended as several blocks, which merge to
// the same state because the merge is associative.
constexpr int kHeadChunk = 16;
constexpr int kRowBlock = 128;
constexpr int kMaxHeadDim = 512;  // Geometry::Validate's bound
constexpr int kLanes = 8;

float Dot(const float* a, const float* b, int dim) {
  float acc[kLanes] = {};
  int j = 0;
  for (; j + kLanes <= dim; j += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[j + l] * b[j + l];
  float sum = 0.f;
  for (int l = 0; l < kLanes; ++l) sum += acc[l];
  for (; j < dim; ++j) sum += a[j] * b[j];
  return sum;
}

struct BlockScratch {
  float logits[kHeadChunk][kRowBlock];
  float o[kHeadChunk][kMaxHeadDim];
  float m[kHeadChunk];
  float d[kHeadChunk];
};

// Partial states of `heads` query heads over rows [0, rows) of k/v.
void BlockPartial(const float* q, int heads, int head_dim, const float* k, const float* v, int rows,
                  float scale, BlockScratch& s) {
  for (int r = 0; r < rows; ++r) {
    const float* k_row = k + std::size_t(r) * head_dim;
    for (int g = 0; g < heads; ++g)
      s.logits[g][r] = scale * Dot(q + std::size_t(g) * head_dim, k_row, head_dim);
  }
  for (int g = 0; g < heads; ++g) {
    float m = kNegInf;
    for (int r = 0; r < rows; ++r) m = s.logits[g][r] > m ? s.logits[g][r] : m;
    float d = 0.f;
    for (int r = 0; r < rows; ++r) {
      s.logits[g][r] = std::exp(s.logits[g][r] - m);
      d += s.logits[g][r];
    }
    s.m[g] = m;
    s.d[g] = d;
    for (int j = 0; j < head_dim; ++j) s.o[g][j] = 0.f;
  }
  for (int r = 0; r < rows; ++r) {
    const float* v_row = v + std::size_t(r) * head_dim;
    for (int g = 0; g < heads; ++g) {
      const float p = s.logits[g][r];
      for (int j = 0; j < head_dim; ++j) s.o[g][j] += p * v_row[j];
    }
  }
  for (int g = 0; g < heads; ++g) {
    const float inv = 1.f / s.d[g];
    for (int j = 0; j < head_dim; ++j) s.o[g][j] *= inv;
  }
}

void InitEmpty(int group, int head_dim, float* o, float* m, float* d) {
  for (std::size_t i = 0; i < std::size_t(group) * head_dim; ++i) o[i] = 0.f;
  for (int g = 0; g < group; ++g) {
    m[g] = kNegInf;
    d[g] = 0.f;
  }
}

}  // namespace

void AttendPagesCpu(const float* q, int group, int head_dim, const HeadPageRef* pages, int n,
                    float scale, float* o, float* m, float* d) {
  InitEmpty(group, head_dim, o, m, d);
  AttendMorePagesCpu(q, group, head_dim, pages, n, scale, o, m, d);
}

void AttendMorePagesCpu(const float* q, int group, int head_dim, const HeadPageRef* pages, int n,
                        float scale, float* o, float* m, float* d) {
  assert(head_dim <= kMaxHeadDim);
  BlockScratch s;
  for (int g0 = 0; g0 < group; g0 += kHeadChunk) {
    const int heads = group - g0 < kHeadChunk ? group - g0 : kHeadChunk;
    const float* q_chunk = q + std::size_t(g0) * head_dim;
    for (int i = 0; i < n; ++i) {
      for (int r0 = 0; r0 < pages[i].len; r0 += kRowBlock) {
        const int rows = pages[i].len - r0 < kRowBlock ? pages[i].len - r0 : kRowBlock;
        const std::size_t at = std::size_t(r0) * head_dim;
        BlockPartial(q_chunk, heads, head_dim, pages[i].k + at, pages[i].v + at, rows, scale, s);
        for (int g = 0; g < heads; ++g)
          MergeState(o + std::size_t(g0 + g) * head_dim, m[g0 + g], d[g0 + g], s.o[g], s.m[g],
                     s.d[g], head_dim);
      }
    }
  }
}

}  // namespace questkv::kernels
