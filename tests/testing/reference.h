// Test helpers shared by every suite: seeded random data, error measures, and
// a brute-force page-masked attention reference. Deliberately plain: no code
// from kernels/, double precision, obvious loops.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace questkv::test {

// Deterministic fills from a std::mt19937_64 seeded with `seed` (the same seed
// gives the same data on every run of the same standard library).
void FillNormal(float* x, std::size_t n, uint64_t seed, float mean = 0.f, float stddev = 1.f);
void FillUniform(float* x, std::size_t n, uint64_t seed, float lo = -1.f, float hi = 1.f);
std::vector<float> RandomNormal(std::size_t n, uint64_t seed, float mean = 0.f, float stddev = 1.f);
std::vector<float> RandomUniform(std::size_t n, uint64_t seed, float lo = -1.f, float hi = 1.f);

// ||a − b|| / ||b|| with b the reference; 0 when both are zero, +inf when only
// b is.
double RelL2Error(const float* a, const float* b, std::size_t n);

// |a ∩ b| / |a ∪ b| of two sets (duplicates ignored); 1 when both are empty.
double Jaccard(const std::vector<int>& a, const std::vector<int>& b);

// Adaptive budgets (SelectionPolicy::unread_bound_mass) from their
// definition, by a full sort: of one ranking's scores `s` (no NaN), the pages
// outside `fixed` best first (ties toward the lower index); the fewest, at
// least floor_k and at most cap_k, whose bound masses exp((s - top) /
// sqrt(head_dim)) leave at most `share` of all their mass unread (all cap_k
// when the best score is not finite). Returns fixed ∪ those, ascending, and
// their count in *k_out.
std::vector<int> AdaptiveDefinition(const std::vector<float>& s, const std::vector<int>& fixed, double share,
                                    int floor_k, int cap_k, int head_dim, int* k_out);

// Softmax attention of one query head over the tokens t in [0, tokens) whose
// page t / page_size is listed in `pages` (any order, duplicates ignored).
// k, v: [tokens][head_dim] contiguous. Returns [head_dim] in double; zeros
// when no token is selected.
std::vector<double> MaskedAttention(const float* q, const float* k, const float* v, int tokens,
                                    int head_dim, int page_size, const std::vector<int>& pages,
                                    double scale);

}  // namespace questkv::test
