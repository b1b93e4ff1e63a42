// DiskTier: homes of cold pages in page files under one directory.
//
// Whole pages (all KV heads, K and V: Geometry::page_bytes(), rounded up to
// 4096) per I/O, so each I/O is large. Slots in the files are handed out by a
// free list bounded by the byte budget; running out is ResourceExhausted.
// Every page written carries a checksum keyed by (PageId, generation), kept
// here (outside the page). The caller takes it (PageChecksum) when the page is
// sealed and passes it to SubmitWrite, which checks it against the buffer
// right before submission — so a host copy damaged after sealing is refused
// instead of reaching disk under a checksum that matches the damage — and it
// is checked again right after every read completes. A mismatch is a
// Corruption (from SubmitWrite, or as a read's completion), counted, and the
// caller must not use the buffer. A failed write frees its slot; a failed or
// corrupt read leaves the page's disk copy in place (the caller decides).
//
// Page files are created with unique names and unlinked as soon as they are
// open: they hold only this process's cache of pages, so nothing is left
// behind even after a crash.
//
// With DiskTierOptions::check_writes_off_thread the pre-write check runs on
// the tier's own thread: SubmitWrite returns once the slot is taken, the
// write goes to the backend at the owner's next call after its check, and a
// mismatch arrives as the write's completion (Corruption, slot freed).
//
// Thread safety: single owner thread (see IoBackend); the checking thread
// only reads the buffers handed to SubmitWrite.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "questkv/status.h"
#include "tiers/io_backend.h"

namespace questkv {

struct DiskTierOptions {
  std::string dir;                // created if absent; page files live here
  uint64_t bytes = 0;             // byte budget of all page files
  std::size_t page_bytes = 0;     // one page, before rounding up to 4096
  int files = 4;                  // page files the slots are striped over
  bool check_writes_off_thread = false;  // see above
};

struct DiskCompletion {
  uint64_t ticket = 0;
  uint32_t page_id = 0;
  bool is_write = false;
  Status status;                  // OK, IOError (EIO, ENOSPC, short), Corruption
};

struct DiskStats {
  int64_t bytes_written = 0, bytes_read = 0;
  int64_t writes = 0, reads = 0;
  int64_t io_errors = 0, corruptions = 0;
  uint32_t slots_used = 0, slots_peak = 0, slots_capacity = 0;
};

class DiskTier {
 public:
  static Result<std::unique_ptr<DiskTier>> Open(const DiskTierOptions& options, std::unique_ptr<IoBackend> io);
  ~DiskTier();  // waits for in-flight I/O; removes nothing it did not create

  // Buffers passed to SubmitWrite/SubmitRead must lie in this region, each
  // slot_bytes() long and 4096-aligned (the I/O moves whole slots; only the
  // first page_bytes are checksummed).
  Status RegisterRegion(void* base, std::size_t bytes);

  // Queues a write of a page's bytes to a fresh slot. `sealed_checksum` is
  // PageChecksum(src, page_bytes, page_id, generation) taken when the page's
  // bytes were known good; Corruption (counted, nothing written, no slot
  // taken) when src no longer matches it, from here or (checked off the
  // owner's thread) as the write's completion. ResourceExhausted when no slot or
  // queue entry is free; FailedPrecondition when the page already has a disk
  // copy or I/O on it is in flight. `src` must stay untouched until the
  // completion (if it changes, the read-side check catches it).
  Result<uint64_t> SubmitWrite(uint32_t page_id, uint32_t generation, const void* src, uint64_t sealed_checksum);
  // The same with the checksum taken from src now: for callers that have no
  // earlier one, at the price of the pre-write check.
  Result<uint64_t> SubmitWrite(uint32_t page_id, uint32_t generation, const void* src);
  // Queues a read of a page's disk copy into `dst`. NotFound when the page has
  // no disk copy (of this generation); FailedPrecondition while its write is
  // in flight.
  Result<uint64_t> SubmitRead(uint32_t page_id, uint32_t generation, void* dst);
  // Completions, waiting for at least min_complete (at most in_flight()).
  Status Reap(std::vector<DiskCompletion>* out, int min_complete);

  // True when a completed, good write of this (page, generation) is on disk.
  bool Holds(uint32_t page_id, uint32_t generation) const;
  // Drops a page's disk copy and frees its slot (no I/O). With I/O on the
  // page in flight the slot is freed when the last of it completes.
  void Drop(uint32_t page_id);

  // The I/O backend's name(), e.g. "io_uring" or "pread-pool".
  std::string_view io_name() const;
  // Requests from Submit to their reaped completion (writes being checked
  // included); at most queue_depth().
  int in_flight() const;
  int queue_depth() const;
  const DiskStats& stats() const;
  std::size_t slot_bytes() const;

 private:
  struct Impl;
  explicit DiskTier(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace questkv
