#!/usr/bin/env bash
# One device call: GPU tests, compute-sanitizer on a small subset, then the
# benchmarks; a short table last, everything under $OUT.
#   usage (device machine, repo root): bash bench/gpu/run.sh [bin_dir] [bench args]
# bin_dir holds, built for sm_90 (default .device/bin): questkv_kernels_cuda_test,
# questkv_gather_bench, questkv_gpu_kernels_bench (kernels), questkv_runtime_cuda_test
# (the CUDA backend end to end) and questkv (the e2e runs). A part whose
# binary is absent is skipped. SAN=0 skips compute-sanitizer; SDPA=0 skips
# the PyTorch SDPA baseline (bench/gpu/sdpa_baseline.py); KERNELS=0 skips the
# kernel tests and benchmarks, BENCH=0 the kernel benchmarks, E4M3=0 the benchmarks' second
# pass with 8-bit E4M3 summaries; MMA=1 adds the select with its scores on the CUDA cores
# and on the tensor cores (--mma-scores), f16 and E4M3; E2E="run ..." adds bench/gpu/e2e.sh's runs
# whose table then comes last.
set -u -o pipefail
BIN=${1:-.device/bin}
shift || true
OUT=${OUT:-/tmp/questkv-gpu-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
status=0
if [ -x "$BIN/questkv_runtime_cuda_test" ]; then
  echo "== runtime tests (CUDA backend against the CPU backend)"
  "$BIN/questkv_runtime_cuda_test" --gtest_output="json:$OUT/runtime-tests.json" >"$OUT/runtime-tests.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED|Failure|error" "$OUT/runtime-tests.log" | head -20
fi
if [ "${KERNELS:-1}" = 0 ] || [ ! -x "$BIN/questkv_kernels_cuda_test" ]; then
  echo "kernel tests and benchmarks: skipped"
  if [ -n "${E2E:-}" ]; then bash bench/gpu/e2e.sh "$BIN" $E2E || status=1; fi
  exit $status
fi
echo "== tests"
"$BIN/questkv_kernels_cuda_test" --gtest_output="json:$OUT/tests.json" >"$OUT/tests.log" 2>&1 || status=1
grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED|Failure|error" "$OUT/tests.log" | head -40
if [ "${SAN:-1}" = 0 ]; then
  echo "compute-sanitizer: skipped (SAN=0)"
elif command -v compute-sanitizer >/dev/null; then
  SUB='Sizes/AppendCudaTest.*/1:Sizes/ResolveCudaTest.*/1:Policies/SelectCudaTest.*/1:Policies/SelectCudaTest.*/3:Policies/SelectCudaTest.*/14:Policies/SelectCudaTest.*/20:Policies/SelectCudaTest.*/21:Policies/SelectCudaTest.*/22:Sizes/AttendCudaTest.*/1:Sizes/AttendCudaTest.*/6:AttendGraphTest.*:Summaries/LayerStepGraphTest.*:E4m3/SelectCudaTest.*/0:E4m3/SelectCudaTest.*/1:E4m3/SelectCudaTest.*/3:E4m3/AppendCudaTest.*/1'
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
if [ "${BENCH:-1}" = 0 ]; then
  echo "kernel benchmarks: skipped (BENCH=0)"
  if [ -n "${E2E:-}" ]; then bash bench/gpu/e2e.sh "$BIN" $E2E || status=1; fi
  exit $status
fi
echo "== miss gather and resolve"
if [ -x "$BIN/questkv_gather_bench" ]; then
  "$BIN/questkv_gather_bench" 2>&1 | tee "$OUT/gather.log" | tail -20
fi
echo "== bench"
"$BIN/questkv_gpu_kernels_bench" --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log" | tail -60
BENCH_JSONS=(--bench-json "$OUT/bench.json")
if [ "${E4M3:-1}" != 0 ]; then
  echo "== bench, E4M3 summaries"
  "$BIN/questkv_gpu_kernels_bench" --summary-dtype e4m3 --json "$OUT/bench-e4m3.json" "$@" 2>&1 |
    tee "$OUT/bench-e4m3.log" | tail -60
  BENCH_JSONS+=(--bench-json "$OUT/bench-e4m3.json")
fi
if [ "${MMA:-0}" != 0 ]; then
  # The select's scores on the CUDA cores and on the tensor cores, side by side.
  for sd in f16 e4m3; do
    for mma in "" --mma-scores; do
      echo "== select, $sd summaries${mma:+, tensor-core scores}"
      "$BIN/questkv_gpu_kernels_bench" --select-only --summary-dtype $sd $mma \
        --json "$OUT/select-$sd${mma:+-mma}.json" "$@" 2>&1 | tail -12
    done
  done
fi
if [ "${SDPA:-1}" != 0 ]; then
  echo "== sdpa baseline"
  python3 bench/gpu/sdpa_baseline.py "${BENCH_JSONS[@]}" 2>&1 | tee "$OUT/sdpa.log" | tail -60
fi
if [ -n "${E2E:-}" ]; then bash bench/gpu/e2e.sh "$BIN" $E2E || status=1; fi
exit $status
