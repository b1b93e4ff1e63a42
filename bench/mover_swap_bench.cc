// Tier mover benchmark: promotions into a full host over a full disk, where
// each room-making pass must free disk slots first (ReleaseHotDiskCopies: the
// hottest homes that also hold a disk copy give it up, the coldest host pages
// are written there). It prints the promotions' latency and the time spent in
// the slow ones, the swap passes.
//
// Setup: `pages` pages of 128 B (one 4 KiB host slot and disk slot each),
// sealed in order; the host holds 60% of them, the disk 42% (an in-memory
// I/O backend of queue depth 64). Then up to `promotions` pages on disk are
// promoted in page order, all at one model step, so no promoted home is old
// enough to be dropped: every room-making pass writes, and once the disk is
// full, swaps.
//
// Run: questkv_mover_swap_bench [--pages 1000000] [--promotions 200000] [--dir /tmp/questkv-mover-bench]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "prefetch/tier_mover.h"
#include "tiers/arena.h"
#include "tiers/disk_tier.h"
#include "tiers/io_backend.h"

namespace questkv {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

int Run(uint32_t pages, uint32_t promotions, const std::string& dir) {
  const Geometry g{1, 1, 1, 8, 4, DType::kF16};  // 128 B pages
  const uint32_t host_slots = pages / 10 * 6, disk_slots = pages / 100 * 42;
  auto host = SlotArena::Create(1024, host_slots, "host");  // 4 KiB slots: the disk tier's alignment
  if (!host.ok()) return std::fprintf(stderr, "host: %s\n", host.status().ToString().c_str()), 1;
  std::filesystem::remove_all(dir);
  auto disk = DiskTier::Open({dir, uint64_t(disk_slots) * 4096, g.page_bytes()}, MakeMemoryBackend(64));
  if (!disk.ok()) return std::fprintf(stderr, "disk: %s\n", disk.status().ToString().c_str()), 1;
  if (Status s = (*disk)->RegisterRegion((*host)->base(), (*host)->bytes()); !s.ok())
    return std::fprintf(stderr, "disk: %s\n", s.ToString().c_str()), 1;
  TierMover mover(g, 0.95, 0.9, pages, host->get(), disk->get());

  std::vector<uint8_t> bytes(g.page_bytes(), 7);
  const auto t0 = Clock::now();
  for (uint32_t p = 0; p < pages; ++p) {
    auto home = mover.SealBegin(p, 1, 1);
    if (!home.ok()) return std::fprintf(stderr, "seal %u: %s\n", p, home.status().ToString().c_str()), 1;
    std::memcpy(*home, bytes.data(), bytes.size());
    mover.SealEnd(p);
    if (p % 1024 == 0 && !mover.Pump(1).ok()) return 1;
  }
  const auto t1 = Clock::now();

  const int64_t step = 10;
  std::vector<double> us;
  for (uint32_t p = 0; p < pages && us.size() < promotions; ++p) {
    if (mover.HostHome(p)) continue;
    mover.NoteSelected(p, step);
    const auto a = Clock::now();
    if (Status s = mover.EnsureHost(p, 1, step); !s.ok())
      return std::fprintf(stderr, "promote %u: %s\n", p, s.ToString().c_str()), 1;
    us.push_back(1e6 * Seconds(a, Clock::now()));
    if (us.size() % 64 == 0 && !mover.Pump(step).ok()) return 1;
  }
  const auto t2 = Clock::now();
  if (us.empty()) return std::fprintf(stderr, "no page on disk to promote\n"), 1;
  std::vector<double> sorted = us;
  std::sort(sorted.begin(), sorted.end());
  double slow_s = 0;
  int slow = 0;
  for (double x : us)
    if (x > 1000) slow_s += x / 1e6, ++slow;
  std::printf("%u pages sealed in %.1f s (host %u slots, disk %u)\n", pages, Seconds(t0, t1), host_slots, disk_slots);
  std::printf("%zu promotions in %.2f s: p50 %.1f us, p99 %.1f us, max %.0f us; %d over 1 ms took %.2f s (%.2f ms each); "
              "demotions %lld, clean drops %lld\n",
              us.size(), Seconds(t1, t2), sorted[sorted.size() / 2], sorted[sorted.size() * 99 / 100], sorted.back(),
              slow, slow_s, slow ? 1e3 * slow_s / slow : 0.0, (long long)mover.stats().demotions,
              (long long)mover.stats().clean_drops);
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace
}  // namespace questkv

int main(int argc, char** argv) {
  uint32_t pages = 1000000, promotions = 200000;
  std::string dir = "/tmp/questkv-mover-bench";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--pages") pages = uint32_t(std::strtoul(argv[i + 1], nullptr, 10));
    else if (flag == "--promotions") promotions = uint32_t(std::strtoul(argv[i + 1], nullptr, 10));
    else if (flag == "--dir") dir = argv[i + 1];
    else return std::fprintf(stderr, "unknown flag %s\n", argv[i]), 2;
  }
  if (argc % 2 == 0) return std::fprintf(stderr, "usage: %s [--pages N] [--promotions N] [--dir D]\n", argv[0]), 2;
  if (pages < 100) return std::fprintf(stderr, "--pages must be at least 100\n"), 2;
  return questkv::Run(pages, promotions, dir);
}
