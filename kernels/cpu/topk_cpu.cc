// Exact top-K by radix select over order-preserving 32-bit keys, the method of
// the CUDA twin. It replaced std::nth_element, whose partitioning mispredicts
// a branch per element and ran 5x slower at 64K pages. Three passes over all
// n: keys (vectorised), a histogram of the top key digit, and an in-place
// gather of every candidate at or above the bucket holding the k-th key (the
// winners and the few that share their bucket). The lower digits and the
// output then only touch those, and the output comes out in index order with
// no sort.
#include <bit>
#include <cstdint>

#include "kernels/cpu/kernels_cpu.h"

namespace questkv::kernels {
namespace {

// Larger score -> larger key; -0 and +0 share a key (they compare equal, so
// the index breaks the tie); NaN -> 0, below every number (whose keys are
// >= 0x007FFFFF). Branch-free so the key pass vectorises.
uint32_t Key(float x) {
  uint32_t bits = std::bit_cast<uint32_t>(x);
  bits = bits == 0x80000000u ? 0u : bits;
  const uint32_t key = bits ^ (uint32_t(int32_t(bits) >> 31) | 0x80000000u);
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? 0u : key;
}

bool Skipped(const uint8_t* skip, int i) { return skip != nullptr && skip[i] != 0; }

// Key digits, most significant first: 11 + 11 + 10 bits.
struct Digit {
  int shift;
  uint32_t mask;
};
constexpr Digit kDigits[] = {{21, 0x7FFu}, {10, 0x7FFu}, {0, 0x3FFu}};
constexpr int kBuckets = 2048;

// The bucket of hist holding the `rank`-th largest key (1-based); lowers rank
// by the keys in the buckets above it.
uint32_t PickBucket(const uint32_t* hist, uint32_t mask, int* rank) {
  uint32_t b = mask;
  while (int(hist[b]) < *rank) *rank -= int(hist[b--]);
  return b;
}

// Writes to idx, ascending, the candidates whose key's top digit is at least
// that of the k-th largest key; returns how many. Sets *rank to the k-th key's
// rank within its top-digit bucket and *prefix to that bucket's lowest key.
int GatherTopBucket(const float* scores, int n, const uint8_t* skip, int k, int* idx, int* rank,
                    uint32_t* prefix) {
  uint32_t* keys = reinterpret_cast<uint32_t*>(idx);  // same storage, keys first
  for (int i = 0; i < n; ++i) keys[i] = Key(scores[i]);
  uint32_t hist[kBuckets] = {};
  for (int i = 0; i < n; ++i) hist[keys[i] >> kDigits[0].shift] += !Skipped(skip, i);
  *rank = k;
  *prefix = PickBucket(hist, kDigits[0].mask, rank) << kDigits[0].shift;
  int m = 0;
  // In place: the write position never passes the read position.
  for (int i = 0; i < n; ++i)
    if (keys[i] >= *prefix && !Skipped(skip, i)) idx[m++] = i;
  return m;
}

// Narrows *prefix to the full k-th key over the lower digits, among the m
// gathered candidates; leaves in *rank how many keys equal to it win.
void RefineLowerDigits(const float* scores, const int* idx, int m, int* rank, uint32_t* prefix) {
  uint32_t high_mask = kDigits[0].mask << kDigits[0].shift;
  uint32_t hist[kBuckets];
  for (int level = 1; level < 3; ++level) {
    const Digit dg = kDigits[level];
    for (uint32_t b = 0; b <= dg.mask; ++b) hist[b] = 0;
    for (int j = 0; j < m; ++j) {
      const uint32_t key = Key(scores[idx[j]]);
      hist[(key >> dg.shift) & dg.mask] += (key & high_mask) == *prefix;
    }
    *prefix |= PickBucket(hist, dg.mask, rank) << dg.shift;
    high_mask |= dg.mask << dg.shift;
  }
}

}  // namespace

int TopKCpu(const float* scores, int n, const uint8_t* skip, int k, int* out, int* scratch) {
  int candidates = 0;
  for (int i = 0; i < n; ++i) candidates += !Skipped(skip, i);
  if (k <= 0) return 0;
  if (k >= candidates) {
    int c = 0;
    for (int i = 0; i < n; ++i)
      if (!Skipped(skip, i)) out[c++] = i;
    return c;
  }
  int ties = 0;
  uint32_t kth = 0;
  const int m = GatherTopBucket(scores, n, skip, k, scratch, &ties, &kth);
  RefineLowerDigits(scores, scratch, m, &ties, &kth);
  // Every key above the k-th wins; of the keys equal to it, the lowest indices.
  int c = 0;
  for (int j = 0; j < m; ++j) {
    const uint32_t key = Key(scores[scratch[j]]);
    if (key > kth || (key == kth && ties-- > 0)) out[c++] = scratch[j];
  }
  return c;
}

}  // namespace questkv::kernels
