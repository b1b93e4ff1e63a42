// MakeUringBackend: io_uring over O_DIRECT files, with the files registered
// (IOSQE_FIXED_FILE) and the host region registered as fixed buffers
// (READ_FIXED/WRITE_FIXED), so the kernel neither looks up an fd nor pins
// pages per request.
//
// Submit hands the request to the kernel at once, so I/O starts while the
// owner does other work (the pread pool behaves the same); batching entries
// until Reap measured no faster here. An entry the kernel could not take for
// the moment (EAGAIN) stays queued and goes with the next Reap.
//
// With a submission thread (IORING_SETUP_SQPOLL) the kernel's own thread
// takes entries off the ring, so Submit and Reap(0) enter the kernel only to
// wake it after kSqIdleMs without work: the owner (the decode thread) no
// longer pays the block layer's submission path per request, at the price of
// that thread spinning on a core while requests keep coming. in_flight()
// counts requests from Submit to their reaped completion and never exceeds
// queue_depth(), which the ring is sized for, so neither the submission nor
// the completion ring can overflow.
#include <liburing.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <string>

#include "tiers/io_backend_common.h"

namespace questkv {
namespace {

constexpr int kMaxQueueDepth = 4096;
// How long the submission thread spins without new entries before it sleeps.
constexpr unsigned kSqIdleMs = 20;
// The kernel refuses a registered buffer larger than 1 GiB.
constexpr std::size_t kIovecMaxBytes = std::size_t(1) << 30;

class UringBackend final : public IoBackend {
 public:
  UringBackend(int queue_depth, bool sq_thread)
      : queue_depth_(queue_depth), sq_thread_(sq_thread), name_(sq_thread ? "io_uring (sq thread)" : "io_uring") {}

  Status Init() {
    // SUBMIT_ALL: a bad entry does not stall the ones behind it. COOP_TASKRUN:
    // completions are run when we enter the kernel anyway, not by interrupt
    // (the kernel refuses it beside SQPOLL, whose thread runs them).
    const unsigned base = sq_thread_ ? IORING_SETUP_SQPOLL : 0;
    const unsigned since_5_19 = IORING_SETUP_SUBMIT_ALL | (sq_thread_ ? 0 : IORING_SETUP_COOP_TASKRUN);
    int rc = -EINVAL;
    for (const unsigned flags : {base | since_5_19, base}) {  // an older kernel refuses the newer flags
      if (rc != -EINVAL) break;
      io_uring_params params{};
      params.flags = flags;
      params.sq_thread_idle = kSqIdleMs;
      rc = io_uring_queue_init_params(queue_depth_, &ring_, &params);
    }
    if (rc < 0)
      return Status::Unimplemented(ErrnoMessage(
          sq_thread_ ? "io_uring with a submission thread unavailable: io_uring_queue_init" : "io_uring unavailable: io_uring_queue_init",
          -rc));
    ring_ready_ = true;
    return Status::Ok();
  }

  ~UringBackend() override {
    Drain();
    if (ring_ready_) io_uring_queue_exit(&ring_);  // also unregisters files and buffers
    for (int fd : fds_) ::close(fd);
  }

  std::string_view name() const override { return name_; }
  int queue_depth() const override { return queue_depth_; }
  int in_flight() const override { return in_flight_; }

  Status OpenFiles(std::span<const std::string> paths) override {
    if (!fds_.empty()) return Status::FailedPrecondition("io: files already open");
    if (paths.empty()) return Status::InvalidArgument("io: no files");
    for (const std::string& path : paths) {
      bool direct = false;
      Result<int> fd = OpenForIo(path, &direct);
      if (!fd.ok()) return CloseAll(fd.status());
      fds_.push_back(*fd);
    }
    const int rc = io_uring_register_files(&ring_, fds_.data(), unsigned(fds_.size()));
    if (rc < 0) return CloseAll(Status::IOError(ErrnoMessage("io_uring_register_files", -rc)));
    return Status::Ok();
  }

  Status RegisterRegion(void* base, std::size_t bytes) override {
    QKV_RETURN_IF_ERROR(CheckRegion(region_, base, bytes));
    region_ = {static_cast<char*>(base), bytes};
    std::vector<iovec> iovecs;
    for (std::size_t at = 0; at < bytes; at += kIovecMaxBytes)
      iovecs.push_back({region_.base + at, std::min(kIovecMaxBytes, bytes - at)});
    const int rc = io_uring_register_buffers(&ring_, iovecs.data(), unsigned(iovecs.size()));
    // Memory the kernel will not pin for us (a driver's mapping, a memlock
    // limit) still works with plain READ/WRITE: slower, not wrong.
    if (rc < 0) name_ += " (" + ErrnoMessage("buffers not registered", -rc) + ")";
    buffers_registered_ = rc == 0;
    return Status::Ok();
  }

  Status Submit(const IoRequest& request) override {
    QKV_RETURN_IF_ERROR(CheckRequest(request, int(fds_.size()), region_, /*direct=*/true));
    if (in_flight_ >= queue_depth_) return Status::ResourceExhausted("io: queue full");
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) return Status::Internal("io_uring: no submission entry below the queue depth");
    Prepare(sqe, request);
    ++in_flight_;
    io_uring_submit(&ring_);  // on failure the entry stays queued; Reap retries and reports
    return Status::Ok();
  }

  Status Reap(std::vector<IoCompletion>* out, int min_complete) override {
    if (min_complete < 0 || min_complete > in_flight_)
      return Status::InvalidArgument("io: min_complete " + std::to_string(min_complete) + " with " +
                                     std::to_string(in_flight_) + " in flight");
    int reaped = Collect(out);
    // Entries still in the ring are the kernel's: its submission thread's
    // (it takes them without us), or ones it could not take for the moment.
    while (reaped < min_complete || (!sq_thread_ && io_uring_sq_ready(&ring_) > 0)) {
      const int rc = io_uring_submit_and_wait(&ring_, unsigned(std::max(min_complete - reaped, 0)));
      reaped += Collect(out);
      // EAGAIN/EBUSY: the kernel is short of memory or completion space for
      // the moment; it frees up as requests complete, so try again.
      const bool transient = rc >= 0 || rc == -EINTR || rc == -EAGAIN || rc == -EBUSY;
      if (!transient) return Status::IOError(ErrnoMessage("io_uring_enter", -rc));
      if (rc < 0 && rc != -EINTR && reaped >= min_complete) break;  // submit the rest next time
    }
    return Status::Ok();
  }

 private:
  void Prepare(io_uring_sqe* sqe, const IoRequest& r) {
    const int index = BufferIndex(r.buf, r.len);
    const bool read = r.op == IoRequest::Op::kRead;
    if (index >= 0 && read) io_uring_prep_read_fixed(sqe, r.file, r.buf, r.len, r.offset, index);
    if (index >= 0 && !read) io_uring_prep_write_fixed(sqe, r.file, r.buf, r.len, r.offset, index);
    if (index < 0 && read) io_uring_prep_read(sqe, r.file, r.buf, r.len, r.offset);
    if (index < 0 && !read) io_uring_prep_write(sqe, r.file, r.buf, r.len, r.offset);
    sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data64(sqe, r.tag);
  }

  // The registered buffer holding all of [buf, buf+len), or -1 (buffers not
  // registered, or the request straddles two 1 GiB iovecs).
  int BufferIndex(const void* buf, uint32_t len) const {
    if (!buffers_registered_) return -1;
    const std::size_t at = static_cast<const char*>(buf) - region_.base;
    const std::size_t index = at / kIovecMaxBytes;
    return (at + len - 1) / kIovecMaxBytes == index ? int(index) : -1;
  }

  // Moves every completion now in the ring to *out; returns how many.
  int Collect(std::vector<IoCompletion>* out) {
    unsigned head;
    io_uring_cqe* cqe;
    int count = 0;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      out->push_back({io_uring_cqe_get_data64(cqe), cqe->res});
      ++count;
    }
    io_uring_cq_advance(&ring_, unsigned(count));
    in_flight_ -= count;
    return count;
  }

  // Waits out every request still in flight: their buffers must not be
  // written by the kernel after the owner frees them.
  void Drain() {
    std::vector<IoCompletion> ignored;
    while (in_flight_ > 0 && Reap(&ignored, in_flight_).ok()) ignored.clear();
  }

  Status CloseAll(Status status) {
    for (int fd : fds_) ::close(fd);
    fds_.clear();
    return status;
  }

  const int queue_depth_;
  const bool sq_thread_;
  io_uring ring_{};
  bool ring_ready_ = false;
  bool buffers_registered_ = false;
  int in_flight_ = 0;
  std::string name_;
  IoRegion region_;
  std::vector<int> fds_;
};

}  // namespace

Result<std::unique_ptr<IoBackend>> MakeUringBackend(int queue_depth, bool sq_thread) {
  if (queue_depth < 1 || queue_depth > kMaxQueueDepth)
    return Status::InvalidArgument("io_uring: queue depth " + std::to_string(queue_depth) + " outside [1, " +
                                   std::to_string(kMaxQueueDepth) + "]");
  auto backend = std::make_unique<UringBackend>(queue_depth, sq_thread);
  QKV_RETURN_IF_ERROR(backend->Init());
  return std::unique_ptr<IoBackend>(std::move(backend));
}

}  // namespace questkv
