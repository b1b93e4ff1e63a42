"""Independent NumPy reference of `questkv attend`, written from the definition.

Inputs: K, V [Hkv, T, D] and Q [Hq, D] as float arrays (already at the
precision the binary sees: float16 files widened to float32). Everything here
is computed in float64.

Selection, per KV head h with group G = Hq / Hkv and P = ceil(T / S) pages:
  * page p holds tokens [p*S, min((p+1)*S, T)); its summary is the element-wise
    min and max of those valid keys;
  * score of page p for query q: U_p = sum_j max(q_j * min_j, q_j * max_j);
  * page budget PB = floor(B / S). Dense, or PB >= P: every page;
  * otherwise the fixed set is the first `sink` pages and the last `local`
    pages, and the K = PB - |fixed| best of the other pages join it: ranked by
    the group max or group mean of the G query heads' scores (one ranking per
    KV head), or, for "union", the union of each query head's own top K;
    ties go to the lower page index.
Attention: each query head attends the valid tokens of its KV head's selected
pages, softmax scale 1/sqrt(D).

With summary "e4m3" each summary min is rounded down and each max up onto the
values of the OCP E4M3 format (built below from its definition, with -inf and
+inf beyond +-448), and a page scores +inf when any bound its query chooses
(max where q_j >= 0, else min) is infinite.
"""

import numpy as np

GQA_MODES = ("max", "mean", "union")
SUMMARY_DTYPES = ("kv", "e4m3")


def e4m3_values():
    """Every E4M3 value, ascending, with -inf and +inf for the two NaN codes (exponent 15, mantissa 7)."""
    mags = [m / 8 * 2.0 ** -6 for m in range(8)]
    mags += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if (e, m) != (15, 7)]
    return np.array(sorted(set([-x for x in mags] + mags + [-np.inf, np.inf])))


E4M3 = e4m3_values()


def snap(mins, maxs):
    """Summaries rounded outward onto E4M3: mins to the largest value <= them, maxs to the smallest >= them."""
    down = E4M3[np.searchsorted(E4M3, mins, side="right") - 1]
    up = E4M3[np.searchsorted(E4M3, maxs, side="left")]
    return down, up


def num_pages(tokens, page_size):
    return (tokens + page_size - 1) // page_size


def page_summaries(keys, page_size):
    """keys [T, D] -> (mins [P, D], maxs [P, D]) over each page's valid keys."""
    tokens = keys.shape[0]
    mins, maxs = [], []
    for p in range(num_pages(tokens, page_size)):
        block = keys[p * page_size:min((p + 1) * page_size, tokens)]
        mins.append(block.min(axis=0))
        maxs.append(block.max(axis=0))
    return np.array(mins), np.array(maxs)


def page_scores(q, mins, maxs, summary="kv"):
    """q [D], summaries [P, D] -> U [P]."""
    if summary == "kv":
        return np.maximum(q * mins, q * maxs).sum(axis=1)
    chosen = np.where(q >= 0, maxs, mins)
    finite = np.isfinite(chosen).all(axis=1)
    return np.where(finite, (q * np.where(np.isfinite(chosen), chosen, 0)).sum(axis=1), np.inf)


def ranked(scores, candidates):
    """Candidates ordered best first: higher score, then lower page index."""
    return sorted(candidates, key=lambda p: (-scores[p], p))


def group_scores(keys, queries, page_size, summary="kv"):
    """keys [T, D] of one KV head, queries [G, D] of its group -> [G, P]."""
    mins, maxs = page_summaries(keys.astype(np.float64), page_size)
    if summary == "e4m3":
        mins, maxs = snap(mins, maxs)
    return np.array([page_scores(q.astype(np.float64), mins, maxs, summary) for q in queries])


def plan(tokens, page_size, token_budget, sink_pages, local_pages, dense):
    """(fixed pages, candidate pages, K), or None when every page is attended."""
    pages = num_pages(tokens, page_size)
    page_budget = token_budget // page_size
    if dense or page_budget >= pages:
        return None
    fixed = set(range(min(sink_pages, pages))) | set(range(max(0, pages - local_pages), pages))
    candidates = [p for p in range(pages) if p not in fixed]
    k = page_budget - len(fixed)
    assert 0 <= k < len(candidates) + 1, "budget smaller than sink + local"
    return fixed, candidates, k


def rankings(scores, gqa):
    """The score vectors whose top K are taken: one aggregate, or one per query head."""
    if gqa == "max":
        return [scores.max(axis=0)]
    if gqa == "mean":
        return [scores.mean(axis=0)]
    if gqa == "union":
        return list(scores)
    raise ValueError("unknown gqa mode " + gqa)


def select(k, q, page_size, token_budget, sink_pages, local_pages, gqa, dense, summary="kv"):
    """-> list over KV heads of ascending selected page indices."""
    hkv, tokens, _ = k.shape
    group = q.shape[0] // hkv
    p = plan(tokens, page_size, token_budget, sink_pages, local_pages, dense)
    if p is None:
        return [list(range(num_pages(tokens, page_size))) for _ in range(hkv)]
    fixed, candidates, top = p
    rows = []
    for h in range(hkv):
        scores = group_scores(k[h], q[h * group:(h + 1) * group], page_size, summary)
        chosen = set(fixed)
        for s in rankings(scores, gqa):
            chosen |= set(ranked(s, candidates)[:top])
        rows.append(sorted(chosen))
    return rows


def boundary_gap(k, q, page_size, token_budget, sink_pages, local_pages, gqa, dense, summary="kv"):
    """(smallest non-zero relative gap, number of exact ties) between the last
    page taken and the first page left out, over every ranking.

    A gap of exactly zero is a true tie (identical summaries), which both
    implementations must break toward the lower index; a tiny non-zero gap is
    a near-tie that float32 rounding could flip, so callers avoid such inputs.
    The gap is inf when nothing is ranked. Infinite scores (e4m3) are equal
    to each other and far from any finite one; the scale is the finite ones'.
    """
    hkv, tokens, _ = k.shape
    group = q.shape[0] // hkv
    p = plan(tokens, page_size, token_budget, sink_pages, local_pages, dense)
    smallest, ties = np.inf, 0
    if p is None:
        return smallest, ties
    _, candidates, top = p
    for h in range(hkv):
        scores = group_scores(k[h], q[h * group:(h + 1) * group], page_size, summary)
        for s in rankings(scores, gqa):
            order = ranked(s, candidates)
            if top == 0 or top >= len(order):
                continue
            finite = s[candidates][np.isfinite(s[candidates])]
            scale = max(np.abs(finite).max() if finite.size else 0.0, 1e-30)
            a, b = s[order[top - 1]], s[order[top]]
            if a > b:
                smallest = min(smallest, (a - b) / scale)
            else:
                ties += 1
    return smallest, ties


def attend(k, v, q, page_size, rows):
    """Softmax attention of every query head over its KV head's selected pages -> [Hq, D]."""
    hkv, tokens, d = k.shape
    group = q.shape[0] // hkv
    out = np.zeros((q.shape[0], d))
    for qh in range(q.shape[0]):
        h = qh // group
        idx = np.concatenate([np.arange(p * page_size, min((p + 1) * page_size, tokens)) for p in rows[h]])
        logits = k[h, idx].astype(np.float64) @ q[qh].astype(np.float64) / np.sqrt(d)
        w = np.exp(logits - logits.max())
        out[qh] = w @ v[h, idx].astype(np.float64) / w.sum()
    return out


def selection_matrix(rows):
    """Rows -> int32 [Hkv, N], padded with -1, N the longest row."""
    width = max(len(r) for r in rows)
    m = np.full((len(rows), width), -1, dtype=np.int32)
    for h, r in enumerate(rows):
        m[h, :len(r)] = r
    return m


def reference(k, v, q, page_size, token_budget, sink_pages=0, local_pages=1, gqa="max", dense=False, summary="kv"):
    """-> (O [Hq, D] float64, SEL [Hkv, N] int32), what `questkv attend` must write."""
    rows = select(k, q, page_size, token_budget, sink_pages, local_pages, gqa, dense, summary)
    return attend(k, v, q, page_size, rows), selection_matrix(rows)
