// ProbeDiskReads: how fast the disk tier promotes pages, next to what the disk
// gives raw. Random whole-page reads at one block size and queue depth,
// measured side by side in one run (interleaved in short rounds, so drift in
// the device hits every path alike), all into the same kind of buffer pool
// (queue_depth buffers in one registered region, reused first-in first-out):
//   raw_uring          io_uring READ_FIXED from one O_DIRECT file, fixed
//                      file, no bookkeeping, bytes never looked at (the
//                      ceiling);
//   raw_uring_touched  the same, reading each block's cache lines once when
//                      it lands — the least any consumer of the bytes does;
//   tier_uring         DiskTier::SubmitRead + Reap with checksum verification
//                      over the io_uring backend (the promotion path);
//   tier_pread         the same over the pread pool (the fallback);
//   tier_sqpoll        the io_uring tier with a kernel submission thread
//                      (IoBackendKind::kUringSqpoll), where the kernel allows
//                      one.
// Beside each io_uring tier's rates: the owner's time per submit call (the
// checksum re-check of a write included), the time a decode thread spends
// per promotion or demotion it starts.
// On an emulated disk (a VM's virtio-blk) reading the landed bytes can itself
// slow the device down; raw_uring_touched shows how much of the gap between
// raw_uring and tier_uring that is.
// Every file it makes is unlinked as soon as it is open, so nothing is left in
// `dir`, even after a crash. Needs about 4 * file_bytes of free disk.
// Thread-compatible; takes a few seconds plus 4 * seconds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "questkv/status.h"

namespace questkv {

struct DiskProbeResult {
  std::size_t block_bytes = 0;
  int queue_depth = 0;
  uint64_t file_bytes = 0;
  double raw_uring_gbps = 0;   // GB/s = 1e9 bytes per second
  double raw_uring_touched_gbps = 0;
  double tier_uring_gbps = 0;
  double tier_pread_gbps = 0;
  double tier_write_gbps = 0;  // filling the io_uring tier: the demotion path
  bool direct = false;         // the filesystem honoured O_DIRECT (else the page cache was measured)
  std::string uring_backend;   // IoBackend::name() of the io_uring tier
  double tier_uring_read_submit_us = 0;  // the owner's µs per SubmitRead / SubmitWrite
  double tier_write_submit_us = 0;
  double tier_sqpoll_gbps = 0;           // 0 (and sqpoll_backend empty) without a submission thread
  double tier_sqpoll_read_submit_us = 0;
  double tier_sqpoll_write_gbps = 0;
  double tier_sqpoll_write_submit_us = 0;
  std::string sqpoll_backend;
};

// IOError when the disk fails, Unimplemented when io_uring is unavailable,
// InvalidArgument for a block size or file size the tier cannot hold.
Result<DiskProbeResult> ProbeDiskReads(const std::string& dir, uint64_t file_bytes, std::size_t block_bytes,
                                       int queue_depth, double seconds);

}  // namespace questkv
