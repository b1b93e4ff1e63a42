// IoBackend: the one seam through which the disk tier does I/O (like
// LevelDB's Env). Implementations: io_uring (O_DIRECT files, registered
// buffers, fixed files, bounded queue depth), a pread/pwrite thread pool (the
// portable fallback), an in-memory disk (tests, simulation), and a
// fault-injecting wrapper around any of them.
//
// Model: the caller registers its files and the one host region that all
// I/O buffers lie in, then submits reads/writes tagged with a u64 and reaps
// completions. A completion's result is the byte count transferred, or
// -errno; a short count is possible and is the caller's to treat as an error.
// At most queue_depth() requests are in flight; Submit beyond that is
// ResourceExhausted (never an unbounded queue).
//
// Thread safety: one thread submits and reaps (the disk tier's owner);
// implementations may use threads inside.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "questkv/status.h"

namespace questkv {

struct IoRequest {
  enum class Op : uint8_t { kRead, kWrite };
  Op op = Op::kRead;
  int file = 0;          // index into the registered files, not an fd
  uint64_t offset = 0;   // bytes; a multiple of 4096 for O_DIRECT backends
  void* buf = nullptr;   // inside the registered region
  uint32_t len = 0;      // bytes; a multiple of 4096 for O_DIRECT backends
  uint64_t tag = 0;      // returned in the completion
};

struct IoCompletion {
  uint64_t tag = 0;
  int64_t result = 0;    // bytes transferred (>= 0) or -errno
};

class IoBackend {
 public:
  virtual ~IoBackend() = default;
  virtual std::string_view name() const = 0;
  virtual int queue_depth() const = 0;
  virtual int in_flight() const = 0;

  // Files by path, opened (created if absent) for read/write — with O_DIRECT
  // where the backend uses it — and registered (io_uring: fixed files).
  // Call once, before any Submit. IOError naming the path on failure.
  virtual Status OpenFiles(std::span<const std::string> paths) = 0;
  // The host region every request buffer lies in (io_uring: registered
  // buffers). Call once, before any Submit; base 4096-aligned.
  virtual Status RegisterRegion(void* base, std::size_t bytes) = 0;

  // Queues one request. InvalidArgument for a bad file index or a buffer
  // outside the region; ResourceExhausted when queue_depth() are in flight.
  virtual Status Submit(const IoRequest& request) = 0;
  // Appends completions to *out, waiting until at least min_complete are
  // available (0: do not wait). min_complete > in_flight() is InvalidArgument.
  virtual Status Reap(std::vector<IoCompletion>* out, int min_complete) = 0;
};

// io_uring with O_DIRECT, registered buffers and fixed files. Unimplemented
// where io_uring cannot be set up (old kernel, seccomp sandbox). With
// sq_thread, a kernel thread submits the entries (IORING_SETUP_SQPOLL): a
// request costs the owner a ring write instead of a system call, and the
// thread spins on a core while requests keep coming.
Result<std::unique_ptr<IoBackend>> MakeUringBackend(int queue_depth, bool sq_thread = false);
// A thread pool doing pread/pwrite (O_DIRECT where the filesystem allows).
Result<std::unique_ptr<IoBackend>> MakePreadPoolBackend(int threads, int queue_depth);
// io_uring when it works here, else the pread pool.
Result<std::unique_ptr<IoBackend>> MakeDefaultBackend(int queue_depth);
// Files held in memory (paths are names only); completions in submit order
// unless a seed is given, in which case Reap returns them in a seeded random
// order — deterministic for a seed.
std::unique_ptr<IoBackend> MakeMemoryBackend(int queue_depth, uint64_t reorder_seed = 0);

// Faults to inject, each chosen per request from a seeded generator so a
// failing seed reproduces. Probabilities in [0, 1].
struct FaultPlan {
  uint64_t seed = 1;
  double read_eio = 0;         // completion -EIO on a read
  double write_eio = 0;        // completion -EIO on a write
  double write_enospc = 0;     // completion -ENOSPC on a write
  double short_read = 0;       // a read transfers fewer bytes than asked
  double short_write = 0;      // a write transfers fewer bytes than asked
  double corrupt_read = 0;     // one byte of the read buffer flipped after a good read
  double misdirected_write = 0;// the write lands at another page-aligned offset
  double delay = 0;            // completion held back for a few reaps (reordering)
};
std::unique_ptr<IoBackend> MakeFaultInjectingBackend(std::unique_ptr<IoBackend> inner, const FaultPlan& plan);

}  // namespace questkv
