#!/usr/bin/python3
"""PNG plots of bench/gpu/e2e.sh's sweep, from its e2e-*.json reports.

    /usr/bin/python3 bench/plot_e2e.py RESULTS_DIR OUT_PREFIX

writes OUT_PREFIX-time.png (step time per component against context length,
every page in HBM and an HBM budget of 1/8 of the K/V, with the measured
dense-offload step and the crossover where Quest starts to pay) and
OUT_PREFIX-bytes.png (bytes per step on each link against context length,
against dense offload). Needs matplotlib (Debian: python3-matplotlib).
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(folder):
    runs = {}
    for f in os.listdir(folder):
        if f.startswith("e2e-sweep-") and f.endswith(".json"):
            _, _, ctx, kind = f[:-5].split("-")
            with open(os.path.join(folder, f)) as fh:
                runs[(int(ctx), kind)] = json.load(fh)
    return runs


def series(runs, kind, fn):
    pts = sorted((ctx, fn(r)) for (ctx, k), r in runs.items() if k == kind)
    return [p[0] for p in pts], [p[1] for p in pts]


def crossover(xs, quest, dense):
    """First context at which Quest's step is faster than dense offload's."""
    for x, q, d in zip(xs, quest, dense):
        if q < d:
            return x
    return None


def main():
    folder, prefix = sys.argv[1], sys.argv[2]
    runs = load(folder)
    if not runs:
        sys.exit("no e2e-sweep-*.json under " + folder)
    step_ms = lambda r: r["step_latency_us"]["p50"] / 1e3
    part = lambda key: (lambda r: r["step_breakdown_us"][key] / 1e3)
    offload_ms = lambda r: r.get("dense_offload_time", {}).get("step_us_extrapolated", 0) / 1e3

    fig, ax = plt.subplots(figsize=(8, 5))
    for kind, style in (("all", "-"), ("8th", "--")):
        label = "all pages in HBM" if kind == "all" else "HBM = 1/8 of K/V"
        xs, ys = series(runs, kind, step_ms)
        ax.plot(xs, ys, "k" + style, marker="o", label="Quest step, " + label)
        for key, color in (("select", "tab:blue"), ("resolve", "tab:orange"), ("attend", "tab:green"),
                           ("append", "tab:gray")):
            xs, ys = series(runs, kind, part(key))
            ax.plot(xs, ys, style, color=color, marker=".", label=key + (", " + label if kind == "all" else ""))
    xs, dense = series(runs, "all", offload_ms)
    ax.plot(xs, dense, "r-", marker="s", label="dense offload (measured transfer)")
    qx, quest = series(runs, "8th", step_ms)
    cx = crossover(qx, quest, [dict(zip(xs, dense)).get(x, 0) for x in qx])
    if cx:
        ax.axvline(cx, color="r", alpha=0.3)
        # Between the two curves at the crossover, clear of the legend above.
        at = (dict(zip(qx, quest))[cx] * dict(zip(xs, dense))[cx]) ** 0.5
        ax.annotate(" Quest (1/8 HBM) pays from %dK" % (cx // 1024), (cx, at), color="r")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("ms per decode step (32 layers, batch 1)")
    ax.set_title("questkv --backend cuda, Llama-3-8B, budget 2048 tokens, H200")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(prefix + "-time.png", dpi=110)

    fig, ax = plt.subplots(figsize=(8, 5))
    mib = lambda v: v / 2**20
    for kind, style in (("all", "-"), ("8th", "--")):
        label = "all in HBM" if kind == "all" else "HBM = 1/8"
        xs, ys = series(runs, kind, lambda r: mib(r["bytes_moved"]["host_to_hbm"]) / max(1, r["decode_steps"]))
        ax.plot(xs, ys, "b" + style, marker="o", label="host→HBM, " + label)
        xs, ys = series(runs, kind, lambda r: mib(r["bytes_moved"]["hbm_to_host"]) / max(1, r["decode_steps"]))
        ax.plot(xs, ys, "g" + style, marker=".", label="HBM→host (seals), " + label)
    xs, ys = series(runs, "all", lambda r: mib(r["dense_offload_bytes"]) / max(1, r["decode_steps"]))
    ax.plot(xs, ys, "r-", marker="s", label="dense offload (every page, every step)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("MiB per decode step")
    ax.set_title("bytes per link per step (Llama-3-8B, budget 2048 tokens)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(prefix + "-bytes.png", dpi=110)


if __name__ == "__main__":
    main()
