// MakePreadPoolBackend: the portable fallback. Worker threads take requests
// from a queue bounded by the queue depth and run one pread/pwrite each,
// retrying only on EINTR: a short transfer is reported as it happened, for the
// caller to treat as an error (same contract as io_uring).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "tiers/io_backend_common.h"
#include "topology/topology.h"

namespace questkv {
namespace {

constexpr int kMaxThreads = 256;
constexpr int kMaxQueueDepth = 4096;

int64_t Transfer(int fd, const IoRequest& r) {
  for (;;) {
    const ssize_t n = r.op == IoRequest::Op::kRead ? ::pread(fd, r.buf, r.len, off_t(r.offset))
                                                   : ::pwrite(fd, r.buf, r.len, off_t(r.offset));
    if (n >= 0) return n;
    if (errno != EINTR) return -errno;
  }
}

class PreadPoolBackend final : public IoBackend {
 public:
  // Workers run on `node` (the GPU's NUMA node, next to the pinned host
  // arena they fill), or anywhere when it is -1.
  PreadPoolBackend(int threads, int queue_depth, int node) : queue_depth_(queue_depth) {
    workers_.reserve(threads);
    for (int i = 0; i < threads; ++i)
      workers_.emplace_back([this, node] {
        (void)BindCurrentThreadToNode(node);  // placement is a preference, not a requirement
        Work();
      });
  }

  // Finishes every queued request (their buffers are the caller's until
  // completion), then closes the files.
  ~PreadPoolBackend() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    work_cv_.notify_all();
    for (std::thread& t : workers_) t.join();
    for (int fd : fds_) ::close(fd);
  }

  std::string_view name() const override { return "pread-pool"; }
  int queue_depth() const override { return queue_depth_; }
  int in_flight() const override { return in_flight_; }

  Status OpenFiles(std::span<const std::string> paths) override {
    if (!fds_.empty()) return Status::FailedPrecondition("io: files already open");
    if (paths.empty()) return Status::InvalidArgument("io: no files");
    std::vector<int> fds;
    for (const std::string& path : paths) {
      bool direct = false;
      Result<int> fd = OpenForIo(path, &direct);
      if (!fd.ok()) {
        for (int f : fds) ::close(f);
        return fd.status();
      }
      fds.push_back(*fd);
    }
    std::lock_guard<std::mutex> lock(mu_);  // publishes fds_ to the workers
    fds_ = std::move(fds);
    return Status::Ok();
  }

  Status RegisterRegion(void* base, std::size_t bytes) override {
    QKV_RETURN_IF_ERROR(CheckRegion(region_, base, bytes));
    region_ = {static_cast<char*>(base), bytes};
    return Status::Ok();
  }

  Status Submit(const IoRequest& request) override {
    QKV_RETURN_IF_ERROR(CheckRequest(request, int(fds_.size()), region_, /*direct=*/true));
    if (in_flight_ >= queue_depth_) return Status::ResourceExhausted("io: queue full");
    {
      std::lock_guard<std::mutex> lock(mu_);
      queued_.push_back(request);
    }
    ++in_flight_;
    work_cv_.notify_one();
    return Status::Ok();
  }

  Status Reap(std::vector<IoCompletion>* out, int min_complete) override {
    if (min_complete < 0 || min_complete > in_flight_)
      return Status::InvalidArgument("io: min_complete " + std::to_string(min_complete) + " with " +
                                     std::to_string(in_flight_) + " in flight");
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return int(done_.size()) >= min_complete; });
    out->insert(out->end(), done_.begin(), done_.end());
    in_flight_ -= int(done_.size());
    done_.clear();
    return Status::Ok();
  }

 private:
  void Work() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_cv_.wait(lock, [&] { return stopping_ || !queued_.empty(); });
      if (queued_.empty()) return;  // stopping, and nothing left to do
      const IoRequest request = queued_.front();
      queued_.pop_front();
      const int fd = fds_[request.file];
      lock.unlock();
      const int64_t result = Transfer(fd, request);
      lock.lock();
      done_.push_back({request.tag, result});
      done_cv_.notify_one();
    }
  }

  const int queue_depth_;
  int in_flight_ = 0;  // submitted, not yet reaped; owner thread only
  IoRegion region_;
  std::vector<int> fds_;

  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<IoRequest> queued_;     // guarded by mu_; at most queue_depth_
  std::vector<IoCompletion> done_;   // guarded by mu_; at most queue_depth_
  bool stopping_ = false;            // guarded by mu_
  std::vector<std::thread> workers_;
};

}  // namespace

Result<std::unique_ptr<IoBackend>> MakePreadPoolBackend(int threads, int queue_depth) {
  if (threads < 1 || threads > kMaxThreads)
    return Status::InvalidArgument("pread pool: threads " + std::to_string(threads) + " outside [1, " +
                                   std::to_string(kMaxThreads) + "]");
  if (queue_depth < 1 || queue_depth > kMaxQueueDepth)
    return Status::InvalidArgument("pread pool: queue depth " + std::to_string(queue_depth) +
                                   " outside [1, " + std::to_string(kMaxQueueDepth) + "]");
  return std::unique_ptr<IoBackend>(std::make_unique<PreadPoolBackend>(threads, queue_depth, GpuNumaNode(0)));
}

Result<std::unique_ptr<IoBackend>> MakeDefaultBackend(int queue_depth) {
  Result<std::unique_ptr<IoBackend>> uring = MakeUringBackend(queue_depth);
  if (uring.ok() || uring.status().code() != Code::kUnimplemented) return uring;
  // Blocking workers: one per queue slot keeps the queue depth real, up to a cap.
  return MakePreadPoolBackend(std::min(queue_depth, 64), queue_depth);
}

}  // namespace questkv
