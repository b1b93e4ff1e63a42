#!/usr/bin/python3
"""Quest's quality cost on a real model: tinylm (shared/models/tinylm) reads
C/C++ headers it never saw, with questkv's attention in place of its own.

Held-out text: every header under --include (suffixes .h .hh .hpp .hxx),
sorted by path and concatenated. --windows windows of --window bytes, evenly
spaced over it; each window's first W-S bytes are prefilled in PyTorch and
appended to questkv, its last --steps S positions decoded teacher-forced.
Runs, each on a fresh questkv.Runtime per window:

  reference   PyTorch's dense causal attention (no questkv)
  dense       questkv decode, every layer dense
  quest-B     questkv decode, Quest at token budget B (layers 0-1 dense,
              1 sink + 8 local pages), for each B in --budgets
  quest-B-blockN, quest-B-blockN-shared
              with --blocks N: the same positions N at a time through
              DecodeBlock (a speculative verifier's calls, every draft
              accepted), pages per position or one page set a block

Prints a table; --json PATH writes every figure. Example (2-core VM, minutes):
  /usr/bin/python3 bench/tinylm_eval.py --windows 2 --window 4096 --steps 64
With --backend cuda the model runs on the GPU and questkv's CUDA backend holds
the K/V in --kv-dtype (f16 or bf16).
"""
import argparse
import hashlib
import importlib.util
import json
import os
import sys
import time

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SUFFIXES = (".h", ".hh", ".hpp", ".hxx")
KV_ELEMS_PER_TOKEN = 6 * 2 * 2 * 64  # layers × (K, V) × Hkv × D
KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=os.path.join(REPO, "..", "shared", "models", "tinylm"))
    p.add_argument("--pythonpath", default=os.environ.get("QUESTKV_PYTHONPATH", os.path.join(REPO, "build", "python")),
                   help="folder holding the built questkv package (default $QUESTKV_PYTHONPATH or build/python)")
    p.add_argument("--include", default="/usr/include", help="root of the held-out headers")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--window", type=int, default=8192, help="W, tokens per window")
    p.add_argument("--steps", type=int, default=128, help="S, decoded positions at the end of each window")
    p.add_argument("--budgets", default="256,512,1024", help="Quest token budgets, comma-separated")
    p.add_argument("--reranks", default="", help="re-rank factors run beside plain Quest at each budget, "
                   "comma-separated (SelectionPolicy::rerank; 1e6 is the exact-page-max oracle)")
    p.add_argument("--page-size", type=int, default=16, help="tokens a page; sink and local windows keep "
                   "16 and 128 tokens")
    p.add_argument("--summary-dtype", default="kv", help="kv (the K/V dtype) or e4m3")
    p.add_argument("--adaptive", default="", help="unread bound-mass shares run as adaptive budgets beside "
                   "plain Quest at each budget (the cap), comma-separated (SelectionPolicy::unread_bound_mass)")
    p.add_argument("--adaptive-floor", type=int, default=0, help="the adaptive budgets' floor, tokens")
    p.add_argument("--group-pages", type=int, default=0, help="the exact hierarchical scan's group size for "
                   "the sparse runs (SelectionPolicy::group_pages; 0: the flat scan)")
    p.add_argument("--hbm-bytes", type=int, default=0, help="0: room for every page")
    p.add_argument("--host-bytes", type=int, default=0, help="0: room for every page")
    p.add_argument("--disk-dir", default="")
    p.add_argument("--disk-bytes", type=int, default=0)
    p.add_argument("--cold-miss", default="strict", choices=("strict", "deadline"),
                   help="a selected page on disk: wait for it (strict) or attend without it this step (deadline)")
    p.add_argument("--deadline-skip-limit", type=float, default=1.0,
                   help="deadline: a call whose cold misses pass this share of its selection waits for them")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--blocks", type=int, default=0, help="also decode the steps in blocks of N (0: no)")
    p.add_argument("--backend", default="cpu", choices=("cpu", "cuda"),
                   help="questkv's backend; cuda also runs the model on the GPU")
    p.add_argument("--kv-dtype", default="f16", choices=("f16", "bf16"), help="the CUDA backend's K/V dtype")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.windows < 1 or args.steps < 1 or args.window <= args.steps:
        p.error("need --windows >= 1 and --window > --steps >= 1")
    return args


def load_modules(pythonpath):
    """questkv from the build, tinylm from this source tree."""
    sys.path.insert(0, pythonpath)
    try:
        import questkv
    except Exception as e:
        sys.exit(f"tinylm_eval: cannot import questkv from {pythonpath} ({type(e).__name__}: {e})")
    spec = importlib.util.spec_from_file_location("questkv_tinylm", os.path.join(REPO, "python", "questkv", "tinylm.py"))
    tinylm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tinylm)
    return questkv, tinylm


def header_files(root):
    """(path, size) of every header under root, sorted by path."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs.sort()
        for name in names:
            path = os.path.join(folder, name)
            if name.endswith(SUFFIXES) and os.path.isfile(path) and not os.path.islink(path):
                found.append((path, os.path.getsize(path)))
    return sorted(found)


def read_span(files, start, length):
    """Bytes start..start+length-1 of the files' concatenation."""
    out, offset = bytearray(), 0
    for path, size in files:
        if offset + size > start and len(out) < length:
            with open(path, "rb") as f:
                f.seek(max(0, start - offset))
                out += f.read(length - len(out))
        offset += size
    return bytes(out)


def windows(files, count, length):
    total = sum(size for _, size in files)
    if total < length:
        sys.exit(f"tinylm_eval: the headers hold {total} bytes, fewer than one window of {length}")
    starts = [i * (total - length) // max(count - 1, 1) for i in range(count)]
    return total, [(s, read_span(files, s, length)) for s in starts]


def runtime_config(args, budget, rerank=0.0, unread=0.0, blocks="per-position"):
    return dict(block_selection=blocks, rerank=rerank, unread_bound_mass=unread, adaptive_floor=args.adaptive_floor if unread else 0,
                group_pages=args.group_pages if budget else 0, layers=6, q_heads=6, kv_heads=2,
                head_dim=64, page_size=args.page_size,
                summary_dtype=args.summary_dtype, token_budget=budget or 256,
                sink_pages=max(1, 16 // args.page_size), local_pages=max(1, 128 // args.page_size),
                dense_layers=range(6) if budget is None else [0, 1], gqa="max",
                hbm_bytes=args.hbm_bytes, host_bytes=args.host_bytes, disk_dir=args.disk_dir,
                disk_bytes=args.disk_bytes, cold_miss=args.cold_miss, deadline_skip_limit=args.deadline_skip_limit,
                backend=args.backend, dtype=kv_dtype(args))


def kv_dtype(args):
    """The runtime's K/V dtype: float32 on the CPU backend."""
    return "f32" if args.backend == "cpu" else args.kv_dtype


class LayerCounts:
    """A questkv.Runtime whose decode calls also count, per layer, the
    head-pages they selected and the cold misses they attended without."""

    def __init__(self, rt):
        self.rt, self.selected, self.skipped = rt, {}, {}

    def __getattr__(self, name):
        return getattr(self.rt, name)

    def decode(self, seqs, layer, q):
        before = self.rt.stats()
        out = self.rt.decode(seqs, layer, q)
        after = self.rt.stats()
        for key, counts in (("head_pages_selected", self.selected), ("pages_skipped", self.skipped)):
            counts[layer] = counts.get(layer, 0) + after[key] - before[key]
        return out


def decode_figures(r, counts=None):
    """What one questkv run moved and read during its decode steps."""
    before, after = r.prefill_stats, r.stats
    delta = {k: after[k] - before[k] for k in ("bytes_host_to_hbm", "bytes_hbm_to_host", "bytes_disk_to_host",
                                               "head_pages_selected", "head_pages_total", "kv_bytes_read",
                                               "summary_bytes_read", "rerank_key_bytes", "cold_misses",
                                               "cold_stalls", "pages_skipped", "deadline_waits")}
    adaptive = {k: after[k] for k in ("adaptive_rankings", "adaptive_pages", "adaptive_pages_max", "adaptive_cap_hits",
                                      "adaptive_pages_p95")}
    return dict(loss=r.loss, ms_per_token=r.ms_per_token, questkv_ms_per_token=r.questkv_ms_per_token, **delta,
                **adaptive, layer_selected=[counts.selected.get(l, 0) if counts else 0 for l in range(6)],
                layer_skipped=[counts.skipped.get(l, 0) if counts else 0 for l in range(6)])


def evaluate(args, questkv, tinylm, model, spans):
    budgets = [int(b) for b in args.budgets.split(",")]
    reranks = [float(c) for c in args.reranks.split(",") if c]
    unreads = [float(e) for e in args.adaptive.split(",") if e]
    configs = [("dense", None, 0.0, 0.0, 0, "per-position")]
    for b in budgets:
        configs += [(f"quest-{b}", b, 0.0, 0.0, 0, "per-position")]
        configs += [(f"rerank{c:g}-{b}", b, c, 0.0, 0, "per-position") for c in reranks]
        configs += [(f"adaptive{e:g}-{b}", b, 0.0, e, 0, "per-position") for e in unreads]
        if args.blocks:
            n = args.blocks
            configs += [(f"quest-{b}-block{n}", b, 0.0, 0.0, n, "per-position"),
                        (f"quest-{b}-block{n}-shared", b, 0.0, 0.0, n, "shared")]
    runs = {"reference": []} | {name: [] for name, *_ in configs}
    prefill = args.window - args.steps
    for i, (start, data) in enumerate(spans):
        t0 = time.perf_counter()
        cache = tinylm.prefill_cache(model, data, prefill)
        runs["reference"].append(dict(loss=tinylm.reference_loss(model, data, prefill, args.steps, cache=cache)))
        for name, budget, rerank, unread, block, selection in configs:
            rt = questkv.Runtime(**runtime_config(args, budget, rerank, unread, selection))
            if args.disk_dir and not block:  # (two stats() calls a layer: not in the in-memory runs' timings)
                rt = LayerCounts(rt)
            if block:
                r = tinylm.questkv_block_loss(model, rt, data, prefill, args.steps, block, cache=cache,
                                              kv_dtype=KV_DTYPES[kv_dtype(args)])
            else:
                r = tinylm.questkv_loss(model, rt, data, prefill, args.steps, cache=cache,
                                        kv_dtype=KV_DTYPES[kv_dtype(args)])
            runs[name].append(decode_figures(r, rt if isinstance(rt, LayerCounts) else None))
            del rt
        print(f"window {i + 1}/{len(spans)} at byte {start}: reference {runs['reference'][-1]['loss']:.4f}, "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return runs


def mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


def print_table(args, runs):
    dense = mean(runs["dense"], "loss")
    offload_mib = args.window * KV_ELEMS_PER_TOKEN * torch.empty(0, dtype=KV_DTYPES[kv_dtype(args)]).element_size() / 2**20
    print(f"tinylm, {args.windows} windows of {args.window} tokens, last {args.steps} decoded; means over windows")
    print("| run | loss (nats/byte) | vs dense | step ms/token | of which questkv | "
          "pages attended | K/V read KiB/token | summaries read KiB/token | "
          "read KiB/token (K/V + summaries + re-rank keys) | host→hbm KiB/token |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, rows in runs.items():
        loss = mean(rows, "loss")
        if name == "reference":
            print(f"| {name} | {loss:.4f} | {loss - dense:+.4f} | — | — | all | — | — | — | — |")
            continue
        steps = args.steps
        pages = sum(r["head_pages_selected"] for r in rows) / sum(r["head_pages_total"] for r in rows)
        print(f"| {name} | {loss:.4f} | {loss - dense:+.4f} | {mean(rows, 'ms_per_token'):.2f} | "
              f"{mean(rows, 'questkv_ms_per_token'):.2f} | {100 * pages:.1f}% | "
              f"{mean(rows, 'kv_bytes_read') / steps / 1024:.0f} | "
              f"{mean(rows, 'summary_bytes_read') / steps / 1024:.0f} | "
              f"{(mean(rows, 'kv_bytes_read') + mean(rows, 'summary_bytes_read') + mean(rows, 'rerank_key_bytes')) / steps / 1024:.0f} | "
              f"{mean(rows, 'bytes_host_to_hbm') / steps / 1024:.1f} |")
    print(f"A dense offload would move {offload_mib:.1f} MiB of K/V a token at this context.")
    missed = [(name, rows) for name, rows in runs.items() if name != "reference" and sum(r["cold_misses"] for r in rows)]
    if missed:
        print(f"\nCold misses ({args.cold_miss}): selected head-pages whose home was disk, over every window")
        print("| run | head-pages selected | cold misses | of them attended without | share skipped | "
              "calls that waited | skipped by layer 0-5 |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for name, rows in missed:
            sel, cold, skipped, waits = (sum(r[k] for r in rows) for k in ("head_pages_selected", "cold_misses",
                                                                            "pages_skipped", "deadline_waits"))
            layers = " / ".join(f"{100 * sum(r['layer_skipped'][l] for r in rows) / max(1, sum(r['layer_selected'][l] for r in rows)):.1f}%"
                                for l in range(6))
            print(f"| {name} | {sel} | {cold} | {skipped} | {100 * skipped / sel:.2f}% | {waits} | {layers} |")
    adaptive = [(name, rows) for name, rows in runs.items() if rows and rows[0].get("adaptive_rankings")]
    if adaptive:
        print("\nAdaptive budgets: query-aware pages per ranking (beside sink and local), over every window")
        print("| run | mean | P95 (max over windows) | max | at the cap |")
        print("| --- | --- | --- | --- | --- |")
        for name, rows in adaptive:
            n = sum(r["adaptive_rankings"] for r in rows)
            print(f"| {name} | {sum(r['adaptive_pages'] for r in rows) / n:.1f} | "
                  f"{max(r['adaptive_pages_p95'] for r in rows)} | {max(r['adaptive_pages_max'] for r in rows)} | "
                  f"{100 * sum(r['adaptive_cap_hits'] for r in rows) / n:.1f}% |")


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    questkv, tinylm = load_modules(args.pythonpath)
    model = tinylm.load(args.model_dir, "cuda" if args.backend == "cuda" else "cpu")
    files = header_files(args.include)
    total, spans = windows(files, args.windows, args.window + 1)
    runs = evaluate(args, questkv, tinylm, model, spans)
    print_table(args, runs)
    if args.json:
        corpus = dict(root=args.include, files=len(files), bytes=total,
                      windows=[dict(start=s, sha256=hashlib.sha256(d).hexdigest()) for s, d in spans])
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), torch_threads=torch.get_num_threads(), corpus=corpus, runs=runs), f, indent=1)


if __name__ == "__main__":
    main()
