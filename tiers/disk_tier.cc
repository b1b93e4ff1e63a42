// DiskTier: a slot allocator over page files plus the bookkeeping that turns
// backend completions into checked page completions.
//
// Slot s lives in file s % files at offset (s / files) * slot_bytes, so
// consecutive slots spread over the files. Slots come from a free list backed
// by a high-water mark (memory grows with slots used, not with capacity).
// A page's record exists from SubmitWrite until its slot is freed, and while
// any I/O on the page is in flight its slot is never freed, so a slot is never
// written and read by two pages at once. A write checked off the owner's
// thread counts as in flight from SubmitWrite: its slot and queue entry are
// taken there, and the owner hands it to the backend (or completes it as a
// Corruption) when it next submits or reaps after the check.
#include "tiers/disk_tier.h"

#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cassert>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <limits>
#include <mutex>
#include <thread>

#include "tiers/checksum.h"
#include "tiers/io_backend_common.h"

namespace questkv {
namespace {

constexpr int kMaxFiles = 256;

enum class PageState : uint8_t { kWriting, kOnDisk };

struct PageRecord {
  uint32_t slot = 0;
  uint32_t generation = 0;
  uint64_t checksum = 0;
  PageState state = PageState::kWriting;
  int reads_in_flight = 0;
  bool dropped = false;  // free the slot once the I/O in flight is done
};

struct PendingOp {
  uint32_t page_id = 0;
  uint32_t generation = 0;
  uint32_t slot = 0;
  bool is_write = false;
  void* buf = nullptr;
  uint64_t checksum = 0;  // what a read must match
};

// A write's pre-write check, for the checking thread, and its outcome.
struct WriteCheck {
  uint64_t ticket = 0;
  PendingOp op;
  bool matches = false;
};

Status Damaged(uint32_t page_id, uint32_t generation) {
  return Status::Corruption("disk tier: page " + std::to_string(page_id) + " generation " +
                            std::to_string(generation) + " no longer matches its sealed checksum; not written");
}

// Distinguishes the files of several tiers in one process and directory.
std::atomic<uint64_t> g_tier_instance{0};

std::string ResultMessage(const char* what, uint32_t page_id, int64_t result, std::size_t want_bytes) {
  const std::string page = std::string(what) + " of page " + std::to_string(page_id);
  if (result < 0) return ErrnoMessage(page, int(-result));
  return page + ": short transfer, " + std::to_string(result) + " of " + std::to_string(want_bytes) + " bytes";
}

// The budget must fit the filesystem's free space and the process's file-size
// limit: past either, writes fail (ENOSPC, EFBIG) only once the tier fills.
Status CheckRoom(const DiskTierOptions& options, uint64_t slots, std::size_t slot_bytes) {
  struct statvfs fs {};
  if (::statvfs(options.dir.c_str(), &fs) != 0) return Status::IOError(ErrnoMessage("disk tier: statvfs " + options.dir, errno));
  const uint64_t free_bytes = uint64_t(fs.f_bavail) * fs.f_frsize;
  const uint64_t budget = slots * slot_bytes;
  if (budget > free_bytes)
    return Status::ResourceExhausted("disk tier: budget of " + std::to_string(budget) + " bytes exceeds the " +
                                     std::to_string(free_bytes) + " bytes free on the filesystem of " + options.dir);
  struct rlimit limit {};
  const uint64_t file_bytes = (slots + uint64_t(options.files) - 1) / uint64_t(options.files) * slot_bytes;
  if (::getrlimit(RLIMIT_FSIZE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY && file_bytes > limit.rlim_cur)
    return Status::ResourceExhausted("disk tier: page files of up to " + std::to_string(file_bytes) +
                                     " bytes each exceed the file-size limit (RLIMIT_FSIZE, ulimit -f) of " +
                                     std::to_string(uint64_t(limit.rlim_cur)) + " bytes; lower the disk budget");
  return Status::Ok();
}

}  // namespace

struct DiskTier::Impl {
  DiskTierOptions options;
  std::unique_ptr<IoBackend> io;
  std::size_t slot_bytes = 0;
  uint32_t capacity = 0;
  uint32_t fresh_slot = 0;            // slots >= this were never handed out
  std::vector<uint32_t> free_slots;   // handed out before, free again
  std::unordered_map<uint32_t, PageRecord> pages;
  std::unordered_map<uint64_t, PendingOp> pending;  // by ticket; at most queue_depth
  uint64_t next_ticket = 1;
  IoRegion region;
  DiskStats stats;
  bool created_dir = false;
  std::vector<IoCompletion> reaped;   // reused by Reap

  // Writes checked off the owner's thread (options.check_writes_off_thread).
  std::thread checker;
  std::mutex mu;
  std::condition_variable to_check, checked_cv;  // guarded by mu
  std::deque<WriteCheck> unchecked;              // guarded by mu
  std::vector<WriteCheck> checked;               // guarded by mu
  bool stopping = false;                         // guarded by mu
  bool checker_waits = false, owner_waits = false;  // guarded by mu: a wait to notify
  int checking = 0;                   // owner: handed to the checker, outcome not yet taken
  std::vector<WriteCheck> outcomes;   // owner: reused by TakeChecked
  std::vector<DiskCompletion> ready;  // owner: writes completed without the backend

  ~Impl();
  void CheckLoop();
  void TakeChecked(bool wait);
  int in_flight() const { return io->in_flight() + checking; }

  Result<uint32_t> TakeSlot();
  void FreeSlot(uint32_t slot);
  void ErasePage(uint32_t page_id, uint32_t slot);
  Status CheckBuffer(const void* buf) const;
  Status CheckQueue() const;
  IoRequest Request(IoRequest::Op op, uint32_t slot, void* buf, uint64_t ticket) const;
  DiskCompletion Complete(const IoCompletion& c);
  Status Reap(std::vector<DiskCompletion>* out, int min_complete);
  DiskCompletion CompleteWrite(const PendingOp& op, int64_t result, DiskCompletion d);
  DiskCompletion CompleteRead(const PendingOp& op, int64_t result, DiskCompletion d);
  void Drain();
};

DiskTier::Impl::~Impl() {
  if (!checker.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu);
    stopping = true;
  }
  to_check.notify_one();
  checker.join();
}

void DiskTier::Impl::CheckLoop() {
  std::unique_lock<std::mutex> lock(mu);
  for (;;) {
    checker_waits = true;
    to_check.wait(lock, [&] { return stopping || !unchecked.empty(); });
    checker_waits = false;
    if (unchecked.empty()) return;  // stopping, nothing left
    WriteCheck c = unchecked.front();
    unchecked.pop_front();
    lock.unlock();
    c.matches = PageChecksum(c.op.buf, options.page_bytes, c.op.page_id, c.op.generation) == c.op.checksum;
    lock.lock();
    checked.push_back(c);
    if (owner_waits) checked_cv.notify_one();
  }
}

// Checked writes go to the backend; a mismatch, or a backend that refuses the
// write, completes it here (into `ready`, slot freed). With `wait`, waits for
// at least one outcome (some write must be being checked).
void DiskTier::Impl::TakeChecked(bool wait) {
  if (checking == 0) return;
  outcomes.clear();
  {
    std::unique_lock<std::mutex> lock(mu);
    owner_waits = wait;
    if (wait) checked_cv.wait(lock, [&] { return !checked.empty(); });
    owner_waits = false;
    outcomes.swap(checked);
  }
  for (const WriteCheck& c : outcomes) {
    --checking;
    const PendingOp& op = c.op;
    Status status;
    if (!c.matches) {
      ++stats.corruptions;
      status = Damaged(op.page_id, op.generation);
    } else {
      status = io->Submit(Request(IoRequest::Op::kWrite, op.slot, op.buf, c.ticket));
      if (status.ok()) continue;  // in the backend now
    }
    ErasePage(op.page_id, op.slot);
    pending.erase(c.ticket);
    ready.push_back({c.ticket, op.page_id, true, std::move(status)});
  }
}

Result<uint32_t> DiskTier::Impl::TakeSlot() {
  uint32_t slot;
  if (!free_slots.empty()) {
    slot = free_slots.back();
    free_slots.pop_back();
  } else if (fresh_slot < capacity) {
    slot = fresh_slot++;
  } else {
    return Status::ResourceExhausted("disk tier: all " + std::to_string(capacity) + " slots of " +
                                     std::to_string(slot_bytes) + " bytes in use (budget " +
                                     std::to_string(options.bytes) + " bytes)");
  }
  ++stats.slots_used;
  stats.slots_peak = std::max(stats.slots_peak, stats.slots_used);
  return slot;
}

void DiskTier::Impl::FreeSlot(uint32_t slot) {
  assert(slot < fresh_slot && stats.slots_used > 0);
  free_slots.push_back(slot);
  --stats.slots_used;
}

void DiskTier::Impl::ErasePage(uint32_t page_id, uint32_t slot) {
  FreeSlot(slot);
  pages.erase(page_id);
}

Status DiskTier::Impl::CheckBuffer(const void* buf) const {
  if (!region.registered()) return Status::FailedPrecondition("disk tier: no region registered");
  if (!region.Contains(buf, slot_bytes) || reinterpret_cast<uintptr_t>(buf) % kDirectAlignBytes != 0)
    return Status::InvalidArgument("disk tier: buffer is not a 4096-aligned slot inside the region");
  return Status::Ok();
}

Status DiskTier::Impl::CheckQueue() const {
  if (in_flight() >= io->queue_depth())
    return Status::ResourceExhausted("disk tier: " + std::to_string(io->queue_depth()) + " I/Os in flight");
  return Status::Ok();
}

IoRequest DiskTier::Impl::Request(IoRequest::Op op, uint32_t slot, void* buf, uint64_t ticket) const {
  const uint32_t files = uint32_t(options.files);
  return {op, int(slot % files), uint64_t(slot / files) * slot_bytes, buf, uint32_t(slot_bytes), ticket};
}

DiskCompletion DiskTier::Impl::Complete(const IoCompletion& c) {
  auto it = pending.find(c.tag);
  assert(it != pending.end() && "completion for a ticket never submitted");
  if (it == pending.end()) return {c.tag, 0, false, Status::Internal("disk tier: unknown completion")};
  const PendingOp op = it->second;
  pending.erase(it);
  DiskCompletion d{c.tag, op.page_id, op.is_write, Status::Ok()};
  return op.is_write ? CompleteWrite(op, c.result, std::move(d)) : CompleteRead(op, c.result, std::move(d));
}

DiskCompletion DiskTier::Impl::CompleteWrite(const PendingOp& op, int64_t result, DiskCompletion d) {
  PageRecord& record = pages.at(op.page_id);
  if (result != int64_t(slot_bytes)) {
    // The slot holds some unknown part of the page: it is no copy at all.
    d.status = Status::IOError(ResultMessage("write", op.page_id, result, slot_bytes));
    ++stats.io_errors;
    ErasePage(op.page_id, op.slot);
    return d;
  }
  ++stats.writes;
  stats.bytes_written += int64_t(slot_bytes);
  record.state = PageState::kOnDisk;
  if (record.dropped) ErasePage(op.page_id, op.slot);
  return d;
}

DiskCompletion DiskTier::Impl::CompleteRead(const PendingOp& op, int64_t result, DiskCompletion d) {
  PageRecord& record = pages.at(op.page_id);
  --record.reads_in_flight;
  if (result != int64_t(slot_bytes)) {
    d.status = Status::IOError(ResultMessage("read", op.page_id, result, slot_bytes));
    ++stats.io_errors;
  } else if (PageChecksum(op.buf, options.page_bytes, op.page_id, op.generation) != op.checksum) {
    d.status = Status::Corruption("disk tier: page " + std::to_string(op.page_id) + " generation " +
                                  std::to_string(op.generation) + " read back with a checksum mismatch");
    ++stats.corruptions;
  } else {
    ++stats.reads;
    stats.bytes_read += int64_t(slot_bytes);
  }
  if (record.dropped && record.reads_in_flight == 0) ErasePage(op.page_id, op.slot);
  return d;
}

Status DiskTier::Impl::Reap(std::vector<DiskCompletion>* out, int min_complete) {
  if (min_complete < 0 || min_complete > in_flight())
    return Status::InvalidArgument("disk tier: min_complete " + std::to_string(min_complete) + " with " +
                                   std::to_string(in_flight()) + " in flight");
  int got = 0;
  auto take_ready = [&] {  // checked writes into the backend; refused ones are complete
    TakeChecked(/*wait=*/false);
    got += int(ready.size());
    for (DiskCompletion& d : ready) out->push_back(std::move(d));
    ready.clear();
  };
  take_ready();
  do {
    if (got < min_complete && io->in_flight() == 0) {  // only writes being checked can complete
      TakeChecked(/*wait=*/true);
    } else {
      reaped.clear();
      // Completions the backend delivered are accounted for even if it then failed.
      const Status status = io->Reap(&reaped, std::min(std::max(min_complete - got, 0), io->in_flight()));
      for (const IoCompletion& c : reaped) out->push_back(Complete(c));
      got += int(reaped.size());
      if (!status.ok()) return status;
    }
    take_ready();
  } while (got < min_complete);
  return Status::Ok();
}

void DiskTier::Impl::Drain() {
  std::vector<DiskCompletion> ignored;
  while (in_flight() > 0 && Reap(&ignored, 1).ok()) ignored.clear();
}

Result<std::unique_ptr<DiskTier>> DiskTier::Open(const DiskTierOptions& options, std::unique_ptr<IoBackend> io) {
  if (io == nullptr) return Status::InvalidArgument("disk tier: no I/O backend");
  if (options.dir.empty()) return Status::InvalidArgument("disk tier: no directory");
  if (options.page_bytes == 0 || options.page_bytes > kMaxRequestBytes)
    return Status::InvalidArgument("disk tier: page of " + std::to_string(options.page_bytes) +
                                   " bytes outside [1, 2^30]");
  if (options.files < 1 || options.files > kMaxFiles)
    return Status::InvalidArgument("disk tier: files " + std::to_string(options.files) + " outside [1, " +
                                   std::to_string(kMaxFiles) + "]");
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->slot_bytes = (options.page_bytes + kDirectAlignBytes - 1) / kDirectAlignBytes * kDirectAlignBytes;
  const uint64_t slots = options.bytes / impl->slot_bytes;
  if (slots == 0 || slots > std::numeric_limits<uint32_t>::max())
    return Status::InvalidArgument("disk tier: budget of " + std::to_string(options.bytes) + " bytes gives " +
                                   std::to_string(slots) + " slots of " + std::to_string(impl->slot_bytes) +
                                   " bytes (need 1 to 2^32-1)");
  impl->capacity = uint32_t(slots);
  impl->stats.slots_capacity = impl->capacity;

  std::error_code ec;
  impl->created_dir = std::filesystem::create_directories(options.dir, ec);
  if (ec) return Status::IOError("disk tier: cannot create " + options.dir + ": " + ec.message());
  if (Status room = CheckRoom(options, slots, impl->slot_bytes); !room.ok()) {
    if (impl->created_dir) std::filesystem::remove(options.dir, ec);
    return room;
  }
  std::vector<std::string> paths;
  const uint64_t instance = g_tier_instance.fetch_add(1);
  for (int i = 0; i < options.files; ++i)
    paths.push_back(options.dir + "/questkv-pages." + std::to_string(::getpid()) + "." +
                    std::to_string(instance) + "." + std::to_string(i));
  const Status opened = io->OpenFiles(paths);
  for (const std::string& path : paths) ::unlink(path.c_str());  // an in-memory backend made none
  if (!opened.ok()) {
    if (impl->created_dir) std::filesystem::remove(options.dir, ec);
    return opened;
  }
  impl->io = std::move(io);
  if (options.check_writes_off_thread) {
    Impl* t = impl.get();
    impl->checker = std::thread([t] { t->CheckLoop(); });
  }
  return std::unique_ptr<DiskTier>(new DiskTier(std::move(impl)));
}

DiskTier::DiskTier(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

DiskTier::~DiskTier() {
  impl_->Drain();
  impl_->io.reset();  // closes the (already unlinked) files
  std::error_code ec;
  if (impl_->created_dir) std::filesystem::remove(impl_->options.dir, ec);  // only if empty
}

Status DiskTier::RegisterRegion(void* base, std::size_t bytes) {
  QKV_RETURN_IF_ERROR(CheckRegion(impl_->region, base, bytes));
  QKV_RETURN_IF_ERROR(impl_->io->RegisterRegion(base, bytes));
  impl_->region = {static_cast<char*>(base), bytes};
  return Status::Ok();
}

Result<uint64_t> DiskTier::SubmitWrite(uint32_t page_id, uint32_t generation, const void* src) {
  QKV_RETURN_IF_ERROR(impl_->CheckBuffer(src));
  return SubmitWrite(page_id, generation, src, PageChecksum(src, impl_->options.page_bytes, page_id, generation));
}

Result<uint64_t> DiskTier::SubmitWrite(uint32_t page_id, uint32_t generation, const void* src,
                                       uint64_t sealed_checksum) {
  Impl& t = *impl_;
  QKV_RETURN_IF_ERROR(t.CheckBuffer(src));
  if (t.pages.count(page_id))
    return Status::FailedPrecondition("disk tier: page " + std::to_string(page_id) +
                                      " already has a disk copy or I/O in flight");
  t.TakeChecked(/*wait=*/false);
  QKV_RETURN_IF_ERROR(t.CheckQueue());
  QKV_ASSIGN_OR_RETURN(const uint32_t slot, t.TakeSlot());
  const uint64_t ticket = t.next_ticket++;
  const PendingOp op{page_id, generation, slot, true, const_cast<void*>(src), sealed_checksum};
  if (t.checker.joinable()) {  // checked on the tier's thread, submitted after
    bool wake;
    {
      std::lock_guard<std::mutex> lock(t.mu);
      t.unchecked.push_back({ticket, op, false});
      wake = t.checker_waits;  // a busy checker finds the job without a system call
    }
    if (wake) t.to_check.notify_one();
    ++t.checking;
  } else {
    // The pre-write half of the assert pair, as late as it can be.
    if (PageChecksum(src, t.options.page_bytes, page_id, generation) != sealed_checksum) {
      t.FreeSlot(slot);
      ++t.stats.corruptions;
      return Damaged(page_id, generation);
    }
    const Status submitted = t.io->Submit(t.Request(IoRequest::Op::kWrite, slot, op.buf, ticket));
    if (!submitted.ok()) {
      t.FreeSlot(slot);
      return submitted;
    }
  }
  t.pages[page_id] = {slot, generation, sealed_checksum, PageState::kWriting};
  t.pending[ticket] = op;
  return ticket;
}

Result<uint64_t> DiskTier::SubmitRead(uint32_t page_id, uint32_t generation, void* dst) {
  Impl& t = *impl_;
  QKV_RETURN_IF_ERROR(t.CheckBuffer(dst));
  auto it = t.pages.find(page_id);
  if (it == t.pages.end() || it->second.dropped || it->second.generation != generation)
    return Status::NotFound("disk tier: no disk copy of page " + std::to_string(page_id) + " generation " +
                            std::to_string(generation));
  PageRecord& record = it->second;
  if (record.state == PageState::kWriting)
    return Status::FailedPrecondition("disk tier: page " + std::to_string(page_id) + " is still being written");
  t.TakeChecked(/*wait=*/false);
  QKV_RETURN_IF_ERROR(t.CheckQueue());
  const uint64_t ticket = t.next_ticket++;
  QKV_RETURN_IF_ERROR(t.io->Submit(t.Request(IoRequest::Op::kRead, record.slot, dst, ticket)));
  ++record.reads_in_flight;
  t.pending[ticket] = {page_id, generation, record.slot, false, dst, record.checksum};
  return ticket;
}

Status DiskTier::Reap(std::vector<DiskCompletion>* out, int min_complete) { return impl_->Reap(out, min_complete); }

bool DiskTier::Holds(uint32_t page_id, uint32_t generation) const {
  auto it = impl_->pages.find(page_id);
  return it != impl_->pages.end() && !it->second.dropped && it->second.state == PageState::kOnDisk &&
         it->second.generation == generation;
}

void DiskTier::Drop(uint32_t page_id) {
  auto it = impl_->pages.find(page_id);
  if (it == impl_->pages.end()) return;
  PageRecord& record = it->second;
  if (record.state == PageState::kWriting || record.reads_in_flight > 0) {
    record.dropped = true;
    return;
  }
  impl_->ErasePage(page_id, record.slot);
}

std::string_view DiskTier::io_name() const { return impl_->io->name(); }
int DiskTier::in_flight() const { return impl_->in_flight(); }
int DiskTier::queue_depth() const { return impl_->io->queue_depth(); }
const DiskStats& DiskTier::stats() const { return impl_->stats; }
std::size_t DiskTier::slot_bytes() const { return impl_->slot_bytes; }

}  // namespace questkv
