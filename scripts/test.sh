#!/usr/bin/env bash
# Builds questkv and runs every test (ctest). GPU tests skip, with a reason,
# where no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc)" "$@"
