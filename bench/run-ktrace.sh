#!/bin/sh
# run-ktrace.sh - the layer's chain in sluice-compute on the GPU's clock: the kernel trace
# (bench/cupti/ktrace.c injected) of an all-in-T0 run of bench-L4 (routing $ROUTING,
# uniform by default), read by bench-ktrace, for compute/ as built and for each extra
# flag set given (e.g. --norm-kernel), every run twice in turn; each table and the run's
# tokens/s into OUT_DIR/ktrace.md, the CSVs and logs into OUT_DIR/ktrace-runs.tar.gz (a
# device call brings few files back). Needs BUILD_DIR/lib/libsl_ktrace.so (built when
# CUDA's CUPTI is found).
# usage: [ROUTING=uniform|zipf:S] bench/run-ktrace.sh BUILD_DIR OUT_DIR [CHECKPOINT_DIR] [-- FLAGS...]
set -eu
build=$1
out=$2
shift 2
dir=/tmp/sluice-bench-L4
if [ $# -gt 0 ] && [ "$1" != "--" ]; then
    dir=$1
    shift
fi
[ $# -gt 0 ] && [ "$1" = "--" ] && shift
lib="$PWD/$build/lib/libsl_ktrace.so"
[ -f "$lib" ] || { echo "run-ktrace.sh: $lib is missing (CUPTI not found at build time?)" >&2; exit 2; }
mkdir -p "$out"
if ! ls "$dir"/sluice-bench-L4-00001-of-*.gguf >/dev/null 2>&1; then
    "$build/bin/sluice-synth" --preset bench-L4 --out "$dir" --shards 4 --seed 1 --quiet
fi
first=$(ls "$dir"/sluice-bench-L4-00001-of-*.gguf)
ep="ipc:///tmp/sluice-ktrace.sock"
"$build/bin/sluice-fetcher" -m "$first" --endpoint "$ep" --arena-slots 1536 -q &
fpid=$!
trap 'kill $fpid 2>/dev/null; wait $fpid 2>/dev/null || true' EXIT
sleep 1
md="$out/ktrace.md"
: >"$md"
for round in 1 2; do
    i=0
    for flags in "" "$@"; do
        i=$((i + 1))
        csv="$out/ktrace-$i-$round.csv"
        # shellcheck disable=SC2086
        CUDA_INJECTION64_PATH="$lib" SL_KTRACE="$csv" "$build/bin/sluice-compute" -m "$first" \
            --endpoint "$ep" -n 32 --seed 7 --backend gpu --t0-slots 1536 --t0-preload \
            --warmup 4 --routing "${ROUTING:-uniform}" $flags >"$out/ktrace-$i-$round.log" 2>&1
        {
            echo "## sluice-compute ${flags:-as built}, routing ${ROUTING:-uniform}, run $round"
            echo
            "$build/bin/bench-ktrace" "$csv" --period k_down_pt_q3_k
            echo
            grep -i "tokens/s" "$out/ktrace-$i-$round.log" || true
            echo
        } >>"$md"
    done
done
(cd "$out" && tar czf ktrace-runs.tar.gz ktrace-*-*.csv ktrace-*-*.log && rm -f ktrace-*-*.csv ktrace-*-*.log)
cat "$md"
