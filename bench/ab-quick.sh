#!/bin/sh
# ab-quick.sh - an A/B of bench-moe --quick between builds in one call on the GPU box
# (machines differ by 2-5% between calls: compare only within one). Each NAME is a
# bench-moe copied to BUILD_DIR/ab/bench-moe-NAME before a rebuild, or "new" for
# BUILD_DIR/bin/bench-moe; each runs twice, in turn, and prints one line: the shipped
# 6-expert row (gate/up, down, both us, bits), the device-routed layer plain and with the
# norm inside the router (us, back to back), the layer gate/up's first entry to last
# end, and in the norm layer's timeline the router's wait to x in shared memory, the
# selection's wait to its table in cycles, the table's publication, the gate/up's end
# (median / last) and the down's last end (us after the router's first entry), the
# down's first CTA past its wait (us after the table: set by the bytes since the table,
# session 35), and its gate/up's group leaders' time queueing refills. Their tables stay in
# OUT_DIR/q-NAME-RUN.md.
# usage: bench/ab-quick.sh BUILD_DIR OUT_DIR NAME...
set -u
build=$1
out=$2
shift 2
export LD_LIBRARY_PATH="$PWD/$build/devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
arm_bin() { # NAME's bench-moe
    if [ "$1" = new ]; then echo "$build/bin/bench-moe"; else echo "$build/ab/bench-moe-$1"; fi
}
for v in "$@"; do # every arm before any runs: a missing one would waste the call
    b=$(arm_bin "$v")
    if [ ! -x "$b" ]; then
        echo "ab-quick.sh: no $b (bench/ab-arm.sh builds an arm)" >&2
        exit 2
    fi
done
for i in 1 2; do
    for v in "$@"; do
        b=$(arm_bin "$v")
        f=$out/q-$v-$i.md
        "$b" --quick -o "$f" >"$out/q-$v-$i.log" 2>&1 || echo "$v run $i: bench-moe failed (its log: $out/q-$v-$i.log)"
        printf '%s %s:' "$v" "$i"
        grep -E '^\| gt 2x NW4 TR8 ST4, staggered start, q8_1' "$f" |
            awk -F'|' '{printf " 6 experts gate/up %s down %s both %s%s |", $3, $5, $7, $11}'
        grep -E 'queued at once, finish' "$f" | awk -F'|' '{printf " plain layer%s", $6}'
        grep -E '^\|.*inside the router \(sluice' "$f" | awk -F'|' '{printf " norm layer%s", $6}'
        # the norm layer's timeline: the router's wait to x (the norm), the selection's
        # wait to its table in its SM's cycles; then its phases (us after the router's
        # first entry): the table published, the gate/up's end (median / last) and the
        # down's last end, the figures a chain's stages are judged by
        awk '/^With the residual and the norm inside the router/ { s = 1 }
             s && /^\| router \| past its wait/ && !w { w = $0; split(w, a, "|"); wt = a[5] }
             s && /^\| router \| x in shared memory/ && !x { x = $0; split(x, b, "|"); xt = b[5] }
             s && /^\| selection \| table published/ && !tp { tp = 1; split($0, d, "|"); tb = d[5] }
             s && /^\| gate\/up \| end/ && !ge { ge = 1; split($0, g, "|"); gm = g[5]; gl = g[6] }
             s && /^\| down \| past its wait/ && !dw { dw = 1; split($0, v, "|"); dwt = v[4] }
             s && /^\| down \| end/ && !de { de = 1; split($0, h, "|"); dl = h[6] }
             s && /^The selection.s steps after its wait/ && !c {
                 c = 1; n = 0; t = 0; line = $0
                 while (n < 4 && match(line, /[0-9]+ cycles/)) {
                     t += substr(line, RSTART, RLENGTH - 7); n++
                     line = substr(line, RSTART + RLENGTH)
                 }
             }
             END { if (w && x) printf " | norm %.2f us wait to x", xt - wt
                   if (c) printf ", selection %d cycles wait to table", t
                   if (tp && ge && de)
                       printf " | table %.2f, gate/up end %.2f / %.2f, down last %.2f us", tb, gm,
                              gl, dl
                   if (tp && dw) printf ", down past its wait %.2f after the table", dwt - tb }' "$f"
        # the norm layer's gate/up: its group leaders' time queueing refills (median)
        awk '/^Milestones of the device-routed layer.s gate\/up \(6 experts and the shared one, the norm inside the router\)/ { s = 1 }
             s && /^Refills queued/ { match($0, /median [0-9.]+ us in [0-9]+ refills/)
                                     printf " | refills %s", substr($0, RSTART + 7, RLENGTH - 7); exit }' "$f"
        grep -E "^Milestones of the device-routed layer's gate/up \(6 experts and the shared one\)" "$f" |
            grep -o '[0-9.]* us from' | sed 's/^/ | /; s/ from/ gate\/up span/' | tr '\n' ' '
        echo
    done
done
