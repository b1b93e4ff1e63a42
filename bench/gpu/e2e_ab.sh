#!/usr/bin/env bash
# Old and new side by side in one device call: bench/gpu/e2e.sh's runs for two
# builds of questkv, alternating old, new, old, new, ... so that both see the
# same machine state; each round's JSON under $OUT/<old|new><round>/, tables
# last, packed into $OUT/ab.tgz after every run (a call cut short keeps what
# was packed; the device tool returns at most 8 files).
#   usage (device machine, repo root): bash bench/gpu/e2e_ab.sh OLD_XZ_OR_DIR NEW_XZ_OR_DIR run ...
# A build is a directory holding `questkv`, or a questkv binary compressed
# with xz (as carried). ROUNDS (default 2) rounds; e2e.sh's variables
# (STEPS, PROFILE_HOST, RECALL_1M, ...) pass through; T (default 170) limits
# each run in seconds. OLD_ARGS and NEW_ARGS add flags to each side's runs
# (e2e.sh's RUN_ARGS): one build twice compares two settings, e.g.
#   OLD_ARGS="--io-backend uring" NEW_ARGS="--io-backend uring-sqpoll --io-checks-off-thread" \
#     bash bench/gpu/e2e_ab.sh BUILD BUILD l3-1m-deadline-16l
set -u -o pipefail
[ $# -ge 3 ] || { echo "usage: $0 OLD NEW run ..." >&2; exit 2; }
OLD=$1 NEW=$2
shift 2
RUNS="$*"
OUT=${OUT:-/tmp/questkv-ab}
mkdir -p "$OUT"
unpack() {  # build, name -> a directory holding questkv
  if [ -d "$1" ]; then echo "$1"; return; fi
  mkdir -p "/tmp/questkv-ab-$2" && xz -dc "$1" > "/tmp/questkv-ab-$2/questkv" && chmod +x "/tmp/questkv-ab-$2/questkv" &&
    echo "/tmp/questkv-ab-$2"
}
old=$(unpack "$OLD" old) && new=$(unpack "$NEW" new) || { echo "cannot unpack the builds" >&2; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
status=0
for i in $(seq 1 "${ROUNDS:-2}"); do
  for run in $RUNS; do
    for side in old new; do
      bin=$old args=${OLD_ARGS:-}
      [ $side = new ] && bin=$new args=${NEW_ARGS:-}
      s=$(date +%s)
      OUT="$OUT/$side$i" RUN_ARGS="$args" timeout "${T:-170}" bash bench/gpu/e2e.sh "$bin" "$run" > "$OUT/$side$i.log" 2>&1 || status=1
      echo "$side$i $run: $(( $(date +%s) - s )) s"
      tar czf "$OUT/ab.tgz" -C "$OUT" --exclude ab.tgz . 2>/dev/null
    done
  done
done
for d in "$OUT"/old* "$OUT"/new*; do
  [ -d "$d" ] && { echo "== $(basename "$d")"; python3 bench/gpu/e2e_table.py "$d"; }
done
exit $status
