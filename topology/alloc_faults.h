// A test hook that makes one chosen allocation fail, so tests can walk every
// out-of-memory path. Allocators (HostRegion, the arenas) call ShouldFail()
// once per allocation and, when it says so, return ResourceExhausted saying
// the failure was injected. Disarmed it costs one relaxed atomic load.
// Thread-safe: the countdown is one atomic shared by the whole process.
#pragma once

#include <atomic>
#include <cstdint>

namespace questkv {

class AllocFaults {
 public:
  // The n-th allocation counted from now (1-based) fails, and only that one;
  // n <= 0 disarms.
  static void FailAt(int64_t n) { countdown_.store(n > 0 ? n : 0, std::memory_order_relaxed); }
  static void Clear() { FailAt(0); }
  // True while the armed failure has not happened yet.
  static bool Pending() { return countdown_.load(std::memory_order_relaxed) > 0; }

  // Counts one allocation while armed; true for the armed one.
  static bool ShouldFail() {
    int64_t left = countdown_.load(std::memory_order_relaxed);
    while (left > 0) {
      if (countdown_.compare_exchange_weak(left, left - 1, std::memory_order_relaxed)) return left == 1;
    }
    return false;
  }

 private:
  static inline std::atomic<int64_t> countdown_{0};
};

}  // namespace questkv
