#!/usr/bin/env bash
# End-to-end `questkv run --backend cuda` jobs: each named run's
# JSON report lands in $OUT/e2e-<name>.json, then bench/gpu/e2e_table.py
# prints the table (tiered against all-in-HBM, dense offload, PCIe saved).
#   usage (device machine, repo root): bash bench/gpu/e2e.sh [bin_dir] [run ...]
# Runs (default: l3-all l3-2g l3g-all l3g-2g):
#   l3-all   Llama-3-8B, 128K, structured, every page in HBM (the ceiling)
#   l3-2g    the same with a 2 GiB HBM K/V budget
#   l3g-all, l3g-2g   the gaussian workload (no locality: the worst case)
#   l2-all   Llama-2-7B, 128K (64 GiB of K/V), every page in HBM (l2-8g's ceiling)
#   l2-8g    Llama-2-7B, 128K (64 GiB of K/V), 8 GiB of HBM
#   sweep    Llama-3-8B at $SWEEP tokens (default 2K 8K 32K 128K), every page in HBM and an
#            HBM budget of 1/8 of the K/V (where that holds two steps' selections: >= 32K); plots: /usr/bin/python3 bench/plot_e2e.py $OUT PREFIX
#   l3-all-nog   l3-all with --no-cuda-graphs (every step launched directly)
#   l3-all-dense l3-all with every layer dense (the same runtime attending every page): the baseline
#            each selection mode's step is compared with
#   l3-all-e4m3, l3-2g-e4m3, l2-all-e4m3   l3-all, l3-2g and l2-all with 8-bit E4M3 summaries
#            (--summary-dtype e4m3): the select scans half the bytes; recall sampled on l3-all-e4m3
#   l3-all-s8-e4m3, l3-all-s8   l3-all with 8-token pages (sink and local windows of the same tokens),
#            E4M3 or f16 summaries: E4M3 at S = 8 reads f16's summary bytes at S = 16; recall sampled
#   l3-all-rrC, l3-all-s8-e4m3-rrC   l3-all and l3-all-s8-e4m3 with the two-stage re-rank, C times the
#            budget's pages as candidates (--rerank C); recall sampled
#   l3-all-adE   l3-all with adaptive budgets: per ranking the fewest pages leaving at most E of
#            the bound mass unread, capped at the token budget (--unread-bound-mass E)
#   gen-check    sweep-32768-all's run with the K/V generated on the host: the same digest
#   l3-1m-strict, l3-1m-deadline   Llama-3-8B, 1M tokens (128 GiB of K/V): 16 GiB HBM,
#            $HOST_1M (80G) pinned host, the rest on disk ($DISK_1M, 56G: the device has ~60 GB free) under $DISK;
#            recall every $RECALL_1M (8: steps 0 and 8; 0: none) steps at layers $RECALL_LAYERS_1M
#            (default 2,11,21,31: a 1M layer's diagnostics take ~20 s, mostly reading its homes);
#            $STEPS_1M decode steps (default 16; the first steps after prefill find the caches cold)
#   draft-CTX-N  Llama-3-8B at CTX tokens, speculative decoding: the last token and N drafts
#            appended (AppendDraft), verified by one DecodeBlock call, drafts accepted with probability 0.7
#            each; N = 0: one token a step, the baseline the blocks are compared with (e.g.
#            draft-32768-0 draft-32768-4); both through device pointers, or the host API's
#            floats with DRAFT_API=host;
#            draft-CTX-N-dense: the same with every layer dense; draft-CTX-N-shared: one page
#            set a block (--block-selection shared); from 512K on, homes as l3-512k-all / l3-1m-all
#   l3-1m-all    the same homes, every page cached in HBM (128 GiB of K/V + 8 GiB of summaries
#            fit an H200): the 1M ceiling. `deadline`: no page misses, so no cold miss ever
#            waits, but `strict` would make every layer wait for its (zero) cold count, without
#            graphs. The sweep's 1M points are l3-1m-all and l3-1m-deadline.
#   RUN-mma  any run above with --mma-scores (the select's scores on the tensor cores), named RUN-mma
#   RUN-16l  any run above with 16 layers (--layers 16); the 1M runs' host and disk halved (40G, 28G),
#            their HBM 12014M (the two dense layers' 8 GiB and each sparse layer's share at 32 layers):
#            l3-1m-all-16l's 64 GiB of K/V fit an H100, each layer's work unchanged
#   l3-1m-all-rrC, l3-1m-all-adE, l3-1m-all-dense   l3-1m-all with the two-stage re-rank
#            (--rerank C), adaptive budgets (--unread-bound-mass E), or every layer dense
#   l3-512k-all  the same at 512K tokens (64 GiB of K/V + 4 GiB of summaries fit an H100), homes on
#            $HOST_512K (40G) pinned host and $DISK_512K (40G) of disk
#   l3-512k-deadline, l3-512k-strict   l3-512k-all's homes with 8 GiB of HBM (1/8 of the K/V)
#            (the 512K runs sample recall every $RECALL_512K steps, default 0: none, at layers
#            $RECALL_LAYERS_512K, default 2,31)
#   l3-512k-all-rrC, l3-512k-all-adE, l3-512k-all-dense   l3-512k-all with the two-stage re-rank
#            (--rerank C), adaptive budgets (--unread-bound-mass E), or every layer dense
#   l3-512k-deadline-slF, l3-1m-deadline-slF   l3-512k-deadline and l3-1m-deadline with a skip
#            limit (--deadline-skip-limit F): a call whose cold misses pass F of its selection waits
# RUN_ARGS adds flags to every run (e.g. RUN_ARGS="--io-backend uring-sqpoll").
# PROFILE_HOST=0 drops --profile-host (its host phases and the stream's marks: events between
# a step's calls) to time the step without them.
set -u -o pipefail
BIN=${1:-.device/bin}
shift || true
RUNS=${*:-l3-all l3-2g l3g-all l3g-2g}
OUT=${OUT:-/tmp/questkv-gpu-out}
STEPS=${STEPS:-32}
DISK=${DISK:-/tmp/questkv-disk}
mkdir -p "$OUT"
# (No --no-progress: into a log, a phase longer than a minute writes a line a minute.)
Q="$BIN/questkv run --backend cuda --json --token-budget 2048 ${RUN_ARGS:-}"
L3="--preset llama3-8b --context 131072 --steps $STEPS"
status=0
one() {  # name, flags...
  local name=$1$SUFFIX
  shift
  echo "== e2e $name: $* $EXTRA" >&2
  local t0=$(date +%s%N)
  local prof=--profile-host
  [ "${PROFILE_HOST:-1}" = 0 ] && prof=""
  if $Q "$@" $EXTRA $prof >"$OUT/e2e-$name.json" 2>"$OUT/e2e-$name.err"; then
    echo "   done in $((($(date +%s%N) - t0) / 1000000)) ms; $(tail -1 "$OUT/e2e-$name.err")" >&2
  else
    echo "   FAILED: $(tail -3 "$OUT/e2e-$name.err")" >&2
    rm -f "$OUT/e2e-$name.json"
    status=1
  fi
}
for run in $RUNS; do
  # RUN-mma: RUN with the select's scores on the tensor cores.
  SUFFIX="" EXTRA="" LAYERS=32
  if [ "${run%-mma}" != "$run" ]; then run=${run%-mma} SUFFIX=-mma EXTRA=--mma-scores; fi
  # RUN-16l: RUN with 16 of the preset's 32 layers, the 1M runs' homes halved with them (a 1M
  # run's K/V, 64 GiB, then fits an H100; a layer's work is the same).
  if [ "${run%-16l}" != "$run" ]; then run=${run%-16l} SUFFIX=-16l$SUFFIX EXTRA="$EXTRA --layers 16" LAYERS=16; fi
  DENSE=$(seq -s, 0 $((LAYERS - 1)))
  case $run in
    l3-all) one l3-all $L3 --recall-every 32 ;;
    l3-all-nog) one l3-all-nog $L3 --recall-every 0 --no-cuda-graphs ;;
    l3-all-dense) one l3-all-dense $L3 --recall-every 0 --dense-layers $DENSE ;;
    gen-check) one sweep-32768-hostgen --preset llama3-8b --context 32768 --steps 16 --recall-every 0 --gen host ;;
    l3-2g) one l3-2g $L3 --hbm-bytes 2G --recall-every 0 ;;
    l3-all-e4m3) one l3-all-e4m3 $L3 --summary-dtype e4m3 --recall-every 32 ;;
    l3-all-s8-e4m3) one l3-all-s8-e4m3 $L3 --page-size 8 --sink-pages 2 --local-pages 16 --summary-dtype e4m3 --recall-every 32 ;;
    l3-all-s8) one l3-all-s8 $L3 --page-size 8 --sink-pages 2 --local-pages 16 --recall-every 32 ;;
    l3-all-rr*) one $run $L3 --rerank ${run#l3-all-rr} --recall-every 32 ;;
    l3-all-ad*) one $run $L3 --unread-bound-mass ${run#l3-all-ad} --recall-every 32 ;;
    l3-all-s8-e4m3-rr*) one $run $L3 --page-size 8 --sink-pages 2 --local-pages 16 --summary-dtype e4m3 \
      --rerank ${run#l3-all-s8-e4m3-rr} --recall-every 32 ;;
    l3-2g-e4m3) one l3-2g-e4m3 $L3 --summary-dtype e4m3 --hbm-bytes 2G --recall-every 0 ;;
    l2-all-e4m3) one l2-all-e4m3 --preset llama2-7b --context 131072 --steps $STEPS --summary-dtype e4m3 --recall-every 0 ;;
    l3g-all) one l3g-all $L3 --workload gaussian --recall-every 0 ;;
    l3g-2g) one l3g-2g $L3 --workload gaussian --hbm-bytes 2G --recall-every 0 ;;
    l2-all) one l2-all --preset llama2-7b --context 131072 --steps $STEPS --recall-every 0 ;;
    l2-8g) one l2-8g --preset llama2-7b --context 131072 --steps $STEPS --hbm-bytes 8G --recall-every 0 ;;
    draft-*-*)
      spec=${run#draft-}; extra=""
      # draft-CTX-N-dense: every layer dense (the block's dense attention);
      # draft-CTX-N-shared: one page set a block (--block-selection shared).
      [ "${spec%-dense}" != "$spec" ] && spec=${spec%-dense} && extra="--dense-layers $DENSE"
      [ "${spec%-shared}" != "$spec" ] && spec=${spec%-shared} && extra="--block-selection shared"
      ctx=${spec%-*}; n=${spec#*-}
      # From 512K on, the K/V is homed on $HOST_512K / $HOST_1M of pinned host and the rest on
      # disk, as l3-512k-all and l3-1m-all (pages cached in HBM, `deadline`).
      homes=""
      if [ $ctx -ge 524288 ]; then
        rm -rf "$DISK" && mkdir -p "$DISK"
        if [ $ctx -ge 1048576 ]; then homes="--host-bytes ${HOST_1M:-80G} --disk-bytes ${DISK_1M:-56G}"
        else homes="--host-bytes ${HOST_512K:-40G} --disk-bytes ${DISK_512K:-40G}"; fi
        homes="$homes --disk-dir $DISK --cold-miss deadline"
      fi
      api="--decode-api ${DRAFT_API:-device}"  # the same calls for the blocks and their baseline
      [ "$n" = 0 ] || api="$api --draft $n"
      one $run --preset llama3-8b --context $ctx --steps 16 --recall-every 0 $api $extra $homes
      [ -n "$homes" ] && rm -rf "$DISK" ;;
    sweep)
      for ctx in ${SWEEP:-2048 8192 32768 131072}; do
        # 128K with 1/8 of the K/V in HBM is l3-all / l3-2g: reuse them when they ran.
        if [ $ctx = 131072 ] && [ -s "$OUT/e2e-l3-all$SUFFIX.json" ] && [ -s "$OUT/e2e-l3-2g$SUFFIX.json" ]; then
          cp "$OUT/e2e-l3-all$SUFFIX.json" "$OUT/e2e-sweep-131072-all$SUFFIX.json"
          cp "$OUT/e2e-l3-2g$SUFFIX.json" "$OUT/e2e-sweep-131072-8th$SUFFIX.json"
          continue
        fi
        # 1M: the host cannot home 128 GiB, so its points are the 1M runs (disk tier).
        if [ $ctx = 1048576 ]; then
          [ -s "$OUT/e2e-l3-1m-all$SUFFIX.json" ] && cp "$OUT/e2e-l3-1m-all$SUFFIX.json" "$OUT/e2e-sweep-1048576-all$SUFFIX.json"
          [ -s "$OUT/e2e-l3-1m-deadline$SUFFIX.json" ] && cp "$OUT/e2e-l3-1m-deadline$SUFFIX.json" "$OUT/e2e-sweep-1048576-8th$SUFFIX.json"
          continue
        fi
        kv=$((ctx * 32 * 8 * 128 * 2 * 2))  # bytes of K/V, f16
        one sweep-$ctx-all --preset llama3-8b --context $ctx --steps 16 --recall-every 0
        # Every layer's list must hold a step's selection (2048 tokens): below
        # twice that, 1/8 of the K/V cannot run (a clear ResourceExhausted).
        sel=$((2 * 2048 * 32 * 8 * 128 * 2 * 2))
        if [ $((kv / 8)) -lt $sel ]; then
          echo "== e2e sweep-$ctx-8th: skipped, 1/8 of the K/V ($((kv / 8 >> 20)) MiB) < two steps' selections ($((sel >> 20)) MiB)" >&2
          continue
        fi
        one sweep-$ctx-8th --preset llama3-8b --context $ctx --steps 16 --recall-every 0 --hbm-bytes $((kv / 8))
      done ;;
    l3-1m-strict | l3-1m-deadline | l3-1m-deadline-sl* | l3-1m-all | l3-1m-all-rr* | l3-1m-all-ad* | l3-1m-all-dense)
      rm -rf "$DISK" && mkdir -p "$DISK"
      # 16G at 32 layers: the two dense layers' 8 GiB and 8/30 GiB a sparse layer.
      hbm_1m="$((8192 + (LAYERS - 2) * 8192 / 30))M"
      hbm="--hbm-bytes $hbm_1m --cold-miss ${run#l3-1m-}"
      # A dense layer has no selection to diagnose: the dense run samples no recall.
      recall="--recall-every ${RECALL_1M:-8}"
      recall="$recall --recall-layers ${RECALL_LAYERS_1M:-2,$((LAYERS * 11 / 32)),$((LAYERS * 21 / 32)),$((LAYERS - 1))}"
      case $run in
        l3-1m-deadline-sl*) hbm="--hbm-bytes $hbm_1m --cold-miss deadline --deadline-skip-limit ${run#l3-1m-deadline-sl}" ;;
        l3-1m-all) hbm="--cold-miss deadline" ;;
        l3-1m-all-rr*) hbm="--cold-miss deadline --rerank ${run#l3-1m-all-rr}" ;;
        l3-1m-all-ad*) hbm="--cold-miss deadline --unread-bound-mass ${run#l3-1m-all-ad}" ;;
        l3-1m-all-dense) hbm="--cold-miss deadline --dense-layers $DENSE" recall="--recall-every 0" ;;
      esac
      one $run --preset llama3-8b --context 1048576 --steps ${STEPS_1M:-16} $recall $hbm \
        --host-bytes ${HOST_1M:-$((LAYERS * 5 / 2))G} --disk-dir "$DISK" --disk-bytes ${DISK_1M:-$((LAYERS * 7 / 4))G}
      rm -rf "$DISK" ;;
    l3-512k-all | l3-512k-all-rr* | l3-512k-all-ad* | l3-512k-all-dense | l3-512k-deadline | l3-512k-strict | \
    l3-512k-deadline-sl*)
      mode="--cold-miss deadline"
      recall="--recall-every ${RECALL_512K:-0} --recall-layers ${RECALL_LAYERS_512K:-2,31}"
      case $run in
        l3-512k-deadline | l3-512k-strict) mode="--hbm-bytes 8G --cold-miss ${run#l3-512k-}" ;;
        l3-512k-deadline-sl*) mode="--hbm-bytes 8G --cold-miss deadline --deadline-skip-limit ${run#l3-512k-deadline-sl}" ;;
        l3-512k-all-rr*) mode="$mode --rerank ${run#l3-512k-all-rr}" ;;
        l3-512k-all-ad*) mode="$mode --unread-bound-mass ${run#l3-512k-all-ad}" ;;
        l3-512k-all-dense) mode="$mode --dense-layers $DENSE" recall="--recall-every 0" ;;
      esac
      rm -rf "$DISK" && mkdir -p "$DISK"
      one $run --preset llama3-8b --context 524288 --steps 16 $recall $mode \
        --host-bytes ${HOST_512K:-40G} --disk-dir "$DISK" --disk-bytes ${DISK_512K:-40G}
      rm -rf "$DISK" ;;
    *) echo "unknown run $run" >&2; status=1 ;;
  esac
done
python3 bench/gpu/e2e_table.py "$OUT" | tee "$OUT/e2e-table.txt"
exit $status
