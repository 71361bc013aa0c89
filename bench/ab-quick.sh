#!/bin/sh
# ab-quick.sh - an A/B of bench-moe --quick between builds in one call on the GPU box
# (machines differ by 2-5% between calls: compare only within one). Each NAME is a
# bench-moe copied to BUILD_DIR/ab/bench-moe-NAME before a rebuild, or "new" for
# BUILD_DIR/bin/bench-moe; each runs twice, in turn, and prints one line: the shipped
# 6-expert row (gate/up, down, both us, bits), the device-routed layer plain and with the
# norm inside the router (us, back to back), and the layer gate/up's first entry to last
# end. Their tables stay in OUT_DIR/q-NAME-RUN.md.
# usage: bench/ab-quick.sh BUILD_DIR OUT_DIR NAME...
set -u
build=$1
out=$2
shift 2
export LD_LIBRARY_PATH="$PWD/$build/devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for i in 1 2; do
    for v in "$@"; do
        b=$build/ab/bench-moe-$v
        [ "$v" = new ] && b=$build/bin/bench-moe
        f=$out/q-$v-$i.md
        "$b" --quick -o "$f" >"$out/q-$v-$i.log" 2>&1 || echo "$v run $i: bench-moe failed (its log: $out/q-$v-$i.log)"
        printf '%s %s:' "$v" "$i"
        grep -E '^\| gt 2x NW4 TR8 ST4, staggered start, q8_1' "$f" |
            awk -F'|' '{printf " 6 experts gate/up %s down %s both %s%s |", $3, $5, $7, $11}'
        grep -E 'queued at once, finish' "$f" | awk -F'|' '{printf " plain layer%s", $6}'
        grep -E 'inside the router \(sluice' "$f" | awk -F'|' '{printf " norm layer%s", $6}'
        grep -E "^Milestones of the device-routed layer's gate/up \(6 experts and the shared one\)" "$f" |
            grep -o '[0-9.]* us from' | sed 's/ from/ gate\/up span/' | tr '\n' ' '
        echo
    done
done
