// Disk tier benchmark: random whole-page reads at queue depth 64, side by side
// in one run (tiers/disk_probe.h):
//
//   raw io_uring   READ_FIXED, registered buffers, fixed O_DIRECT file
//   raw touched    the same, reading each block's cache lines once on arrival
//   tier io_uring  DiskTier promotion path (SubmitRead + Reap, checksum
//                  verified) over the io_uring backend
//   tier pread     the same over the pread pool (one thread per queue slot)
//   sq thread      the io_uring tier with a kernel submission thread, where
//                  the kernel allows one
//
// and, for the io_uring tiers, the owner's time per submit call: what a
// decode thread pays per promotion or demotion it starts.
//
// at two page sizes: 64 KiB (Hkv 8, S 16, D 128, fp16 — any layer count: one
// page is one layer) and 16 KiB. Also the PageChecksum rate over a 64 KiB
// page, to show the check costs next to nothing.
//
// Run: questkv_disk_bench [--dir /tmp/questkv-disk-bench] [--file-bytes 1G]
//      [--seconds 3] [--queue-depth 64] [--blocks 65536,16384] [--json PATH]
// The file (file-bytes, per path) lives in --dir only while the run lasts.
#include <sys/utsname.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tiers/checksum.h"
#include "tiers/disk_probe.h"

namespace questkv {
namespace {

struct Args {
  std::string dir = "/tmp/questkv-disk-bench";
  uint64_t file_bytes = uint64_t(1) << 30;
  double seconds = 3;
  int queue_depth = 64;
  std::vector<std::size_t> blocks = {65536, 16384};
  std::string json;
  std::string command;
};

// "64K", "16M", "1G" or plain bytes; 0 when malformed.
uint64_t ParseBytes(const std::string& s) {
  char* end = nullptr;
  const unsigned long long n = std::strtoull(s.c_str(), &end, 10);
  const std::string unit = end ? end : "";
  if (unit.empty()) return n;
  if (unit == "K") return n << 10;
  if (unit == "M") return n << 20;
  if (unit == "G") return n << 30;
  return 0;
}

bool Parse(int argc, char** argv, Args* a) {
  for (int i = 0; i < argc; ++i) a->command += std::string(i ? " " : "") + argv[i];
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--dir") {
      a->dir = value;
    } else if (flag == "--file-bytes") {
      a->file_bytes = ParseBytes(value);
    } else if (flag == "--seconds") {
      a->seconds = std::atof(value.c_str());
    } else if (flag == "--queue-depth") {
      a->queue_depth = std::atoi(value.c_str());
    } else if (flag == "--json") {
      a->json = value;
    } else if (flag == "--blocks") {
      a->blocks.clear();
      for (std::size_t at = 0; at <= value.size();) {
        const std::size_t comma = std::min(value.find(',', at), value.size());
        a->blocks.push_back(ParseBytes(value.substr(at, comma - at)));
        at = comma + 1;
      }
    } else {
      return false;
    }
  }
  return argc % 2 == 1 && a->file_bytes > 0 && a->seconds > 0 && !a->blocks.empty();
}

// PageChecksum over one 64 KiB page, repeated for about 0.2 s: GB/s.
double ChecksumGbps() {
  std::vector<unsigned char> page(65536);
  for (std::size_t i = 0; i < page.size(); ++i) page[i] = uint8_t(i * 131 + 7);
  uint64_t sink = 0;
  int64_t bytes = 0;
  const auto start = std::chrono::steady_clock::now();
  double seconds = 0;
  while (seconds < 0.2) {
    for (int k = 0; k < 256; ++k) sink += PageChecksum(page.data(), page.size(), uint32_t(k), 1);
    bytes += 256 * int64_t(page.size());
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  if (sink == 42) std::puts("");  // keeps the loop from being optimised away
  return double(bytes) / seconds / 1e9;
}

std::string Machine() {
  utsname u{};
  ::uname(&u);
  return std::string(u.nodename) + " " + u.sysname + " " + u.release + " " + u.machine;
}

void PrintTable(const Args& a, const std::vector<DiskProbeResult>& rows, double checksum_gbps) {
  std::printf("disk tier reads: %s, file %llu bytes per path, queue depth %d, %.2f s per path\n", a.dir.c_str(),
              (unsigned long long)a.file_bytes, a.queue_depth, a.seconds);
  std::printf("%-8s %14s %14s %15s %12s %9s %13s %12s %7s\n", "block", "raw io_uring", "raw touched",
              "tier io_uring", "tier pread", "tier/raw", "tier/touched", "tier write", "direct");
  for (const DiskProbeResult& r : rows)
    std::printf("%-8zu %9.3f GB/s %9.3f GB/s %10.3f GB/s %7.3f GB/s %9.3f %13.3f %7.3f GB/s %7s\n", r.block_bytes,
                r.raw_uring_gbps, r.raw_uring_touched_gbps, r.tier_uring_gbps, r.tier_pread_gbps,
                r.tier_uring_gbps / r.raw_uring_gbps, r.tier_uring_gbps / r.raw_uring_touched_gbps,
                r.tier_write_gbps, r.direct ? "yes" : "NO");
  if (!rows.empty()) std::printf("io_uring backend: %s\n", rows[0].uring_backend.c_str());
  std::printf("the owner's time per submit (a write's includes its checksum check), and the io_uring tier with a "
              "kernel submission thread:\n");
  std::printf("%-8s %16s %17s %17s %16s %18s\n", "block", "io_uring read", "io_uring write", "sq thread read",
              "sq thread write", "sq thread rates");
  for (const DiskProbeResult& r : rows) {
    if (r.sqpoll_backend.empty()) {
      std::printf("%-8zu %13.2f us %14.2f us %17s %16s %18s\n", r.block_bytes, r.tier_uring_read_submit_us,
                  r.tier_write_submit_us, "-", "-", "unavailable");
      continue;
    }
    std::printf("%-8zu %13.2f us %14.2f us %14.2f us %13.2f us %6.3f / %.3f GB/s\n", r.block_bytes,
                r.tier_uring_read_submit_us, r.tier_write_submit_us, r.tier_sqpoll_read_submit_us,
                r.tier_sqpoll_write_submit_us, r.tier_sqpoll_gbps, r.tier_sqpoll_write_gbps);
  }
  std::printf("PageChecksum, 64 KiB pages: %.2f GB/s\n", checksum_gbps);
}

bool WriteJson(const Args& a, const std::vector<DiskProbeResult>& rows, double checksum_gbps) {
  std::FILE* f = std::fopen(a.json.c_str(), "w");
  if (!f) return false;
  std::fprintf(f, "{\"bench\":\"disk\",\"machine\":\"%s\",\"command\":\"%s\",\"dir\":\"%s\",\"file_bytes\":%llu,",
               Machine().c_str(), a.command.c_str(), a.dir.c_str(), (unsigned long long)a.file_bytes);
  std::fprintf(f, "\"queue_depth\":%d,\"seconds\":%g,\"checksum_gb_per_s\":%.3f,\"results\":[", a.queue_depth,
               a.seconds, checksum_gbps);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const DiskProbeResult& r = rows[i];
    std::fprintf(f,
                 "%s{\"block_bytes\":%zu,\"raw_uring_gb_per_s\":%.4f,\"raw_uring_touched_gb_per_s\":%.4f,"
                 "\"tier_uring_gb_per_s\":%.4f,\"tier_pread_gb_per_s\":%.4f,\"tier_over_raw\":%.4f,"
                 "\"tier_over_raw_touched\":%.4f,\"tier_write_gb_per_s\":%.4f,\"direct\":%s,"
                 "\"uring_backend\":\"%s\",\"tier_uring_read_submit_us\":%.3f,\"tier_write_submit_us\":%.3f,"
                 "\"tier_sqpoll_gb_per_s\":%.4f,\"tier_sqpoll_read_submit_us\":%.3f,"
                 "\"tier_sqpoll_write_gb_per_s\":%.4f,\"tier_sqpoll_write_submit_us\":%.3f,\"sqpoll_backend\":\"%s\"}",
                 i ? "," : "", r.block_bytes, r.raw_uring_gbps, r.raw_uring_touched_gbps, r.tier_uring_gbps,
                 r.tier_pread_gbps, r.tier_uring_gbps / r.raw_uring_gbps, r.tier_uring_gbps / r.raw_uring_touched_gbps,
                 r.tier_write_gbps, r.direct ? "true" : "false", r.uring_backend.c_str(), r.tier_uring_read_submit_us,
                 r.tier_write_submit_us, r.tier_sqpoll_gbps, r.tier_sqpoll_read_submit_us, r.tier_sqpoll_write_gbps,
                 r.tier_sqpoll_write_submit_us, r.sqpoll_backend.c_str());
  }
  std::fprintf(f, "]}\n");
  return std::fclose(f) == 0;
}

int Main(int argc, char** argv) {
  Args a;
  if (!Parse(argc, argv, &a)) {
    std::fprintf(stderr,
                 "usage: %s [--dir DIR] [--file-bytes N[K|M|G]] [--seconds S] [--queue-depth N] "
                 "[--blocks B,B...] [--json PATH]\n",
                 argv[0]);
    return 2;
  }
  std::vector<DiskProbeResult> rows;
  for (std::size_t block : a.blocks) {
    Result<DiskProbeResult> r = ProbeDiskReads(a.dir, a.file_bytes, block, a.queue_depth, a.seconds);
    if (!r.ok()) {
      std::fprintf(stderr, "disk bench, block %zu: %s\n", block, r.status().ToString().c_str());
      return 1;
    }
    rows.push_back(*r);
  }
  const double checksum_gbps = ChecksumGbps();
  PrintTable(a, rows, checksum_gbps);
  if (!a.json.empty() && !WriteJson(a, rows, checksum_gbps)) {
    std::fprintf(stderr, "disk bench: cannot write %s\n", a.json.c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace questkv

int main(int argc, char** argv) { return questkv::Main(argc, argv); }
