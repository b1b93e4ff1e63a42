#include "topology/memory_probe.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <latch>
#include <thread>
#include <vector>

#include "topology/host_memory.h"

namespace questkv {

Result<MemcpyBandwidth> MeasureMemcpyBandwidth(std::size_t bytes, int threads, double seconds) {
  MemcpyBandwidth bw;
  bw.threads = threads;
  // Cache-line multiples, so no two threads write the same line.
  bw.slice_bytes = threads > 0 ? bytes / std::size_t(threads) / 64 * 64 : 0;
  if (bw.slice_bytes == 0) return Status::InvalidArgument("memcpy probe: under 64 bytes per thread");
  constexpr HostPlacement kPlain{-1, /*pin_for_gpu=*/false};
  QKV_ASSIGN_OR_RETURN(HostRegion src, HostRegion::Allocate(bytes, kPlain));
  QKV_ASSIGN_OR_RETURN(HostRegion dst, HostRegion::Allocate(bytes, kPlain));
  // Fault every page in first, so the timing sees copies, not page faults.
  std::memset(src.data(), 1, bytes);
  std::memset(dst.data(), 2, bytes);

  std::atomic<bool> stop{false};
  std::vector<int64_t> copied_bytes(threads, 0);
  std::latch go(1);
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t)
    workers.emplace_back([&, t] {
      char* to = static_cast<char*>(dst.data()) + t * bw.slice_bytes;
      const char* from = static_cast<const char*>(src.data()) + t * bw.slice_bytes;
      go.wait();
      while (!stop.load(std::memory_order_relaxed)) {
        std::memcpy(to, from, bw.slice_bytes);
        copied_bytes[t] += int64_t(bw.slice_bytes);
      }
    });
  const auto start = std::chrono::steady_clock::now();
  go.count_down();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop = true;
  for (std::thread& w : workers) w.join();
  // Copies still running at the stop count in full, and so does their time.
  const double elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int64_t b : copied_bytes) bw.bytes_copied += b;
  bw.gb_per_s = double(bw.bytes_copied) / elapsed_s / 1e9;
  return bw;
}

}  // namespace questkv
