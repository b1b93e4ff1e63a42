// Selection-quality diagnostics for one (sequence, layer, step), computed
// against dense attention over the same K/V (seed §1.1, §2.2, §3.1–3.3).
#pragma once

#include <cstdint>
#include <vector>

#include "questkv/config.h"
#include "selector/select.h"

namespace questkv {

struct StepDiagnostics {
  // Mean over query heads of |dense top-R tokens whose page was selected| / R.
  double page_recall = 0;
  // Mean over query heads of Σ_{j in selected pages} p_j (1 − ε).
  double attention_mass_recall = 0;
  // ||o_sparse − o_dense|| / ||o_dense|| over all query heads.
  double output_rel_error = 0;
  // What the selection alone costs: ||o_sel − o_dense|| / ||o_dense||, o_sel
  // the exact attention over the tokens of the selected pages (zero for a
  // KV head that selected none).
  double selection_rel_error = 0;
  // What the step lost beyond its selection — pages it attended without
  // (`deadline`'s cold misses), and rounding: ||o_sparse − o_sel|| / ||o_sel||.
  double attended_rel_error = 0;
  // Page slack g_p = U_p − max_{k in p} q·k (unscaled), per query head and page,
  // [Hq][num_pages]; never negative beyond rounding.
  std::vector<float> slack;
  double slack_mean = 0;
  double slack_max = 0;
};

// sparse_out: [Hq][D] the sparse output of this step. scores: [Hq][P] U_p(q)
// per query head (from ScorePagesCpu), P = ceil(T / S); the last page may be
// partial. sel: the Selector's output for these P pages. Query head h reads
// KV head h / G. Top-R ranks unscaled logits q·k in double, ties toward the
// lower token index (the same order as ExactTopRSearch); the mass recall and
// the dense output use the scale 1/sqrt(D). InvalidArgument for an invalid
// geometry, null pointers, T < 1, K/V sizes other than [Hkv][T][D], a
// selection that is not a CSR of Hkv rows of pages in [0, P), or R outside
// 1..T. threads: query heads are spread over up to this many threads (at
// least 1); the result does not depend on it (per-head figures are summed
// in head order).
Result<StepDiagnostics> Diagnose(const Geometry& g, const float* q, const DenseView& kv,
                                 const PageSelection& sel, const float* scores,
                                 const float* sparse_out, int top_r, int threads = 1);

// Exact top-R by branch-and-bound (seed §3.2): per query head, read pages in
// descending order of U_p (ties toward the lower page; a NaN bound is read
// first, as +inf) until R tokens are seen and the next unread bound is
// strictly below the R-th best true logit seen, τ_R. The result certifies the
// exact dense top-R tokens under Diagnose's ranking: the bounds hold by eq. 4,
// and each fp32 U_p is widened by 1e-4·(1+|U_p|) before the comparison so its
// rounding cannot end the search early (it may read a page more).
// Same inputs, threads and errors as Diagnose, less the selection and output.
struct ExactTopR {
  std::vector<std::vector<int32_t>> tokens;  // [Hq] token indices, ascending
  std::vector<int32_t> pages_read;           // [Hq]
};
Result<ExactTopR> ExactTopRSearch(const Geometry& g, const float* q, const DenseView& kv,
                                  const float* scores, int top_r, int threads = 1);

}  // namespace questkv
