#!/usr/bin/env bash
# Builds the CPU side (no CUDA, no benchmarks) under a sanitizer and runs its
# tests: `address` (AddressSanitizer + UndefinedBehaviorSanitizer, any report
# fails the test) into build-asan/, or `thread` (ThreadSanitizer) into
# build-tsan/. Extra arguments go to ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:-}
shift || true
case $kind in
  address)
    dir=build-asan
    flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
    # ASan keeps freed memory in quarantine, so a region's release does not
    # show in the resident set; the package's consumers link without ASan.
    skip='^(HostRegion\.ReturnsItsMemoryWhenDestroyed|package\.install)$'
    export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1} UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
    ;;
  thread)
    dir=build-tsan
    flags="-fsanitize=thread"
    # Under an address-space limit TSan cannot map its shadow memory.
    skip='^OutOfMemory\.AttendOnKeysLargerThanTheLimitExitsOneWithAMessage$'
    export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1 second_deadlock_stack=1}
    ;;
  *)
    echo "usage: scripts/sanitize.sh address|thread [ctest arguments]" >&2
    exit 2
    ;;
esac
scripts/setup.sh
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DQUESTKV_CUDA=OFF -DQUESTKV_BENCH=OFF \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_C_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="$flags" >/dev/null
cmake --build "$dir" -j "$(nproc)"
exec ctest --test-dir "$dir" --output-on-failure -j "$(nproc)" -E "$skip" "$@"
