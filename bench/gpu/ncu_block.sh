#!/usr/bin/env bash
# What a verified block's attention reads from HBM and from L2, against one
# token a step: Nsight Compute on AttendKernel during `questkv run` (Llama-3-8B
# geometry, every page in HBM), two steps skipped, the next 64 launches
# profiled (the medians are the sparse layers': 30 of each step's 32).
# Whether positions that select the same pages already share their reads
# through L2 (their rows run in one wave) or each reads HBM on its own is
# what a block attention kernel that reads each page once would change.
#   usage (device machine, repo root): bash bench/gpu/ncu_block.sh [bin_dir] [ctx] [n ...]
# n = 0: one token a step through the host API; n > 0: --draft n (the last
# token and n drafts a block). Needs ncu where it reads the counters
# (Firecracker machines); clocks are left alone (--clock-control none).
set -u -o pipefail
BIN=${1:-.device/bin}
CTX=${2:-32768}
shift 2 || shift $#
NS=${*:-0 4}
OUT=${OUT:-/tmp/questkv-gpu-out}
mkdir -p "$OUT"
NCU=${NCU:-$(command -v ncu || echo /opt/nvidia/nsight-compute/2025.3.1/ncu)}
status=0
for n in $NS; do
  if [ "$n" = 0 ]; then api="--decode-api host"; else api="--draft $n"; fi
  echo "== ncu: ${CTX} tokens, $api" >&2
  if ! "$NCU" --clock-control none -k regex:AttendKernel --launch-skip 64 --launch-count 64 \
      --metrics dram__bytes_read.sum,lts__t_bytes.sum,gpu__time_duration.sum --csv --page raw --print-units base \
      "$BIN/questkv" run --backend cuda --token-budget 2048 --preset llama3-8b --context "$CTX" --steps 6 \
      --recall-every 0 --no-progress $api >"$OUT/ncu-block-$CTX-$n.csv" 2>"$OUT/ncu-block-$CTX-$n.err"; then
    echo "   FAILED: $(tail -3 "$OUT/ncu-block-$CTX-$n.err")" >&2
    status=1
  fi
done
/usr/bin/python3 - "$OUT" "$CTX" $NS <<'EOF'
import csv, statistics, sys
out, ctx, ns = sys.argv[1], sys.argv[2], sys.argv[3:]
print("positions  dram MiB/launch  L2 MiB/launch  us/launch  (medians, AttendKernel, %s tokens)" % ctx)
for n in ns:
    try:
        lines = open("%s/ncu-block-%s-%s.csv" % (out, ctx, n)).read().splitlines()
    except OSError:
        continue
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        print("%9s  (no profile)" % n)
        continue
    rows = list(csv.DictReader(lines[start:]))[1:]  # the line after the header holds the units
    def med(key, scale):
        vals = [float(r[key].replace(",", "")) for r in rows if r.get(key)]
        return statistics.median(vals) * scale if vals else float("nan")
    # --print-units base: bytes and nanoseconds.
    print("%9s  %15.2f  %13.2f  %9.1f" % (1 if n == "0" else int(n) + 1, med("dram__bytes_read.sum", 2**-20),
                                          med("lts__t_bytes.sum", 2**-20), med("gpu__time_duration.sum", 1e-3)))
EOF
exit $status
