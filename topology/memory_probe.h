// Host memory copy bandwidth: the ceiling for host-side page moves (the CPU
// backend's tier copies, staging for the disk tier). Used by `questkv probe`.
// Thread-compatible; starts and joins its own threads.
#pragma once

#include <cstddef>
#include <cstdint>

#include "questkv/status.h"

namespace questkv {

struct MemcpyBandwidth {
  double gb_per_s = 0;          // bytes copied per second / 1e9; memory traffic is twice this
  int threads = 0;
  std::size_t slice_bytes = 0;  // one memcpy call
  int64_t bytes_copied = 0;
};

// Each of `threads` threads copies its own slice of one `bytes`-sized src/dst
// pair (plain memory, pages faulted in beforehand) over and over for about
// `seconds`. InvalidArgument when a slice would be under 64 bytes;
// ResourceExhausted when the buffers cannot be had.
Result<MemcpyBandwidth> MeasureMemcpyBandwidth(std::size_t bytes, int threads, double seconds);

}  // namespace questkv
