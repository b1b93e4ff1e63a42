// PageChecksum: eight independent multiply-mix lanes over 8-byte words, so the
// multiplies of neighbouring words overlap (or share one AVX-512 vector) and
// the hash runs far faster than any disk (bench/disk_bench prints its GB/s:
// about 11 GB/s scalar, 35 with AVX-512, on the development VM).
//
// Each lane step is a bijection of the lane for a fixed word and of the word
// for a fixed lane, and the lanes are folded by the same step: a page that
// differs from the checksummed bytes in exactly one 8-byte word always hashes
// differently. The key (PageId, generation) and the length seed the lanes, so
// the right bytes under the wrong key mismatch too (with probability 2^-64 of
// a collision, like any other difference).
#include "tiers/checksum.h"

#include <cstring>

namespace questkv {
namespace {

constexpr uint64_t kMulA = 0x9e3779b97f4a7c15ull;  // odd: multiplying is a bijection
constexpr uint64_t kMulB = 0xd6e8feb86659fd93ull;  // odd
constexpr int kLanes = 8;

uint64_t Load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

uint64_t Step(uint64_t lane, uint64_t word) {
  lane = (lane ^ word) * kMulA;
  return lane ^ (lane >> 29);
}

// A full-avalanche finaliser (bijective).
uint64_t Finish(uint64_t h) {
  h ^= h >> 32;
  h *= kMulB;
  h ^= h >> 29;
  h *= kMulA;
  return h ^ (h >> 32);
}

// Where the CPU has AVX-512 (vpmullq), the eight lanes run as one vector;
// the result is bit-identical to the scalar clone (the lanes are independent).
// Not under ThreadSanitizer: the clones' resolver runs while the loader
// relocates, before the sanitizer's runtime is up, and crashes there.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define QKV_CHECKSUM_CLONES __attribute__((target_clones("arch=x86-64-v4", "default")))
#else
#define QKV_CHECKSUM_CLONES
#endif

}  // namespace

QKV_CHECKSUM_CLONES uint64_t PageChecksum(const void* data, std::size_t bytes, uint32_t page_id, uint32_t generation) {
  const uint64_t key = (uint64_t(page_id) << 32) | generation;
  const uint64_t seed = Finish(key ^ kMulB) ^ Finish(uint64_t(bytes) + kMulA);
  uint64_t lane[kLanes];
  for (int i = 0; i < kLanes; ++i) lane[i] = seed + uint64_t(i + 1) * kMulB;

  const auto* p = static_cast<const unsigned char*>(data);
  std::size_t i = 0;
  for (; i + kLanes * 8 <= bytes; i += kLanes * 8)
    for (int l = 0; l < kLanes; ++l) lane[l] = Step(lane[l], Load64(p + i + 8 * l));
  for (int l = 0; i + 8 <= bytes; i += 8, ++l) lane[l] = Step(lane[l], Load64(p + i));
  if (i < bytes) {
    uint64_t last = 0;
    std::memcpy(&last, p + i, bytes - i);
    lane[kLanes - 1] = Step(lane[kLanes - 1], last);
  }

  uint64_t h = key;
  for (int l = 0; l < kLanes; ++l) h = Step(h, lane[l]);
  return Finish(h);
}

}  // namespace questkv
