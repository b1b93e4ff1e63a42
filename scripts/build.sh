#!/usr/bin/env bash
# Configures and builds questkv into build/ (CUDA backend too when nvcc exists).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DQUESTKV_TORCH=ON "$@" >/dev/null
cmake --build build -j "$(nproc)"
