#!/bin/sh
# ab-a.sh - an A/B of issue [4]'s (a) between builds in one call on the GPU box: one
# checkpoint, one fetcher and one set of ceilings for all, then each NAME's
# sluice-compute (BUILD_DIR/ab/sluice-compute-NAME, or "new" for BUILD_DIR/bin's) runs
# (a) with the real model's 40 layers (bench-L4's 4 run 10 times a step, every expert in
# T0, uniform routing), the arms in turn, ROUNDS times (default 3). One line a run: the
# step time against its byte floor. The runs' output stays in OUT_DIR/a-NAME-ROUND.txt.
# (bench/run-moe-e2e.sh makes the figures of record; this compares builds.)
# usage: bench/ab-a.sh BUILD_DIR OUT_DIR NAME...
set -u
build=$1
out=$2
shift 2
export LD_LIBRARY_PATH="$PWD/$build/devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
dir=/tmp/sluice-bench-L4
arm_bin() { # NAME's sluice-compute
    if [ "$1" = new ]; then echo "$build/bin/sluice-compute"; else echo "$build/ab/sluice-compute-$1"; fi
}
for v in "$@"; do # every arm before any runs
    [ -x "$(arm_bin "$v")" ] || { echo "ab-a.sh: no $(arm_bin "$v") (bench/ab-arm.sh builds an arm)" >&2; exit 2; }
done
if ! ls "$dir"/sluice-bench-L4-00001-of-*.gguf >/dev/null 2>&1; then
    "$build/bin/sluice-synth" --preset bench-L4 --out "$dir" --shards 4 --seed 1 --quiet || exit 1
    sync
fi
first=$(ls "$dir"/sluice-bench-L4-00001-of-*.gguf)
"$build/bin/bench-ceilings" -m "$first" >"$out/a-ceilings.txt" || exit 1
ceilings=$(tail -n 1 "$out/a-ceilings.txt")
echo "ab-a.sh: $ceilings"
ep="ipc:///tmp/sluice-ab-a.sock"
"$build/bin/sluice-fetcher" -m "$first" --endpoint "$ep" --arena-slots 1536 -q &
fpid=$!
trap 'kill $fpid 2>/dev/null; wait $fpid 2>/dev/null' EXIT
for i in $(seq 1 "${ROUNDS:-3}"); do
    for v in "$@"; do
        f=$out/a-$v-$i.txt
        # shellcheck disable=SC2086
        "$(arm_bin "$v")" -m "$first" --endpoint "$ep" -n 64 --seed 7 --backend gpu $ceilings \
            --routing uniform --t0-slots 1536 --t0-preload --warmup 4 --layer-passes 10 >"$f" 2>&1 ||
            echo "$v run $i: sluice-compute failed (its output: $f)"
        printf '%s %s: ' "$v" "$i"
        grep 'step (40 layers)' "$f" | sed 's/.*step (40 layers) //'
    done
done
