#include "runtime/runtime.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <unordered_map>

#include "kernels/cpu/kernels_cpu.h"
#include "tiers/arena.h"
#include "tiers/page_allocator.h"
#include "tiers/page_table.h"

namespace questkv {

namespace {
std::string SeqName(SeqId id) { return "sequence " + std::to_string(id); }
}  // namespace

struct Runtime::Impl {
  Config config;
  Geometry g;
  PageAllocator ids;
  std::unique_ptr<SlotArena> hbm;         // page bytes, the CPU backend's "hbm"
  std::unique_ptr<SummarySlab> summaries;
  std::vector<uint32_t> slot_of;          // [max_pages] PageId -> hbm slot
  struct Sequence {
    std::vector<PageList> layers;
  };
  std::unordered_map<SeqId, Sequence> seqs;
  SeqId next_seq = 1;
  Selector selector;
  // Decode scratch, reused across calls.
  PageTableCsr csr;
  std::vector<const PageList*> lists;
  std::vector<kernels::HeadPageRef> refs;
  std::vector<float> m, d;

  Impl(const Config& c, std::unique_ptr<SlotArena> arena, std::unique_ptr<SummarySlab> slab)
      : config(c), g(c.geometry), ids(c.max_pages), hbm(std::move(arena)), summaries(std::move(slab)),
        slot_of(c.max_pages, UINT32_MAX), selector(c.geometry, c.policy) {}

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

  float* page(PageId id) { return hbm->data(slot_of[id]); }
  const float* page(PageId id) const { return hbm->data(slot_of[id]); }

  // A fresh page with an empty summary box, or the error with nothing held.
  Result<PageId> NewPage() {
    QKV_ASSIGN_OR_RETURN(PageId id, ids.Allocate());
    auto slot = hbm->Allocate();
    if (!slot.ok()) {
      ids.Unref(id);
      return slot.status();
    }
    slot_of[id] = *slot;
    kernels::ResetSummaryCpu(summaries->page(id), g.kv_heads, g.head_dim);
    return id;
  }
  void Release(PageId id) {
    if (!ids.Unref(id)) return;
    hbm->Free(slot_of[id]);
    slot_of[id] = UINT32_MAX;
  }
  void ReleaseAll(const std::vector<PageId>& pages) {
    for (PageId id : pages) Release(id);
  }
  // Allocates n fresh pages, all or none.
  Result<std::vector<PageId>> NewPages(int64_t n) {
    std::vector<PageId> out;
    out.reserve(n);
    for (int64_t i = 0; i < n; ++i) {
      auto id = NewPage();
      if (!id.ok()) {
        ReleaseAll(out);
        return id.status();
      }
      out.push_back(*id);
    }
    return out;
  }
  // A private copy of `src` holding its first `len` tokens, summary rebuilt.
  Result<PageId> CopyPage(PageId src, int len) {
    QKV_ASSIGN_OR_RETURN(PageId dst, NewPage());
    std::memcpy(page(dst), page(src), g.page_elems() * sizeof(float));
    kernels::RebuildSummaryCpu(page(dst), summaries->page(dst), g.kv_heads, g.page_size, g.head_dim, len);
    return dst;
  }

  void AppendToList(PageList& list, const float* k, const float* v, int64_t n, std::vector<PageId>& fresh) {
    const std::size_t row = std::size_t(g.kv_heads) * g.head_dim;
    list.pages.insert(list.pages.end(), fresh.begin(), fresh.end());
    int64_t done = 0;
    while (done < n) {
      const int64_t pos = list.tokens + done;
      const PageId id = list.pages[pos / g.page_size];
      const int offset = int(pos % g.page_size);
      const int take = int(std::min<int64_t>(n - done, g.page_size - offset));
      kernels::AppendTokensCpu(page(id), summaries->page(id), g.kv_heads, g.page_size, g.head_dim, offset,
                               k + done * row, v + done * row, take);
      done += take;
    }
    list.tokens += n;
  }

  kernels::HeadPageRef Ref(PageId id, int kv_head, int len) const {
    const float* p = page(id);
    return {p + std::size_t(kv_head) * g.head_page_elems(),
            p + (std::size_t(g.kv_heads) + kv_head) * g.head_page_elems(), len};
  }

  Status CheckBatch(std::span<const SeqId> seqs_in, int layer, const float* q, const float* out) {
    QKV_RETURN_IF_ERROR(CheckLayer(layer));
    if (seqs_in.empty()) return Status::InvalidArgument("empty batch");
    if (!q || !out) return Status::InvalidArgument("null query or output pointer");
    lists.clear();
    for (SeqId id : seqs_in) {
      QKV_ASSIGN_OR_RETURN(Sequence * s, Find(id));
      const PageList& list = s->layers[layer];
      if (list.tokens == 0)
        return Status::FailedPrecondition(SeqName(id) + " holds no token in layer " + std::to_string(layer));
      lists.push_back(&list);
    }
    csr.Assign(lists, g.page_size);
    return Status::Ok();
  }

  // Attends one (sequence, KV head) over the given logical pages.
  void AttendRow(int b, int kv_head, const int32_t* logical, int n, const float* q, float* out) {
    const uint32_t* pages = csr.pages(b);
    const int last = csr.num_pages(b) - 1;
    refs.clear();
    for (int i = 0; i < n; ++i) {
      const int p = logical[i];
      refs.push_back(Ref(pages[p], kv_head, p == last ? csr.last_page_len[b] : g.page_size));
    }
    const int G = g.group();
    m.resize(G);
    d.resize(G);
    const std::size_t qoff = (std::size_t(b) * g.q_heads + std::size_t(kv_head) * G) * g.head_dim;
    kernels::AttendPagesCpu(q + qoff, G, g.head_dim, refs.data(), n, 1.f / std::sqrt(float(g.head_dim)),
                            out + qoff, m.data(), d.data());
  }
};

Runtime::Runtime(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Runtime::~Runtime() = default;

Result<std::unique_ptr<Runtime>> Runtime::Create(const Config& config) {
  QKV_RETURN_IF_ERROR(config.Validate());
  if (config.geometry.dtype != DType::kF32)
    return Status::Unimplemented("the CPU backend stores K/V as f32; " +
                                 std::string(DTypeName(config.geometry.dtype)) + " needs the CUDA backend");
  const Geometry& g = config.geometry;
  const std::size_t hbm_bytes = config.hbm_bytes ? config.hbm_bytes : std::size_t(config.max_pages) * g.page_bytes();
  const uint32_t slots = uint32_t(std::min<std::size_t>(hbm_bytes / g.page_bytes(), config.max_pages));
  QKV_ASSIGN_OR_RETURN(auto arena, SlotArena::Create(g.page_elems(), slots, "hbm arena"));
  QKV_ASSIGN_OR_RETURN(auto slab, SummarySlab::Create(config.max_pages, g.kv_heads, g.head_dim));
  return std::unique_ptr<Runtime>(new Runtime(std::make_unique<Impl>(config, std::move(arena), std::move(slab))));
}

const Config& Runtime::config() const { return impl_->config; }

Result<SeqId> Runtime::CreateSequence() {
  const SeqId id = impl_->next_seq++;
  impl_->seqs[id].layers.resize(impl_->g.layers);
  return id;
}

Result<SeqId> Runtime::CreateFromPrefix(SeqId parent, int64_t pages) {
  Impl& I = *impl_;
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * p, I.Find(parent));
  if (pages < 0) return Status::InvalidArgument("prefix of " + std::to_string(pages) + " pages");
  for (int l = 0; l < I.g.layers; ++l)
    if (p->layers[l].sealed_pages(I.g.page_size) < pages)
      return Status::OutOfRange(SeqName(parent) + " has " + std::to_string(p->layers[l].sealed_pages(I.g.page_size)) +
                                " sealed pages in layer " + std::to_string(l) + ", fewer than " + std::to_string(pages));
  Impl::Sequence child;
  child.layers.resize(I.g.layers);
  for (int l = 0; l < I.g.layers; ++l) {
    PageList& dst = child.layers[l];
    dst.pages.assign(p->layers[l].pages.begin(), p->layers[l].pages.begin() + pages);
    dst.tokens = pages * I.g.page_size;
    for (PageId id : dst.pages) I.ids.Ref(id);
  }
  const SeqId id = I.next_seq++;
  I.seqs.emplace(id, std::move(child));
  return id;
}

Result<SeqId> Runtime::Fork(SeqId parent) {
  Impl& I = *impl_;
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * p, I.Find(parent));
  // Copy every partial tail first, so a failure leaves nothing behind.
  std::vector<PageId> tails(I.g.layers, kNoPage);
  for (int l = 0; l < I.g.layers; ++l) {
    const PageList& src = p->layers[l];
    if (src.tokens % I.g.page_size == 0) continue;
    auto copy = I.CopyPage(src.pages.back(), src.last_page_len(I.g.page_size));
    if (!copy.ok()) {
      for (PageId t : tails)
        if (t != kNoPage) I.Release(t);
      return copy.status();
    }
    tails[l] = *copy;
  }
  Impl::Sequence child = *p;
  for (int l = 0; l < I.g.layers; ++l) {
    PageList& dst = child.layers[l];
    for (PageId& id : dst.pages) {
      if (&id == &dst.pages.back() && tails[l] != kNoPage) {
        id = tails[l];
      } else {
        I.ids.Ref(id);
      }
    }
  }
  const SeqId id = I.next_seq++;
  I.seqs.emplace(id, std::move(child));
  return id;
}

Status Runtime::Rollback(SeqId seq, int64_t tokens) {
  Impl& I = *impl_;
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.Find(seq));
  if (tokens < 0) return Status::InvalidArgument("rollback by " + std::to_string(tokens) + " tokens");
  const int S = I.g.page_size;
  for (int l = 0; l < I.g.layers; ++l)
    if (s->layers[l].tokens < tokens)
      return Status::OutOfRange("rollback by " + std::to_string(tokens) + " tokens, but " + SeqName(seq) + " holds " +
                                std::to_string(s->layers[l].tokens) + " in layer " + std::to_string(l));
  // A new tail that is still shared (sealed, referenced by a fork or prefix)
  // must be copied before its summary is rebuilt: allocate those copies first.
  std::vector<PageId> copies(I.g.layers, kNoPage);
  for (int l = 0; l < I.g.layers; ++l) {
    const PageList& list = s->layers[l];
    const int64_t keep = list.tokens - tokens;
    if (keep % S == 0) continue;
    const PageId tail = list.pages[keep / S];
    if (I.ids.refcount(tail) == 1) continue;
    auto copy = I.CopyPage(tail, int(keep % S));
    if (!copy.ok()) {
      for (PageId c : copies)
        if (c != kNoPage) I.Release(c);
      return copy.status();
    }
    copies[l] = *copy;
  }
  for (int l = 0; l < I.g.layers; ++l) {
    PageList& list = s->layers[l];
    const int64_t keep = list.tokens - tokens;
    const std::size_t keep_pages = std::size_t((keep + S - 1) / S);
    for (std::size_t i = keep_pages; i < list.pages.size(); ++i) I.Release(list.pages[i]);
    list.pages.resize(keep_pages);
    list.tokens = keep;
    if (keep % S == 0) continue;
    PageId& tail = list.pages.back();
    if (copies[l] != kNoPage) {
      I.Release(tail);
      tail = copies[l];
    } else {
      kernels::RebuildSummaryCpu(I.page(tail), I.summaries->page(tail), I.g.kv_heads, S, I.g.head_dim, int(keep % S));
    }
  }
  return Status::Ok();
}

Status Runtime::Free(SeqId seq) {
  Impl& I = *impl_;
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.Find(seq));
  for (PageList& list : s->layers) I.ReleaseAll(list.pages);
  I.seqs.erase(seq);
  return Status::Ok();
}

Status Runtime::Append(SeqId seq, int layer, const float* k, const float* v, int64_t n) {
  Impl& I = *impl_;
  QKV_ASSIGN_OR_RETURN(Impl::Sequence * s, I.Find(seq));
  QKV_RETURN_IF_ERROR(I.CheckLayer(layer));
  if (n < 1) return Status::InvalidArgument("append of " + std::to_string(n) + " tokens");
  if (!k || !v) return Status::InvalidArgument("null K or V pointer");
  PageList& list = s->layers[layer];
  const int64_t S = I.g.page_size;
  const int64_t need = (list.tokens + n + S - 1) / S - int64_t(list.pages.size());
  QKV_ASSIGN_OR_RETURN(std::vector<PageId> fresh, I.NewPages(need));
  // The page being filled is never shared: fork and rollback copy shared tails.
  assert(list.tokens % S == 0 || I.ids.refcount(list.pages.back()) == 1);
  I.AppendToList(list, k, v, n, fresh);
  return Status::Ok();
}

Status Runtime::DecodeAttention(std::span<const SeqId> seqs, int layer, const float* q, float* out,
                                std::vector<PageSelection>* selections, AttendStats* stats) {
  Impl& I = *impl_;
  QKV_RETURN_IF_ERROR(I.CheckBatch(seqs, layer, q, out));
  const Geometry& g = I.g;
  if (selections) selections->resize(seqs.size());
  PageSelection local;
  for (int b = 0; b < I.csr.batch(); ++b) {
    PageSelection& sel = selections ? (*selections)[b] : local;
    SelectInput in;
    in.q = q + std::size_t(b) * g.q_heads * g.head_dim;
    in.summary_slab = I.summaries->base();
    in.page_ids = I.csr.pages(b);
    in.num_pages = I.csr.num_pages(b);
    in.layer = layer;
    QKV_RETURN_IF_ERROR(I.selector.Select(in, &sel));
    for (int h = 0; h < g.kv_heads; ++h) {
      I.AttendRow(b, h, sel.row(h), sel.count(h), q, out);
      if (stats) {
        stats->head_pages_selected += sel.count(h);
        stats->head_pages_total += in.num_pages;
        for (int i = 0; i < sel.count(h); ++i)
          stats->kv_bytes_read += int64_t(I.refs[i].len) * g.head_dim * 2 * int64_t(sizeof(float));
      }
    }
    // The selector scores only when the budget is smaller than the page count.
    if (stats && !I.selector.scores().empty()) stats->summary_bytes_read += int64_t(in.num_pages) * int64_t(I.summaries->page_bytes());
  }
  return Status::Ok();
}

Status Runtime::DenseAttention(std::span<const SeqId> seqs, int layer, const float* q, float* out) {
  Impl& I = *impl_;
  QKV_RETURN_IF_ERROR(I.CheckBatch(seqs, layer, q, out));
  std::vector<int32_t> all;
  for (int b = 0; b < I.csr.batch(); ++b) {
    all.resize(I.csr.num_pages(b));
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = int32_t(i);
    for (int h = 0; h < I.g.kv_heads; ++h) I.AttendRow(b, h, all.data(), int(all.size()), q, out);
  }
  return Status::Ok();
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
  for (int h = 0; h < g.kv_heads; ++h) {
    for (std::size_t p = 0; p < list.pages.size(); ++p) {
      const int len = p + 1 == list.pages.size() ? list.last_page_len(g.page_size) : g.page_size;
      const kernels::HeadPageRef r = I.Ref(list.pages[p], h, len);
      const std::size_t dst = (std::size_t(h) * T + p * g.page_size) * D;
      std::memcpy(view.k.data() + dst, r.k, len * D * sizeof(float));
      std::memcpy(view.v.data() + dst, r.v, len * D * sizeof(float));
    }
  }
  return view;
}

Result<std::vector<float>> Runtime::Summary(uint32_t page_id) const {
  const Impl& I = *impl_;
  if (!I.ids.live(page_id)) return Status::NotFound("page " + std::to_string(page_id) + " is not live");
  const float* s = I.summaries->page(page_id);
  return std::vector<float>(s, s + I.g.summary_elems());
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
  for (int h = 0; h < g.kv_heads; ++h)
    kernels::ScorePagesCpu(q + std::size_t(h) * G * g.head_dim, G, g.head_dim, I.summaries->base(), g.kv_heads, h,
                           list.pages.data(), P, scores.data() + std::size_t(h) * G * P);
  return scores;
}

uint32_t Runtime::live_pages() const { return impl_->ids.live_count(); }
std::size_t Runtime::live_sequences() const { return impl_->seqs.size(); }

}  // namespace questkv
