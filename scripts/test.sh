#!/usr/bin/env bash
# Builds questkv and runs every test (ctest). GPU tests skip, with a reason,
# where no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "questkv: no GPU on this machine: the CUDA kernel tests are built and will skip (GTEST_SKIP)."
  echo "questkv: run them on a GPU with bench/gpu/run.sh (see README)."
fi
exec ctest --test-dir build --output-on-failure -j "$(nproc)" "$@"
