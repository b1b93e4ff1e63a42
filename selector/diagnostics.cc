#include "selector/diagnostics.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <queue>
#include <string>
#include <thread>
#include <utility>

#include "kernels/cpu/kernels_cpu.h"

namespace questkv {
namespace {

std::string Num(long long x) { return std::to_string(x); }

int NumPages(int tokens, int page_size) { return (tokens + page_size - 1) / page_size; }

Status ValidateCommon(const Geometry& g, const float* q, const DenseView& kv, const float* scores,
                      int top_r) {
  QKV_RETURN_IF_ERROR(g.Validate());
  if (q == nullptr) return Status::InvalidArgument("q is null");
  if (scores == nullptr) return Status::InvalidArgument("scores is null");
  if (kv.tokens < 1)
    return Status::InvalidArgument("kv.tokens = " + Num(kv.tokens) + ", must be >= 1");
  const std::size_t elems = std::size_t(g.kv_heads) * kv.tokens * g.head_dim;
  if (kv.k.size() != elems || kv.v.size() != elems)
    return Status::InvalidArgument("kv.k has " + Num(kv.k.size()) + " and kv.v " +
                                   Num(kv.v.size()) + " floats; [Hkv][T][D] needs " + Num(elems));
  if (top_r < 1 || top_r > kv.tokens)
    return Status::InvalidArgument("top_r = " + Num(top_r) + ", must be in 1..tokens (" +
                                   Num(kv.tokens) + ")");
  return Status::Ok();
}

Status ValidateSelection(const PageSelection& sel, int kv_heads, int pages) {
  if (sel.indptr.size() != std::size_t(kv_heads) + 1 || sel.indptr[0] != 0 ||
      sel.indptr.back() != int64_t(sel.pages.size()))
    return Status::InvalidArgument("selection indptr must have Hkv + 1 = " + Num(kv_heads + 1) +
                                   " entries from 0 to pages.size() = " + Num(sel.pages.size()));
  for (int h = 0; h < kv_heads; ++h)
    if (sel.indptr[h] > sel.indptr[h + 1])
      return Status::InvalidArgument("selection indptr decreases at KV head " + Num(h));
  for (int32_t p : sel.pages)
    if (p < 0 || p >= pages)
      return Status::InvalidArgument("selected page " + Num(p) + " is outside 0.." +
                                     Num(pages - 1));
  return Status::Ok();
}

double DotDouble(const float* a, const float* b, int dim) {
  double sum = 0;
  for (int j = 0; j < dim; ++j) sum += double(a[j]) * double(b[j]);
  return sum;
}

// A scored token; Better is the one ranking used for every top-R here:
// higher unscaled logit first, equal logits toward the lower token index.
struct Scored {
  double logit;
  int32_t token;
};
bool Better(const Scored& a, const Scored& b) {
  return a.logit != b.logit ? a.logit > b.logit : a.token < b.token;
}

// One query head against its KV head's [T][D] keys and values.
struct HeadView {
  const float* q;
  const float* k;
  const float* v;
  int tokens;
  int head_dim;
  int page_size;
};

HeadView ViewOf(const Geometry& g, const float* q, const DenseView& kv, int q_head) {
  const std::size_t base = std::size_t(q_head / g.group()) * kv.tokens * g.head_dim;
  return {q + std::size_t(q_head) * g.head_dim,
          kv.k.data() + base,
          kv.v.data() + base,
          kv.tokens,
          g.head_dim,
          g.page_size};
}

void Logits(const HeadView& hv, std::vector<double>* out) {
  out->resize(hv.tokens);
  for (int t = 0; t < hv.tokens; ++t)
    (*out)[t] = DotDouble(hv.q, hv.k + std::size_t(t) * hv.head_dim, hv.head_dim);
}

std::vector<int32_t> DenseTopR(const std::vector<double>& logits, int top_r) {
  std::vector<Scored> all(logits.size());
  for (std::size_t t = 0; t < logits.size(); ++t) all[t] = {logits[t], int32_t(t)};
  std::nth_element(all.begin(), all.begin() + (top_r - 1), all.end(), Better);
  std::vector<int32_t> top;
  for (int i = 0; i < top_r; ++i) top.push_back(all[i].token);
  std::sort(top.begin(), top.end());
  return top;
}

double PageRecall(const std::vector<double>& logits, int top_r, int page_size,
                  const std::vector<uint8_t>& selected) {
  int hit = 0;
  for (int32_t t : DenseTopR(logits, top_r)) hit += selected[t / page_size];
  return double(hit) / top_r;
}

// Σ of dense softmax probabilities over tokens of selected pages (1 − ε).
double MassRecall(const std::vector<double>& logits, double scale, int page_size,
                  const std::vector<uint8_t>& selected) {
  const double max_logit = *std::max_element(logits.begin(), logits.end());
  double total = 0, kept = 0;
  for (std::size_t t = 0; t < logits.size(); ++t) {
    const double w = std::exp(scale * (logits[t] - max_logit));
    total += w;
    if (selected[t / page_size]) kept += w;
  }
  return kept / total;
}

// Exact attention of one query head over the tokens of its selected pages
// (zero when none is selected): DenseAttentionReference over those tokens,
// gathered.
std::vector<float> SelectedAttention(const HeadView& hv, double scale, const std::vector<uint8_t>& selected) {
  std::vector<float> k, v, out(hv.head_dim);
  for (int t = 0; t < hv.tokens; ++t) {
    if (!selected[t / hv.page_size]) continue;
    const std::size_t at = std::size_t(t) * hv.head_dim;
    k.insert(k.end(), hv.k + at, hv.k + at + hv.head_dim);
    v.insert(v.end(), hv.v + at, hv.v + at + hv.head_dim);
  }
  kernels::DenseAttentionReference(hv.q, k.data(), v.data(), int(k.size() / hv.head_dim), hv.head_dim, hv.head_dim,
                                   scale, out.data());
  return out;
}

// g_p = U_p − max_{t in p} q·k_t for every page of one query head.
void Slack(const std::vector<double>& logits, int page_size, const float* scores, float* slack) {
  const int pages = NumPages(int(logits.size()), page_size);
  for (int p = 0; p < pages; ++p) {
    const int end = std::min<int>(int(logits.size()), (p + 1) * page_size);
    double page_max = -std::numeric_limits<double>::infinity();
    for (int t = p * page_size; t < end; ++t) page_max = std::max(page_max, logits[t]);
    slack[p] = float(double(scores[p]) - page_max);
  }
}

void SelectedPages(const PageSelection& sel, int kv_head, int pages, std::vector<uint8_t>* out) {
  out->assign(pages, 0);
  for (int i = 0; i < sel.count(kv_head); ++i) (*out)[sel.row(kv_head)[i]] = 1;
}

void SlackStats(StepDiagnostics* d) {
  double sum = 0, max = -std::numeric_limits<double>::infinity();
  for (float s : d->slack) {
    sum += s;
    max = std::max(max, double(s));
  }
  d->slack_mean = sum / double(d->slack.size());
  d->slack_max = max;
}

// Runs body(h) for h in [0, n) on up to `threads` threads (this one among
// them), heads dealt round-robin; returns when every call has returned.
template <typename Body>
void ForEachHead(int n, int threads, const Body& body) {
  const int workers = std::clamp(threads, 1, std::max(n, 1));
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  auto run = [&](int first) {
    for (int h = first; h < n; h += workers) body(h);
  };
  for (int w = 1; w < workers; ++w) pool.emplace_back(run, w);
  run(0);
  for (std::thread& t : pool) t.join();
}

}  // namespace

Result<StepDiagnostics> Diagnose(const Geometry& g, const float* q, const DenseView& kv,
                                 const PageSelection& sel, const float* scores,
                                 const float* sparse_out, int top_r, int threads) {
  QKV_RETURN_IF_ERROR(ValidateCommon(g, q, kv, scores, top_r));
  if (sparse_out == nullptr) return Status::InvalidArgument("sparse_out is null");
  const int pages = NumPages(kv.tokens, g.page_size);
  QKV_RETURN_IF_ERROR(ValidateSelection(sel, g.kv_heads, pages));
  const double scale = 1.0 / std::sqrt(double(g.head_dim));
  StepDiagnostics d;
  d.slack.resize(std::size_t(g.q_heads) * pages);
  struct Head {
    double page_recall = 0, mass_recall = 0, err_sq = 0, ref_sq = 0;
    double sel_err_sq = 0, att_err_sq = 0, sel_sq = 0;  // o_sel against dense; sparse against o_sel
  };
  std::vector<Head> heads(g.q_heads);
  ForEachHead(g.q_heads, threads, [&](int hq) {
    const HeadView hv = ViewOf(g, q, kv, hq);
    std::vector<double> logits;
    std::vector<uint8_t> selected;
    std::vector<float> dense(g.head_dim);
    Logits(hv, &logits);
    SelectedPages(sel, hq / g.group(), pages, &selected);
    Head& h = heads[hq];
    h.page_recall = PageRecall(logits, top_r, g.page_size, selected);
    h.mass_recall = MassRecall(logits, scale, g.page_size, selected);
    Slack(logits, g.page_size, scores + std::size_t(hq) * pages, d.slack.data() + std::size_t(hq) * pages);
    kernels::DenseAttentionReference(hv.q, hv.k, hv.v, hv.tokens, hv.head_dim, hv.head_dim, scale,
                                     dense.data());
    const std::vector<float> chosen = SelectedAttention(hv, scale, selected);
    const float* sparse = sparse_out + std::size_t(hq) * g.head_dim;
    for (int j = 0; j < g.head_dim; ++j) {
      h.err_sq += (double(sparse[j]) - dense[j]) * (double(sparse[j]) - dense[j]);
      h.ref_sq += double(dense[j]) * dense[j];
      h.sel_err_sq += (double(chosen[j]) - dense[j]) * (double(chosen[j]) - dense[j]);
      h.att_err_sq += (double(sparse[j]) - chosen[j]) * (double(sparse[j]) - chosen[j]);
      h.sel_sq += double(chosen[j]) * chosen[j];
    }
  });
  double err_sq = 0, ref_sq = 0, sel_err_sq = 0, att_err_sq = 0, sel_sq = 0;
  for (const Head& h : heads) {
    d.page_recall += h.page_recall;
    d.attention_mass_recall += h.mass_recall;
    err_sq += h.err_sq;
    ref_sq += h.ref_sq;
    sel_err_sq += h.sel_err_sq;
    att_err_sq += h.att_err_sq;
    sel_sq += h.sel_sq;
  }
  auto relative = [](double e, double r) { return r > 0 ? std::sqrt(e / r) : std::sqrt(e); };
  d.page_recall /= g.q_heads;
  d.attention_mass_recall /= g.q_heads;
  d.output_rel_error = relative(err_sq, ref_sq);
  d.selection_rel_error = relative(sel_err_sq, ref_sq);
  d.attended_rel_error = relative(att_err_sq, sel_sq);
  SlackStats(&d);
  return d;
}

namespace {

// Pages of one query head in the order branch-and-bound reads them: U_p
// descending, ties toward the lower page. A NaN bound proves nothing, so it
// is read first, as if it were +inf.
std::vector<int> ReadOrder(const float* scores, int pages) {
  auto key = [&](int p) {
    return std::isnan(scores[p]) ? std::numeric_limits<float>::infinity() : scores[p];
  };
  std::vector<int> order(pages);
  for (int p = 0; p < pages; ++p) order[p] = p;
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return key(a) != key(b) ? key(a) > key(b) : a < b; });
  return order;
}

// Branch-and-bound for one query head; returns the pages read and leaves the
// top-R tokens in *top (ascending).
int SearchHead(const HeadView& hv, const float* scores, int top_r, std::vector<int32_t>* top) {
  const int pages = NumPages(hv.tokens, hv.page_size);
  // Max-heap under Better: the top is the worst token kept, i.e. τ_R once full.
  std::priority_queue<Scored, std::vector<Scored>, decltype(&Better)> kept(&Better);
  int read = 0;
  for (int p : ReadOrder(scores, pages)) {
    // Strict: a page whose bound equals τ_R may hold a tie with a lower index.
    // The fp32 bound is widened by a rounding margin so that a tight bound
    // rounded a few ulps low cannot end the search early.
    const double bound = double(scores[p]) + 1e-4 * (1.0 + std::fabs(double(scores[p])));
    if (int(kept.size()) == top_r && bound < kept.top().logit) break;
    ++read;
    const int end = std::min(hv.tokens, (p + 1) * hv.page_size);
    for (int t = p * hv.page_size; t < end; ++t) {
      const Scored s{DotDouble(hv.q, hv.k + std::size_t(t) * hv.head_dim, hv.head_dim), t};
      if (int(kept.size()) < top_r) {
        kept.push(s);
      } else if (Better(s, kept.top())) {
        kept.pop();
        kept.push(s);
      }
    }
  }
  top->clear();
  for (; !kept.empty(); kept.pop()) top->push_back(kept.top().token);
  std::sort(top->begin(), top->end());
  return read;
}

}  // namespace

Result<ExactTopR> ExactTopRSearch(const Geometry& g, const float* q, const DenseView& kv,
                                  const float* scores, int top_r, int threads) {
  QKV_RETURN_IF_ERROR(ValidateCommon(g, q, kv, scores, top_r));
  const int pages = NumPages(kv.tokens, g.page_size);
  ExactTopR r;
  r.tokens.resize(g.q_heads);
  r.pages_read.resize(g.q_heads);
  ForEachHead(g.q_heads, threads, [&](int hq) {
    r.pages_read[hq] = SearchHead(ViewOf(g, q, kv, hq), scores + std::size_t(hq) * pages, top_r, &r.tokens[hq]);
  });
  return r;
}

}  // namespace questkv
