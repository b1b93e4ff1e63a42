// Exact top-K by selection (std::nth_element, O(n) on average), then the
// chosen indices sorted ascending so callers get logical page order.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/kernels_cpu.h"

namespace questkv::kernels {
namespace {

// A strict total order on indices: higher score first, NaN below every number,
// equal scores (and NaN vs NaN) toward the lower index. Total, so the chosen
// set is unique and the CUDA radix select can be compared with it exactly.
struct RanksBefore {
  const float* scores;
  bool operator()(int a, int b) const {
    const float sa = scores[a];
    const float sb = scores[b];
    const bool nan_a = std::isnan(sa);
    const bool nan_b = std::isnan(sb);
    if (nan_a != nan_b) return nan_b;
    if (!nan_a && sa != sb) return sa > sb;
    return a < b;
  }
};

}  // namespace

int TopKCpu(const float* scores, int n, const uint8_t* skip, int k, int* out, int* scratch) {
  int candidates = 0;
  for (int i = 0; i < n; ++i)
    if (skip == nullptr || skip[i] == 0) scratch[candidates++] = i;
  if (k <= 0) return 0;
  if (k < candidates) {
    std::nth_element(scratch, scratch + k, scratch + candidates, RanksBefore{scores});
    std::sort(scratch, scratch + k);
  }
  const int chosen = std::min(k, candidates);
  std::copy(scratch, scratch + chosen, out);
  return chosen;
}

}  // namespace questkv::kernels
