#!/bin/sh
# run-prefetch.sh - does prefetch win? Two cold runs of sluice-compute (GPU path) on a
# bench-L4 checkpoint, each against a fresh fetcher (O_DIRECT: nothing cached between
# them), without and with --prefetch. Prints both summaries.
# usage: bench/run-prefetch.sh BUILD_DIR [CHECKPOINT_DIR] [STEPS]
set -eu
build=$1
dir=${2:-/tmp/sluice-bench-L4}
steps=${3:-32}
if ! ls "$dir"/sluice-bench-L4-00001-of-*.gguf >/dev/null 2>&1; then
    "$build/bin/sluice-synth" --preset bench-L4 --out "$dir" --shards 4 --seed 1 --quiet
    sync # the new shards on disk before any ceiling is measured (writeback slows reads)
fi
first=$(ls "$dir"/sluice-bench-L4-00001-of-*.gguf)
for mode in off on; do
    ep="ipc:///tmp/sluice-prefetch-$mode.sock"
    "$build/bin/sluice-fetcher" -m "$first" --endpoint "$ep" --arena-slots 1536 -q &
    fpid=$!
    echo "== cold start, prefetch $mode"
    flag=""
    [ "$mode" = on ] && flag=--prefetch
    # shellcheck disable=SC2086
    "$build/bin/sluice-compute" -m "$first" --endpoint "$ep" -n "$steps" --seed 7 --backend gpu \
        $flag 2>&1 | grep -v 'layers, dim\|memory plan'
    kill $fpid
    wait $fpid 2>/dev/null || true
done
