#!/usr/bin/env python3
"""The table of bench/gpu/e2e.sh: one row per e2e-<name>.json under a folder.

Columns: step p50 (all layers), its breakdown (means over the directly
launched, phase-timed steps 1, 5, 9, ...), hit rate, host-link bytes per
step, PCIe saved against dense offload, the measured dense-offload step and
Quest's speedup over it, and — for a tiered run whose all-in-HBM twin ran
(<x>-2g, <x>-8g, <x>-strict or <x>-deadline beside <x>-all, sweep-N-8th beside
sweep-N-all, <x>-nog — graphs off — beside <x>) — the step against
the twin's and whether the output digests agree."""
import json
import os
import sys


def load(folder):
    runs = {}
    for f in sorted(os.listdir(folder)):
        if f.startswith("e2e-") and f.endswith(".json"):
            with open(os.path.join(folder, f)) as fh:
                try:
                    runs[f[4:-5]] = json.load(fh)
                except json.JSONDecodeError:
                    pass
    return runs


def twin(name, runs):
    base, suffix = name, ""
    for s in ("-mma", "-16l"):  # variants of a run (e2e.sh): the twin is the same variant
        if base.endswith(s):
            base, suffix = base[: -len(s)], s + suffix
    for a, b in (("-2g", "-all"), ("-8g", "-all"), ("-8th", "-all"), ("-strict", "-all"), ("-deadline", "-all"),
                 ("-nog", ""), ("-hostgen", "-all")):
        if base.endswith(a) and base[: -len(a)] + b + suffix in runs:
            return runs[base[: -len(a)] + b + suffix]
    return None


def main():
    runs = load(sys.argv[1] if len(sys.argv) > 1 else ".")
    hdr = ("run", "ctx", "hbm GiB", "step ms", "app/sel/res/att ms", "hit %", "link MiB/step", "PCIe saved",
           "offload ms", "x offload", "vs all-HBM", "digest")
    rows = []
    for name, r in runs.items():
        steps = max(1, r["decode_steps"])
        bd = r["step_breakdown_us"]
        off = r.get("dense_offload_time", {})
        t = twin(name, runs)
        vs = ""
        if t is not None:
            vs = "%.2fx %s" % (r["step_latency_us"]["p50"] / max(1e-9, t["step_latency_us"]["p50"]),
                               "same" if t["output_digest"] == r["output_digest"] else "DIFFERENT")
        rows.append((name, "%dK" % (r["context_tokens"] // 1024), "%.1f" % (r["tiers"]["hbm"]["capacity_bytes"] / 2**30),
                     "%.2f" % (r["step_latency_us"]["p50"] / 1e3),
                     "%.2f/%.2f/%.2f/%.2f" % (bd["append"] / 1e3, bd["select"] / 1e3, bd["resolve"] / 1e3, bd["attend"] / 1e3),
                     "%.1f" % (100 * r["hbm_cache"]["hit_rate"]), "%.1f" % (r["host_link_bytes"] / steps / 2**20),
                     "%.2f%%" % (100 * r["pcie_saved"]), "%.1f" % (off.get("step_us_extrapolated", 0) / 1e3),
                     "%.1fx" % off.get("quest_speedup", 0), vs, r["output_digest"][:8]))
    widths = [max(len(str(x)) for x in col) for col in zip(hdr, *rows)] if rows else [len(h) for h in hdr]
    for row in (hdr, *rows):
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
    selection(runs)
    speculative(runs)


def sparse_selected(r):
    """Head-pages the sparse layers selected: the run's total less the dense
    layers', which select every page of the context at each step (the pages
    of ctx + step tokens, the tail's included)."""
    g = r["geometry"]
    S, ctx, dense = g["page_size"], r["context_tokens"], len(r.get("dense_layers", []))
    per_step = [dense * g["kv_heads"] * r["batch"] * ((ctx + step) // S + 1) for step in range(r["decode_steps"])]
    return r["head_pages_selected"] - sum(per_step)


def share(part, whole):
    """part as a percentage of whole, or "-" where there is no whole (every layer dense)."""
    return "%.1f" % (100 * part / whole) if whole > 0 else "-"


def later_skips(r, first=16):
    """Skipped head-pages of the steps from `first` on, as a share of those steps' selections
    (all, and the sparse layers'): a step selects the same number of head-pages at every step
    (a dense layer's page a head more every S steps), so those steps' share of the run's. The
    first steps after prefill find HBM and host holding what prefill left there."""
    steps = r.get("per_step", [])
    n = r["decode_steps"]
    if n <= first or len(steps) != n:
        return "-"
    skipped = sum(s.get("pages_skipped", 0) for s in steps[first:])
    later = (n - first) / n
    return "%.3f (%s)" % (100 * skipped / max(1, later * r["head_pages_selected"]),
                          share(skipped, later * sparse_selected(r)))


def sampled_skips(calls):
    """Skipped of selected head-pages at the diagnosed calls, and the mean attended error of those that skipped."""
    selected = sum(c["head_pages_selected"] for c in calls)
    if not selected:
        return "-"
    skipping = [c["attended_rel_error"] for c in calls if c["head_pages_skipped"] > 0]
    return "%.2f (%s)" % (100 * sum(c["head_pages_skipped"] for c in calls) / selected,
                          "%.1e" % (sum(skipping) / len(skipping)) if skipping else "-")


def selection(runs):
    """What each run selected: head-pages read (of dense), recall where sampled, adaptive budgets, and
    under `deadline` the head-pages attended without, as a share of all selections and of the
    sparse layers' (the dense layers' hundreds of thousands a step would hide them). The output
    error splits into the selection's own (exact attention over the selected pages, against dense)
    and the attended output's against that (what skipped pages and rounding cost); at the sampled
    calls, the share of selected head-pages skipped and the attended error of the calls that skipped;
    with a skip limit, the calls that waited for their cold misses instead."""
    hdr = ("run", "head-pages %", "recall mass", "out err (selection / attended)", "adaptive pages mean/P95/max",
           "at cap %",
           "skipped % (of sparse)", "from step 16", "calls waited", "sampled: skipped % (err)")
    rows = []
    for name, r in runs.items():
        rec, a = r.get("recall", {}), r.get("adaptive", {})
        sampled = rec.get("samples", 0) > 0
        ranked = a.get("rankings", 0)
        skipped = r.get("disk_events", {}).get("pages_skipped", 0)
        rows.append((name, "%.2f" % (100 * r["head_pages_selected"] / max(1, r["head_pages_total"])),
                     "%.3f" % rec["attention_mass"] if sampled else "-",
                     "%.3f (%.3f / %.1e)" % (rec["output_rel_error"], rec.get("selection_rel_error", float("nan")),
                                             rec.get("attended_rel_error", float("nan"))) if sampled else "-",
                     "%.1f/%d/%d" % (a["pages"] / ranked, a["pages_p95"], a["pages_max"]) if ranked else "-",
                     "%.1f" % (100 * a["cap_hits"] / ranked) if ranked else "-",
                     "%.3f (%s)" % (100 * skipped / max(1, r["head_pages_selected"]), share(skipped, sparse_selected(r)))
                     if skipped else "-", later_skips(r) if skipped else "-",
                     r.get("disk_events", {}).get("deadline_waits", 0) or "-",
                     sampled_skips(rec.get("calls", []))))
    if not rows:
        return
    widths = [max(len(str(x)) for x in col) for col in zip(hdr, *rows)]
    print()
    for row in (hdr, *rows):
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))


def speculative(runs):
    """Speculative runs (draft-CTX-N): tokens per second (a block keeps its
    first token and the drafts accepted after it) against draft-CTX-0, one
    token a step through the same host API."""
    spec = {n: r for n, r in runs.items() if n.startswith("draft-")}
    if not spec:
        return
    hdr = ("run", "ctx", "step ms", "append/verify/settle ms", "accepted/drafted", "tokens", "tokens/s", "vs one a step",
           "head-pages/token", "digest")
    rows = []
    for name, r in spec.items():
        s = r.get("speculative")
        p50 = r["step_latency_us"]["p50"]
        rate = s["tokens_per_s"] if s else 1e6 / max(1e-9, p50)
        tokens = s["tokens"] if s else max(1, r["decode_steps"])
        base = spec.get("-".join(name.split("-")[:2]) + "-0")  # draft-CTX-0: sparse, one a step
        vs = ""
        if base is not None:
            vs = "%.2fx" % (rate / (1e6 / max(1e-9, base["step_latency_us"]["p50"])))
        split = "-"
        if s and "append_seconds" in s:
            blocks = max(1, r["decode_steps"])
            split = "/".join("%.2f" % (1e3 * s[k] / blocks) for k in ("append_seconds", "verify_seconds", "settle_seconds"))
        rows.append((name, "%dK" % (r["context_tokens"] // 1024), "%.2f" % (p50 / 1e3), split,
                     "%d/%d" % (s["accepted"], s["drafted"]) if s else "-", str(tokens), "%.1f" % rate, vs,
                     "%.0f" % (r["head_pages_selected"] / max(1, tokens)), r["output_digest"][:8]))
    widths = [max(len(str(x)) for x in col) for col in zip(hdr, *rows)]
    print()
    for row in (hdr, *rows):
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))


if __name__ == "__main__":
    main()
