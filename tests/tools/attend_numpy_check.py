"""Checks `questkv attend` against the NumPy reference (attend_reference.py).

usage: /usr/bin/python3 attend_numpy_check.py path/to/questkv [--cases N] [--seed S] [--verbose]

For many seeded random cases (geometries, page sizes around T, float16 and
float32 inputs, the three GQA modes, sink/local mixes, dense, planted ties,
exact and E4M3 summaries, keys past E4M3's +-448) it
writes K/V/Q with NumPy, runs the binary, and requires the same selected pages
exactly and outputs within 1e-4 relative (L2 per query head). A few bad inputs
must fail with the documented exit codes. Prints one summary line; exits 1 on
any mismatch.
"""

import argparse
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
except ImportError:
    sys.stderr.write("attend_numpy_check: FAILED: %s cannot import numpy; install it for this interpreter "
                     "(Debian: apt-get install python3-numpy)\n" % sys.executable)
    sys.exit(1)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attend_reference as ref  # noqa: E402

REL_TOL = 1e-4
# Inputs whose top-K boundary has a non-zero relative gap below this are
# regenerated: float32 scoring may legitimately order such near-ties either way.
NEAR_TIE = 1e-4
GEOMETRIES = [(1, 1, 8), (2, 1, 16), (4, 2, 32), (6, 2, 64), (8, 8, 16), (8, 2, 128), (3, 3, 5), (12, 4, 24),
              (4, 1, 7)]
PAGE_SIZES = [1, 2, 3, 5, 7, 8, 16, 17]


def make_case(rng, index):
    hq, hkv, d = GEOMETRIES[rng.integers(len(GEOMETRIES))]
    s = int(PAGE_SIZES[rng.integers(len(PAGE_SIZES))])
    # One case in three sits at a page edge (T = 1, S-1, S, S+1); the rest
    # span many pages so that selection has a choice to make.
    t_kind = index % 12
    t = {0: 1, 1: max(1, s - 1), 2: s, 3: s + 1}.get(t_kind, int(rng.integers(2 * s, 40 * s + 1)))
    pages = ref.num_pages(t, s)
    sink = int(rng.integers(0, 4))
    local = int(rng.integers(1, 5))
    dense = rng.random() < 0.1
    # Budget from "just sink + local" to "more than every page", plus a remainder.
    low = sink + local
    if rng.random() < 0.25:
        page_budget = low + int(rng.integers(0, max(1, pages + 2 - low)))
    else:
        page_budget = low + int(rng.integers(0, max(1, min(pages - low, 12))))
    budget = page_budget * s + int(rng.integers(0, s))
    return dict(hq=hq, hkv=hkv, d=d, s=s, t=t, sink=sink, local=local, dense=dense,
                gqa=ref.GQA_MODES[index % 3], budget=budget,
                kv_dtype=np.float16 if rng.random() < 0.35 else np.float32,
                q_dtype=np.float16 if rng.random() < 0.25 else np.float32,
                ties=rng.random() < 0.15, plant=rng.random() < 0.5,
                # Decided by the index, so the random draws of the other cases stay as they were.
                summary="e4m3" if index % 4 == 3 else "kv", beyond=index % 8 == 7)


def make_inputs(case, rng):
    hq, hkv, d, s, t = case["hq"], case["hkv"], case["d"], case["s"], case["t"]
    scale = float(rng.choice([0.3, 1.0, 3.0]))
    k = rng.standard_normal((hkv, t, d)) * scale
    v = rng.standard_normal((hkv, t, d))
    q = rng.standard_normal((hq, d))
    full_pages = t // s
    if case["plant"] and full_pages > 2:
        # A few pages holding keys aligned with their group's queries, so
        # selection has something to find.
        group = hq // hkv
        for h in range(hkv):
            for p in rng.choice(full_pages, size=min(3, full_pages), replace=False):
                row = p * s + int(rng.integers(s))
                k[h, row] += 2.0 * q[h * group:(h + 1) * group].mean(axis=0)
    if case["beyond"]:
        # A few key elements past E4M3's range: their bounds become infinite.
        for _ in range(3):
            h, row, j = int(rng.integers(hkv)), int(rng.integers(t)), int(rng.integers(d))
            k[h, row, j] = float(rng.choice([-1.0, 1.0])) * float(rng.uniform(500.0, 1000.0))
    if case["ties"] and full_pages > 3:
        # Copies of one full page into several others: identical summaries, so
        # exactly equal scores that must go to the lower page index.
        src = int(rng.integers(full_pages))
        for dst in rng.choice(full_pages, size=min(full_pages - 1, 6), replace=False):
            k[:, dst * s:(dst + 1) * s] = k[:, src * s:(src + 1) * s]
    return k.astype(case["kv_dtype"]), v.astype(case["kv_dtype"]), q.astype(case["q_dtype"])


def rel_error(got, want):
    """L2 relative error per query head."""
    return np.linalg.norm(got - want, axis=1) / np.maximum(np.linalg.norm(want, axis=1), 1e-30)


def run(binary, args):
    return subprocess.run([binary, "attend"] + args, capture_output=True, text=True)


def check_case(binary, tmp, case, k, v, q):
    """-> (list of problems, worst relative error)."""
    paths = {n: os.path.join(tmp, n + ".npy") for n in ("k", "v", "q", "o", "sel")}
    np.save(paths["k"], k)
    np.save(paths["v"], v)
    np.save(paths["q"], q)
    args = ["--keys", paths["k"], "--values", paths["v"], "--query", paths["q"], "--page-size", str(case["s"]),
            "--token-budget", str(case["budget"]), "--sink-pages", str(case["sink"]),
            "--local-pages", str(case["local"]), "--gqa", case["gqa"], "--output", paths["o"],
            "--selected", paths["sel"], "--summary-dtype", case["summary"]]
    if case["dense"]:
        args.append("--dense")
    r = run(binary, args)
    if r.returncode != 0:
        return ["exit %d: %s" % (r.returncode, r.stderr.strip())], np.inf
    k32, v32, q32 = (x.astype(np.float32) for x in (k, v, q))
    want_o, want_sel = ref.reference(k32, v32, q32, case["s"], case["budget"], case["sink"], case["local"],
                                     case["gqa"], case["dense"], case["summary"])
    got_o, got_sel = np.load(paths["o"]), np.load(paths["sel"])
    problems = []
    if got_sel.dtype != np.int32 or got_sel.shape != want_sel.shape or not np.array_equal(got_sel, want_sel):
        problems.append("selection differs:\n  got  %s\n  want %s" % (got_sel.tolist(), want_sel.tolist()))
    if got_o.dtype != np.float32 or got_o.shape != want_o.shape:
        problems.append("output dtype/shape %s %s, want float32 %s" % (got_o.dtype, got_o.shape, want_o.shape))
        return problems, np.inf
    err = rel_error(got_o, want_o)
    worst = float(err.max())
    if worst > REL_TOL:
        problems.append("output relative error %.3g > %g (per query head: %s)" %
                        (worst, REL_TOL, np.array2string(err, precision=2)))
    if problems and got_sel.ndim == 2 and got_sel.shape[0] == k.shape[0]:
        # Tell an output error apart from a selection error: is the output at
        # least attention over the pages the binary says it chose?
        rows = [[int(p) for p in row if p >= 0] for row in got_sel]
        if all(rows) and all(0 <= p < ref.num_pages(case["t"], case["s"]) for r in rows for p in r):
            own = float(rel_error(got_o, ref.attend(k32, v32, q32, case["s"], rows)).max())
            problems.append("output vs attention over its own SEL: relative error %.3g" % own)
    return problems, worst


def describe(case):
    return ("Hq %(hq)d Hkv %(hkv)d D %(d)d S %(s)d T %(t)d B %(budget)d sink %(sink)d local %(local)d "
            "gqa %(gqa)s dense %(dense)s summary %(summary)s beyond %(beyond)s" % case) + " kv %s q %s ties %s" % (
                np.dtype(case["kv_dtype"]).name, np.dtype(case["q_dtype"]).name, case["ties"])


def check_errors(binary, tmp):
    """Bad inputs through the real binary: exit codes and messages.
    -> (number of checks, list of problems)."""
    problems, checks = [], []
    paths = {n: os.path.join(tmp, n + ".npy") for n in ("k", "v", "q", "o")}
    rng = np.random.default_rng(7)
    k = rng.standard_normal((2, 20, 8)).astype(np.float32)
    q = rng.standard_normal((4, 8)).astype(np.float32)
    base = ["--keys", paths["k"], "--values", paths["v"], "--query", paths["q"], "--page-size", "4",
            "--token-budget", "8", "--output", paths["o"]]

    def expect(name, args, code, needle, files):
        for n, a in files.items():
            np.save(paths[n], a)
        checks.append(name)
        r = run(binary, args)
        if r.returncode != code or needle not in r.stderr:
            problems.append("%s: exit %d (want %d), stderr %r (want %r)" % (name, r.returncode, code, r.stderr, needle))

    ok = dict(k=k, v=k, q=q)
    nan_k = k.copy()
    nan_k[1, 2, 3] = np.nan
    expect("NaN key", base, 1, "NaN", dict(ok, k=nan_k))
    expect("inf query", base, 1, "infinite", dict(ok, q=np.full((4, 8), np.inf, np.float32)))
    expect("shape mismatch", base, 1, "same shape", dict(ok, v=k[:, :19]))
    expect("float64", base, 1, "unsupported dtype '<f8'", dict(ok, k=k.astype(np.float64)))
    expect("fortran order", base, 1, "Fortran", dict(ok, k=np.asfortranarray(k)))
    expect("big-endian", base, 1, "big-endian", dict(ok, k=k.astype(">f4")))
    expect("budget below sink + local", base + ["--sink-pages", "1", "--local-pages", "2"], 2, "fewer than", ok)
    expect("unknown summary dtype", base + ["--summary-dtype", "int4"], 2, "--summary-dtype", ok)
    expect("missing flag", base[2:], 2, "missing required flag --keys", ok)
    return len(checks), problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("binary")
    ap.add_argument("--cases", type=int, default=360)
    ap.add_argument("--seed", type=int, default=20240611)
    ap.add_argument("--verbose", action="store_true")
    opts = ap.parse_args()
    if not os.access(opts.binary, os.X_OK):
        sys.stderr.write("attend_numpy_check: FAILED: %s is not an executable\n" % opts.binary)
        return 1

    failures, worst, regenerated, boundary_ties, bad_cases = [], 0.0, 0, 0, 0
    counts = dict(f16=0, dense=0, ties=0, sparse=0, e4m3=0)
    with tempfile.TemporaryDirectory(prefix="questkv_attend_check_") as tmp:
        for i in range(opts.cases):
            rng = np.random.default_rng([opts.seed, i])
            case = make_case(rng, i)
            for attempt in range(50):
                k, v, q = make_inputs(case, rng)
                kq = (k.astype(np.float32), q.astype(np.float32))
                gap, ties = ref.boundary_gap(kq[0], kq[1], case["s"], case["budget"], case["sink"], case["local"],
                                             case["gqa"], case["dense"], case["summary"])
                if gap >= NEAR_TIE:
                    boundary_ties += ties
                    break
                regenerated += 1
            else:
                failures.append("case %d (%s): no input without near-ties in 50 draws" % (i, describe(case)))
                bad_cases += 1
                continue
            problems, err = check_case(opts.binary, tmp, case, k, v, q)
            worst = max(worst, err)
            counts["f16"] += case["kv_dtype"] == np.float16 or case["q_dtype"] == np.float16
            counts["dense"] += bool(case["dense"])
            counts["ties"] += bool(case["ties"])
            counts["e4m3"] += case["summary"] == "e4m3"
            counts["sparse"] += ref.plan(case["t"], case["s"], case["budget"], case["sink"], case["local"],
                                         case["dense"]) is not None
            if opts.verbose:
                print("case %d: %s: %s, err %.2g" % (i, describe(case), "ok" if not problems else "MISMATCH", err))
            bad_cases += bool(problems)
            for p in problems:
                failures.append("case %d (seed [%d, %d]; %s): %s" % (i, opts.seed, i, describe(case), p))
        error_checks, error_problems = check_errors(opts.binary, tmp)
    failures += ["bad input: " + p for p in error_problems]
    bad_cases += len(error_problems)

    for f in failures[:20]:
        sys.stderr.write(f + "\n")
    print("attend_numpy_check: %s: %d cases (%d sparse, %d dense, %d with float16, %d with planted ties, "
          "%d with E4M3 summaries; %d exact ties at a top-K boundary, %d near-tie draws redrawn), %d bad-input "
          "checks, %d failing, worst output rel error %.2g (tol %g)" %
          ("FAILED" if failures else "ok", opts.cases, counts["sparse"], counts["dense"], counts["f16"],
           counts["ties"], counts["e4m3"], boundary_ties, regenerated, error_checks, bad_cases, worst, REL_TOL))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
