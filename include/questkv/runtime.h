// questkv::Runtime — the KV cache manager and decode-attention backend.
//
// A Runtime owns the page-id space, the summary slab (always resident), the
// three tiers — hbm (device memory on the CUDA backend; on the CPU backend a
// bounded host arena of head-page slots: tails plus a cache), host (homes of
// sealed pages) and optionally disk — and the sequences. The host-pointer API takes and returns f32 on
// both backends (the CUDA backend converts to and from the model dtype). Sequences are
// named by SeqId. K/V enter per layer, token-major [n][Hkv][D]; decode
// attention takes queries [B][Hq][D] for a batch of sequences at one layer and
// writes outputs [B][Hq][D].
//
// Thread safety: a Runtime is thread-compatible — callers serialise calls.
// Errors: every method returns a Status / Result; on error the runtime is
// unchanged (no page, slot or reference leaks). Per-page tables grow with
// the pages in use, and a table or arena that cannot grow is
// ResourceExhausted. A disk tier that keeps failing is IOError naming the
// page and the OS's reason after a bounded number of attempts (the page
// keeps its host home). The C API and the CLI also catch std::bad_alloc.
// Aliasing: the host-pointer calls allow q == out; the device calls refuse
// overlapping q and out.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "questkv/config.h"
#include "questkv/selection.h"
#include "questkv/stats.h"
#include "questkv/status.h"

namespace questkv {

using SeqId = uint64_t;
class IoBackend;  // the disk tier's I/O seam (tiers/io_backend.h), for tests

class Runtime {
 public:
  // InvalidArgument when the config does not validate; ResourceExhausted when
  // the arena cannot be allocated.
  // `io`, when given, is the disk tier's I/O backend (tests inject the
  // in-memory and fault-injecting ones); otherwise config.io_backend picks.
  static Result<std::unique_ptr<Runtime>> Create(const Config& config);
  static Result<std::unique_ptr<Runtime>> Create(const Config& config, std::unique_ptr<IoBackend> io);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  const Config& config() const;

  // A new empty sequence (length 0 in every layer).
  Result<SeqId> CreateSequence();
  // A new sequence sharing the first `pages` sealed pages of `parent` in every
  // layer (prefix sharing, by refcount). OutOfRange when a layer of the parent
  // has fewer than `pages` sealed pages.
  Result<SeqId> CreateFromPrefix(SeqId parent, int64_t pages);
  // A copy of `parent`: sealed pages shared, each layer's tail page copied.
  Result<SeqId> Fork(SeqId parent);
  // Drops `tokens` tokens from the end of every layer (whole pages released,
  // the new tail's summary rebuilt from its valid keys). OutOfRange when any
  // layer holds fewer tokens.
  Status Rollback(SeqId seq, int64_t tokens);
  // Releases the sequence; pages shared with others stay alive.
  Status Free(SeqId seq);

  // Appends n >= 1 tokens of K/V to one layer: k, v are [n][Hkv][D] floats.
  // ResourceExhausted when pages or arena slots run out (nothing appended).
  Status Append(SeqId seq, int layer, const float* k, const float* v, int64_t n);
  // Draft tokens (speculative decoding): appended like Append, but a page
  // they fill stays in hbm, unsealed — it never reaches host or disk — until
  // Accept keeps the drafts that Rollback left. A rolled-back draft leaves no
  // trace in the tiers. Append refuses a layer holding drafts until then.
  // ResourceExhausted when hbm has no room to hold the pages they fill.
  Status AppendDraft(SeqId seq, int layer, const float* k, const float* v, int64_t n);
  // The sequence's remaining drafts become ordinary tokens: their full pages
  // are sealed to their homes.
  Status Accept(SeqId seq);

  // Sparse decode attention for a batch at one layer: q [B][Hq][D] -> out
  // [B][Hq][D], softmax scale 1/sqrt(D). Every sequence must hold >= 1 token
  // in the layer. InvalidArgument when an output is not finite (logits past
  // float32's range, or NaN/inf in the inputs). `selections`, when non-null, is resized to the batch and
  // entry b receives seqs[b]'s selection. `stats`, when non-null, is
  // incremented.
  Status DecodeAttention(std::span<const SeqId> seqs, int layer, const float* q, float* out,
                         std::vector<PageSelection>* selections = nullptr,
                         AttendStats* stats = nullptr);

  // Decode attention for a block of new tokens per sequence at one layer
  // (speculative decoding's verify step, multi-token prediction): the last
  // block[b] >= 1 tokens of seqs[b], already appended, are its block. q and
  // out hold one row per block token, sequence by sequence:
  // [sum(block)][Hq][D]. Each position attends causally — every token up to
  // and including its own. Under BlockSelection::kPerPosition (the default)
  // each selects its own pages, as a decode call made right after appending
  // up to that token would: the outputs equal those of sum(block)
  // single-token calls (under `strict`). Under kShared the block selects
  // once (see BlockSelection). Rollback then drops the rejected tail. The
  // CUDA backend runs a block in one step: each position selects (or the
  // block once), the union of a sequence's positions' pages is fetched once,
  // and each position attends its own (a sequence whose partition cannot
  // hold the union takes its block in halves; a shared block, never split,
  // is ResourceExhausted).
  Status DecodeBlock(std::span<const SeqId> seqs, std::span<const int> block, int layer, const float* q, float* out,
                     AttendStats* stats = nullptr);

  // CUDA backend only (FailedPrecondition otherwise): Append and
  // DecodeAttention on device memory in the geometry's dtype — k, v
  // [n][Hkv][D]; q, out [B][Hq][D] — for engines whose tensors live on the
  // GPU. Their work is ordered on cuda_stream(): k, v and q are read, and out
  // written, when that stream reaches them, so the caller produces its inputs
  // on that stream (or before the call) and reads out after it (on the
  // stream, or after Synchronize()). Unless selections or phase timings are
  // asked for, or cold misses under `strict` must be waited for (a disk
  // tier), a decode call returns as soon as its work is enqueued: an
  // engine's layers run back to back on the GPU with no host round trip
  // between them (the tiers learn what a call selected two calls later).
  // Otherwise the calls return with the work complete. A fault the device
  // reports for an enqueued call comes back from the next call or from
  // Synchronize().
  Status AppendDevice(SeqId seq, int layer, const void* k, const void* v, int64_t n);
  Status DecodeAttentionDevice(std::span<const SeqId> seqs, int layer, const void* q, void* out,
                               std::vector<PageSelection>* selections = nullptr, AttendStats* stats = nullptr);
  // AppendDraft and DecodeBlock on device memory, as above: a speculative
  // block verified with no host round trip (q, out [sum(block)][Hq][D]).
  Status AppendDraftDevice(SeqId seq, int layer, const void* k, const void* v, int64_t n);
  Status DecodeBlockDevice(std::span<const SeqId> seqs, std::span<const int> block, int layer, const void* q,
                           void* out, AttendStats* stats = nullptr);
  // Waits for every call's device work; returns the first fault an enqueued
  // call reported. Ok at once on the CPU backend.
  Status Synchronize();
  // The cudaStream_t the CUDA backend orders its work on; null on the CPU backend.
  void* cuda_stream() const;

  // CUDA backend only: the time, in microseconds, to stream every page of
  // the sequences at `layer` from pinned host memory into the GPU, as dense
  // attention over an offloaded cache must each step (the zero-copy gather,
  // median of `reps`). At most `max_bytes` are streamed; past that the time
  // is scaled by the bytes. *bytes gets what the time stands for.
  // FailedPrecondition when none of those pages has a host home.
  Result<double> TimeDenseOffload(std::span<const SeqId> seqs, int layer, std::size_t max_bytes, int reps,
                                  int64_t* bytes);

  // Dense attention over every token (the reference path), same shapes. On
  // the CUDA backend it goes through hbm like any step, so hbm must hold every
  // page of the batch's sequences at that layer.
  Status DenseAttention(std::span<const SeqId> seqs, int layer, const float* q, float* out);

  // Tokens held by a sequence in a layer.
  Result<int64_t> Length(SeqId seq, int layer) const;
  // PageIds of a sequence in a layer, logical order.
  Result<std::vector<uint32_t>> Pages(SeqId seq, int layer) const;
  // Copies one layer's K/V into a DenseView (diagnostics, tests).
  Result<DenseView> Gather(SeqId seq, int layer) const;
  // Summary [Hkv][2][D] of a page (tests, diagnostics).
  Result<std::vector<float>> Summary(uint32_t page_id) const;
  // Scores U_p(q) [Hq][num_pages] for one sequence at one layer, q [Hq][D].
  Result<std::vector<float>> Scores(SeqId seq, int layer, const float* q) const;

  TierStats tier_stats() const;

  // Pages alive / arena slots in use (leak checks).
  uint32_t live_pages() const;
  std::size_t live_sequences() const;

 private:
  struct Impl;
  explicit Runtime(std::unique_ptr<Impl> impl);
  static Result<std::unique_ptr<Runtime>> CreateValid(const Config& config, std::unique_ptr<IoBackend> io);
  std::unique_ptr<Impl> impl_;
};

}  // namespace questkv
