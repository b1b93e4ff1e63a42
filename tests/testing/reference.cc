#include "tests/testing/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <set>

namespace questkv::test {

void FillNormal(float* x, std::size_t n, uint64_t seed, float mean, float stddev) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(mean, stddev);
  for (std::size_t i = 0; i < n; ++i) x[i] = dist(rng);
}

void FillUniform(float* x, std::size_t n, uint64_t seed, float lo, float hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  for (std::size_t i = 0; i < n; ++i) x[i] = dist(rng);
}

std::vector<float> RandomNormal(std::size_t n, uint64_t seed, float mean, float stddev) {
  std::vector<float> x(n);
  FillNormal(x.data(), n, seed, mean, stddev);
  return x;
}

std::vector<float> RandomUniform(std::size_t n, uint64_t seed, float lo, float hi) {
  std::vector<float> x(n);
  FillUniform(x.data(), n, seed, lo, hi);
  return x;
}

double RelL2Error(const float* a, const float* b, std::size_t n) {
  double diff = 0, ref = 0;
  for (std::size_t i = 0; i < n; ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    ref += double(b[i]) * b[i];
  }
  if (ref == 0) return diff == 0 ? 0 : std::numeric_limits<double>::infinity();
  return std::sqrt(diff / ref);
}

double Jaccard(const std::vector<int>& a, const std::vector<int>& b) {
  const std::set<int> sa(a.begin(), a.end());
  const std::set<int> sb(b.begin(), b.end());
  std::set<int> all = sa;
  all.insert(sb.begin(), sb.end());
  if (all.empty()) return 1;
  std::size_t common = 0;
  for (int x : sa) common += sb.count(x);
  return double(common) / double(all.size());
}

std::vector<int> AdaptiveDefinition(const std::vector<float>& s, const std::vector<int>& fixed, double share,
                                    int floor_k, int cap_k, int head_dim, int* k_out) {
  const std::set<int> is_fixed(fixed.begin(), fixed.end());
  std::vector<int> idx;
  for (int i = 0; i < int(s.size()); ++i)
    if (!is_fixed.count(i)) idx.push_back(i);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return s[a] > s[b]; });
  const int cap = std::min<int>(cap_k, int(idx.size()));
  int k = cap;
  if (!idx.empty() && std::isfinite(s[idx[0]])) {
    const float top = s[idx[0]];
    const double scale = 1.f / std::sqrt(float(head_dim));
    auto mass = [&](int i) { return std::exp(double(s[i] - top) * scale); };
    double total = 0;
    for (int i : idx) total += mass(i);
    k = 0;
    double unread = total;
    while (k < cap && (k < floor_k || unread > share * total)) unread -= mass(idx[k++]);
  }
  *k_out = k;
  std::vector<int> rows(is_fixed.begin(), is_fixed.end());
  rows.insert(rows.end(), idx.begin(), idx.begin() + k);
  std::sort(rows.begin(), rows.end());
  return rows;
}

std::vector<double> MaskedAttention(const float* q, const float* k, const float* v, int tokens,
                                    int head_dim, int page_size, const std::vector<int>& pages,
                                    double scale) {
  const std::set<int> chosen(pages.begin(), pages.end());
  std::vector<int> rows;
  for (int t = 0; t < tokens; ++t)
    if (chosen.count(t / page_size)) rows.push_back(t);
  std::vector<double> out(head_dim, 0.0);
  if (rows.empty()) return out;
  std::vector<double> logits;
  for (int t : rows) {
    double s = 0;
    for (int j = 0; j < head_dim; ++j) s += double(q[j]) * k[std::size_t(t) * head_dim + j];
    logits.push_back(scale * s);
  }
  const double max_logit = *std::max_element(logits.begin(), logits.end());
  double denom = 0;
  for (double& s : logits) denom += (s = std::exp(s - max_logit));
  for (std::size_t i = 0; i < rows.size(); ++i)
    for (int j = 0; j < head_dim; ++j)
      out[j] += logits[i] / denom * v[std::size_t(rows[i]) * head_dim + j];
  return out;
}

}  // namespace questkv::test
