"""Dense decode attention through PyTorch's scaled_dot_product_attention (flash and cuDNN
backends, fp16, D 128) for the geometries, batches and contexts of gpu_kernels_bench's `step`
rows, measured like the C++ bench (CUDA events, a 512 MiB L2-flushing fill before each call,
3 warm-ups, median of --reps), called directly and replayed from a CUDA graph. With --bench-json (the C++ bench's JSON lines) it prints the
comparison table last: the whole Quest step (append + select + resolve + attend) vs the best of
our dense kernel and SDPA, speedup vs the ideal 1/rho, and the crossover context below which
dense is faster.
usage: python3 bench/gpu/sdpa_baseline.py [--bench-json $OUT/bench.json [--bench-json $OUT/bench-e4m3.json]] [--reps 15]"""
import argparse, json, math, os
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

ap = argparse.ArgumentParser()
ap.add_argument("--bench-json", action="append", help="the C++ bench's JSON lines; repeat for several runs")
ap.add_argument("--reps", type=int, default=15)
args = ap.parse_args()
dev = "cuda"
S, D, BUDGET = 16, 128, 2048
GEOS = [("llama2-7b", 32, 32), ("llama3-8b", 32, 8)]
CTXS = [8192, 32768, 131072, 524288, 1048576]
flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)


def median_us(fn, reps):
    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = []
    for i in range(reps):
        flush.fill_(i & 0xFF)
        a.record(); fn(); b.record(); b.synchronize()
        t.append(a.elapsed_time(b) * 1e3)
    t.sort()
    return t[len(t) // 2]


def graph_us(fn, reps):
    """median_us of the replays of a CUDA graph that captures fn() (the C++ bench's graph column)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return median_us(g.replay, reps)


rows = []
for name, hq, hkv in GEOS:
    for B in (1, 16):
        for T in CTXS:
            kv_bytes = 2 * B * hkv * T * D * 2
            if kv_bytes > 40e9:
                continue
            g = torch.Generator(device=dev).manual_seed(T + B)
            k = torch.empty(B, hkv, T, D, device=dev, dtype=torch.float16).uniform_(-1, 1, generator=g)
            v = torch.empty_like(k).uniform_(-1, 1, generator=g)
            q = torch.empty(B, hq, 1, D, device=dev, dtype=torch.float16).uniform_(-1, 1, generator=g)
            res = {"geometry": name, "batch": B, "context": T, "kv_bytes": kv_bytes}
            for bname, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    def f(be=be):
                        with sdpa_kernel(be):
                            return F.scaled_dot_product_attention(q, k, v, enable_gqa=(hq != hkv))
                    res[bname + "_us"] = median_us(f, args.reps)
                except Exception as e:  # a backend may refuse a shape
                    res[bname + "_us"] = None
                    res[bname + "_err"] = str(e)[:100]
                try:
                    res[bname + "_graph_us"] = graph_us(f, args.reps) if res[bname + "_us"] else None
                except Exception as e:  # or its capture
                    res[bname + "_graph_us"] = None
                    res[bname + "_graph_err"] = str(e)[:100]
            rows.append(res)
            print(f"sdpa {name:9s} b={B:<2d} ctx={T:<7d} flash {res['flash_us'] or float('nan'):9.1f} us  "
                  f"cudnn {res['cudnn_us'] or float('nan'):9.1f} us  graphs: flash "
                  f"{res['flash_graph_us'] or float('nan'):9.1f} cudnn {res['cudnn_graph_us'] or float('nan'):9.1f}",
                  flush=True)
            del k, v, q
            torch.cuda.empty_cache()
out = os.environ.get("OUT", ".")
json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows},
          open(os.path.join(out, "sdpa_baseline.json"), "w"), indent=1)

def step_table(path):
    steps, summary_dtype = {}, "f16"
    for line in open(path):
        r = json.loads(line)
        if r.get("bench") == "step":
            steps[(r["geometry"], r["batch"], r["context"])] = r
        elif r.get("bench") == "device":
            summary_dtype = r.get("summary_dtype", "f16")
    # The ideal 1/rho (seed eq. 12) counts summaries at 1/S of the K/V bytes, as f16
    # summaries over f16 K/V are; 1-byte E4M3 summaries are half that, so their byte-count ideal,
    # 1/(1/(2S) + B/N), is printed beside it.
    summary_share = 0.5 if summary_dtype == "e4m3" else 1.0
    print(f"\n== Quest step (append + select + resolve + attend, all hits; budget {BUDGET}, S={S}, {summary_dtype} "
          f"summaries) vs dense decode attention; us, medians, cold L2 ==")
    print(f"{'geometry':9s} {'b':>2s} {'ctx':>8s} {'step':>8s} {'sel+att':>8s} {'own dense':>10s} {'flash':>9s} "
          f"{'cudnn':>9s} {'vs best':>8s} {'ideal':>6s} {'% ideal':>8s} {'sel+att %':>9s} {'graph step':>10s} {'% ideal':>8s}"
          + (f" {'byte ideal':>10s} {'%':>5s}" if summary_share != 1.0 else ""))
    cross = {}
    for r in rows:
        key = (r["geometry"], r["batch"], r["context"])
        st = steps.get(key)
        if not st or "whole_us" not in st:
            continue
        sdpa = min(x for x in (r["flash_us"], r["cudnn_us"]) if x) if (r["flash_us"] or r["cudnn_us"]) else math.nan
        best_dense = min(st["dense_us"], sdpa)
        ideal = 1.0 / (1.0 / S + min(1.0, BUDGET / r["context"]))
        byte_ideal = 1.0 / (summary_share / S + min(1.0, BUDGET / r["context"]))
        sp = best_dense / st["whole_us"]
        sp_sa = best_dense / st["step_us"]
        # Graph replays on both sides: our step and dense kernel, SDPA captured by torch.cuda.graph.
        dense_graph = [x for x in (st.get("dense_graph_us"), r.get("flash_graph_us"), r.get("cudnn_graph_us")) if x]
        step_graph = st.get("whole_graph_us")
        sp_graph = min(dense_graph) / step_graph if dense_graph and step_graph else math.nan
        print(f"{r['geometry']:9s} {r['batch']:>2d} {r['context']:>8d} {st['whole_us']:8.1f} {st['step_us']:8.1f} "
              f"{st['dense_us']:10.1f} {r['flash_us'] or math.nan:9.1f} {r['cudnn_us'] or math.nan:9.1f} "
              f"{sp:7.2f}x {ideal:5.2f}x {100 * sp / ideal:7.0f}% {100 * sp_sa / ideal:8.0f}% "
              f"{step_graph or math.nan:10.1f} {100 * sp_graph / ideal:7.0f}%"
              + (f" {byte_ideal:9.2f}x {100 * sp / byte_ideal:4.0f}%" if summary_share != 1.0 else ""))
        c = cross.setdefault(key[:2], [])
        c.append((r["context"], sp >= 1.0))
    print("step: the runtime's layer step (append one token, select, resolve every selected head-page as a hit, attend);")
    print("sel+att: select emitting slots + attend (no append, no resolve), the figure of earlier runs;")
    print("vs best: the best dense (own, SDPA flash, SDPA cuDNN) / step; % ideal: vs best / ideal (sel+att %: the same for sel+att);")
    print("graph step, % ideal: the step replayed as a CUDA graph, against the best dense replayed as one too")
    for (geo, b), pts in cross.items():
        pts.sort()
        slower = [t for t, win in pts if not win]
        faster = [t for t, win in pts if win]
        if not faster:
            msg = f"dense faster at every measured context (<= {pts[-1][0]})"
        elif not slower:
            msg = f"Quest faster at every measured context (>= {pts[0][0]})"
        else:
            msg = f"dense faster up to {max(slower)}, Quest faster from {min(t for t in faster if t > max(slower)) if any(t > max(slower) for t in faster) else 'n/a'}"
        print(f"crossover {geo} b={b}: {msg}")


for path in args.bench_json or []:
    step_table(path)
