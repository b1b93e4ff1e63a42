#!/usr/bin/env bash
# One device call on a machine of 2+ GPUs: the GPU decoder's tests (threaded
# ranks and NCCL), the parallel suite (NCCL communicator included), then the
# multi-GPU benchmark; a short table last, everything under $OUT.
#   usage (device machine, repo root): bash bench/multigpu/run.sh [bin_dir] [bench args]
# bin_dir (default .device/mgpu) holds questkv_parallel_cuda_test,
# questkv_parallel_test and questkv_multigpu_bench built for sm_90, plain or
# gzipped (NAME.gz), and COMMIT (the commit they were built from). They link
# libnccl.so.2 dynamically: it is taken from PyTorch's nvidia-nccl wheel or
# the CUDA toolkit. TESTS=0 skips the tests; NVLink multicast stays off.
set -u -o pipefail
BIN=${1:-.device/mgpu}
shift || true
OUT=${OUT:-/tmp/questkv-mgpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Every kernel loaded when a context starts: a kernel lazily loaded at its
# first launch can wait on the device while a peer rank's NCCL kernel waits
# for this rank (ranks are threads of one process here).
export CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-EAGER}

WORK=$(mktemp -d)
for f in "$BIN"/*; do
  case "$f" in
    *.gz) gunzip -c "$f" >"$WORK/$(basename "$f" .gz)" ;;
    *) cp "$f" "$WORK/" ;;
  esac
done
chmod +x "$WORK"/questkv_* 2>/dev/null
COMMIT=$(cat "$WORK/COMMIT" 2>/dev/null || echo unknown)

nccl_dirs=$(python3 -c 'import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null)
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda-13*/lib64 /usr/lib/x86_64-linux-gnu; do
  [ -e "$d/libnccl.so.2" ] && nccl_dirs="$nccl_dirs:$d"
done
export LD_LIBRARY_PATH="${nccl_dirs#:}:${LD_LIBRARY_PATH:-}"
echo "commit $COMMIT; libnccl from: ${nccl_dirs#:}"
for b in "$WORK"/questkv_*; do
  missing=$(ldd "$b" | grep "not found")
  [ -n "$missing" ] && echo "$(basename "$b"): $missing"
done
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
nvidia-smi topo -m >"$OUT/topo.txt" 2>&1 && head -5 "$OUT/topo.txt"

status=0
if [ "${TESTS:-1}" != 0 ]; then
  for t in questkv_parallel_cuda_test questkv_parallel_test; do
    if [ ! -x "$WORK/$t" ]; then echo "== $t: not in $BIN, skipped"; continue; fi
    echo "== $t"
    timeout 400 "$WORK/$t" --gtest_output="json:$OUT/$t.json" >"$OUT/$t.log" 2>&1 || status=1
    # The totals, the failed tests' names, and why tests skipped.
    grep -E "^\[  (PASSED|SKIPPED|FAILED) +\] [0-9]+ test|^\[  FAILED  \] .*[^)]$" "$OUT/$t.log" | head -20
    grep -A1 "Skipped$" "$OUT/$t.log" | grep -v "Skipped$\|^--" | sort | uniq -c | head -5
  done
fi

echo "== bench"
"$WORK/questkv_multigpu_bench" --json "$OUT/multigpu.json" --commit "$COMMIT" "$@" >"$OUT/bench.log" 2>"$OUT/bench.err"
rc=$?
[ $rc -eq 0 ] || status=1
tail -5 "$OUT/bench.err"
echo "tests and bench: $([ $status -eq 0 ] && echo ok || echo FAILED) (bench rc=$rc; logs in $OUT)"
cat "$OUT/bench.log"
rm -rf "$WORK"
exit $status
