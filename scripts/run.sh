#!/usr/bin/env bash
# The main job: builds questkv, then runs `questkv run` with its embedded
# defaults (flags given here are passed on, e.g. --json or --workload gaussian).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
exec build/questkv run "$@"
