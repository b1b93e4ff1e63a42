#include "questkv/runtime.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <new>
#include <unordered_map>

#include "prefetch/tier_mover.h"
#include "runtime/backend.h"
#include "core/half.h"
#include "tiers/arena.h"
#include "tiers/disk_tier.h"
#include "tiers/io_backend.h"
#include "tiers/page_allocator.h"
#include "tiers/page_table.h"
#include "kernels/cpu/kernels_cpu.h"

namespace questkv {

namespace {
std::string SeqName(SeqId id) { return "sequence " + std::to_string(id); }

// A block call names one block length per sequence.
Status BlockMatches(std::span<const SeqId> seqs, std::span<const int> block) {
  if (block.size() == seqs.size()) return Status::Ok();
  return Status::InvalidArgument("block has " + std::to_string(block.size()) + " entries for " +
                                 std::to_string(seqs.size()) + " sequences");
}
constexpr std::size_t kIoAlignFloats = 1024;  // 4096 bytes
// Whether two buffers of `bytes` each share a byte.
bool Overlap(const void* a, const void* b, std::size_t bytes) {
  const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + bytes && y < x + bytes;
}
}  // namespace

// The policy half of the runtime: sequences, page ids and refcounts, page
// lists, steps, and the host and disk homes. The data plane is the backend's.
struct Runtime::Impl {
  Config config;
  Geometry g;
  PageAllocator ids;
  std::unique_ptr<SlotArena> host;  // homes of sealed pages
  std::unique_ptr<DiskTier> disk;   // null without a disk tier
  std::unique_ptr<TierMover> mover;
  std::unique_ptr<DataPlane> backend;
  int64_t step = 0;                 // advances twice per decode call
  struct Sequence {
    std::vector<PageList> layers;
    std::vector<uint32_t> partitions;  // the backend's partition per layer
    std::vector<int64_t> drafts;       // per layer: trailing draft tokens (AppendDraft), not yet accepted
  };
  std::unordered_map<SeqId, Sequence> seqs;
  SeqId next_seq = 1;
  // Scratch, reused across calls.
  std::vector<const PageList*> lists;
  std::vector<uint32_t> list_partitions;
  std::vector<float> page_scratch;
  std::vector<float> q_copy;   // the queries, when the caller's q overlaps out
  std::vector<PageList> block_views;  // DecodeBlock: each position's list

  explicit Impl(const Config& c) : config(c), g(c.geometry), ids(c.max_pages) {}
  Result<std::size_t> BlockRows(std::span<const SeqId> seqs, std::span<const int> block, int layer,
                                std::vector<SeqId>* row_seqs);

  // Per-page tables grow with the ids handed out (PageAllocator's hook).
  Status GrowPageTables(uint32_t pages) {
    try {
      mover->GrowPages(pages);
      backend->GrowPages(pages);
    } catch (const std::bad_alloc&) {
      return Status::ResourceExhausted("page tables: out of memory growing to " + std::to_string(pages) + " page ids");
    }
    return Status::Ok();
  }

  Result<Sequence*> Find(SeqId id) {
    auto it = seqs.find(id);
    if (it == seqs.end()) return Status::NotFound(SeqName(id) + " does not exist");
    return &it->second;
  }
  Status CheckLayer(int layer) const {
    if (layer < 0 || layer >= g.layers)
      return Status::OutOfRange("layer " + std::to_string(layer) + " is outside 0.." + std::to_string(g.layers - 1));
    return Status::Ok();
  }

  // ---- pages -----------------------------------------------------------------

  void Release(PageId id) {
    if (!ids.Unref(id)) return;
    backend->PageDied(id);  // first: a backend may still be writing the page's homes
    mover->Drop(id);
  }
  void ReleaseAll(const std::vector<PageId>& pages) {
    for (PageId id : pages) Release(id);
  }

  // A new private tail holding the first `len` tokens of `src`, which is
  // sealed or else the tail of `src_partition`.
  Result<PageId> CopyToNewTail(PageId src, int len, uint32_t partition, uint32_t src_partition) {
    QKV_ASSIGN_OR_RETURN(PageId dst, ids.Allocate());
    Status s;
    if (mover->sealed(src)) {
      page_scratch.resize(g.page_bytes() / sizeof(float) + 1);
      s = backend->ReadPage(src_partition, src, page_scratch.data(), step);
      if (s.ok()) s = backend->TailFromHost(partition, dst, page_scratch.data(), len, step);
    } else {
      s = backend->CopyTail(src_partition, src, partition, dst, len, step);
    }
    if (!s.ok()) {
      Release(dst);
      return s;
    }
    return dst;
  }

  // The sequence an append of n tokens of k, v (host or device) goes to.
  Result<Sequence*> CheckAppend(SeqId seq, int layer, const void* k, const void* v, int64_t n) {
    QKV_ASSIGN_OR_RETURN(Sequence * s, Find(seq));
    QKV_RETURN_IF_ERROR(CheckLayer(layer));
    if (n < 1) return Status::InvalidArgument("append of " + std::to_string(n) + " tokens");
    if (!k || !v) return Status::InvalidArgument("null K or V pointer");
    return s;
  }
  Status Append(SeqId id, Sequence& s, int layer, const void* k, const void* v, int64_t n, bool host_f32,
                bool draft = false) {
    PageList& list = s.layers[layer];
    if (!draft && s.drafts[layer] > 0)
      return Status::FailedPrecondition(SeqName(id) + " holds " + std::to_string(s.drafts[layer]) +
                                        " draft tokens in layer " + std::to_string(layer) +
                                        ": accept or roll them back first");
    // The page being filled is a private tail: fork and rollback copy.
    assert(list.tokens % g.page_size == 0 ||
           (ids.refcount(list.pages.back()) == 1 && !mover->sealed(list.pages.back())));
    // A backend reserves the host homes of the pages a call fills before it
    // fills them, so a call sealing more pages than the host tier holds could
    // never run: it goes in pieces of at most half the host's pages, each
    // piece's homes filled (and demotable) before the next reserves its own.
    // On a failed piece the pieces before it are cut back, so the call
    // appends all or nothing.
    const int S = g.page_size;
    const int64_t piece_pages = std::max<int64_t>(1, mover->stats().host_slots_capacity / 2);
    const std::size_t row_bytes = std::size_t(g.kv_heads) * g.head_dim * (host_f32 ? sizeof(float) : DTypeBytes(g.dtype));
    const int64_t old_tokens = list.tokens;
    for (int64_t done = 0; done < n;) {
      const int64_t m = std::min(n - done, (list.tokens / S + piece_pages) * S - list.tokens);
      const Status st = backend->Append(s.partitions[layer], list, static_cast<const char*>(k) + done * row_bytes,
                                        static_cast<const char*>(v) + done * row_bytes, m, host_f32, step, draft);
      if (!st.ok()) {
        if (done == 0) return st;
        const Status undone = CutAppended(s, layer, old_tokens);
        if (!undone.ok())
          return Status(st.code(), st.message() + "; " + std::to_string(list.tokens - old_tokens) +
                                       " tokens stay appended: cutting them back failed (" + undone.ToString() + ")");
        return st;
      }
      done += m;
    }
    if (draft) s.drafts[layer] += n;
    return Status::Ok();
  }

  // Undoes the pieces of a failed append: its fresh pages go first (the
  // room the old tail's copy may need), then the old tail is cut back.
  Status CutAppended(Sequence& s, int l, int64_t old_tokens) {
    const int S = g.page_size;
    QKV_RETURN_IF_ERROR(CutLayer(s, l, (old_tokens + S - 1) / S * S, kNoPage));
    QKV_ASSIGN_OR_RETURN(const PageId copy, KeptTailCopy(s, l, old_tokens));
    return CutLayer(s, l, old_tokens, copy);
  }

  // Cutting a layer back to its first `keep` tokens, in two steps so that a
  // failure changes nothing. First a private copy of the kept part of a new
  // tail that is sealed (immutable, maybe shared, maybe not in hbm); kNoPage
  // where none is needed.
  Result<PageId> KeptTailCopy(const Sequence& s, int l, int64_t keep) {
    const PageList& list = s.layers[l];
    const int S = g.page_size;
    if (keep % S == 0) return kNoPage;
    const PageId tail = list.pages[std::size_t(keep / S)];
    if (!mover->sealed(tail) && ids.refcount(tail) == 1) return kNoPage;  // still a private tail: edit in place
    return CopyToNewTail(tail, int(keep % S), s.partitions[l], s.partitions[l]);
  }
  // Then the cut: the pages past `keep` released, the new tail replaced by
  // its copy or cut back in place.
  Status CutLayer(Sequence& s, int l, int64_t keep, PageId copy) {
    PageList& list = s.layers[l];
    const int S = g.page_size;
    const std::size_t keep_pages = std::size_t((keep + S - 1) / S);
    for (std::size_t i = keep_pages; i < list.pages.size(); ++i) Release(list.pages[i]);
    list.pages.resize(keep_pages);
    list.tokens = keep;
    if (keep % S != 0) {
      PageId& tail = list.pages.back();
      if (copy != kNoPage) {
        Release(tail);
        tail = copy;
      } else {
        QKV_RETURN_IF_ERROR(backend->TruncateTail(s.partitions[l], tail, int(keep % S)));
      }
    }
    return backend->SetPages(s.partitions[l], list.pages);
  }

  // ---- attention ---------------------------------------------------------------

  // Queries the call may read while it writes out: q itself, or a copy of
  // it when the two overlap (q == out is allowed on the host API).
  const float* Unaliased(const float* q, const float* out, std::size_t batch) {
    const std::size_t n = batch * g.q_heads * g.head_dim;
    if (!Overlap(q, out, n * sizeof(float))) return q;
    q_copy.assign(q, q + n);
    return q_copy.data();
  }

  // The device calls read q while they write out: the two must not share a
  // byte over `rows` rows.
  Status CheckDeviceAliasing(const void* q, const void* out, std::size_t rows) const {
    if (!Overlap(q, out, rows * g.q_heads * g.head_dim * DTypeBytes(g.dtype))) return Status::Ok();
    return Status::InvalidArgument("q and out overlap: the device path reads q while it writes out");
  }

  Status CheckBatch(std::span<const SeqId> seqs_in, int layer, const void* q, const void* out) {
    QKV_RETURN_IF_ERROR(CheckLayer(layer));
    if (seqs_in.empty()) return Status::InvalidArgument("empty batch");
    if (!q || !out) return Status::InvalidArgument("null query or output pointer");
    lists.clear();
    list_partitions.clear();
    for (SeqId id : seqs_in) {
      QKV_ASSIGN_OR_RETURN(Sequence * s, Find(id));
      const PageList& list = s->layers[layer];
      if (list.tokens == 0)
        return Status::FailedPrecondition(SeqName(id) + " holds no token in layer " + std::to_string(layer));
      lists.push_back(&list);
      list_partitions.push_back(s->partitions[layer]);
    }
    return Status::Ok();
  }

  // A decode call runs in a step of its own: what it selects is protected
  // from eviction until it returns, and nothing else runs in that step.
  Status Decode(int layer, const void* q, void* out, bool host_f32, bool dense,
                std::vector<PageSelection>* selections, AttendStats* stats,
                std::span<const int> shared_blocks = {}) {
    ++step;
    struct StepEnd {  // ends the decode call's step however the call returns
      int64_t& step;
      ~StepEnd() { ++step; }
    } end{step};
    backend->BeginStep(step);
    QKV_RETURN_IF_ERROR(mover->Pump(step));
    DataPlane::Step st;
    st.partitions = list_partitions;
    st.lists = lists;
    st.layer = layer;
    st.dense = dense;
    st.q = q;
    st.out = out;
    st.host_f32 = host_f32;
    st.step = step;
    st.selections = selections;
    st.stats = stats;
    st.shared_blocks = shared_blocks;
    return backend->DecodeStep(st);
  }

  // Finite queries must give finite outputs: logits past float32's range
  // (huge keys or queries) would otherwise come back as NaN with an OK.
  Status CheckFinite(std::span<const SeqId> seqs, const float* q, const float* out) const {
    const std::size_t per_seq = std::size_t(g.q_heads) * g.head_dim;
    for (std::size_t i = 0; i < seqs.size() * per_seq; ++i) {
      if (std::isfinite(out[i])) continue;
      const std::size_t b = i / per_seq, head = i % per_seq / g.head_dim;
      const float* qh = q + i / g.head_dim * g.head_dim;
      const bool q_finite = std::all_of(qh, qh + g.head_dim, [](float x) { return std::isfinite(x); });
      return Status::InvalidArgument("attention output of " + SeqName(seqs[b]) + ", query head " + std::to_string(head) +
                                     " is not finite: " +
                                     (q_finite ? "its logits q·k/sqrt(D) overflow float32 (keys or queries too large) "
                                                 "or the keys hold NaN/inf"
                                               : "the query holds NaN/inf"));
    }
    return Status::Ok();
  }
};

Runtime::Runtime(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Runtime::~Runtime() = default;

namespace {
Result<std::unique_ptr<IoBackend>> MakeIoBackend(const Config& c) {
  switch (c.io_backend) {
    case IoBackendKind::kUring: return MakeUringBackend(c.io_queue_depth);
    case IoBackendKind::kUringSqpoll: return MakeUringBackend(c.io_queue_depth, /*sq_thread=*/true);
    case IoBackendKind::kPread: return MakePreadPoolBackend(4, c.io_queue_depth);
    case IoBackendKind::kAuto: break;
  }
  return MakeDefaultBackend(c.io_queue_depth);
}
}  // namespace

Result<std::unique_ptr<Runtime>> Runtime::Create(const Config& config) { return Create(config, nullptr); }

Result<std::unique_ptr<Runtime>> Runtime::Create(const Config& config, std::unique_ptr<IoBackend> io) {
  QKV_RETURN_IF_ERROR(config.Validate());
  try {
    return CreateValid(config, std::move(io));
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("out of memory creating a runtime for " + config.geometry.ToString() +
                                     ", max_pages " + std::to_string(config.max_pages));
  }
}

Result<std::unique_ptr<Runtime>> Runtime::CreateValid(const Config& config, std::unique_ptr<IoBackend> io) {
  const Geometry& g = config.geometry;
  auto impl = std::make_unique<Impl>(config);
  const std::size_t page_floats = (g.page_bytes() + sizeof(float) - 1) / sizeof(float);
  const std::size_t host_slot_elems = (page_floats + kIoAlignFloats - 1) / kIoAlignFloats * kIoAlignFloats;
  const std::size_t host_slot_bytes = host_slot_elems * sizeof(float);
  const uint64_t host_slots = config.host_bytes ? std::min<uint64_t>(config.host_bytes / host_slot_bytes, config.max_pages)
                                                : config.max_pages;
  if (host_slots < 2) return Status::InvalidArgument("host_bytes holds fewer than two 4096-aligned pages");
  // Homes of sealed pages: pinned and mapped for the GPU when there is one,
  // bound to the GPU's NUMA node (HostRegion).
  QKV_ASSIGN_OR_RETURN(impl->host, SlotArena::Create(host_slot_elems, uint32_t(host_slots), "host",
                                                     {.numa_node = -1, .pin_for_gpu = true}));
  if (!config.disk_dir.empty()) {
    if (!io) {
      QKV_ASSIGN_OR_RETURN(io, MakeIoBackend(config));
    }
    DiskTierOptions opts{config.disk_dir, config.disk_bytes, g.page_bytes()};
    opts.check_writes_off_thread = config.io_checks_off_thread;
    QKV_ASSIGN_OR_RETURN(impl->disk, DiskTier::Open(opts, std::move(io)));
    QKV_RETURN_IF_ERROR(impl->disk->RegisterRegion(impl->host->base(), impl->host->bytes()));
  }
  impl->mover = std::make_unique<TierMover>(g, config.host_high_water, config.host_low_water,
                                            /*pages=*/0, impl->host.get(), impl->disk.get());
  if (config.backend == Backend::kCuda) {
    QKV_ASSIGN_OR_RETURN(impl->backend, MakeCudaBackend(config, &impl->ids, impl->mover.get(), impl->host.get()));
  } else {
    QKV_ASSIGN_OR_RETURN(impl->backend, MakeCpuBackend(config, &impl->ids, impl->mover.get()));
  }
  Impl* I = impl.get();
  I->ids.SetGrowHook([I](uint32_t pages) { return I->GrowPageTables(pages); });
  I->mover->SetHomeListener([I](uint32_t page, const void* home) { I->backend->SetHome(page, home); });
  return std::unique_ptr<Runtime>(new Runtime(std::move(impl)));
}

const Config& Runtime::config() const { return impl_->config; }

Result<SeqId> Runtime::CreateSequence() {
  Impl& I = *impl_;
  const SeqId id = I.next_seq++;
  Impl::Sequence& s = I.seqs[id];
  s.layers.resize(I.g.layers);
  s.drafts.assign(I.g.layers, 0);
  s.partitions.reserve(I.g.layers);
  for (int l = 0; l < I.g.layers; ++l) {
    auto part = I.backend->AddPartition();
    if (!part.ok()) {
      for (uint32_t p : s.partitions) I.backend->RemovePartition(p);
      I.seqs.erase(id);
      return part.status();
    }
    s.partitions.push_back(*part);
  }
  return id;
}

Result<SeqId> Runtime::CreateFromPrefix(SeqId parent, int64_t pages) {
  Impl& I = *impl_;
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * p, I.Find(parent));
  if (pages < 0) return Status::InvalidArgument("prefix of " + std::to_string(pages) + " pages");
  for (int l = 0; l < I.g.layers; ++l) {
    if (p->layers[l].sealed_pages(I.g.page_size) < pages)
      return Status::OutOfRange(SeqName(parent) + " has " + std::to_string(p->layers[l].sealed_pages(I.g.page_size)) +
                                " sealed pages in layer " + std::to_string(l) + ", fewer than " + std::to_string(pages));
    if (pages * I.g.page_size > p->layers[l].tokens - p->drafts[l])
      return Status::FailedPrecondition("a prefix of " + std::to_string(pages) + " pages of " + SeqName(parent) +
                                        " holds draft tokens in layer " + std::to_string(l) + ": accept them first");
  }
  QKV_ASSIGN_OR_RETURN(SeqId id, CreateSequence());
  Impl::Sequence& child = I.seqs[id];
  const Impl::Sequence& src = I.seqs[parent];
  for (int l = 0; l < I.g.layers; ++l) {
    PageList& dst = child.layers[l];
    dst.pages.assign(src.layers[l].pages.begin(), src.layers[l].pages.begin() + pages);
    dst.tokens = pages * I.g.page_size;
    for (PageId pid : dst.pages) I.ids.Ref(pid);
    QKV_RETURN_IF_ERROR(I.backend->SetPages(child.partitions[l], dst.pages));
  }
  return id;
}

Result<SeqId> Runtime::Fork(SeqId parent) {
  Impl& I = *impl_;
  QKV_RETURN_IF_ERROR(I.Find(parent).status());
  QKV_ASSIGN_OR_RETURN(SeqId id, CreateSequence());
  Impl::Sequence& child = I.seqs[id];
  const Impl::Sequence& p = I.seqs[parent];
  // Copy every partial tail first, so a failure leaves nothing behind.
  std::vector<PageId> tails(I.g.layers, kNoPage);
  for (int l = 0; l < I.g.layers; ++l) {
    const PageList& src = p.layers[l];
    if (src.tokens % I.g.page_size == 0) continue;
    auto copy = I.CopyToNewTail(src.pages.back(), src.last_page_len(I.g.page_size), child.partitions[l],
                                p.partitions[l]);
    if (!copy.ok()) {
      for (PageId t : tails)
        if (t != kNoPage) I.Release(t);
      (void)Free(id);
      return copy.status();
    }
    tails[l] = *copy;
  }
  child.drafts = p.drafts;  // its copies of the drafts stay drafts
  for (int l = 0; l < I.g.layers; ++l) {
    PageList& dst = child.layers[l];
    dst = p.layers[l];
    for (PageId& pid : dst.pages) {
      if (&pid == &dst.pages.back() && tails[l] != kNoPage) {
        pid = tails[l];
      } else {
        I.ids.Ref(pid);
      }
    }
    QKV_RETURN_IF_ERROR(I.backend->SetPages(child.partitions[l], dst.pages));
  }
  return id;
}

Status Runtime::Rollback(SeqId seq, int64_t tokens) {
  Impl& I = *impl_;
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.Find(seq));
  if (tokens < 0) return Status::InvalidArgument("rollback by " + std::to_string(tokens) + " tokens");
  for (int l = 0; l < I.g.layers; ++l)
    if (s->layers[l].tokens < tokens)
      return Status::OutOfRange("rollback by " + std::to_string(tokens) + " tokens, but " + SeqName(seq) + " holds " +
                                std::to_string(s->layers[l].tokens) + " in layer " + std::to_string(l));
  if (tokens == 0) return Status::Ok();  // (every draft accepted: the tails stay as they are)
  // Every layer's tail copy first, so that a failure changes nothing.
  std::vector<PageId> copies(I.g.layers, kNoPage);
  for (int l = 0; l < I.g.layers; ++l) {
    auto copy = I.KeptTailCopy(*s, l, s->layers[l].tokens - tokens);
    if (!copy.ok()) {
      for (PageId c : copies)
        if (c != kNoPage) I.Release(c);
      return copy.status();
    }
    copies[l] = *copy;
  }
  for (int l = 0; l < I.g.layers; ++l) {
    QKV_RETURN_IF_ERROR(I.CutLayer(*s, l, s->layers[l].tokens - tokens, copies[l]));
    s->drafts[l] = std::max<int64_t>(0, s->drafts[l] - tokens);
  }
  return Status::Ok();
}

Status Runtime::Accept(SeqId seq) {
  Impl& I = *impl_;
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.Find(seq));
  const int S = I.g.page_size;
  for (int l = 0; l < I.g.layers; ++l) {
    const PageList& list = s->layers[l];
    // Pages holding drafts that are full now go to their homes.
    for (int64_t i = (list.tokens - s->drafts[l]) / S; i < list.tokens / S; ++i)
      QKV_RETURN_IF_ERROR(I.backend->SealHeld(list.pages[std::size_t(i)]));
    s->drafts[l] = 0;
  }
  return Status::Ok();
}

Status Runtime::AppendDraft(SeqId seq, int layer, const float* k, const float* v, int64_t n) {
  Impl& I = *impl_;
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.CheckAppend(seq, layer, k, v, n));
  return I.Append(seq, *s, layer, k, v, n, /*host_f32=*/true, /*draft=*/true);
}

Status Runtime::Free(SeqId seq) {
  Impl& I = *impl_;
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.Find(seq));
  for (PageList& list : s->layers) I.ReleaseAll(list.pages);
  for (uint32_t part : s->partitions) I.backend->RemovePartition(part);
  I.seqs.erase(seq);
  return Status::Ok();
}

Status Runtime::Append(SeqId seq, int layer, const float* k, const float* v, int64_t n) {
  Impl& I = *impl_;
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.CheckAppend(seq, layer, k, v, n));
  return I.Append(seq, *s, layer, k, v, n, /*host_f32=*/true);
}

Status Runtime::AppendDevice(SeqId seq, int layer, const void* k, const void* v, int64_t n) {
  Impl& I = *impl_;
  if (!I.backend->on_device()) return Status::FailedPrecondition("AppendDevice needs the CUDA backend");
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.CheckAppend(seq, layer, k, v, n));
  return I.Append(seq, *s, layer, k, v, n, /*host_f32=*/false);
}

Status Runtime::DecodeAttention(std::span<const SeqId> seqs, int layer, const float* q_in, float* out,
                                std::vector<PageSelection>* selections, AttendStats* stats) {
  Impl& I = *impl_;
  QKV_RETURN_IF_ERROR(I.CheckBatch(seqs, layer, q_in, out));
  const float* q = I.Unaliased(q_in, out, seqs.size());
  QKV_RETURN_IF_ERROR(I.Decode(layer, q, out, /*host_f32=*/true, /*dense=*/false, selections, stats));
  return I.CheckFinite(seqs, q, out);
}

// One row per block position: the sequence's page list as it stood right
// after that token was appended (its pages up to it; the last one's valid
// length ends at it), so the step selects and attends exactly as a
// single-token call would have then.
// The rows of a block call (block.size() == seqs.size(), after CheckBatch):
// one per block token, each a causal view of its sequence's list (lists and
// list_partitions replaced by them).
Result<std::size_t> Runtime::Impl::BlockRows(std::span<const SeqId> seqs, std::span<const int> block, int layer,
                                             std::vector<SeqId>* row_seqs) {
  const int S = g.page_size;
  std::size_t rows = 0;
  for (std::size_t b = 0; b < seqs.size(); ++b) {
    if (block[b] < 1 || block[b] > lists[b]->tokens)
      return Status::OutOfRange("block of " + std::to_string(block[b]) + " tokens for " + SeqName(seqs[b]) +
                                ", which holds " + std::to_string(lists[b]->tokens) + " in layer " +
                                std::to_string(layer));
    rows += std::size_t(block[b]);
  }
  block_views.resize(rows);
  std::vector<uint32_t> row_parts;
  std::size_t r = 0;
  for (std::size_t b = 0; b < seqs.size(); ++b) {
    for (int i = 0; i < block[b]; ++i, ++r) {
      PageList& view = block_views[r];
      view.tokens = lists[b]->tokens - block[b] + 1 + i;
      view.pages.assign(lists[b]->pages.begin(), lists[b]->pages.begin() + (view.tokens + S - 1) / S);
      if (row_seqs) row_seqs->push_back(seqs[b]);
      row_parts.push_back(list_partitions[b]);
    }
  }
  lists.clear();
  for (const PageList& view : block_views) lists.push_back(&view);
  list_partitions = std::move(row_parts);
  return rows;
}

Status Runtime::DecodeBlock(std::span<const SeqId> seqs, std::span<const int> block, int layer, const float* q_in,
                            float* out, AttendStats* stats) {
  Impl& I = *impl_;
  QKV_RETURN_IF_ERROR(BlockMatches(seqs, block));
  QKV_RETURN_IF_ERROR(I.CheckBatch(seqs, layer, q_in, out));
  std::vector<SeqId> row_seqs;
  QKV_ASSIGN_OR_RETURN(const std::size_t rows, I.BlockRows(seqs, block, layer, &row_seqs));
  const float* q = I.Unaliased(q_in, out, rows);
  const bool shared = I.config.policy.block_selection == BlockSelection::kShared;
  QKV_RETURN_IF_ERROR(I.Decode(layer, q, out, /*host_f32=*/true, /*dense=*/false, nullptr, stats,
                               shared ? block : std::span<const int>{}));
  return I.CheckFinite(row_seqs, q, out);
}

Status Runtime::AppendDraftDevice(SeqId seq, int layer, const void* k, const void* v, int64_t n) {
  Impl& I = *impl_;
  if (!I.backend->on_device()) return Status::FailedPrecondition("AppendDraftDevice needs the CUDA backend");
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.CheckAppend(seq, layer, k, v, n));
  return I.Append(seq, *s, layer, k, v, n, /*host_f32=*/false, /*draft=*/true);
}

Status Runtime::DecodeBlockDevice(std::span<const SeqId> seqs, std::span<const int> block, int layer, const void* q,
                                  void* out, AttendStats* stats) {
  Impl& I = *impl_;
  if (!I.backend->on_device()) return Status::FailedPrecondition("DecodeBlockDevice needs the CUDA backend");
  QKV_RETURN_IF_ERROR(BlockMatches(seqs, block));
  QKV_RETURN_IF_ERROR(I.CheckBatch(seqs, layer, q, out));
  QKV_ASSIGN_OR_RETURN(const std::size_t rows, I.BlockRows(seqs, block, layer, nullptr));
  QKV_RETURN_IF_ERROR(I.CheckDeviceAliasing(q, out, rows));
  const bool shared = I.config.policy.block_selection == BlockSelection::kShared;
  return I.Decode(layer, q, out, /*host_f32=*/false, /*dense=*/false, nullptr, stats,
                  shared ? block : std::span<const int>{});
}

Status Runtime::DecodeAttentionDevice(std::span<const SeqId> seqs, int layer, const void* q, void* out,
                                      std::vector<PageSelection>* selections, AttendStats* stats) {
  Impl& I = *impl_;
  if (!I.backend->on_device()) return Status::FailedPrecondition("DecodeAttentionDevice needs the CUDA backend");
  QKV_RETURN_IF_ERROR(I.CheckBatch(seqs, layer, q, out));
  QKV_RETURN_IF_ERROR(I.CheckDeviceAliasing(q, out, seqs.size()));
  return I.Decode(layer, q, out, /*host_f32=*/false, /*dense=*/false, selections, stats);
}

Status Runtime::Synchronize() {
  Impl& I = *impl_;
  return I.backend->Synchronize();
}

void* Runtime::cuda_stream() const { return impl_->backend->stream(); }

Result<double> Runtime::TimeDenseOffload(std::span<const SeqId> seqs, int layer, std::size_t max_bytes, int reps,
                                         int64_t* bytes) {
  Impl& I = *impl_;
  QKV_RETURN_IF_ERROR(I.CheckLayer(layer));
  if (reps < 1 || !bytes) return Status::InvalidArgument("reps must be >= 1 and bytes non-null");
  std::vector<const PageList*> lists;
  for (SeqId id : seqs) {
    QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.Find(id));
    lists.push_back(&s->layers[layer]);
  }
  return I.backend->TimeDenseOffload(lists, max_bytes, reps, bytes);
}

Status Runtime::DenseAttention(std::span<const SeqId> seqs, int layer, const float* q_in, float* out) {
  Impl& I = *impl_;
  QKV_RETURN_IF_ERROR(I.CheckBatch(seqs, layer, q_in, out));
  const float* q = I.Unaliased(q_in, out, seqs.size());
  QKV_RETURN_IF_ERROR(I.Decode(layer, q, out, /*host_f32=*/true, /*dense=*/true, nullptr, nullptr));
  return I.CheckFinite(seqs, q, out);
}

Result<int64_t> Runtime::Length(SeqId seq, int layer) const {
  auto& I = const_cast<Impl&>(*impl_);
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.Find(seq));
  QKV_RETURN_IF_ERROR(I.CheckLayer(layer));
  return s->layers[layer].tokens;
}

Result<std::vector<uint32_t>> Runtime::Pages(SeqId seq, int layer) const {
  auto& I = const_cast<Impl&>(*impl_);
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.Find(seq));
  QKV_RETURN_IF_ERROR(I.CheckLayer(layer));
  return s->layers[layer].pages;
}

Result<DenseView> Runtime::Gather(SeqId seq, int layer) const {
  auto& I = const_cast<Impl&>(*impl_);
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.Find(seq));
  QKV_RETURN_IF_ERROR(I.CheckLayer(layer));
  const PageList& list = s->layers[layer];
  const Geometry& g = I.g;
  DenseView view;
  view.tokens = int(list.tokens);
  const std::size_t T = std::size_t(list.tokens), D = g.head_dim;
  view.k.resize(std::size_t(g.kv_heads) * T * D);
  view.v.resize(view.k.size());
  std::vector<float> converted(g.dtype == DType::kF32 ? 0 : g.page_elems());
  I.page_scratch.resize(g.page_elems());  // f32: the widest model dtype
  for (std::size_t p = 0; p < list.pages.size(); ++p) {
    const PageId id = list.pages[p];
    QKV_RETURN_IF_ERROR(I.backend->ReadPage(s->partitions[layer], id, I.page_scratch.data(), I.step));
    const float* page = I.page_scratch.data();
    if (!converted.empty()) {
      ToFloats(page, g.dtype, converted.size(), converted.data());
      page = converted.data();
    }
    const int len = p + 1 == list.pages.size() ? list.last_page_len(g.page_size) : g.page_size;
    for (int h = 0; h < g.kv_heads; ++h) {
      const std::size_t dst = (std::size_t(h) * T + p * g.page_size) * D;
      std::memcpy(view.k.data() + dst, page + h * g.head_page_elems(), len * D * sizeof(float));
      std::memcpy(view.v.data() + dst, page + (g.kv_heads + h) * g.head_page_elems(), len * D * sizeof(float));
    }
  }
  return view;
}

Result<std::vector<float>> Runtime::Summary(uint32_t page_id) const {
  const Impl& I = *impl_;
  if (!I.ids.live(page_id)) return Status::NotFound("page " + std::to_string(page_id) + " is not live");
  std::vector<float> out(I.g.summary_elems());
  const PageId one[1] = {page_id};
  QKV_RETURN_IF_ERROR(I.backend->ReadSummaries(one, out.data()));
  return out;
}

Result<std::vector<float>> Runtime::Scores(SeqId seq, int layer, const float* q) const {
  auto& I = const_cast<Impl&>(*impl_);
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.Find(seq));
  QKV_RETURN_IF_ERROR(I.CheckLayer(layer));
  if (!q) return Status::InvalidArgument("null query pointer");
  const Geometry& g = I.g;
  const PageList& list = s->layers[layer];
  const int P = int(list.pages.size()), G = g.group();
  std::vector<float> scores(std::size_t(g.q_heads) * P);
  // A compact copy of the list's summaries, scored as the selector would.
  std::vector<float> compact(std::size_t(P) * g.summary_elems());
  std::vector<uint32_t> local(P);
  QKV_RETURN_IF_ERROR(I.backend->ReadSummaries(list.pages, compact.data()));
  for (int p = 0; p < P; ++p) local[p] = uint32_t(p);
  for (int h = 0; h < g.kv_heads; ++h)
    kernels::ScorePagesCpu(q + std::size_t(h) * G * g.head_dim, G, g.head_dim, compact.data(), g.kv_heads, h,
                           local.data(), P, scores.data() + std::size_t(h) * G * P, g.e4m3_summaries());
  return scores;
}

TierStats Runtime::tier_stats() const {
  const Impl& I = *impl_;
  const MoverStats& m = I.mover->stats();
  const BackendCounters c = I.backend->counters();
  TierStats t;
  t.bytes_host_to_hbm = c.bytes_host_to_hbm;
  t.bytes_hbm_to_host = m.bytes_hbm_to_host;
  t.bytes_host_to_disk = m.bytes_host_to_disk;
  t.bytes_disk_to_host = m.bytes_disk_to_host;
  t.hbm_hits = c.hits, t.hbm_misses = c.misses, t.hbm_evictions = c.evictions, t.hbm_bypasses = c.bypasses;
  t.cold_misses = c.cold_misses, t.cold_stalls = c.cold_stalls, t.pages_skipped = c.pages_skipped;
  t.deadline_waits = c.deadline_waits;
  t.hbm_capacity_bytes = c.slots_capacity * c.slot_bytes, t.hbm_peak_bytes = c.slots_peak * c.slot_bytes;
  t.hbm_used_bytes = c.slots_used * c.slot_bytes;
  t.demotions = m.demotions, t.promotions = m.promotions, t.clean_drops = m.clean_drops, t.prefetches = m.prefetches;
  t.deferred_seals = c.deferred_seals;
  t.demotion_orders = m.demotion_orders;
  t.io_errors = m.io_errors, t.corruptions = m.corruptions;
  const uint64_t ps = I.host->slot_bytes();
  t.host_capacity_bytes = m.host_slots_capacity * ps, t.host_peak_bytes = m.host_slots_peak * ps;
  t.host_used_bytes = m.host_slots_used * ps;
  if (I.disk) {
    const DiskStats& d = I.disk->stats();
    const uint64_t ds = I.disk->slot_bytes();
    t.disk_capacity_bytes = d.slots_capacity * ds, t.disk_peak_bytes = d.slots_peak * ds, t.disk_used_bytes = d.slots_used * ds;
  }
  t.summary_bytes = uint64_t(I.ids.live_count()) * I.g.summary_elems() * I.backend->summary_elem_bytes();
  return t;
}

uint32_t Runtime::live_pages() const { return impl_->ids.live_count(); }
std::size_t Runtime::live_sequences() const { return impl_->seqs.size(); }

}  // namespace questkv
