#!/bin/sh
# run-moe-e2e.sh - the compute process's GPU path end to end on a bench-L4 checkpoint
# generated where it runs: one fetcher holding every expert, then sluice-compute runs
# (cold from disk with kernels reading T1 in place, warm T1 zero-copy, warm with a
# device tier T0 of all or half the experts, with the router's picks or synthetic
# uniform / Zipf popularity). Prints each run's summary, extrapolated to 40 layers.
# usage: bench/run-moe-e2e.sh BUILD_DIR [CHECKPOINT_DIR] [STEPS]
set -eu
build=$1
dir=${2:-/tmp/sluice-bench-L4}
steps=${3:-32}
if ! ls "$dir"/sluice-bench-L4-00001-of-*.gguf >/dev/null 2>&1; then
    "$build/bin/sluice-synth" --preset bench-L4 --out "$dir" --shards 4 --seed 1 --quiet
fi
first=$(ls "$dir"/sluice-bench-L4-00001-of-*.gguf)
ep="ipc:///tmp/sluice-e2e.sock"
"$build/bin/sluice-fetcher" -m "$first" --endpoint "$ep" --arena-slots 1536 -q &
fpid=$!
trap 'kill $fpid 2>/dev/null || true' EXIT
run() {
    echo "== $1"
    shift
    "$build/bin/sluice-compute" -m "$first" --endpoint "$ep" -n "$steps" --seed 7 "$@" 2>&1 |
        grep -v '^sluice-compute: .*layers, dim'
}
run "cold start (every expert read from disk once), GPU reads T1 in place" --backend gpu
run "warm, all experts in T1, GPU reads T1 in place (zero-copy)" --backend gpu
run "warm T1, device tier T0 of 1536 slots (all experts)" --backend gpu --t0-slots 1536
run "warm T1, device tier T0 of 768 slots (half the experts)" --backend gpu --t0-slots 768
run "warm T1, T0 of 768 slots, Zipf(1.0) routing" --backend gpu --t0-slots 768 --routing zipf:1.0
run "warm T1, T0 of 768 slots, uniform routing" --backend gpu --t0-slots 768 --routing uniform
kill $fpid
wait $fpid 2>/dev/null || true
