#!/usr/bin/env bash
# Everything GPU in one device call, most important first, each part under
# its own time limit, the results packed into $OUT/all.tgz after each part
# (the device tool returns at most 8 files, and a call cut short keeps what
# was packed):
#   1. the CUDA backend's tests and the 128K runs (bench/gpu/run.sh, E2E)
#   2. the 1M-token run under strict
#   3. several GPUs (bench/multigpu/run.sh), when there are 2+ GPUs
#   4. the length sweep (plots: bench/plot_e2e.py)
#   5. the kernel tests of resolve and of a layer's step in a CUDA graph
#   6. the 1M-token run under deadline
#   7. the largest context per GPU count: a whole Llama-3-8B's K/V (32 layers)
#      over 1, 2, 4, ... GPUs, when there are 2+ GPUs
#   usage (device machine, repo root): bash bench/gpu/all.sh [bin_dir] [mgpu_dir]
# PARTS="1 3 4 5" runs only those parts (default all; the whole list does
# not fit one 600 s call — split it: "1 3 4 5", then "2 6 7" on the warm machine).
set -u -o pipefail
BIN=${1:-.device/bin}
MGPU=${2:-.device/mgpu}
FINAL=${OUT:-/tmp/questkv-all}
export OUT=/tmp/questkv-all-work
mkdir -p "$OUT" "$FINAL"
pack() { tar czf "$FINAL/all.tgz" -C "$OUT" . 2>/dev/null; }
PARTS=${PARTS:-1 2 3 4 5 6 7}
part() {  # number, seconds, title, command...
  local n=$1 limit=$2 title=$3
  shift 3
  case " $PARTS " in *" $n "*) ;; *) return 0 ;; esac
  echo "=== $title (limit ${limit}s)"
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/part-${title// /_}.log" 2>&1
  echo "rc=$? in $(($(date +%s) - t0)) s"
  tail -${TAIL:-14} "$OUT/part-${title// /_}.log"
  pack
}
for f in "$BIN"/*.gz; do [ -e "$f" ] && gunzip -f "$f"; done
chmod +x "$BIN"/questkv* 2>/dev/null
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
free -g | head -2; df -h /tmp | tail -1; nproc
part 1 ${T1:-240} "runtime tests and 128K" env KERNELS=0 E2E="${E2E:-l3-all l3-all-nog l3-2g l3g-all l3g-2g gen-check}" \
  bash bench/gpu/run.sh "$BIN"
part 2 ${T2:-290} "1M strict" bash bench/gpu/e2e.sh "$BIN" l3-1m-strict
GPUS=$(nvidia-smi -L | wc -l)
COUNTS=1; for n in 2 4 8; do [ "$GPUS" -ge $n ] && COUNTS="$COUNTS,$n"; done
if [ "$GPUS" -ge 2 ] && [ -d "$MGPU" ]; then
  part 3 ${T3:-150} "several GPUs" bash bench/multigpu/run.sh "$MGPU" --contexts 32768,131072,1048576 --gpus $COUNTS --reps 10
fi
part 4 ${T4:-120} "sweep" env SWEEP="2048 8192 32768 131072" bash bench/gpu/e2e.sh "$BIN" sweep
part 5 ${T5:-60} "kernel tests" "$BIN/questkv_kernels_cuda_test" --gtest_filter='*Resolve*:*LayerStepGraph*'
part 6 ${T6:-290} "1M deadline" bash bench/gpu/e2e.sh "$BIN" l3-1m-deadline
if [ "$GPUS" -ge 2 ] && [ -d "$MGPU" ]; then
  part 7 ${T7:-250} "largest context" env TESTS=0 bash bench/multigpu/run.sh "$MGPU" --layers 32 \
    --contexts 1048576,1572864,2097152,3145728,4194304,6291456,8388608,12582912 --gpus $COUNTS \
    --schemes context,head --reps 3 --warmup 1 --timeout-s 120
fi
python3 bench/gpu/e2e_table.py "$OUT"
pack
