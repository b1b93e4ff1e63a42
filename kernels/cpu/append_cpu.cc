// Append + summary (eq. 8/14): the summary is folded on the append path, so a
// query never rescans page keys to score a page.
#include <cassert>
#include <cstddef>
#include <limits>

#include "kernels/cpu/kernels_cpu.h"
#include "core/e4m3.h"

namespace questkv::kernels {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// min/max of one key row into one head's summary [2][D]. Written as two plain
// loops over contiguous D so the compiler emits minps/maxps.
void FoldKey(float* summary_head, const float* key, int head_dim) {
  float* lo = summary_head;
  float* hi = summary_head + head_dim;
  for (int j = 0; j < head_dim; ++j) lo[j] = key[j] < lo[j] ? key[j] : lo[j];
  for (int j = 0; j < head_dim; ++j) hi[j] = key[j] > hi[j] ? key[j] : hi[j];
}

void CopyRow(float* dst, const float* src, int head_dim) {
  for (int j = 0; j < head_dim; ++j) dst[j] = src[j];
}

}  // namespace

void AppendTokensHeadsCpu(float* const* k_heads, float* const* v_heads, float* summary, int kv_heads,
                          int head_dim, int offset, const float* k, const float* v, int n) {
  for (int t = 0; t < n; ++t) {
    const std::size_t slot = std::size_t(offset + t) * head_dim;
    for (int h = 0; h < kv_heads; ++h) {
      const std::size_t src = (std::size_t(t) * kv_heads + h) * head_dim;
      float* k_row = k_heads[h] + slot;
      CopyRow(k_row, k + src, head_dim);
      CopyRow(v_heads[h] + slot, v + src, head_dim);
      FoldKey(summary + std::size_t(h) * 2 * head_dim, k_row, head_dim);
    }
  }
}

void AppendTokensCpu(float* page, float* summary, int kv_heads, int page_size, int head_dim,
                     int offset, const float* k, const float* v, int n) {
  assert(kv_heads <= kMaxKvHeads);
  float* k_heads[kMaxKvHeads];
  float* v_heads[kMaxKvHeads];
  const std::size_t head_page = std::size_t(page_size) * head_dim;
  for (int h = 0; h < kv_heads; ++h) {
    k_heads[h] = page + h * head_page;
    v_heads[h] = page + (std::size_t(kv_heads) + h) * head_page;
  }
  AppendTokensHeadsCpu(k_heads, v_heads, summary, kv_heads, head_dim, offset, k, v, n);
}

void ResetSummaryCpu(float* summary, int kv_heads, int head_dim) {
  for (int h = 0; h < kv_heads; ++h) {
    float* lo = summary + std::size_t(h) * 2 * head_dim;
    float* hi = lo + head_dim;
    for (int j = 0; j < head_dim; ++j) lo[j] = kInf;
    for (int j = 0; j < head_dim; ++j) hi[j] = -kInf;
  }
}

void SnapSummaryE4m3Cpu(float* summary, int kv_heads, int head_dim) {
  for (int h = 0; h < kv_heads; ++h) {
    float* lo = summary + std::size_t(h) * 2 * head_dim;
    float* hi = lo + head_dim;
    for (int j = 0; j < head_dim; ++j) lo[j] = e4m3::SnapDown(lo[j]);
    for (int j = 0; j < head_dim; ++j) hi[j] = e4m3::SnapUp(hi[j]);
  }
}

void EncodeSummaryE4m3Cpu(const float* summary, int kv_heads, int head_dim, uint8_t* codes) {
  for (int h = 0; h < kv_heads; ++h) {
    const std::size_t base = std::size_t(h) * 2 * head_dim;
    for (int j = 0; j < head_dim; ++j) codes[base + j] = e4m3::RoundDown(summary[base + j]);
    for (int j = head_dim; j < 2 * head_dim; ++j) codes[base + j] = e4m3::RoundUp(summary[base + j]);
  }
}

void DecodeSummaryE4m3Cpu(const uint8_t* codes, std::size_t elems, float* out) {
  for (std::size_t i = 0; i < elems; ++i) out[i] = e4m3::ToFloat(codes[i]);
}

void RebuildSummaryHeadsCpu(const float* const* k_heads, float* summary, int kv_heads, int head_dim,
                            int len) {
  ResetSummaryCpu(summary, kv_heads, head_dim);
  for (int h = 0; h < kv_heads; ++h)
    for (int r = 0; r < len; ++r)
      FoldKey(summary + std::size_t(h) * 2 * head_dim, k_heads[h] + std::size_t(r) * head_dim, head_dim);
}

void RebuildSummaryCpu(const float* page, float* summary, int kv_heads, int page_size, int head_dim,
                       int len) {
  assert(kv_heads <= kMaxKvHeads);
  const float* k_heads[kMaxKvHeads];
  for (int h = 0; h < kv_heads; ++h) k_heads[h] = page + std::size_t(h) * page_size * head_dim;
  RebuildSummaryHeadsCpu(k_heads, summary, kv_heads, head_dim, len);
}

}  // namespace questkv::kernels
