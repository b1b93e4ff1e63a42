// MakeMemoryBackend: a disk held in memory for tests and simulation.
//
// A request does nothing until it completes: Reap performs the transfer and
// reports it, so with a reorder seed a later request can land before an
// earlier one, as on a real device. Files behave like sparse files: reads past
// the end are short, writes grow them, up to kFileMaxBytes (beyond: -ENOSPC,
// so a stray offset cannot make an unbounded allocation).
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>

#include "tiers/io_backend_common.h"

namespace questkv {
namespace {

constexpr uint64_t kFileMaxBytes = uint64_t(4) << 30;

class MemoryBackend final : public IoBackend {
 public:
  MemoryBackend(int queue_depth, uint64_t reorder_seed)
      : queue_depth_(queue_depth), reorder_(reorder_seed != 0), rng_(reorder_seed) {}

  std::string_view name() const override { return reorder_ ? "memory-reordered" : "memory"; }
  int queue_depth() const override { return queue_depth_; }
  int in_flight() const override { return int(pending_.size()); }

  Status OpenFiles(std::span<const std::string> paths) override {
    if (!files_.empty()) return Status::FailedPrecondition("io: files already open");
    if (paths.empty()) return Status::InvalidArgument("io: no files");
    files_.resize(paths.size());
    return Status::Ok();
  }

  Status RegisterRegion(void* base, std::size_t bytes) override {
    QKV_RETURN_IF_ERROR(CheckRegion(region_, base, bytes));
    region_ = {static_cast<char*>(base), bytes};
    return Status::Ok();
  }

  Status Submit(const IoRequest& request) override {
    QKV_RETURN_IF_ERROR(CheckRequest(request, int(files_.size()), region_, /*direct=*/false));
    if (in_flight() >= queue_depth_) return Status::ResourceExhausted("io: queue full");
    pending_.push_back(request);
    return Status::Ok();
  }

  Status Reap(std::vector<IoCompletion>* out, int min_complete) override {
    if (min_complete < 0 || min_complete > in_flight())
      return Status::InvalidArgument("io: min_complete " + std::to_string(min_complete) + " with " +
                                     std::to_string(in_flight()) + " in flight");
    // Unseeded: everything pending completes, in submit order. Seeded: a
    // random number of them (at least min_complete), in random order.
    const std::size_t count =
        reorder_ ? min_complete + rng_.Below(pending_.size() - min_complete + 1) : pending_.size();
    for (std::size_t k = 0; k < count; ++k) {
      const std::size_t i = reorder_ ? rng_.Below(pending_.size()) : 0;
      const IoRequest request = pending_[i];
      pending_.erase(pending_.begin() + i);
      out->push_back({request.tag, Transfer(request)});
    }
    return Status::Ok();
  }

 private:
  int64_t Transfer(const IoRequest& r) {
    std::vector<char>& file = files_[r.file];
    if (r.op == IoRequest::Op::kRead) {
      if (r.offset >= file.size()) return 0;
      const std::size_t n = std::min<uint64_t>(r.len, file.size() - r.offset);
      std::memcpy(r.buf, file.data() + r.offset, n);
      return int64_t(n);
    }
    const uint64_t end = r.offset + r.len;
    if (end > kFileMaxBytes) return -ENOSPC;
    try {
      if (end > file.size()) file.resize(end);
    } catch (const std::bad_alloc&) {
      return -ENOMEM;
    }
    std::memcpy(file.data() + r.offset, r.buf, r.len);
    return r.len;
  }

  const int queue_depth_;
  const bool reorder_;
  SeededRng rng_;
  IoRegion region_;
  std::vector<std::vector<char>> files_;
  std::vector<IoRequest> pending_;  // at most queue_depth_
};

}  // namespace

std::unique_ptr<IoBackend> MakeMemoryBackend(int queue_depth, uint64_t reorder_seed) {
  return std::make_unique<MemoryBackend>(std::max(queue_depth, 1), reorder_seed);
}

}  // namespace questkv
