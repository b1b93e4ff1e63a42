// An outside C++ program against an installed questkv: a CPU runtime, two
// sequences of ragged lengths filled by a prefill chunk and single decode
// tokens, then decode attention at a dense layer and at a sparse layer whose
// budget covers every page. Both must equal dense attention computed here in
// double precision within 1e-5. Exits 0 and prints the outputs' sum, or
// prints what went wrong and exits 1.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "questkv/runtime.h"

namespace {

constexpr int kLayers = 2, kQHeads = 4, kKvHeads = 2, kHeadDim = 64, kPageSize = 16;
constexpr int kTokens[2] = {53, 20};  // a partly filled tail page each
constexpr int kPrefill = 16;          // appended in one call; the rest a token a call
constexpr double kTolerance = 1e-5;

// Deterministic values in [-1, 1).
float Next(uint32_t& state) {
  state = state * 1664525u + 1013904223u;
  return float(state >> 8) / float(1u << 23) - 1.f;
}

std::vector<float> Fill(std::size_t n, uint32_t seed) {
  std::vector<float> x(n);
  for (float& e : x) e = Next(seed);
  return x;
}

// Dense softmax attention of query heads [Hq][D] over tokens [n][Hkv][D];
// query head h reads KV head h / (Hq / Hkv).
std::vector<double> Reference(const float* q, const std::vector<float>& k, const std::vector<float>& v, int n) {
  std::vector<double> out(std::size_t(kQHeads) * kHeadDim, 0.0);
  const double scale = 1.0 / std::sqrt(double(kHeadDim));
  for (int h = 0; h < kQHeads; ++h) {
    const int kvh = h / (kQHeads / kKvHeads);
    std::vector<double> logit(n);
    double max_logit = -INFINITY, denom = 0;
    for (int t = 0; t < n; ++t) {
      double dot = 0;
      for (int d = 0; d < kHeadDim; ++d) dot += double(q[h * kHeadDim + d]) * k[(t * kKvHeads + kvh) * kHeadDim + d];
      logit[t] = dot * scale;
      max_logit = std::fmax(max_logit, logit[t]);
    }
    for (int t = 0; t < n; ++t) denom += logit[t] = std::exp(logit[t] - max_logit);
    for (int t = 0; t < n; ++t)
      for (int d = 0; d < kHeadDim; ++d)
        out[h * kHeadDim + d] += logit[t] / denom * v[(t * kKvHeads + kvh) * kHeadDim + d];
  }
  return out;
}

bool Check(questkv::Status st, const char* what) {
  if (!st.ok()) std::printf("cpp_consumer: %s: %s\n", what, st.ToString().c_str());
  return st.ok();
}

}  // namespace

int main() {
  questkv::Config cfg;
  cfg.geometry.layers = kLayers;
  cfg.geometry.q_heads = kQHeads;
  cfg.geometry.kv_heads = kKvHeads;
  cfg.geometry.head_dim = kHeadDim;
  cfg.geometry.page_size = kPageSize;
  cfg.policy.dense_layers = {0};
  cfg.policy.token_budget = 4 * kPageSize;  // covers all four pages of the longer sequence
  cfg.policy.sink_pages = 1;
  cfg.policy.local_pages = 1;
  if (!Check(cfg.Validate(), "Config::Validate")) return 1;
  auto dtype = questkv::ParseDType(questkv::DTypeName(cfg.geometry.dtype));  // the free functions link too
  if (!dtype.ok() || *dtype != questkv::DType::kF32) return std::puts("cpp_consumer: ParseDType(DTypeName)"), 1;
  auto rt = questkv::Runtime::Create(cfg);
  if (!rt.ok()) return Check(rt.status(), "Runtime::Create"), 1;

  const std::size_t row = std::size_t(kKvHeads) * kHeadDim;  // one token's K (or V)
  std::vector<questkv::SeqId> seqs;
  std::vector<std::vector<float>> k[kLayers], v[kLayers];
  for (int b = 0; b < 2; ++b) {
    auto seq = (*rt)->CreateSequence();
    if (!seq.ok()) return Check(seq.status(), "CreateSequence"), 1;
    seqs.push_back(*seq);
    for (int layer = 0; layer < kLayers; ++layer) {
      const uint32_t seed = 100u * b + layer + 1;
      k[layer].push_back(Fill(kTokens[b] * row, seed));
      v[layer].push_back(Fill(kTokens[b] * row, seed + 50));
      const float* kb = k[layer][b].data();
      const float* vb = v[layer][b].data();
      if (!Check((*rt)->Append(*seq, layer, kb, vb, kPrefill), "Append (prefill)")) return 1;
      for (int t = kPrefill; t < kTokens[b]; ++t)
        if (!Check((*rt)->Append(*seq, layer, kb + t * row, vb + t * row, 1), "Append (token)")) return 1;
    }
  }

  const std::size_t q_elems = std::size_t(kQHeads) * kHeadDim;
  double sum = 0, max_err = 0;
  for (int layer = 0; layer < kLayers; ++layer) {
    std::vector<float> q = Fill(2 * q_elems, 7u + layer), out(q.size());
    if (!Check((*rt)->DecodeAttention(seqs, layer, q.data(), out.data()), "DecodeAttention")) return 1;
    for (int b = 0; b < 2; ++b) {
      std::vector<double> ref = Reference(q.data() + b * q_elems, k[layer][b], v[layer][b], kTokens[b]);
      for (std::size_t i = 0; i < q_elems; ++i) {
        max_err = std::fmax(max_err, std::fabs(out[b * q_elems + i] - ref[i]));
        sum += out[b * q_elems + i];
      }
    }
  }
  if (!(max_err <= kTolerance)) {
    std::printf("cpp_consumer: output differs from dense attention by %.3g (tolerance %.0e)\n", max_err, kTolerance);
    return 1;
  }
  std::printf("%.6f\n", sum);
  return 0;
}
