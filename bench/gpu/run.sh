#!/usr/bin/env bash
# One device call: GPU tests, compute-sanitizer on a small subset, then the
# benchmarks; a short table last, everything under $OUT.
#   usage (device machine, repo root): bash bench/gpu/run.sh [bin_dir] [bench args]
# bin_dir holds questkv_kernels_cuda_test, questkv_gather_bench and questkv_gpu_kernels_bench built
# for sm_90 (default .device/bin). SAN=0 skips compute-sanitizer; SDPA=0 skips
# the PyTorch SDPA baseline (bench/gpu/sdpa_baseline.py), whose comparison
# table then comes last.
set -u -o pipefail
BIN=${1:-.device/bin}
shift || true
OUT=${OUT:-/tmp/questkv-gpu-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
status=0
echo "== tests"
"$BIN/questkv_kernels_cuda_test" --gtest_output="json:$OUT/tests.json" >"$OUT/tests.log" 2>&1 || status=1
grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED|Failure|error" "$OUT/tests.log" | head -40
if [ "${SAN:-1}" = 0 ]; then
  echo "compute-sanitizer: skipped (SAN=0)"
elif command -v compute-sanitizer >/dev/null; then
  SUB='Sizes/AppendCudaTest.*/1:Sizes/ResolveCudaTest.*/1:Policies/SelectCudaTest.*/1:Policies/SelectCudaTest.*/3:Sizes/AttendCudaTest.*/1:Sizes/AttendCudaTest.*/6:AttendGraphTest.*'
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer $tool"
    timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 "$BIN/questkv_kernels_cuda_test" \
      --gtest_filter="$SUB" >"$OUT/sanitizer-$tool.log" 2>&1
    rc=$?
    echo "$tool rc=$rc"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$OUT/sanitizer-$tool.log" | head -5
    [ $rc -eq 0 ] || status=1
  done
else
  echo "compute-sanitizer: not found"
fi
echo "== miss gather and resolve"
if [ -x "$BIN/questkv_gather_bench" ]; then
  "$BIN/questkv_gather_bench" 2>&1 | tee "$OUT/gather.log" | tail -20
fi
echo "== bench"
"$BIN/questkv_gpu_kernels_bench" --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log" | tail -60
if [ "${SDPA:-1}" != 0 ]; then
  echo "== sdpa baseline"
  python3 bench/gpu/sdpa_baseline.py --bench-json "$OUT/bench.json" 2>&1 | tee "$OUT/sdpa.log" | tail -40
fi
exit $status
