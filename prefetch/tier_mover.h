// TierMover: keeps the homes of sealed pages (host and disk), moves page
// bytes between them and counts every byte moved — the one place that does
// either. The hbm tier belongs to the runtime's backend, which
// asks the mover for homes and reports the bytes it fetched from them.
//
//   seal        a full page's bytes -> its host home (SealBegin/SealEnd)
//   miss        a selected head-page not in hbm: its readable host home,
//               promoted from disk first if need be (HomeForMiss)
//   demote      host -> disk, coldest pages first (least recently, then least
//               often selected), past the host high-water mark down to the low
//               one; the host slot is freed once the write completed and its
//               checksum held; a page whose disk copy exists leaves for free.
//               When a cold miss waits for room, promoted homes leave first
//               (oldest first, a model step after they landed and were last
//               selected): no write stands between the wait and its read.
//               With the disk full, the hottest host pages with a disk
//               copy give their disk slots to the coldest pages without one
//   promote     disk -> host, for a cold miss: a call that waits (`strict`,
//               or `deadline` past its skip limit) waits for it, one that
//               does not skips the page this step and lets it land later;
//               a missed page whose read cannot start yet (no free host
//               slot, a full I/O queue) waits in a queue that Pump (and a
//               strict wait that made room) serves, oldest first, before
//               background demotions take the queue; each waiting miss
//               adds a write to a Pump's demotions and may take the room of
//               a clean home (as many as reads can start)
//
// I/O errors are bounded and surfaced, never retried forever. A page whose
// demotion write fails keeps its host home (nothing is lost) and may be tried
// again; after kIoAttempts failed writes in a row the disk counts as failing:
// background demotion keeps one probe write in flight (a success clears the
// state), and a seal or promotion that needs host room gets IOError naming
// the last failed page and its reason instead of waiting. A page whose
// promotion read failed kIoAttempts times in a row is an IOError for the
// decode step that selects it, waiting or not.
//
// A host home the device may still be reading is not reused too soon: a
// backend whose decode calls return before the device is done with them
// reports them (SetDeviceReads), and a readable home that stops being so
// while such a call may still read it keeps its slot out of use until that
// call is done (the slot counts as used meanwhile).
//
// Sealed pages are immutable, so every copy is clean and nothing is ever
// written back from hbm more than once. The runtime drives this from the
// decode thread (Pump once per decode call); nothing here starts a thread.
//
// Thread-compatible.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "questkv/config.h"
#include "questkv/status.h"
#include "tiers/arena.h"
#include "tiers/disk_tier.h"

namespace questkv {

struct MoverStats {
  int64_t bytes_host_to_hbm = 0, bytes_hbm_to_host = 0, bytes_host_to_disk = 0, bytes_disk_to_host = 0;
  int64_t cold_misses = 0;    // selected head-pages whose home was disk
  int64_t cold_stalls = 0;    // ... that the step waited for (strict)
  int64_t pages_skipped = 0;  // ... that the step attended without (deadline)
  int64_t demotions = 0, promotions = 0, clean_drops = 0, prefetches = 0;
  int64_t demotion_orders = 0;  // demotion orders built (each scans every page)
  int64_t io_errors = 0, corruptions = 0;
  int64_t write_errors = 0, read_errors = 0;  // failed demotion writes / promotion reads (in io_errors too)
  uint32_t host_slots_capacity = 0, host_slots_used = 0, host_slots_peak = 0;
};

class TierMover {
 public:
  // Failed I/Os in a row after which the disk (for writes) or a page's disk
  // copy (for reads) counts as failing.
  static constexpr int kIoAttempts = 3;

  // `disk` may be null (no disk tier). The mover does not own the tiers.
  // `pages`: the page ids the mover's table holds at first (GrowPages adds).
  TierMover(const Geometry& g, double high_water, double low_water, uint32_t pages, SlotArena* host,
            DiskTier* disk);
  // Holds page ids [0, pages) from now on (PageAllocator's grow hook).
  // Throws std::bad_alloc, leaving the table as it was, when memory is short.
  void GrowPages(uint32_t pages) { homes_.resize(std::max<std::size_t>(homes_.size(), pages)); }

  // Called whenever a page's host home becomes readable (its address) or
  // stops being so (null): the CUDA backend mirrors this into the device's
  // host_addr table, which its resolve reads.
  using HomeListener = std::function<void(uint32_t page, const void* home)>;
  void SetHomeListener(HomeListener listener) { listener_ = std::move(listener); }

  // Device work that may read host homes, counted in calls: `queued` is the
  // newest call enqueued (1, 2, ...; 0: none), `done(wait)` the newest one
  // finished, after waiting for every queued one when `wait` is set. A host
  // slot whose page stops being readable (demoted, dropped) returns to use
  // once every call queued by then is done.
  struct DeviceReads {
    std::function<uint64_t()> queued;
    std::function<Result<uint64_t>(bool wait)> done;
  };
  void SetDeviceReads(DeviceReads reads) { device_ = std::move(reads); }
  // Host slots out of use until the device is done with them.
  std::size_t retired_slots() const { return retired_.size(); }

  // Gives a full page its host home, in two halves: SealBegin reserves the
  // home and returns it to be filled (ResourceExhausted when host and disk
  // are both full, IOError when demotions keep failing); SealEnd, once the
  // bytes have landed, checksums it and makes it readable. Between the two
  // the page is neither readable nor demotable.
  Result<void*> SealBegin(uint32_t page, uint32_t generation, int64_t step);
  void SealEnd(uint32_t page);
  // Whether the page was sealed (has a home, readable or not).
  bool sealed(uint32_t page) const { return page < homes_.size() && homes_[page].sealed; }
  // Makes the page's host home readable, promoting it from disk and waiting
  // for it if need be (a cold miss under `strict`); a promotion it starts
  // also starts the queued ones that the room it made lets in.
  Status EnsureHost(uint32_t page, uint32_t generation, int64_t step);
  // The page's readable host home, or null (on disk, or mid-promotion).
  const void* HostHome(uint32_t page) const;
  // Counts a selection of the page at `step` (demotion order), for the CUDA
  // backend whose selections the mover does not see one by one.
  void NoteSelected(uint32_t page, int64_t step);
  // The same for each of `pages`, their homes fetched ahead: a dense
  // layer's report names every page, 64K scattered homes at 1M tokens.
  void NoteSelected(std::span<const uint32_t> pages, int64_t step);
  // A selected head-page that missed hbm at `step`: its readable host home
  // (the whole page, [2][Hkv][S][D]). A home on disk is a cold miss: with
  // `wait` the call waits for its promotion (strict); without, the promotion
  // starts (or queues) and the result is null: attend without it this step.
  // A page whose reads keep failing is IOError.
  Result<const void*> HomeForMiss(uint32_t page, uint32_t generation, int64_t step, bool wait);
  // Bytes a backend copied from host homes into hbm (the one byte counter).
  void CountHostToHbm(int64_t bytes) { stats_.bytes_host_to_hbm += bytes; }
  // The caller reads the page's host home in place until EndReads: it is not
  // demoted meanwhile.
  void ReadInPlace(uint32_t page) { homes_[page].pinned_epoch = read_epoch_; }
  // Copies a sealed page's bytes (layout [2][Hkv][S][D], page_bytes() of the
  // model dtype) from its home to dst, promoting it from disk (counted like
  // any promotion) if need be.
  Status ReadPage(uint32_t page, uint32_t generation, void* dst, int64_t step);
  // A page predicted to be selected soon: if its home is disk and the host
  // has room below its high-water mark, start promoting it (never waits).
  // `ahead` false: a page already missed, promoted into any free host slot
  // (counted as a promotion only, not as a prefetch), or queued for Pump
  // when its read cannot start now.
  Status Prefetch(uint32_t page, bool ahead = true);
  // A page died: frees its host slot and disk copy (waiting for its I/O).
  void Drop(uint32_t page);
  // Reaps finished I/O, starts the queued promotions that now have room, then
  // demotions past the high-water mark.
  Status Pump(int64_t step);
  // Missed pages waiting for their promotion to start.
  std::size_t pending_promotions() const { return pending_.size(); }
  // The caller is done with every host home it read in place so far: they
  // may be demoted again.
  void EndReads() { ++read_epoch_; }

  const MoverStats& stats() const { return stats_; }
  bool has_disk() const { return disk_ != nullptr; }
  // OK, or the last failed demotion write while writes are failing.
  Status write_health() const { return writes_failing() ? last_write_error_ : Status::Ok(); }

 private:
  enum class Io : uint8_t { kIdle, kWriting, kReading };
  struct Home {
    uint32_t host_slot = UINT32_MAX;
    bool sealed = false;      // SealBegin called
    bool host_valid = false;  // host slot holds the bytes (not mid-read)
    Io io = Io::kIdle;
    uint32_t generation = 0;
    int64_t last_step = -1;   // last selected
    int64_t pinned_epoch = -1; // read in place from the host slot during this epoch
    uint32_t uses = 0;
    uint64_t checksum = 0;    // PageChecksum at seal time
    bool pending = false;     // in pending_, waiting for its promotion to start
    uint8_t read_failures = 0; // failed promotion reads in a row
    int64_t clean_since = -1;  // step its clean host copy landed (an entry in clean_)
    Status error;             // last failed read, surfaced to strict waiters
  };
  // A host home whose disk copy exists, from the step it became so.
  struct CleanHome {
    uint32_t page, generation;
    int64_t since;
  };
  bool writes_failing() const { return write_failures_in_a_row_ >= kIoAttempts; }
  Status DemotionFailed() const;
  Status Complete(const DiskCompletion& c);
  Status ReapAll(int min_complete);
  Status WaitIdle(uint32_t page);
  // Frees a host slot; `for_wait`: for a cold miss that waits (EnsureHost),
  // which may take a promoted home's slot before anything is written.
  Status MakeHostRoom(int64_t step, bool for_wait);
  // Writes stop at `max_in_flight` I/Os in flight (background demotion
  // leaves room in the queue for promotions; a failing disk gets one) or
  // at `max_new` submitted by this call (Pump's share of a call's host time).
  Status Demote(std::size_t target_used, int64_t step, int max_in_flight = INT32_MAX, int max_new = INT32_MAX);
  Status StartPromotion(uint32_t page);
  // Starts promoting a page whose home is disk if it is idle, a host slot is
  // free and the I/O queue takes it; never waits. True when started.
  Result<bool> PromoteIfRoom(uint32_t page);
  // A missed page: PromoteIfRoom, or into pending_ when its read cannot start.
  Status PromoteOrQueue(uint32_t page);
  // Starts pending_'s promotions, oldest first, while there is room.
  Status StartPending();
  void CountHost();
  // Host slots holding homes (used, less those retired): what the water marks judge.
  std::size_t homes_used() const { return host_->used() - retired_.size(); }
  void SetHostValid(uint32_t page, bool valid);
  // The page's host home holds the bytes of its disk copy from now on.
  void NoteClean(uint32_t page);
  // Frees the host home of a page whose disk copy exists (no write).
  void DropClean(uint32_t page);
  // Least recently selected, then least often.
  bool Colder(uint32_t a, uint32_t b) const {
    const Home &x = homes_[a], &y = homes_[b];
    return x.last_step != y.last_step ? x.last_step < y.last_step : x.uses < y.uses;
  }
  // Drops up to n homes of clean_ that are a model step old; returns how many.
  std::size_t DropOldestClean(std::size_t n, int64_t step);
  // Frees the disk slots of the n most recently selected pages whose host
  // home holds their bytes too (a scan of every page): the demotion order's
  // coldest pages take them. Returns how many.
  std::size_t ReleaseHotDiskCopies(std::size_t n);
  // Frees the slot of a home that was readable: at once, or once the device
  // calls that may read it are done.
  void ReleaseHome(uint32_t slot);
  // Unreadable from now on: a home its demotion's pre-write check refused.
  void DropDamagedHome(uint32_t page, Status why);
  // Returns retired slots whose readers are done (all of them, after waiting
  // for the device, when `wait`).
  Status Recycle(bool wait);

  Geometry g_;
  double high_water_, low_water_;
  SlotArena* host_;
  DiskTier* disk_;
  std::vector<Home> homes_;  // [page ids handed out so far, rounded up]
  std::vector<DiskCompletion> done_;
  std::vector<uint32_t> order_;  // demotion candidates, coldest first (Demote)
  std::deque<std::pair<uint32_t, uint32_t>> pending_;  // (page, generation), oldest first
  std::deque<CleanHome> clean_;  // host homes with a disk copy, oldest first (DropOldestClean)
  int64_t now_ = 0;              // the newest step Pump, SealBegin or EnsureHost saw
  std::size_t order_pos_ = 0;
  int64_t order_step_ = -1;
  MoverStats stats_;
  int64_t read_epoch_ = 0;
  int64_t write_failures_ = 0;           // failed demotion writes, all told
  int write_failures_in_a_row_ = 0;      // since the last good one
  Status last_write_error_;
  HomeListener listener_;
  DeviceReads device_;
  std::deque<std::pair<uint64_t, uint32_t>> retired_;  // (newest call that may read it, slot), oldest first
};

}  // namespace questkv
