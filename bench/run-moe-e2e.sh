#!/bin/sh
# run-moe-e2e.sh - issue [4] point 7: sluice-compute's GPU path end to end on a bench-L4
# checkpoint generated where it runs, each figure beside the byte floor of its tiers
# computed from ceilings measured in the same run (bench-ceilings), just before the runs
# they serve.
#
#   (a) every expert in T0 (--t0-preload; also with the 4 layers run 10 times a step: the
#   real model's 40 layers measured), (b) T0 of half the experts + T1 for the rest,
#   steady state after --warmup steps, (c) a cold start from disk (fresh fetcher, empty
#   arena); each with uniform routing and Zipf(1.0) popularity (compute.h); plus the
#   warm zero-copy path (T1 read in place) for reference, and (b') (b) in the steady state
#   under each T0 admission (--t0-admit always | freq).
#
# usage: bench/run-moe-e2e.sh BUILD_DIR [CHECKPOINT_DIR] [STEPS] [WARMUP] [CPUS]
# CPUS "A,B" pins the fetcher's and the compute process's serving threads (--cpu).
# COMPUTE_FLAGS: more flags for every sluice-compute run (e.g. --norm-kernel, to compare).
# SKIP_COLD=1 leaves out (c) (the disk reads take most of the run); ONLY_COLD=1 runs (c)
# alone. COLD_PAUSE (s, default 0): a rest for the disk before each cold start's ceiling
# and before the cold start itself (session 35 tried 30 s: the ceiling and the cold
# starts came out the same: bench/results/2026-12-03-s35-experiments.md, call 6).
# STEADY (default 400):
# the warm-up steps of (b'), (b) in the steady state under each T0 admission. ONLY_A=1
# runs (a) alone (e.g. twice, with and without a COMPUTE_FLAGS, in one device call).
set -eu
build=$1
dir=${2:-/tmp/sluice-bench-L4}
steps=${3:-32}
warm=${4:-64}
steady=${STEADY:-400}
cpus=${5:-}
if ! ls "$dir"/sluice-bench-L4-00001-of-*.gguf >/dev/null 2>&1; then
    "$build/bin/sluice-synth" --preset bench-L4 --out "$dir" --shards 4 --seed 1 --quiet
    sync # the new shards on disk before any ceiling is measured (writeback slows reads)
fi
first=$(ls "$dir"/sluice-bench-L4-00001-of-*.gguf)
# The ceilings (printed) into $ceilings, the --ceilings argument of the runs that follow.
measure_ceilings() {
    "$build/bin/bench-ceilings" -m "$first" >/tmp/sluice-e2e-ceilings.txt
    cat /tmp/sluice-e2e-ceilings.txt
    ceilings=$(tail -n 1 /tmp/sluice-e2e-ceilings.txt)
}
fpin=""
cpin=""
if [ -n "$cpus" ]; then
    fpin="--cpu ${cpus%,*}"
    cpin="--cpu ${cpus#*,}"
fi
ep="ipc:///tmp/sluice-e2e.sock"
fpid=""
start_fetcher() {
    [ -z "$fpid" ] || { kill "$fpid"; wait "$fpid" 2>/dev/null || true; }
    # shellcheck disable=SC2086
    "$build/bin/sluice-fetcher" -m "$first" --endpoint "$ep" --arena-slots 1536 -q $fpin &
    fpid=$!
}
# On exit the fetcher is stopped and waited for: the next fetcher of this model (another
# bench script) is refused while this one still holds the arena.
trap '[ -z "$fpid" ] || { kill $fpid 2>/dev/null; wait $fpid 2>/dev/null; } || true' EXIT
run() {
    echo "== $1"
    shift
    # shellcheck disable=SC2086
    "$build/bin/sluice-compute" -m "$first" --endpoint "$ep" -n "$steps" --seed 7 --backend gpu \
        $ceilings $cpin ${COMPUTE_FLAGS:-} "$@" 2>&1 |
        grep -v '^  \(experts  \|T1 host\|GPU  \|T0 dev\|GPU left\)' |
        grep -v 'memory plan:\|layers, dim'
}
# Each cold start gets its own ceilings, measured just before it, and the warm runs one
# set after them: the GPU box's virtual disk reads at 1.2-2.2 GB/s from one call to the
# next (bench-ceilings takes the best of six queue depths, 2 to 64 threads: 16 threads
# alone were beaten by the fetcher by 30-40%, and 16-64 by 3-17%,
# bench/results/2026-12-03-s35-experiments.md, calls 2 and 5-7).
for routing in uniform zipf:1.0; do
    start_fetcher
    [ -n "${SKIP_COLD:-}" ] && continue
    sleep "${COLD_PAUSE:-0}"
    measure_ceilings
    sleep "${COLD_PAUSE:-0}"
    run "(c) cold start from disk, T0 auto, routing $routing" --routing "$routing"
done
[ -n "${ONLY_COLD:-}" ] && exit 0
measure_ceilings
for routing in uniform zipf:1.0; do
    run "(a) every expert in T0 (preloaded), routing $routing" --routing "$routing" \
        --t0-slots 1536 --t0-preload --warmup 4
    # The real model's 40 layers measured: bench-L4's 4 layers run 10 times a step.
    run "(a) every expert in T0 (preloaded), 40 layers a step (--layer-passes 10), routing $routing" \
        --routing "$routing" --t0-slots 1536 --t0-preload --warmup 4 --layer-passes 10
    [ -n "${ONLY_A:-}" ] && continue
    run "(b) T0 of 768 slots (50%) + T1, after $warm warm-up steps, routing $routing" \
        --routing "$routing" --t0-slots 768 --warmup "$warm"
    # The device tier is not full yet after $warm steps of Zipf routing (bench-t0sim):
    # the admissions differ only once it is, so these runs warm up longer.
    for admit in always freq; do
        run "(b') T0 of 768 slots + T1, after $steady warm-up steps, --t0-admit $admit, routing $routing" \
            --routing "$routing" --t0-slots 768 --warmup "$steady" --t0-admit "$admit"
    done
    run "warm T1 read in place (zero-copy), routing $routing" --routing "$routing" --zero-copy \
        --warmup 4
done
