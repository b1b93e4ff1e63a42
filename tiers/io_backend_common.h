// Pieces every IoBackend implementation shares: request validation against the
// registered files and region, and opening files for direct I/O. Internal to
// tiers/ (not part of the IoBackend contract).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "questkv/status.h"
#include "tiers/io_backend.h"

namespace questkv {

// O_DIRECT wants offsets, lengths and buffer addresses on this boundary.
inline constexpr std::size_t kDirectAlignBytes = 4096;
// One request moves at most this much, so a byte count fits a completion's
// int32 result on every backend (io_uring's cqe->res is 32 bits).
inline constexpr uint32_t kMaxRequestBytes = 1u << 30;

// The one host region requests must lie in.
struct IoRegion {
  char* base = nullptr;
  std::size_t bytes = 0;
  bool registered() const { return base != nullptr; }
  bool Contains(const void* p, std::size_t len) const;
};

// InvalidArgument naming what is wrong with `r`: file index out of
// [0, file_count), zero or oversized length, buffer outside the region, or
// (when `direct`) offset/length/address off kDirectAlignBytes.
// FailedPrecondition before OpenFiles/RegisterRegion.
Status CheckRequest(const IoRequest& r, int file_count, const IoRegion& region, bool direct);

// Validates a RegisterRegion call (non-null, non-empty, 4096-aligned base,
// not registered twice).
Status CheckRegion(const IoRegion& current, void* base, std::size_t bytes);

// Opens (creating if absent) `path` read/write with O_DIRECT; where the
// filesystem refuses O_DIRECT (tmpfs), opens it without and sets *direct to
// false. IOError naming the path on failure.
Result<int> OpenForIo(const std::string& path, bool* direct);

// SplitMix64: a small generator whose stream is the same on every platform
// (std distributions are not), so seeded faults and completion orders
// reproduce anywhere.
class SeededRng {
 public:
  explicit SeededRng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n); 0 when n is 0.
  uint64_t Below(uint64_t n) { return n == 0 ? 0 : Next() % n; }
  // Uniform in [0, 1).
  double Uniform() { return double(Next() >> 11) * 0x1.0p-53; }

 private:
  uint64_t state_;
};

// "<what>: <strerror(err)>".
std::string ErrnoMessage(const std::string& what, int err);

}  // namespace questkv
