#include "tiers/disk_probe.h"

#include <fcntl.h>
#include <liburing.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <unordered_map>
#include <vector>

#include "tiers/checksum.h"
#include "tiers/disk_tier.h"
#include "tiers/io_backend_common.h"

namespace questkv {
namespace {

using Clock = std::chrono::steady_clock;

// Paths alternate in rounds this long, so drift in a shared virtual disk
// lands on all three alike.
constexpr double kRoundSeconds = 0.25;
constexpr std::size_t kFillChunkBytes = std::size_t(1) << 20;
constexpr uint32_t kGeneration = 1;

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};
using AlignedBytes = std::unique_ptr<char, FreeDeleter>;

Result<AlignedBytes> AllocateAligned(std::size_t bytes, uint64_t seed) {
  const std::size_t rounded = (bytes + kDirectAlignBytes - 1) / kDirectAlignBytes * kDirectAlignBytes;
  AlignedBytes p(static_cast<char*>(std::aligned_alloc(kDirectAlignBytes, rounded)));
  if (!p) return Status::ResourceExhausted("disk probe: cannot allocate " + std::to_string(rounded) + " bytes");
  SeededRng rng(seed);
  for (std::size_t i = 0; i + 8 <= rounded; i += 8) {
    const uint64_t v = rng.Next();
    std::memcpy(p.get() + i, &v, 8);
  }
  return p;
}

struct Throughput {
  int64_t bytes = 0;
  double seconds = 0;
  int64_t submits = 0;          // requests the owner submitted
  double submit_seconds = 0;    // the owner's time inside those submit calls
  double gbps() const { return seconds > 0 ? double(bytes) / seconds / 1e9 : 0; }
  double submit_us() const { return submits > 0 ? submit_seconds / double(submits) * 1e6 : 0; }
  void Add(const Throughput& t) {
    bytes += t.bytes;
    seconds += t.seconds;
    submits += t.submits;
    submit_seconds += t.submit_seconds;
  }
};

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

Clock::time_point After(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// One buffer per queue slot, in one 4096-aligned region, handed out in FIFO
// order (like the probe's bufs[n % qd]). Every path uses the same pool, so
// the memory the device writes into behaves alike in each.
class BufferPool {
 public:
  static Result<BufferPool> Create(std::size_t block_bytes, int count) {
    BufferPool pool;
    pool.block_bytes_ = block_bytes;
    pool.count_ = count;
    QKV_ASSIGN_OR_RETURN(pool.bytes_, AllocateAligned(block_bytes * count, 3));
    for (int i = 0; i < count; ++i) pool.free_.push_back(i);
    return pool;
  }
  char* region() const { return bytes_.get(); }
  std::size_t region_bytes() const { return block_bytes_ * count_; }
  char* at(int i) const { return bytes_.get() + std::size_t(i) * block_bytes_; }
  bool empty() const { return free_.empty(); }
  int Take() {
    const int i = free_.front();
    free_.pop_front();
    return i;
  }
  void Give(int i) { free_.push_back(i); }

 private:
  std::size_t block_bytes_ = 0;
  int count_ = 0;
  AlignedBytes bytes_;
  std::deque<int> free_;
};

// Reads each byte's cache line once, as any consumer of a read must at least.
uint64_t TouchLines(const char* p, std::size_t bytes) {
  uint64_t sum = 0;
  for (std::size_t i = 0; i < bytes; i += 64) sum += uint8_t(p[i]);
  return sum;
}

// The ceiling: io_uring READ_FIXED of random blocks of one O_DIRECT file, the
// pool registered as the fixed buffer, a fixed file, and no bookkeeping.
class RawUringReader {
 public:
  ~RawUringReader() {
    if (ring_ready_) io_uring_queue_exit(&ring_);
    if (fd_ >= 0) ::close(fd_);
  }

  static Result<std::unique_ptr<RawUringReader>> Create(const std::string& dir, uint64_t file_bytes,
                                                        std::size_t block_bytes, int queue_depth) {
    auto r = std::unique_ptr<RawUringReader>(new RawUringReader(block_bytes, queue_depth));
    r->blocks_ = file_bytes / block_bytes;
    const std::string path = dir + "/questkv-probe." + std::to_string(::getpid()) + ".raw";
    QKV_ASSIGN_OR_RETURN(r->fd_, OpenForIo(path, &r->direct_));
    ::unlink(path.c_str());
    QKV_RETURN_IF_ERROR(r->Fill());
    QKV_ASSIGN_OR_RETURN(r->pool_, BufferPool::Create(block_bytes, queue_depth));
    QKV_RETURN_IF_ERROR(r->SetUpRing());
    return r;
  }

  bool direct() const { return direct_; }

  // With `touch`, reads every block's cache lines once when it lands.
  Result<Throughput> Run(double seconds, bool touch, SeededRng* rng) {
    Throughput t;
    uint64_t touched = 0;
    const Clock::time_point start = Clock::now();
    const Clock::time_point deadline = After(seconds);
    for (int in_flight = 0;;) {
      for (const bool open = Clock::now() < deadline; open && !pool_.empty(); ++in_flight) {
        const int b = pool_.Take();
        io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
        io_uring_prep_read_fixed(sqe, 0, pool_.at(b), unsigned(block_bytes_), rng->Below(blocks_) * block_bytes_, 0);
        sqe->flags |= IOSQE_FIXED_FILE;
        io_uring_sqe_set_data64(sqe, uint64_t(b));
      }
      if (in_flight == 0) break;
      const int rc = io_uring_submit_and_wait(&ring_, 1);
      if (rc < 0 && rc != -EINTR) return Status::IOError(ErrnoMessage("disk probe: io_uring_enter", -rc));
      unsigned head, seen = 0;
      io_uring_cqe* cqe;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        if (cqe->res != int(block_bytes_))
          return Status::IOError("disk probe: raw read returned " + std::to_string(cqe->res));
        const int b = int(io_uring_cqe_get_data64(cqe));
        if (touch) touched += TouchLines(pool_.at(b), block_bytes_);
        pool_.Give(b);
        ++seen;
      }
      io_uring_cq_advance(&ring_, seen);
      in_flight -= int(seen);
      t.bytes += int64_t(seen * block_bytes_);
    }
    t.seconds = SecondsSince(start);
    sink_ += touched;
    return t;
  }

 private:
  RawUringReader(std::size_t block_bytes, int queue_depth) : block_bytes_(block_bytes), queue_depth_(queue_depth) {}

  // Real bytes on every block: reading a hole would not touch the device.
  Status Fill() {
    QKV_ASSIGN_OR_RETURN(AlignedBytes chunk, AllocateAligned(kFillChunkBytes, 1));
    const uint64_t bytes = blocks_ * block_bytes_;
    for (uint64_t at = 0; at < bytes;) {
      const std::size_t n = std::min<uint64_t>(kFillChunkBytes, bytes - at);
      const ssize_t w = ::pwrite(fd_, chunk.get(), n, off_t(at));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return Status::IOError(ErrnoMessage("disk probe: filling the raw file", w < 0 ? errno : EIO));
      at += uint64_t(w);
    }
    return Status::Ok();
  }

  Status SetUpRing() {
    int rc = io_uring_queue_init(unsigned(queue_depth_), &ring_, 0);
    if (rc < 0) return Status::Unimplemented(ErrnoMessage("disk probe: io_uring_queue_init", -rc));
    ring_ready_ = true;
    const iovec region{pool_.region(), pool_.region_bytes()};
    rc = io_uring_register_buffers(&ring_, &region, 1);
    if (rc < 0) return Status::IOError(ErrnoMessage("disk probe: io_uring_register_buffers", -rc));
    rc = io_uring_register_files(&ring_, &fd_, 1);
    if (rc < 0) return Status::IOError(ErrnoMessage("disk probe: io_uring_register_files", -rc));
    return Status::Ok();
  }

  const std::size_t block_bytes_;
  const int queue_depth_;
  uint64_t blocks_ = 0;
  int fd_ = -1;
  bool direct_ = false;
  bool ring_ready_ = false;
  io_uring ring_{};
  BufferPool pool_;
  uint64_t sink_ = 0;  // keeps the touching loads
};

// A DiskTier filled with `pages` pages, and the pool its I/O uses. The tier
// is declared last so it is destroyed, draining its I/O, before the pool.
struct FilledTier {
  BufferPool pool;
  std::size_t slot_bytes = 0;
  uint32_t pages = 0;
  std::string backend;
  std::unique_ptr<DiskTier> tier;
};

// Keeps every pool buffer busy until `deadline` or `count` I/Os, recycling a
// buffer when its I/O completes. `submit(buffer, i)` issues the i-th I/O.
// Any failed completion ends the run with its status.
template <typename SubmitFn>
Result<Throughput> Pump(FilledTier* t, int64_t count, Clock::time_point deadline, SubmitFn submit) {
  std::unordered_map<uint64_t, int> buffer_of;
  std::vector<DiskCompletion> done;
  Throughput result;
  const Clock::time_point start = Clock::now();
  for (int64_t issued = 0;;) {
    for (const bool open = Clock::now() < deadline; open && issued < count && !t->pool.empty(); ++issued) {
      const int b = t->pool.Take();
      const Clock::time_point submit_start = Clock::now();
      Result<uint64_t> ticket = submit(t->pool.at(b), issued);
      result.submit_seconds += SecondsSince(submit_start);
      ++result.submits;
      if (!ticket.ok()) t->pool.Give(b);
      QKV_RETURN_IF_ERROR(ticket.status());
      buffer_of[*ticket] = b;
    }
    if (buffer_of.empty()) break;
    done.clear();
    QKV_RETURN_IF_ERROR(t->tier->Reap(&done, 1));
    for (const DiskCompletion& d : done) {
      if (!d.status.ok()) return d.status;
      t->pool.Give(buffer_of.at(d.ticket));
      buffer_of.erase(d.ticket);
      result.bytes += int64_t(t->slot_bytes);
    }
  }
  result.seconds = SecondsSince(start);
  return result;
}

Result<std::unique_ptr<FilledTier>> FillTier(const std::string& dir, uint64_t file_bytes, std::size_t block_bytes,
                                             Result<std::unique_ptr<IoBackend>> io, Throughput* write) {
  if (!io.ok()) return io.status();
  auto t = std::make_unique<FilledTier>();
  const int queue_depth = (*io)->queue_depth();
  QKV_ASSIGN_OR_RETURN(t->tier, DiskTier::Open({dir, file_bytes, block_bytes}, std::move(*io)));
  t->slot_bytes = t->tier->slot_bytes();
  t->pages = t->tier->stats().slots_capacity;
  QKV_ASSIGN_OR_RETURN(t->pool, BufferPool::Create(t->slot_bytes, queue_depth));
  QKV_RETURN_IF_ERROR(t->tier->RegisterRegion(t->pool.region(), t->pool.region_bytes()));
  t->backend = std::string(t->tier->io_name());  // after RegisterRegion, which may change it
  QKV_ASSIGN_OR_RETURN(*write, Pump(t.get(), t->pages, Clock::time_point::max(), [&](char* buf, int64_t i) {
    const uint32_t page = uint32_t(i);
    std::memcpy(buf, &page, sizeof page);  // distinct bytes per page
    return t->tier->SubmitWrite(page, kGeneration, buf, PageChecksum(buf, block_bytes, page, kGeneration));
  }));
  return t;
}

Result<Throughput> ReadTier(FilledTier* t, double seconds, SeededRng* rng) {
  return Pump(t, INT64_MAX, After(seconds), [&](char* buf, int64_t) {
    return t->tier->SubmitRead(uint32_t(rng->Below(t->pages)), kGeneration, buf);
  });
}

Status CheckProbeArgs(uint64_t file_bytes, std::size_t block_bytes, int queue_depth, double seconds) {
  if (block_bytes == 0 || block_bytes % kDirectAlignBytes != 0 || block_bytes > kMaxRequestBytes)
    return Status::InvalidArgument("disk probe: block of " + std::to_string(block_bytes) +
                                   " bytes is not a multiple of 4096 up to 2^30");
  if (queue_depth < 1 || queue_depth > 1024)
    return Status::InvalidArgument("disk probe: queue depth " + std::to_string(queue_depth) + " outside [1, 1024]");
  if (file_bytes < uint64_t(block_bytes) * queue_depth)
    return Status::InvalidArgument("disk probe: file of " + std::to_string(file_bytes) +
                                   " bytes is smaller than one block per queue slot");
  if (!(seconds > 0)) return Status::InvalidArgument("disk probe: seconds must be positive");
  return Status::Ok();
}

Result<DiskProbeResult> Probe(const std::string& dir, uint64_t file_bytes, std::size_t block_bytes,
                              int queue_depth, double seconds) {
  QKV_ASSIGN_OR_RETURN(auto raw, RawUringReader::Create(dir, file_bytes, block_bytes, queue_depth));
  Throughput uring_write, pread_write;
  QKV_ASSIGN_OR_RETURN(auto uring, FillTier(dir, file_bytes, block_bytes, MakeUringBackend(queue_depth), &uring_write));
  QKV_ASSIGN_OR_RETURN(auto pread, FillTier(dir, file_bytes, block_bytes,
                                            MakePreadPoolBackend(queue_depth, queue_depth), &pread_write));
  // The io_uring tier with a kernel submission thread, where the kernel
  // allows one (its absence leaves its figures at 0).
  Throughput sqpoll_write, sqpoll_read;
  Result<std::unique_ptr<FilledTier>> sqpoll =
      FillTier(dir, file_bytes, block_bytes, MakeUringBackend(queue_depth, /*sq_thread=*/true), &sqpoll_write);
  if (!sqpoll.ok() && sqpoll.status().code() != Code::kUnimplemented) return sqpoll.status();
  Throughput raw_read, raw_touched, uring_read, pread_read;
  // One generator per path, same seed: all read the same block sequence.
  SeededRng raw_rng(7), touched_rng(7), uring_rng(7), pread_rng(7), sqpoll_rng(7);
  const int rounds = std::max(1, int(seconds / kRoundSeconds + 0.5));
  for (int round = 0; round < rounds; ++round) {
    QKV_ASSIGN_OR_RETURN(const Throughput r, raw->Run(seconds / rounds, /*touch=*/false, &raw_rng));
    QKV_ASSIGN_OR_RETURN(const Throughput u, ReadTier(uring.get(), seconds / rounds, &uring_rng));
    QKV_ASSIGN_OR_RETURN(const Throughput p, ReadTier(pread.get(), seconds / rounds, &pread_rng));
    QKV_ASSIGN_OR_RETURN(const Throughput c, raw->Run(seconds / rounds, /*touch=*/true, &touched_rng));
    if (sqpoll.ok()) {
      QKV_ASSIGN_OR_RETURN(const Throughput s, ReadTier(sqpoll->get(), seconds / rounds, &sqpoll_rng));
      sqpoll_read.Add(s);
    }
    raw_read.Add(r);
    uring_read.Add(u);
    pread_read.Add(p);
    raw_touched.Add(c);
  }
  DiskProbeResult result;
  result.block_bytes = block_bytes;
  result.queue_depth = queue_depth;
  result.file_bytes = file_bytes;
  result.raw_uring_gbps = raw_read.gbps();
  result.raw_uring_touched_gbps = raw_touched.gbps();
  result.tier_uring_gbps = uring_read.gbps();
  result.tier_pread_gbps = pread_read.gbps();
  result.tier_write_gbps = uring_write.gbps();
  result.direct = raw->direct();
  result.uring_backend = uring->backend;
  result.tier_uring_read_submit_us = uring_read.submit_us();
  result.tier_write_submit_us = uring_write.submit_us();
  if (sqpoll.ok()) {
    result.tier_sqpoll_gbps = sqpoll_read.gbps();
    result.tier_sqpoll_read_submit_us = sqpoll_read.submit_us();
    result.tier_sqpoll_write_gbps = sqpoll_write.gbps();
    result.tier_sqpoll_write_submit_us = sqpoll_write.submit_us();
    result.sqpoll_backend = (*sqpoll)->backend;
  }
  return result;
}

}  // namespace

Result<DiskProbeResult> ProbeDiskReads(const std::string& dir, uint64_t file_bytes, std::size_t block_bytes,
                                       int queue_depth, double seconds) {
  QKV_RETURN_IF_ERROR(CheckProbeArgs(file_bytes, block_bytes, queue_depth, seconds));
  std::error_code ec;
  const bool created_dir = std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IOError("disk probe: cannot create " + dir + ": " + ec.message());
  Result<DiskProbeResult> result = Probe(dir, file_bytes, block_bytes, queue_depth, seconds);
  if (created_dir) std::filesystem::remove(dir, ec);  // only if empty
  return result;
}

}  // namespace questkv
