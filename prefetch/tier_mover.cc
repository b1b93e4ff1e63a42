#include "prefetch/tier_mover.h"

#include "tiers/checksum.h"

#include <algorithm>
#include <cassert>
#include <cstring>

namespace questkv {

namespace {
constexpr uint32_t kNoSlot = UINT32_MAX;
// Model steps a demotion order is used for. The runtime's step advances twice
// a decode call, and a model step is a call per layer: at 256 runtime steps
// (the bound before), a 32-layer model rebuilt its order every 4th step, and
// at 1M tokens each rebuild (every host page scanned) stalled that step by
// ~45 ms on the H200 machine (steps 4, 8, 12 at 63-68 ms against 21-27).
constexpr int64_t kOrderAgeModelSteps = 64;
// A demotion order holds the coldest this many pages only: sorting every
// host page took 411 ms for 1.3M of them (a 1M-token Llama-3-8B's host tier;
// this machine), the partial selection and sort of the coldest 64K 50 ms.
constexpr std::size_t kOrderBatch = std::size_t(1) << 16;
// Disk copies a full disk's scan releases at once (ReleaseHotDiskCopies).
constexpr std::size_t kReleaseBatch = 256;
// Demotion writes a Pump call submits at most. Each costs the decode thread
// its pre-write checksum and submit (~6 us). 16 a call while missed pages
// waited for host room let 57% more promotions through at 512K with 8 GiB of
// HBM (H100) but skipped only 3% fewer head-pages, for a step 2 ms slower.
constexpr int kPumpWrites = 4;
}  // namespace

TierMover::TierMover(const Geometry& g, double high_water, double low_water, uint32_t pages, SlotArena* host,
                     DiskTier* disk)
    : g_(g), high_water_(high_water), low_water_(low_water), host_(host), disk_(disk),
      homes_(pages) {
  stats_.host_slots_capacity = host_->capacity();
}

void TierMover::SetHostValid(uint32_t page, bool valid) {
  Home& h = homes_[page];
  if (h.host_valid == valid) return;
  h.host_valid = valid;
  if (listener_) listener_(page, valid ? host_->data(h.host_slot) : nullptr);
}

void TierMover::NoteClean(uint32_t page) {
  Home& h = homes_[page];
  h.clean_since = now_;
  // A host's worth of entries at most: an older one is stale by then, or its
  // page is left to the demotion order.
  if (clean_.size() >= host_->capacity()) clean_.pop_front();
  clean_.push_back({page, h.generation, now_});
}

void TierMover::DropClean(uint32_t page) {
  Home& h = homes_[page];
  SetHostValid(page, false);
  ReleaseHome(h.host_slot);
  h.host_slot = kNoSlot;
  h.clean_since = -1;
  ++stats_.clean_drops;
}

void TierMover::ReleaseHome(uint32_t slot) {
  const uint64_t queued = device_.queued ? device_.queued() : 0;
  if (queued == 0) {
    host_->Free(slot);
  } else {
    retired_.emplace_back(queued, slot);
  }
}

// A demotion's pre-write check found the host copy no longer matching its
// seal: it must never be served, and `why` is what a wait for it returns.
void TierMover::DropDamagedHome(uint32_t page, Status why) {
  Home& h = homes_[page];
  SetHostValid(page, false);
  ReleaseHome(h.host_slot);
  h.host_slot = kNoSlot;
  h.error = std::move(why);
}

Status TierMover::Recycle(bool wait) {
  if (retired_.empty()) return Status::Ok();
  uint64_t done = UINT64_MAX;  // no device reads any more
  if (device_.done) {
    QKV_ASSIGN_OR_RETURN(done, device_.done(wait));
  }
  while (!retired_.empty() && retired_.front().first <= done) {
    host_->Free(retired_.front().second);
    retired_.pop_front();
  }
  CountHost();
  return Status::Ok();
}

const void* TierMover::HostHome(uint32_t page) const {
  const Home& h = homes_[page];
  return h.host_valid ? host_->data(h.host_slot) : nullptr;
}

void TierMover::NoteSelected(uint32_t page, int64_t step) {
  Home& h = homes_[page];
  if (h.last_step != step) ++h.uses;
  h.last_step = step;
}

void TierMover::NoteSelected(std::span<const uint32_t> pages, int64_t step) {
  constexpr std::size_t kAhead = 16;  // homes in flight while one is noted
  const std::size_t n = pages.size();
  for (std::size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) __builtin_prefetch(&homes_[pages[i + kAhead]], 1);
    Home& h = homes_[pages[i]];
    if (h.last_step != step) ++h.uses;
    h.last_step = step;
  }
}

Result<void*> TierMover::SealBegin(uint32_t page, uint32_t generation, int64_t step) {
  now_ = step;
  Home& h = homes_[page];
  assert(h.host_slot == kNoSlot && h.io == Io::kIdle);
  auto slot = host_->Allocate();
  if (!slot.ok()) {
    QKV_RETURN_IF_ERROR(MakeHostRoom(step, /*for_wait=*/false));
    slot = host_->Allocate();
    if (!slot.ok()) return slot.status();
  }
  h = Home{};
  h.host_slot = *slot;
  h.sealed = true;
  h.generation = generation;
  h.last_step = step - 1;  // sealed, not yet selected: demotable this step
  CountHost();
  return static_cast<void*>(host_->data(*slot));
}

void TierMover::SealEnd(uint32_t page) {
  Home& h = homes_[page];
  assert(h.host_slot != kNoSlot && !h.host_valid);
  stats_.bytes_hbm_to_host += int64_t(g_.page_bytes());
  // Taken while the bytes are known good; checked again right before a write.
  h.checksum = PageChecksum(host_->data(h.host_slot), g_.page_bytes(), page, h.generation);
  SetHostValid(page, true);
}

void TierMover::CountHost() {
  stats_.host_slots_used = host_->used();
  stats_.host_slots_peak = std::max(stats_.host_slots_peak, host_->used());
}

Result<const void*> TierMover::HomeForMiss(uint32_t page, uint32_t generation, int64_t step, bool wait) {
  Home& h = homes_[page];
  if (!h.host_valid) {
    if (!disk_) return Status::Internal("page " + std::to_string(page) + " has no home");
    ++stats_.cold_misses;
    // Skipping a page whose disk copy cannot be read would hide the loss for good.
    if (h.read_failures >= kIoAttempts) return h.error;
    if (!wait) {
      // Start the promotion if there is room now, else queue it; never wait for it.
      QKV_RETURN_IF_ERROR(PromoteOrQueue(page));
      ++stats_.pages_skipped;
      return static_cast<const void*>(nullptr);
    }
    ++stats_.cold_stalls;
    QKV_RETURN_IF_ERROR(EnsureHost(page, generation, step));
  }
  return static_cast<const void*>(host_->data(h.host_slot));
}

Status TierMover::ReadPage(uint32_t page, uint32_t generation, void* dst, int64_t step) {
  QKV_RETURN_IF_ERROR(EnsureHost(page, generation, step));
  std::memcpy(dst, host_->data(homes_[page].host_slot), g_.page_bytes());
  return Status::Ok();
}

Status TierMover::Prefetch(uint32_t page, bool ahead) {
  const Home& h = homes_[page];
  if (!disk_ || h.host_valid || !disk_->Holds(page, h.generation)) return Status::Ok();
  // A speculative read keeps the host below its high-water mark; a page
  // already missed (attended without under deadline) may take any free slot,
  // as HomeForMiss's deadline path does: with the host held just above the mark
  // by demotions in flight, the high-water rule refused every such promotion
  // and a 1M-token CUDA run skipped the same third of its selections each step.
  if (!ahead) return PromoteOrQueue(page);
  if (homes_used() + 1 > high_water_ * host_->capacity()) return Status::Ok();  // no room to spare
  QKV_ASSIGN_OR_RETURN(const bool started, PromoteIfRoom(page));
  if (started) ++stats_.prefetches;
  return Status::Ok();
}

Status TierMover::PromoteOrQueue(uint32_t page) {
  QKV_ASSIGN_OR_RETURN(const bool started, PromoteIfRoom(page));
  Home& h = homes_[page];
  if (!started && h.io == Io::kIdle && !h.pending) {
    h.pending = true;
    pending_.emplace_back(page, h.generation);
  }
  return Status::Ok();
}

// Entries of pages dropped, recycled, read back or already on their way since
// they were queued are passed over. (A 1M-token CUDA run under deadline
// started ~170 promotions a step and skipped ~10K head-pages a step: a missed
// page whose read found the queue full waited until it was missed again.)
Status TierMover::StartPending() {
  while (!pending_.empty()) {
    const auto [page, generation] = pending_.front();
    Home& h = homes_[page];
    if (!h.pending || h.generation != generation) {  // dropped or recycled since
      pending_.pop_front();
      continue;
    }
    if (h.host_valid || h.io != Io::kIdle || !disk_->Holds(page, generation) || h.read_failures >= kIoAttempts) {
      h.pending = false;
      pending_.pop_front();
      continue;
    }
    QKV_ASSIGN_OR_RETURN(const bool started, PromoteIfRoom(page));
    if (!started) break;  // no free host slot or a full queue: the rest next time
    h.pending = false;
    pending_.pop_front();
  }
  return Status::Ok();
}

Result<bool> TierMover::PromoteIfRoom(uint32_t page) {
  const Home& h = homes_[page];
  if (h.io != Io::kIdle || h.read_failures >= kIoAttempts || host_->used() >= host_->capacity()) return false;
  Status s = StartPromotion(page);
  if (s.code() == Code::kResourceExhausted) return false;  // queue full: a later call tries again
  QKV_RETURN_IF_ERROR(s);
  return true;
}

void TierMover::Drop(uint32_t page) {
  Home& h = homes_[page];
  if (h.io != Io::kIdle) (void)WaitIdle(page);  // its outcome no longer matters
  const bool was_readable = h.host_valid;
  SetHostValid(page, false);
  if (h.host_slot != kNoSlot) {
    if (was_readable) {
      ReleaseHome(h.host_slot);
    } else {
      host_->Free(h.host_slot);
    }
  }
  if (disk_) disk_->Drop(page);
  h = Home{};
  CountHost();
}

Status TierMover::Pump(int64_t step) {
  now_ = step;
  QKV_RETURN_IF_ERROR(Recycle(/*wait=*/false));
  if (!disk_) return Status::Ok();
  QKV_RETURN_IF_ERROR(ReapAll(0));
  // Missed pages queued behind a full host (`deadline`'s cold misses) take
  // the room of clean homes a model step old, as a waiting miss does
  // (MakeHostRoom): their slots free once the device is done with them. A
  // demotion's write cannot make that room where the disk is full, and at
  // kPumpWrites a call it makes less than the misses need: a 1M-token CUDA
  // run with a full disk promoted 36 pages a step while skipping ~5K
  // head-pages a step, with no clean home dropped. As many leave as reads
  // can start, less the slots already on their way back (retired): dropping
  // for the whole queue dropped ~830 homes a step for ~133 promotions.
  if (!pending_.empty() && host_->used() >= host_->capacity()) {
    const std::size_t reads = std::size_t(std::max(0, disk_->queue_depth() - disk_->in_flight()));
    const std::size_t room = std::min(pending_.size(), reads);
    if (room > retired_.size() && DropOldestClean(room - retired_.size(), step) > 0)
      QKV_RETURN_IF_ERROR(Recycle(/*wait=*/false));
  }
  QKV_RETURN_IF_ERROR(StartPending());
  // A quarter of the I/O queue stays free for promotions: a full queue of
  // background writes refused every deadline promotion, step after step,
  // on a 1M-token run whose host tier sat above its high-water mark. A
  // failing disk gets one probe write at a time. Each call submits at most
  // kPumpWrites: a write checks its page's checksum on the decode thread,
  // and a backlog of gigabytes past the high-water mark (a long prefill)
  // made every decode call wait for a queue's worth of them.
  const int max_writes = writes_failing() ? 1 : disk_->queue_depth() - std::max(1, disk_->queue_depth() / 4);
  // Missed pages waiting for room add their count to the call's writes: each
  // write that lands makes room for one of them.
  const int max_new = kPumpWrites + int(std::min<std::size_t>(pending_.size(), std::size_t(max_writes)));
  if (homes_used() > high_water_ * host_->capacity())
    QKV_RETURN_IF_ERROR(Demote(std::size_t(low_water_ * host_->capacity()), step, max_writes, max_new));
  return Status::Ok();
}

Status TierMover::Complete(const DiskCompletion& c) {
  Home& h = homes_[c.page_id];
  const bool was_write = h.io == Io::kWriting;
  assert(h.io != Io::kIdle && was_write == c.is_write);
  h.io = Io::kIdle;
  if (!c.status.ok()) {
    ++(c.status.code() == Code::kCorruption ? stats_.corruptions : stats_.io_errors);
    if (was_write && c.status.code() == Code::kCorruption) {
      // Its pre-write check ran off the decode thread; the disk is not at fault.
      DropDamagedHome(c.page_id, c.status);
      CountHost();
    } else if (was_write) {
      // The page keeps its host home; the failure counts toward a failing disk.
      ++stats_.write_errors;
      ++write_failures_;
      ++write_failures_in_a_row_;
      last_write_error_ = c.status;
    } else {
      // The bytes in the host slot are not to be trusted: drop them.
      ++stats_.read_errors;
      if (h.read_failures < 255) ++h.read_failures;
      host_->Free(h.host_slot);
      h.host_slot = kNoSlot;
      h.error = c.status;
      CountHost();
    }
    return Status::Ok();  // surfaced to whoever waits on the page
  }
  if (was_write) {
    write_failures_in_a_row_ = 0;
    ++stats_.demotions;
    stats_.bytes_host_to_disk += int64_t(g_.page_bytes());
    // Read in place since the write was queued: keep the host copy for now
    // (a later demotion drops it for free, the disk copy being there).
    if (h.pinned_epoch < read_epoch_) {
      SetHostValid(c.page_id, false);
      ReleaseHome(h.host_slot);
      h.host_slot = kNoSlot;
    } else {
      NoteClean(c.page_id);
    }
  } else {
    ++stats_.promotions;
    stats_.bytes_disk_to_host += int64_t(g_.page_bytes());
    h.error = Status::Ok();
    h.read_failures = 0;
    SetHostValid(c.page_id, true);
    NoteClean(c.page_id);
  }
  CountHost();
  return Status::Ok();
}

Status TierMover::ReapAll(int min_complete) {
  done_.clear();
  QKV_RETURN_IF_ERROR(disk_->Reap(&done_, min_complete));
  for (const DiskCompletion& c : done_) QKV_RETURN_IF_ERROR(Complete(c));
  return Status::Ok();
}

Status TierMover::WaitIdle(uint32_t page) {
  while (homes_[page].io != Io::kIdle) QKV_RETURN_IF_ERROR(ReapAll(1));
  return Status::Ok();
}

// Coldest first: least recently selected, then least often. A page read in
// place since the last EndReads stays: attention holds a pointer into it.
// The order is computed once (a scan of every page, the coldest kOrderBatch
// sorted) and consumed
// across calls until it runs out or is kOrderAgeModelSteps old: MakeHostRoom
// and Pump demote a queue's worth at a time, and re-sorting a million pages
// for each would cost more than the writes. Entries are re-checked as they
// are used; a page selected since the order was made is passed over.
Status TierMover::Demote(std::size_t target_used, int64_t step, int max_in_flight, int max_new) {
  int submitted = 0;
  auto eligible = [&](const Home& h) { return h.host_valid && h.io == Io::kIdle && h.pinned_epoch < read_epoch_; };
  std::size_t used = homes_used();
  bool queue_full = false;
  const int64_t max_age = kOrderAgeModelSteps * 2 * std::max(1, g_.layers);
  // A stale or used-up order is rebuilt; one that runs out without reaching
  // the target is rebuilt once more (pages sealed or promoted since).
  for (int pass = 0; pass < 2 && used > target_used && !queue_full; ++pass) {
    if (pass == 1 || order_pos_ >= order_.size() || step - order_step_ > max_age || step < order_step_) {
      order_.clear();
      for (uint32_t p = 0; p < homes_.size(); ++p)
        if (eligible(homes_[p])) order_.push_back(p);
      auto colder = [&](uint32_t a, uint32_t b) { return Colder(a, b); };
      if (order_.size() > kOrderBatch) {
        std::nth_element(order_.begin(), order_.begin() + kOrderBatch, order_.end(), colder);
        order_.resize(kOrderBatch);
      }
      std::sort(order_.begin(), order_.end(), colder);
      order_pos_ = 0;
      order_step_ = step;
      ++stats_.demotion_orders;
    }
    for (; order_pos_ < order_.size() && used > target_used; ++order_pos_) {
      const uint32_t p = order_[order_pos_];
      Home& h = homes_[p];
      if (!eligible(h) || h.last_step > order_step_) continue;  // gone, busy, or selected since
      if (disk_->Holds(p, h.generation)) {  // immutable page already on disk: leaving costs no write
        DropClean(p);
        --used;
        continue;
      }
      if (disk_->in_flight() >= max_in_flight || submitted >= max_new) {  // the rest next time
        queue_full = true;
        break;
      }
      auto ticket = disk_->SubmitWrite(p, h.generation, host_->data(h.host_slot), h.checksum);
      if (!ticket.ok()) {
        const Code code = ticket.status().code();
        if (code == Code::kResourceExhausted) {  // queue or disk full: this page first next time
          queue_full = true;
          break;
        }
        if (code != Code::kCorruption) return ticket.status();
        ++stats_.corruptions;
        DropDamagedHome(p, ticket.status());
        --used;
        continue;
      }
      h.io = Io::kWriting;
      ++submitted;
      --used;
    }
  }
  CountHost();
  return Status::Ok();
}

// Oldest first, once a model step has passed since the home became clean
// and since its page was last selected; an entry whose page was selected
// since leaves the queue (the demotion order still sees the page).
std::size_t TierMover::DropOldestClean(std::size_t n, int64_t step) {
  const int64_t model_step = 2 * std::max(1, g_.layers);
  std::size_t dropped = 0;
  while (dropped < n && !clean_.empty() && step - clean_.front().since >= model_step) {
    const CleanHome c = clean_.front();
    clean_.pop_front();
    const Home& h = homes_[c.page];
    if (h.generation != c.generation || h.clean_since != c.since || !h.host_valid || h.io != Io::kIdle ||
        h.pinned_epoch >= read_epoch_ || step - h.last_step < model_step || !disk_->Holds(c.page, c.generation))
      continue;
    DropClean(c.page);
    ++dropped;
  }
  CountHost();
  return dropped;
}

std::size_t TierMover::ReleaseHotDiskCopies(std::size_t n) {
  // A home holds both copies only once NoteClean has set its clean_since (a
  // promotion or a write read in place since; steps are never negative):
  // that keeps the disk tier's map lookup, which cost ~5.8 ms a scan at a
  // million homes, to those homes.
  std::vector<uint32_t> both;
  for (uint32_t p = 0; p < homes_.size(); ++p) {
    const Home& h = homes_[p];
    if (h.clean_since >= 0 && h.host_valid && h.io == Io::kIdle && disk_->Holds(p, h.generation)) both.push_back(p);
  }
  n = std::min(n, both.size());
  std::partial_sort(both.begin(), both.begin() + n, both.end(), [&](uint32_t a, uint32_t b) { return Colder(b, a); });
  for (std::size_t i = 0; i < n; ++i) {
    disk_->Drop(both[i]);
    homes_[both[i]].clean_since = -1;
  }
  return n;
}

Status TierMover::DemotionFailed() const {
  return Status::IOError("host tier full (" + std::to_string(host_->capacity()) + " pages) and demotions to disk fail (" +
                         std::to_string(write_failures_in_a_row_) + " in a row; the pages keep their host homes); last: " +
                         last_write_error_.message());
}

// Bounded: once kIoAttempts writes of this call have failed it stops
// submitting; a disk already failing gets one probe write, which ends the
// failing state if it lands.
Status TierMover::MakeHostRoom(int64_t step, bool for_wait) {
  // Slots the device is done with first; a wait for the device (a decode
  // call or so) is cheaper than a demotion's write.
  QKV_RETURN_IF_ERROR(Recycle(/*wait=*/false));
  if (host_->used() == host_->capacity() && !retired_.empty()) QKV_RETURN_IF_ERROR(Recycle(/*wait=*/true));
  if (host_->used() < host_->capacity()) return Status::Ok();
  if (!disk_) return Status::ResourceExhausted("host tier full (" + std::to_string(host_->capacity()) +
                                               " pages) and no disk tier to demote to");
  // A cold miss waits for room: promoted homes (their disk copy exists)
  // leave first, for free, enough for the promotions queued behind it to
  // start too. At 512K tokens with 8 GiB of HBM (H100), `strict` wrote a
  // never-selected page for every page it promoted, half the disk's time.
  // A seal makes room by the order alone: dropping promoted homes for seals
  // too made `deadline` skip more (6.2K head-pages against 5.4-5.7K on a
  // 32K-token CPU run), the pages dropped being missed again.
  // Their slots are free now, or retired until the device is done with
  // them, which the loop below waits for before it writes anything.
  if (for_wait) DropOldestClean(pending_.size() + 1, step);
  const int64_t failures_before = write_failures_;
  const int attempts = writes_failing() ? 1 : kIoAttempts;
  const std::size_t target = std::min<std::size_t>(host_->capacity() - 1, std::size_t(low_water_ * host_->capacity()));
  while (host_->used() == host_->capacity()) {
    if (!retired_.empty()) {  // dropped above, or demoted in an earlier pass of this loop
      QKV_RETURN_IF_ERROR(Recycle(/*wait=*/true));
      if (host_->used() < host_->capacity()) break;
    }
    const bool gave_up = write_failures_ - failures_before >= attempts;
    if (gave_up && disk_->in_flight() == 0) return DemotionFailed();
    if (!gave_up) QKV_RETURN_IF_ERROR(Demote(target, step, writes_failing() ? 1 : INT32_MAX));
    if (host_->used() < host_->capacity()) break;
    if (!retired_.empty()) continue;  // clean drops, back once the device is done
    if (disk_->in_flight() == 0) {
      if (writes_failing()) return DemotionFailed();
      const DiskStats& d = disk_->stats();
      // Every disk slot taken by pages the host holds too, or colder ones:
      // the hottest of the former give up their disk copies (a batch for each
      // scan), and the next pass writes the coldest host pages there.
      if (d.slots_used == d.slots_capacity && ReleaseHotDiskCopies(kReleaseBatch) > 0) continue;
      if (d.slots_used == d.slots_capacity)
        return Status::ResourceExhausted("host tier full (" + std::to_string(host_->capacity()) +
                                         " pages) and disk tier full (" + std::to_string(d.slots_capacity) +
                                         " pages): raise the disk budget");
      return Status::ResourceExhausted("host tier full (" + std::to_string(host_->capacity()) +
                                       " pages) and every host page is in use");
    }
    QKV_RETURN_IF_ERROR(ReapAll(1));
  }
  return Status::Ok();
}

Status TierMover::StartPromotion(uint32_t page) {
  Home& h = homes_[page];
  auto slot = host_->Allocate();
  if (!slot.ok()) return slot.status();
  auto ticket = disk_->SubmitRead(page, h.generation, host_->data(*slot));
  if (!ticket.ok()) {
    host_->Free(*slot);
    return ticket.status();
  }
  h.host_slot = *slot;
  h.host_valid = false;
  h.io = Io::kReading;
  CountHost();
  return Status::Ok();
}

Status TierMover::EnsureHost(uint32_t page, uint32_t generation, int64_t step) {
  now_ = step;
  Home& h = homes_[page];
  assert(h.generation == generation);
  (void)generation;
  if (h.host_valid) return Status::Ok();
  if (h.io == Io::kIdle) {
    if (!disk_ || !disk_->Holds(page, h.generation))
      return h.error.ok() ? Status::Internal("page " + std::to_string(page) + " has no readable copy") : h.error;
    if (host_->used() == host_->capacity()) QKV_RETURN_IF_ERROR(MakeHostRoom(step, /*for_wait=*/true));
    Status s = StartPromotion(page);
    while (s.code() == Code::kResourceExhausted && disk_->in_flight() > 0) {  // queue full: make way
      QKV_RETURN_IF_ERROR(ReapAll(1));
      s = StartPromotion(page);
    }
    QKV_RETURN_IF_ERROR(s);
    // The other misses queued for room read while this call waits: a
    // `strict` step's cold pages, queued together, then read one by one.
    QKV_RETURN_IF_ERROR(StartPending());
  }
  QKV_RETURN_IF_ERROR(WaitIdle(page));
  if (!h.host_valid) return h.error.ok() ? Status::Internal("promotion of page " + std::to_string(page) + " failed") : h.error;
  return Status::Ok();
}

}  // namespace questkv
